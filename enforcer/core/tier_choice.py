"""Which enforcement tier holds a limit on this machine, and why (pure): the one choice that
`doctor`, `exec` and the node agent make from what a probe found, and report alike.

A tier is one way of holding a unit to its limit. Sampling is the floor and the backstop
everywhere: it sees usage one interval late and stops the offender. Tiers above it refuse
the allocation itself, so the offender gets an out-of-memory error it can handle and its
neighbours never see the overshoot: the driver's per-cgroup limits (NVIDIA R615+), and, on
request only (`candidates(gate=True)`), the allocation gate, which checks the driver's
allocation calls before they run (seccomp user notification; issue 45).

The tiers that refuse are candidates, tried best first (`CANDIDATES`); each says on which
GPUs it can hold limits and, where it cannot, why. The first that can hold some GPU is
chosen; the reasons of those passed over come with it, so that a person reads why not a
better one. A new tier (issue 45: the driver's allocation calls refused on older drivers)
is one more entry, not a rewrite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from enforcer.core.model import LimitOutcome, LimitResult
from enforcer.core.rm_abi import FIRST_BRANCH, LAST_BRANCH, PROVEN_BRANCHES, layout_for

R615 = 615  # the first driver branch with per-cgroup limits (nvmlDeviceSetMemoryLimits_v1)


class TierName(StrEnum):
    """The tiers, as logs, Events, series and docs name them."""

    DRIVER = "driver-limit"  # the driver refuses an allocation past the cgroup's limit
    GATE = "allocation-gate"  # the driver's allocation calls checked before they run
    SAMPLING = "sampling"  # usage read each interval, the offender stopped


@dataclass(frozen=True, slots=True)
class Probe:
    """What a probe found on this machine, as far as the choice depends on it."""

    driver_version: str  # "" where NVML could not be read
    nvml_error: str  # why NVML could not be read ("" where it could)
    cgroup_v2: str  # the cgroup v2 hierarchy's path, "" where there is none
    dmem: bool  # the kernel's dmem controller is in that hierarchy
    root: bool  # may set limits: NVML's Set needs root
    whole_gpus: tuple[str, ...]  # GPUs that can take a per-cgroup limit (not in MIG mode)
    mig_gpus: tuple[str, ...]  # GPUs in MIG mode: NVML takes no MIG handle
    # The driver's answer to a Get on the probed cgroup, per whole GPU: None where it
    # answered (a limit, or none), else why it could not.
    answers: tuple[tuple[str, LimitOutcome | None], ...] = ()
    toolkit_hook: tuple[str, ...] = ()  # GPUs whose CDI spec runs NVIDIA's memory-limit hook
    limit_calls: bool = True  # NVML has the per-cgroup limit calls (FUNCTION_NOT_FOUND: not)
    cgroup: str = ""  # the probed cgroup: the one below which limited cgroups are made
    # The first of the probed cgroup and its ancestors whose cgroup.subtree_control lacks
    # dmem: the cgroups below it get no dmem files ("" where none lacks it, or no dmem).
    no_dmem_at: str = ""
    unreadable: str = ""  # what the probe could not read (a hung filesystem), "" if nothing
    # The allocation gate's needs (the defaults offer it nothing): why the kernel's seccomp
    # user notification cannot serve it ("" where it can), the machine (`uname -m`), why the
    # callers' parameters cannot be read (Yama's ptrace_scope; "" where they can), and the
    # character majors of NVIDIA's device nodes (the gate judges calls on those alone).
    seccomp_notify: str = "not probed"
    machine: str = ""
    ptrace_blocked: str = ""
    gpu_majors: tuple[int, ...] = ()

    @property
    def conclusive(self) -> bool:
        """Whether the choice made from it may be acted on: NVML answered, every file was
        read, and no Get failed for a reason that may pass (NVML's FAILED). An
        inconclusive probe's choice is said, but the last conclusive one stays in force."""
        return (
            not self.nvml_error
            and not self.unreadable
            and not any(a is not None and a.result is LimitResult.FAILED for _, a in self.answers)
        )

    @property
    def too_old(self) -> bool:
        """The driver has no per-cgroup limits: a branch before R615, or an NVML without
        the calls (FUNCTION_NOT_FOUND)."""
        branch = driver_branch(self.driver_version)
        return (branch is not None and branch < R615) or not self.limit_calls

    @property
    def children_without_dmem(self) -> bool:
        """The kernel's dmem controller is in use, and the cgroups made below the probed one
        get no dmem files: `no_dmem_at` does not hand dmem down."""
        return self.dmem and bool(self.no_dmem_at)


def driver_branch(version: str) -> int | None:
    found = re.match(r"(\d+)\.", version)
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True)
class Choice:
    """The tier that holds limits here, on which GPUs, and why (one sentence a person reads:
    why this tier, and why not a better one on the GPUs it does not cover)."""

    tier: TierName
    gpus: tuple[str, ...]  # where the tier holds limits; sampling covers every GPU
    why: str
    # Why this tier or a better one holds no limit on some GPU, or on any (part of `why`).
    gaps: tuple[str, ...] = ()

    @property
    def refuses(self) -> bool:
        """Whether an allocation past a limit is refused on some GPU, not only stopped."""
        return self.tier is not TierName.SAMPLING and bool(self.gpus)

    def said(self) -> str:
        """One line for a log and `doctor`: the tier, where, and why."""
        where = f" on {', '.join(self.gpus)}" if self.gpus else ""
        backstop = "" if self.tier is TierName.SAMPLING else ", sampling as the backstop"
        return f"tier {self.tier}{where}{backstop}: {self.why}"


