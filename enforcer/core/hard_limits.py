"""Allocation-time limits (NVIDIA R615+ per-cgroup limits): which cgroup gets which limit on
which GPU, and what each outcome means (pure).

With a hard limit in place the driver refuses an allocation that would take the cgroup
past it, so the offender sees an out-of-memory error it can handle, and its neighbours
never see the overshoot. Sampling stays on as the backstop everywhere: the driver's limit
is per GPU while most of ours are a sum over GPUs (a share spread over N GPUs, as KAI
places one, is one share on each), and older drivers, MIG and cgroup v1 have none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum

from enforcer.core.kai import nv_fractions
from enforcer.core.model import Device, HeldLimit, LimitOutcome, MiB
from enforcer.core.owed import Owing, PodOwed
from enforcer.core.tier_choice import TierName


def per_gpu(limit_bytes: int, devices: Sequence[Device]) -> dict[str, int]:
    """The hard limit on each GPU: the unit's limit, capped at the GPU's memory (NVML
    refuses a limit above it). MIG partitions and GPUs in MIG mode get none: NVML takes no
    MIG handles."""
    in_mig_mode = {d.parent_uuid for d in devices if d.parent_uuid}
    return {
        d.uuid: min(limit_bytes, d.total_bytes)
        for d in devices
        if d.parent_uuid is None and d.uuid not in in_mig_mode and d.total_bytes
    }


def on_gpus(gpu_limits: Mapping[str, int], devices: Sequence[Device]) -> dict[str, int]:
    """Limits given per GPU (DRA: what a claim was allocated there), capped and filtered as
    `per_gpu` does. A GPU without a limit gets none: the DRA driver shows a container only
    the GPUs it was allocated, and sampling holds it to 0 on any other."""
    caps = per_gpu(MAX_BYTES, devices)
    return {gpu: min(limit, caps[gpu]) for gpu, limit in gpu_limits.items() if gpu in caps}


MAX_BYTES = 1 << 62  # above any GPU's memory: per_gpu() caps it to each GPU's total

# The soft limit every hard limit of ours goes with, on the pod, the leaf and exec's cgroup.
# A soft limit is the cgroup's `dmem.min` reservation: the driver adds it to every ancestor
# and leaves it there when the runtime deletes the cgroup without zeroing it first (NVIDIA's
# MPS v3 page, "Known limitations"), and the runtime, not we, deletes container cgroups.
# It buys us nothing: we run no MPS eviction, and the lender takes back what a borrower holds
# above its request itself. So none, and none to offer as an option.
SOFT_BYTES = 0


def pod_limits(pod: PodOwed, devices: Sequence[Device]) -> dict[str, int]:
    """The pod cgroup's hard limit on each GPU."""
    return pod_target(pod, "").limits_on(devices)


# The least a cgroup's processes must hold on a GPU, as NVML lists them, before what the
# driver charges to the cgroup's limit tells anything: a CUDA context alone is several
# hundred MiB, so any process that has started computing has passed it.
EVIDENCE_BYTES = 256 * MiB


def charged(listed: int, charged_bytes: int) -> bool | None:
    """Whether the driver charges a cgroup's processes to its limit: the proof that the
    limit binds them. NVIDIA documents these limits as MPS v3 memory partitioning, and
    does not say whether they bind a process that is no MPS client (docs/nvml.md); the
    driver's own count (`currentUsed`) is the evidence. True when it charges at least half
    of what NVML lists for them (the two counts differ by what the driver keeps per
    context); False when it charges nothing; None while they hold too little to tell, or
    the two disagree otherwise (a process that exited between the two reads)."""
    if listed < EVIDENCE_BYTES:
        return None
    if 2 * charged_bytes >= listed:
        return True
    return False if charged_bytes == 0 else None


# Reads in a row on which the driver must charge a cgroup nothing before its limit is said
# not to bind: one could fall between a process's exit and NVML's next listing.
UNCHARGED_READS = 2


def proven(misses: int, verdict: bool | None) -> tuple[int, bool | None]:
    """One more read of `charged`: (reads in a row that charged nothing, the final answer:
    True at once, False after UNCHARGED_READS, None until then)."""
    if verdict is True:
        return 0, True
    misses = misses + 1 if verdict is False else 0
    return misses, (False if misses >= UNCHARGED_READS else None)


