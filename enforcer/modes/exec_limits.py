"""exec's hard limit: the tier chosen (`hard_limits`), the command's cgroup, the driver's limit
on each GPU where it can hold one (`place`), the command's GPU processes kept in that cgroup
(`CgroupKeeper`), and the proof that the driver charges the tree to it (`ChargeWatch`). The
allocation gate, where it is chosen instead, is `exec_gate`'s."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from enforcer.core import messages
from enforcer.core.hard_limits import UNKNOWN_OWNER, per_gpu
from enforcer.core.model import (
    LimitOutcome,
    LimitResult,
    UnitUsage,
    format_bytes,
)
from enforcer.core.settings.exec import ExecSettings
from enforcer.core.tier_choice import HARD_LIMITS_OFF, Choice, TierName, candidates, choose
from enforcer.core.tiers import Holds, Want
from enforcer.edge.cgroupfs import CgroupFsError, CommandCgroup, move, v2_root
from enforcer.edge.charge_proof import ChargeProof
from enforcer.edge.driver_tier import without_dmem
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.tier_probe import TierProbe, host_root, own_cgroup
from enforcer.edge.tiers import tier_for
from enforcer.modes.exec_spawn import StartupError

log = logging.getLogger(__name__)

# How often the command's GPU processes are checked to still be in its cgroup: reading each
# one's cgroup every tick would cost about 10 us a process; sampling covers the gap.
KEEP_IN_CGROUP_EVERY = 1.0


class ChargeWatch:
    """Whether the driver counts the command tree against its hard limit: asked once the
    tree holds enough on a limited GPU to tell (`hard_limits.charged`), each tick until the
    driver has said. A limit it does not charge the tree to is said not to bind, and the
    summary then claims no hard limit."""

    def __init__(
        self, nvml: Nvml, placed: Placed, interval: float, unbound: Callable[[], None]
    ) -> None:
        """`unbound`: told once the driver is shown not to charge the tree."""
        self._proof = ChargeProof(nvml)
        self._placed = placed
        self._unbound = unbound
        self._interval = interval
        self.binds: bool | None = None

    def check(self, units: tuple[UnitUsage, ...]) -> None:
        if self.binds is not None:
            return
        listed: dict[str, int] = {}
        for gpu, used in (pair for unit in units for p in unit.processes for pair in p.by_device):
            listed[gpu] = listed.get(gpu, 0) + (used or 0)
        on_limits = {gpu: listed.get(gpu, 0) for gpu in self._placed.limits}
        proof = self._proof.read(str(self._placed.cgroup.command), on_limits)
        if proof is None:
            return
        self.binds = proof.binds
        if proof.binds:
            log.info(
                "the driver counts the command tree against its hard limit: it "
                "charges %s on %s, where NVML lists %s",
                format_bytes(proof.charged_bytes),
                proof.gpu,
                format_bytes(proof.listed_bytes),
            )
        else:
            why = messages.not_charged(
                proof.gpu, proof.listed_bytes, "the command tree's processes"
            )
            log.warning("%s", messages.sampling_only(why, self._interval))
            self._unbound()


@dataclass(frozen=True, slots=True)
class Placed:
    """The command's cgroup, and the hard limit the driver holds it to on each GPU."""

    cgroup: CommandCgroup
    limits: dict[str, int]


class CgroupKeeper:
    """Holds the command's GPU processes in its cgroup: once a second, one that wrote itself
    into another cgroup (its user may, and the hard limit would no longer hold it) is moved
    back, and said. Sampling counts it either way: the tree is the unit, not the cgroup."""

    def __init__(self, cgroup: CommandCgroup, every: float = KEEP_IN_CGROUP_EVERY) -> None:
        self._cgroup = cgroup
        self._every = every
        self._next = 0.0

    def check(self, units: tuple[UnitUsage, ...], now: float) -> None:
        if now < self._next:
            return
        self._next = now + self._every
        pids = {p.key.pid for unit in units for p in unit.processes}
        for pid, where in self._cgroup.strays(pids).items():
            try:
                move(pid, self._cgroup.command)
            except CgroupFsError as exc:
                log.warning(
                    "pid %d left the command's cgroup for %s, and could not be moved back (%s): "
                    "the driver no longer refuses its allocations past the limit; sampling "
                    "still stops it",
                    pid,
                    where,
                    exc,
                )
            else:
                log.warning(
                    "pid %d had left the command's cgroup for %s; moved it back under "
                    "the hard limit",
                    pid,
                    where,
                )


