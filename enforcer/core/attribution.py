"""Pure attribution: per-process, per-device usage folded into the units that carry limits.

Which unit a process belongs to is a fact the imperative shell establishes (`exec` walks
the process tree, the sidecar reads cgroups); given those facts, the folding is here, and
so is what a pod's units are held to, from what each is owed (`pod_units`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from enforcer.core.declaration import Declaration
from enforcer.core.model import (
    IDLE,
    Activity,
    GpuShare,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
)
from enforcer.core.owed import Owed, Owing, holdings
from enforcer.core.pod import ContainerRef
from enforcer.core.units import POD_UNIT, Unit, of_sole_container


def attribute(
    sample: Sample,
    unit_of: Mapping[ProcessKey, str],
    limits: Mapping[str, int],
    cmdlines: Mapping[ProcessKey, str] | None = None,
) -> tuple[UnitUsage, ...]:
    """Every unit in `limits`, with the processes `unit_of` assigns to it, largest first.

    Processes without a unit, or whose unit has no limit, are left out: nothing can be
    decided about them.
    """
    by_device: dict[ProcessKey, list[tuple[str, int | None]]] = {}
    for usage in sample.processes:
        if unit_of.get(usage.key) in limits:
            by_device.setdefault(usage.key, []).append((usage.device_uuid, usage.used_bytes))
    members: dict[str, list[ProcessTotal]] = {name: [] for name in limits}
    for key, per_device in by_device.items():
        used = sum(b for _, b in per_device if b is not None)
        cmdline = (cmdlines or {}).get(key, "")
        members[unit_of[key]].append(ProcessTotal(key, used, tuple(per_device), cmdline))
    return tuple(
        UnitUsage(name, limit, tuple(sorted(members[name], key=lambda p: -p.used_bytes)))
        for name, limit in limits.items()
    )


def oldest(processes: Iterable[ProcessTotal]) -> ProcessTotal | None:
    """The process that started first; None when there is none, or when two started in the
    same clock tick (then which one is older is not proven)."""
    ordered = sorted(processes, key=lambda p: p.key.start_time)
    if len(ordered) > 1 and ordered[0].key.start_time == ordered[1].key.start_time:
        return None
    return ordered[0] if ordered else None


def reported_only(
    name: str,
    sample: Sample,
    members: Iterable[ProcessKey],
    limit_bytes: int,
    cmdlines: Mapping[ProcessKey, str],
) -> UnitUsage:
    """A unit whose processes are counted against `limit_bytes` but never signalled: those
    of a pod whose containers cannot all be proven yet."""
    (unit,) = attribute(sample, dict.fromkeys(members, name), {name: limit_bytes}, cmdlines)
    return UnitUsage(name, unit.limit_bytes, unit.processes, enforceable=False)


def gpu_shares(units: Iterable[UnitUsage], sample: Sample) -> tuple[GpuShare, ...]:
    """Each unit's memory and utilisation per GPU it uses (and on the GPU of its limit, even
    when idle there), from the processes attribution gave it.

    A GPU where NVML cannot tell a process's utilisation has unknown utilisation for the
    unit; a GPU the unit has no process on is idle.
    """
    activity = {(p.key, p.device_uuid): p.activity for p in sample.processes}
    shares = []
    for unit in units:
        per_gpu: dict[str, tuple[int, list[Activity | None]]] = {}
        if unit.device_uuid is not None:
            per_gpu[unit.device_uuid] = (0, [])
        for process in unit.processes:
            for gpu, used in process.by_device:
                total, seen = per_gpu.get(gpu, (0, []))
                seen.append(activity.get((process.key, gpu)))
                per_gpu[gpu] = (total + (used or 0), seen)
        for gpu, (used, seen) in per_gpu.items():
            shares.append(GpuShare(unit.name, gpu, used, _summed(seen)))
    return tuple(shares)


def unit_activity(unit: UnitUsage, sample: Sample) -> Activity | None:
    """How busy the unit keeps the GPUs, summed over its processes and GPUs; None when it
    has no process on a GPU, or NVML cannot tell how busy one of them is."""
    if not unit.processes:
        return None
    # The sum of gpu_shares' activities, without building them: exec adds it up every tick.
    activity = {(p.key, p.device_uuid): p.activity for p in sample.processes}
    return _summed(activity.get((p.key, gpu)) for p in unit.processes for gpu, _ in p.by_device)


def _summed(activities: Iterable[Activity | None]) -> Activity | None:
    total = IDLE
    for a in activities:
        if a is None:
            return None
        total += a
    return total


def tenants_per_gpu(sample: Sample, tenant_of: Mapping[ProcessKey, str]) -> dict[str, int]:
    """How many tenants (containers, or other cgroups) have a process on each GPU of the
    sample; a GPU nobody uses counts 0. Processes with no known tenant are left out: they
    have exited since the sample."""
    tenants: dict[str, set[str]] = {d.uuid: set() for d in sample.devices}
    for usage in sample.processes:
        tenant = tenant_of.get(usage.key)
        if tenant is not None:
            tenants.setdefault(usage.device_uuid, set()).add(tenant)
    return {gpu: len(found) for gpu, found in tenants.items()}


def usage_by_container(
    sample: Sample, container_of: Mapping[ProcessKey, str]
) -> dict[str, dict[str, int]]:
    """Container ID -> GPU -> what NVML lists for its processes there (unknown counts 0)."""
    found: dict[str, dict[str, int]] = {}
    for usage in sample.processes:
        cid = container_of.get(usage.key)
        if cid is not None and usage.used_bytes:
            per_gpu = found.setdefault(cid, {})
            per_gpu[usage.device_uuid] = per_gpu.get(usage.device_uuid, 0) + usage.used_bytes
    return found


@dataclass(frozen=True, slots=True)
class PodTerms:
    """What a sidecar is told of its pod for its whole life: what each container declares,
    whether one that declares nothing may use a GPU unchecked, and the containers of the
    pod's spec besides the sidecar (the webhook's list; empty when not given)."""

    declared: Declaration
    undeclared_allowed: bool = False
    spec_containers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PodProcesses:
    """A tick's GPU processes of one pod, as its shell read them: `cmdlines` holds every one
    (the sidecar's own and pause's left out), `container_of` those that a container ID in
    the pod's status proves; `containers` are the pod's as the tick knows them, `inits`
    their init processes (when they were looked for)."""

    cmdlines: Mapping[ProcessKey, str]
    container_of: Mapping[ProcessKey, str]
    containers: tuple[ContainerRef, ...]
    inits: Mapping[str, ProcessTotal] = field(default_factory=dict)

    @property
    def unproven(self) -> bool:
        """Whether a process is in no container the pod is known to have (yet)."""
        return any(key not in self.container_of for key in self.cmdlines)


def pod_processes(
    read: Mapping[ProcessKey, tuple[str | None, str]],
    by_id: Mapping[str, ContainerRef],
    inits: Mapping[str, ProcessTotal],
) -> PodProcesses:
    """From each process's (container ID or None, command line) and the pod's containers by
    ID: a process is a container's only when its ID is that container's."""
    return PodProcesses(
        {key: cmdline for key, (_, cmdline) in read.items()},
        {
            key: by_id[cid].name
            for key, (cid, _) in read.items()
            if cid is not None and cid in by_id
        },
        tuple(by_id.values()),
        inits,
    )


@dataclass(frozen=True, slots=True)
class PodUnits:
    """A tick's units of one pod, and each borrower's request (unit -> the bytes a reclaim
    takes it back to), for the units that may borrow above it."""

    units: tuple[UnitUsage, ...]
    requests: dict[str, int]


def pod_units(
    sample: Sample,
    pod: PodProcesses,
    owed: Owed,
    undeclared_allowed: bool,
    lending: bool,
) -> PodUnits:
    """Each unit of the pod held to what it is owed (`owed.owed`): its ceiling while the agent
    decides reclaims (`lending`), else its request; a container spread over GPUs on each of
    the GPUs its shares fall on (`Owing.placed`). A container is held to 0 where it is owed
    nothing: one that declares nothing (unless undeclared containers are allowed) over all
    its GPUs; a spread one, and with DRA any that may be (one that holds a claim; all, unless
    undeclared ones are allowed), on each GPU no unit of it covers. A container whose portion
    of a GPU is not counted yet, or whose claims' GPUs are not proven, is not checked."""
    per_gpu = owed.claimed or any(o.gpus > 1 for o in owed.units)
    held = holdings(sample, pod.container_of) if per_gpu else {}
    units: list[Owing] = []
    confined: set[str] = set()
    for owing in owed.units:
        if owing.gpus > 1:
            confined.add(owing.unit.containers[0])
            units.extend(owing.placed(held.get(owing.unit.containers[0], {})))
        else:
            units.append(owing)
    everyone = () if undeclared_allowed else tuple(ref.name for ref in pod.containers)
    if owed.claimed:
        confined |= (set(everyone) | owed.claiming) - owed.unresolved
    else:
        declaring = {c for owing in owed.units for c in owing.unit.containers}
        idle = (n for n in everyone if n not in declaring and n not in owed.uncounted)
        units.extend(Owing(Unit((name,)), 0, 0) for name in idle)
    if confined:
        covered = {(c, o.unit.gpu) for o in units if o.unit.gpu for c in o.unit.containers}
        for container in sorted(confined):
            for gpu in held.get(container, {}):
                if (container, gpu) not in covered:
                    units.append(Owing(Unit((container,), gpu), 0, 0))
    names = [str(o.unit) for o in units]
    limits = {n: o.ceiling if lending else o.request for n, o in zip(names, units, strict=True)}
    if per_gpu:
        found = _per_gpu(sample, pod, units, names, limits)
    else:  # every tick of almost every pod: each unit is a container, over all its GPUs
        found = attribute(sample, pod.container_of, limits, pod.cmdlines)
    requests = {n: o.request for n, o in zip(names, units, strict=True) if o.borrows}
    return _of_pod(sample, pod, found, requests, owed.total(lending))