@dataclass(frozen=True, slots=True)
class Fit:
    """What one candidate tier can do here: the GPUs it can hold limits on (none: it is
    passed over), what it says of itself where it holds some, and why it cannot hold one
    on the others, or on any."""

    gpus: tuple[str, ...]
    gaps: tuple[str, ...]
    said: tuple[str, ...] = ()


Candidate = tuple[TierName, Callable[[Probe], Fit]]


def choose(probe: Probe, candidates: tuple[Candidate, ...] | None = None) -> Choice:
    """The best tier the probe allows, with its reasons: the first candidate that can hold
    some GPU, else sampling, which holds every one."""
    passed_over: list[str] = []
    for tier, fit in candidates if candidates is not None else CANDIDATES:
        found = fit(probe)
        gaps = tuple(dict.fromkeys([*found.gaps, *passed_over]))
        if found.gpus:
            return Choice(tier, found.gpus, _joined([*found.said, *gaps]), gaps)
        passed_over = list(gaps)
    every = (*probe.whole_gpus, *probe.mig_gpus)
    why = _joined(passed_over) or "no GPU to limit"
    return Choice(TierName.SAMPLING, every, why, tuple(passed_over))


def driver_fit(probe: Probe) -> Fit:
    """The driver's per-cgroup limits: R615+ with the calls in its NVML, cgroup v2, root,
    whole GPUs whose driver answers a Get on the probed cgroup, and that cgroup's children
    given dmem files where the kernel's dmem controller is in use."""
    version = probe.driver_version or "(unknown version)"
    if probe.nvml_error:
        return Fit((), (f"NVML cannot be read ({probe.nvml_error})",))
    if probe.too_old:
        return Fit((), (f"driver {version} has no per-cgroup limits: R{R615}+",))
    if probe.unreadable:
        return Fit((), (f"cannot tell whether the driver can hold limits: {probe.unreadable}",))
    if not probe.cgroup_v2:
        return Fit((), ("no cgroup v2 hierarchy: the driver's limits need one",))
    if not probe.root:
        return Fit((), ("not root: NVML's Set needs root (reading a limit does not)",))
    mig = tuple(f"{gpu} in MIG mode: NVML takes no MIG handle" for gpu in probe.mig_gpus)
    missing = _dmem_missing(probe)
    if missing:
        return Fit((), (missing, *mig))
    why: list[str] = []
    for gpu, answer in probe.answers:
        if answer is not None:
            why.append(f"{gpu}: {_unanswered(probe, answer)}")
    able = tuple(gpu for gpu, answer in probe.answers if answer is None)
    if not able:
        return Fit((), (*_grouped(why, probe), *mig) or ("no whole GPU to limit",))
    backend = "the kernel's dmem controller" if probe.dmem else "no dmem controller: misc backend"
    said = [f"driver {version}, cgroup v2 at {probe.cgroup_v2} ({backend})"]
    if probe.toolkit_hook:
        said.append(
            f"NVIDIA's apply-cuda-memory-limits hook is configured (CDI) for "
            f"{', '.join(probe.toolkit_hook)}: it sets a container's own cgroup at creation"
        )
    return Fit(able, (*why, *mig), tuple(said))


