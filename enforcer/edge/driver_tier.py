"""The driver-limit tier's one write, for the agent and `exec` alike: Set, then Get, and
the limit counts as held only when the driver reads back what was set (`hard_limits.holds`):
an accepted Set proves nothing on a read-only mount, against a racing writer, or for a
limit below what the cgroup already holds, which the driver leaves unchanged."""

from __future__ import annotations

from pathlib import Path

from enforcer.core.hard_limits import SOFT_BYTES, holds
from enforcer.core.model import HeldLimit, LimitOutcome, LimitResult, format_bytes
from enforcer.edge.cgroupfs import first_without
from enforcer.edge.nvml import Nvml


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
