"""The driver-limit tier (NVIDIA R615+ per-cgroup limits), for the agent and `exec` alike:
read before the first write (`hard_limits.first_read`: someone else's limit is never
written), Set with soft 0, then Get: the limit counts as held only when the driver reads
back what was set (`hard_limits.holds`): an accepted Set proves nothing on a read-only
mount, against a racing writer, or for a limit below what the cgroup already holds, which
the driver leaves unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from enforcer.core.hard_limits import SOFT_BYTES, Found, first_read, holds
from enforcer.core.model import HeldLimit, LimitOutcome, LimitResult, format_bytes
from enforcer.core.tier_choice import TierName
from enforcer.core.tiers import Held, Holds, Want
from enforcer.edge.cgroupfs import first_without
from enforcer.edge.nvml import Nvml


class DriverTier:
    """The driver holds each wanted cgroup to its limit, refusing allocations past it."""

    name = TierName.DRIVER

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml

    def hold(self, wants: Sequence[Want]) -> list[Held]:
        return [self._hold(want) for want in wants]

    def _hold(self, want: Want) -> Held:
        if want.first:
            read = self._nvml.memory_limit(want.gpu, want.cgroup)
            if isinstance(read, LimitOutcome):
                return Held(Holds.FAILED, outcome=read)
            found = first_read(read, want.hard_bytes, want.inherited, want.adopt)
            if found is Found.FOREIGN and read is not None:
                return Held(Holds.FOREIGN, read.hard_bytes)
            if found is Found.OURS and read is not None and read.soft_bytes == SOFT_BYTES:
                return Held(Holds.ADOPTED, want.hard_bytes)
            # else none there, or ours with an older release's reservation: (re)written
        outcome = apply(self._nvml, want.gpu, want.cgroup, want.hard_bytes)
        held = Holds.SET if outcome.result is LimitResult.SET else Holds.FAILED
        return Held(held, want.hard_bytes if held is Holds.SET else 0, outcome, wrote=True)


def apply(nvml: Nvml, gpu: str, cgroup: str, hard: int) -> LimitOutcome:
    """Hold `cgroup` to `hard` on the GPU (soft `SOFT_BYTES`): SET once read back as set,
    NOT_APPLIED (with what the driver reads) when it was accepted but does not hold, else
    NVML's refusal."""
    outcome = nvml.set_memory_limit(gpu, cgroup, hard, SOFT_BYTES)
    if outcome.result is not LimitResult.SET:
        return outcome
    read = nvml.memory_limit(gpu, cgroup)
    if holds(read, hard):
        return outcome
    return LimitOutcome(LimitResult.NOT_APPLIED, described(read))


def without_dmem(
    outcome: LimitOutcome, cgroup: str, root: Path
) -> tuple[LimitOutcome, Path | None]:
    """A refusal for want of dmem files, naming the first cgroup from `root` that does not
    enable dmem below it (where it stops reaching `cgroup`), and that cgroup."""
    at = first_without("dmem", Path(cgroup), root)
    if at is None:
        return outcome, None
    found = f"{at} does not enable dmem for its children"
    return LimitOutcome(outcome.result, "; ".join(filter(None, (outcome.detail, found)))), at


def described(read: HeldLimit | LimitOutcome | None) -> str:
    """What a Get answered, in words."""
    if read is None:
        return "no limit"
    if isinstance(read, LimitOutcome):
        return f"nothing ({read.result.value}{': ' + read.detail if read.detail else ''})"
    return f"a hard limit of {format_bytes(read.hard_bytes)}, soft {format_bytes(read.soft_bytes)}"