def place(settings: ExecSettings, nvml: Nvml, choice: Choice) -> tuple[Placed | None, str]:
    """The command's cgroup and its limits on the GPUs of the tier `choice` (`tier_choice`),
    and why some or all GPUs have none ("")."""
    if not choice.refuses:
        return None, choice.why
    try:
        devices = nvml.snapshot().devices
    except NvmlError as exc:
        return None, f"the GPUs could not be listed ({exc})"
    wanted = {g: b for g, b in per_gpu(settings.limit_bytes, devices).items() if g in choice.gpus}
    gaps = "; ".join(choice.gaps)
    if not wanted:
        return None, gaps or "NVML reports no GPU memory to limit"
    try:
        cgroup = CommandCgroup.create()
    except CgroupFsError as exc:
        return None, str(exc)
    command = str(cgroup.command)
    held = tier_for(choice, nvml).hold([Want(command, gpu, b) for gpu, b in wanted.items()])
    limits: dict[str, int] = {}
    failed: dict[str, LimitOutcome] = {}
    foreign: list[str] = []  # a limit someone else set on our new cgroup: never ours to change
    for (gpu, b), h in zip(wanted.items(), held, strict=True):
        if h.holds is Holds.FOREIGN and h.hard_bytes > b:
            text = messages.foreign_limit("the command tree", gpu, h.hard_bytes, b, UNKNOWN_OWNER)
            foreign.append(text)
        elif h.holds in (Holds.SET, Holds.ADOPTED, Holds.FOREIGN):
            limits[gpu] = h.hard_bytes
        elif h.outcome is not None:
            failed[gpu] = h.outcome
    why = [*foreign, *(_why(o, nvml, cgroup, gpu if limits else None) for gpu, o in failed.items())]
    missing = "; ".join(dict.fromkeys([*why, gaps] if gaps else why))
    if not limits:
        cgroup.close()
        return None, missing
    log.info("%s", messages.hard_limit_in_place("the command tree", limits))
    return Placed(cgroup, limits), missing


def _why(outcome: LimitOutcome, nvml: Nvml, cgroup: CommandCgroup, gpu: str | None) -> str:
    root = v2_root()
    if outcome.result is LimitResult.NO_DMEM and root is not None:
        outcome, _ = without_dmem(outcome, str(cgroup.command), root)
    reason = messages.no_hard_limit(outcome, nvml.driver_version, str(cgroup.command))
    return f"{gpu}: {reason}" if gpu else reason


@contextlib.contextmanager
def hard_limits(
    settings: ExecSettings, nvml: Nvml
) -> Iterator[tuple[Placed | None, tuple[int, ...] | None]]:
    """A cgroup for the command, held to the limit on every GPU where the driver can, or
    None where it cannot (said once, unless --hard-limits off); removed afterwards. Or,
    where the allocation gate is chosen, no cgroup but NVIDIA's device majors for the gate
    (else None). The tier chosen (`tier_choice`) is logged first, as doctor and the agent
    say it."""
    choice: Choice = HARD_LIMITS_OFF
    majors: tuple[int, ...] = ()
    if settings.hard_limits != "off":
        probe = TierProbe(own_cgroup, host_root()).probe(nvml)
        choice = choose(probe, candidates(gate=settings.allocation_gate == "on"))
        majors = probe.gpu_majors
    log.info("%s", choice.said())
    if choice.tier is TierName.GATE:  # it holds the tree, summed over GPUs: no cgroup
        yield None, majors
        return
    placed, missing = (None, "") if settings.hard_limits == "off" else place(settings, nvml, choice)
    if missing and settings.hard_limits == "required":
        if placed is not None:
            placed.cgroup.close()
        raise StartupError(f"--hard-limits required, but there is no hard limit: {missing}")
    if missing:
        log.warning("%s", messages.sampling_only(missing, settings.interval))
    try:
        yield placed, None
    finally:
        if placed is not None and not placed.cgroup.close():
            log.warning(
                "left the cgroup %s in place: it still holds processes of the command",
                placed.cgroup.command,
            )