GATE_MACHINES = ("x86_64", "aarch64")  # where the filter and the layouts were checked


def gate_fit(probe: Probe) -> Fit:
    """The allocation gate: NVML read (the gate judges from the sampler's view), a driver
    branch whose parameter layout is known, the kernel's seccomp user notification with
    CONTINUE, a machine the filter covers, the callers' memory readable, NVIDIA's device
    nodes present, and no GPU in MIG mode."""
    version = probe.driver_version or "(unknown version)"
    branch = driver_branch(probe.driver_version)
    if probe.nvml_error:
        return Fit((), (f"NVML cannot be read ({probe.nvml_error})",))
    if branch is None or layout_for(branch) is None:
        known = f"{FIRST_BRANCH}-{LAST_BRANCH}"
        return Fit((), (f"driver {version}: the allocation gate knows the layouts of {known}",))
    if probe.seccomp_notify:
        return Fit((), (f"no allocation gate: {probe.seccomp_notify}",))
    if probe.machine not in GATE_MACHINES:
        return Fit((), (f"no allocation gate for {probe.machine or 'this machine'}",))
    if probe.ptrace_blocked:
        return Fit((), (f"no allocation gate: {probe.ptrace_blocked}",))
    if not probe.gpu_majors:
        return Fit((), ("no allocation gate: no NVIDIA device node on this machine",))
    if probe.mig_gpus:
        mig = ", ".join(probe.mig_gpus)
        return Fit((), (f"{mig} in MIG mode: the allocation gate does not gate MIG yet",))
    if not probe.whole_gpus:
        return Fit((), ("no whole GPU to limit",))
    said = [
        "the driver's allocation calls are checked before they run (cooperative: a racing "
        "thread can get past; sampling is the backstop)"
    ]
    if branch not in PROVEN_BRANCHES:
        said.append(f"not yet verified on driver branch {branch} (tests/gpu/offline.sh gate)")
    return Fit(probe.whole_gpus, (), tuple(said))


CANDIDATES: tuple[Candidate, ...] = ((TierName.DRIVER, driver_fit),)


def candidates(gate: bool) -> tuple[Candidate, ...]:
    """The candidates, with the allocation gate after the driver's limits where it is asked
    for (`exec --allocation-gate on`): it is opt-in, so `CANDIDATES` (doctor's and the
    agent's) stay without it."""
    return (*CANDIDATES, (TierName.GATE, gate_fit)) if gate else CANDIDATES


HARD_LIMITS_OFF = Choice(TierName.SAMPLING, (), "--hard-limits off")  # exec's and the agent's


def _dmem_missing(probe: Probe) -> str:
    """Why the cgroups made below the probed one get no dmem files, "" where they do (or
    where the kernel has no dmem controller, and the driver counts in its misc backend)."""
    if not probe.children_without_dmem:
        return ""
    below = probe.cgroup or probe.cgroup_v2
    return (
        f"cgroups below {below} have no dmem files: dmem is missing from "
        f"{probe.no_dmem_at}'s cgroup.subtree_control"
    )


def _unanswered(probe: Probe, answer: LimitOutcome) -> str:
    """Why the driver (R615+: the calls are there) gave no limit for the probed cgroup."""
    detail = f" ({answer.detail})" if answer.detail else ""
    cgroup = probe.cgroup or "the probed cgroup"
    if answer.result in (LimitResult.UNSUPPORTED, LimitResult.NO_DMEM):
        kernel = "" if probe.dmem else ", and the kernel has no dmem controller (Linux < 6.14)"
        return f"cgroup {cgroup} has no dmem files{detail}{kernel}: the driver cannot count it"
    if answer.result is LimitResult.NO_CGROUP:
        return f"the driver cannot open cgroup {cgroup}{detail}"
    if answer.result is LimitResult.FORBIDDEN:
        return f"NVML refused to read the limit of cgroup {cgroup}{detail}"
    return f"reading the limit of cgroup {cgroup} failed{detail}"


def _grouped(why: list[str], probe: Probe) -> tuple[str, ...]:
    """One reason for every whole GPU where they all give the same one, not one per GPU."""
    reasons = {line.split(": ", 1)[1] for line in why}
    if len(reasons) == 1 and len(why) == len(probe.whole_gpus):
        return tuple(reasons)
    return tuple(why)


def _joined(reasons: list[str]) -> str:
    return "; ".join(dict.fromkeys(reasons))