def mig_gpus(devices: Sequence[Device]) -> tuple[str, ...]:
    """The GPUs in MIG mode, which no hard limit covers."""
    return tuple(sorted({d.parent_uuid for d in devices if d.parent_uuid}))


@dataclass(frozen=True, slots=True)
class Target:
    """One cgroup to hold to a limit, proven to be the pod's (its directory names the pod's
    UID) or the container's (it names the container ID the pod's status gives)."""

    cgroup: str
    namespace: str
    pod: str
    uid: str
    container: str  # "" for the pod as a whole
    limit_bytes: int
    gpu_limits: tuple[tuple[str, int], ...] = ()  # DRA: per GPU, instead of limit_bytes on all

    def limits_on(self, devices: Sequence[Device]) -> dict[str, int]:
        """The hard limit on each GPU that can take one."""
        if self.gpu_limits:
            return on_gpus(dict(self.gpu_limits), devices)
        return per_gpu(self.limit_bytes, devices)


def targets(
    pods: Iterable[PodOwed],
    pod_dirs: Mapping[str, str],
    container_dirs: Mapping[str, Mapping[str, str]],
) -> dict[str, Target]:
    """Cgroup path -> target: each pod's total on its pod cgroup as soon as that exists (it
    does before any container starts), and each container's units on the cgroup named after
    its current container ID, below that pod's cgroup. What each is held to is what it is
    owed (`owed.owed`): its ceiling, the driver's hard limit, on each GPU it may use (one
    share on each, for a container spread over GPUs: the driver's limit is per GPU; with
    DRA, on its allocations' GPUs alone). No soft limit: see `SOFT_BYTES`."""
    found: dict[str, Target] = {}
    for p in pods:
        pod_dir = pod_dirs.get(p.uid)
        if pod_dir is None or not p.owed.units:
            continue
        found[pod_dir] = pod_target(p, pod_dir)
        dirs = container_dirs.get(p.uid, {})
        containers = dict.fromkeys(c for o in p.owed.units for c in o.unit.containers)
        for name in containers:
            path = dirs.get(p.ids.get(name, ""))
            if path is not None:
                of = [o for o in p.owed.units if name in o.unit.containers]
                found[path] = _target(path, p, name, of)
    return found


def pod_target(pod: PodOwed, cgroup: str) -> Target:
    """The pod cgroup's: what all its units may hold on a GPU (with DRA, on each GPU of
    theirs), a unit that containers share counted once."""
    return _target(cgroup, pod, "", pod.owed.units)


def _target(cgroup: str, pod: PodOwed, container: str, units: Sequence[Owing]) -> Target:
    gpus: dict[str, int] = {}
    for o in units:
        if o.unit.gpu is not None:
            gpus[o.unit.gpu] = gpus.get(o.unit.gpu, 0) + o.ceiling
    limit = sum(o.ceiling for o in units)
    return Target(
        cgroup, pod.namespace, pod.name, pod.uid, container, limit, tuple(sorted(gpus.items()))
    )


Key = tuple[str, str]  # (cgroup path, GPU UUID)


@dataclass(frozen=True, slots=True)
class LimitChanges:
    set: tuple[tuple[Target, str, int], ...]  # (target, GPU, bytes) to set
    clear: tuple[Key, ...]  # ours, no longer wanted, the cgroup still there
    forget: tuple[Key, ...]  # ours, but the cgroup is gone and the limit with it