def _per_gpu(
    sample: Sample,
    pod: PodProcesses,
    units: list[Owing],
    names: list[str],
    limits: Mapping[str, int],
) -> tuple[UnitUsage, ...]:
    """Each unit with its processes (on its GPU alone, where it has one), largest first."""
    on_gpu: dict[tuple[str, str | None], str] = {}
    for owing, name in zip(units, names, strict=True):
        for of in owing.unit.containers:
            on_gpu[of, owing.unit.gpu] = name
    members: dict[str, dict[ProcessKey, list[tuple[str, int | None]]]] = {}
    for usage in sample.processes:
        container = pod.container_of.get(usage.key)
        if container is None:
            continue
        unit = on_gpu.get((container, usage.device_uuid)) or on_gpu.get((container, None))
        if unit is not None:
            per_device = members.setdefault(unit, {}).setdefault(usage.key, [])
            per_device.append((usage.device_uuid, usage.used_bytes))
    found = []
    for owing, name in zip(units, names, strict=True):
        processes = [
            ProcessTotal(
                key, sum(b for _, b in per if b is not None), tuple(per), pod.cmdlines.get(key, "")
            )
            for key, per in members.get(name, {}).items()
        ]
        processes.sort(key=lambda p: -p.used_bytes)
        found.append(UnitUsage(name, limits[name], tuple(processes), device_uuid=owing.unit.gpu))
    return tuple(found)


def _of_pod(
    sample: Sample,
    pod: PodProcesses,
    units: Iterable[UnitUsage],
    requests: dict[str, int],
    total: int,
) -> PodUnits:
    """The units with their containers' inits; and, while a process is not proven to be in
    a container, the pod's unit (`units.POD_UNIT`): every process, against the pod's `total`,
    reported on and never signalled."""
    found = list(units)
    if pod.inits:
        found = [replace(u, init_process=of_sole_container(u.name, pod.inits)) for u in found]
    if pod.unproven:
        found.append(reported_only(POD_UNIT, sample, pod.cmdlines, total, pod.cmdlines))
    return PodUnits(tuple(found), requests)