def plan(
    wanted: Mapping[str, Target],
    devices: Sequence[Device],
    applied: Mapping[Key, int],
    existing: AbstractSet[str],
    rejected: AbstractSet[tuple[str, str, int]] = frozenset(),
    foreign: AbstractSet[Key] = frozenset(),
    refused: AbstractSet[str] = frozenset(),
) -> LimitChanges:
    """What to change so that exactly the wanted limits hold, touching only limits that we
    set ourselves (`applied`), never one someone else set (`foreign`). A value NVML
    rejected, or did not hold when read back, is not tried again until it changes; a cgroup
    the driver cannot hold (`refused`: no dmem files) is not tried at all."""
    desired = {
        (t.cgroup, gpu): limit
        for t in wanted.values()
        for gpu, limit in t.limits_on(devices).items()
    }
    to_set = tuple(
        (wanted[cgroup], gpu, limit)
        for (cgroup, gpu), limit in desired.items()
        if applied.get((cgroup, gpu)) != limit
        and (cgroup, gpu, limit) not in rejected
        and (cgroup, gpu) not in foreign
        and cgroup not in refused
    )
    gone = [key for key in applied if key not in desired]
    return LimitChanges(
        to_set,
        tuple(key for key in gone if key[0] in existing),
        tuple(key for key in gone if key[0] not in existing),
    )


# How far the limit the driver reports may be from the one set and still be that one: the
# driver may round it to its page (2 MiB, the GPU's large page), and NVIDIA's toolkit hook
# sets whole MiB.
ROUNDING_BYTES = 2 * MiB


def same_hard(held: HeldLimit, hard: int) -> bool:
    """Whether the driver holds the cgroup to `hard`, give or take its rounding."""
    return abs(held.hard_bytes - hard) < ROUNDING_BYTES


def holds(held: HeldLimit | LimitOutcome | None, hard: int) -> bool:
    """Whether a read after our Set shows what we set (`hard`, soft `SOFT_BYTES`): a
    read-only mount, a racing writer or a value the driver ignored (one below what the
    cgroup holds, on dmem) all fail it."""
    return isinstance(held, HeldLimit) and same_hard(held, hard) and held.soft_bytes == SOFT_BYTES


class Found(StrEnum):
    """What a read before our first write to a (cgroup, GPU) found there."""

    FREE = "free"  # no limit (or only the one its pod cgroup has, read through): ours to set
    OURS = "ours"  # the limit we would set: a restarted or upgraded agent's own, adopted
    FOREIGN = "foreign"  # a limit someone else set: never written or cleared by us


def first_read(
    held: HeldLimit | None, hard: int, inherited: int | None = None, adopt: bool = True
) -> Found:
    """Who holds a (cgroup, GPU) we have not written to yet. `held`: the driver's answer
    (None: no limit). `inherited`: the limit we hold the pod's cgroup to there, which a leaf
    without `dmem` files reads as its own (NVIDIA's MPS v3 page) and is no one else's.
    `adopt`: whether a limit equal to ours may be ours (a restarted agent's); not where
    another writer sets that cgroup (NVIDIA's hook, for a container given its variable)."""
    if held is None:
        return Found.FREE
    if adopt and same_hard(held, hard):
        return Found.OURS
    if inherited is not None and same_hard(held, inherited):
        return Found.FREE
    return Found.FOREIGN


# Who set a foreign limit, as the Event and the series name it.
TOOLKIT = "nvidia-container-toolkit"  # its apply-cuda-memory-limits hook, from the env below
UNKNOWN_OWNER = "unknown"
TOOLKIT_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"  # read by the hook as the container is created


def owner(container_env: AbstractSet[str]) -> str:
    """Who most likely set a limit we did not: the toolkit's hook where the container's spec
    gives it its variable, else unknown."""
    return TOOLKIT if TOOLKIT_LIMIT_ENV in container_env else UNKNOWN_OWNER


# The label gpu-fractioning's MPS daemon puts on a node it serves (its README).
FRACTIONING_LABEL = "gpu-fractioning.kai.scheduler/nvidia-driver-version.major"


def fractioned(annotations: Mapping[str, object], node_labels: Mapping[str, str]) -> bool:
    """Whether gpu-fractioning serves the pod: it declares in KAI's NvFractions form on a
    node that gpu-fractioning's MPS daemon labelled. Its hook sets the pod's leaves (R615 +
    MPS), and its clients are invisible to sampling: nothing of ours is set there."""
    return FRACTIONING_LABEL in node_labels and nv_fractions(annotations)


@dataclass(frozen=True, slots=True)
class Holding:
    """Which tier holds one container, and how (the driver's limit, with its value, who set
    it and the driver's proof) or why sampling alone does: a line of its pod's Event."""

    container: str
    tier: TierName
    how: str
