"""Pure attribution: per-process, per-device usage folded into the units that carry limits.

Which unit a process belongs to is a fact the imperative shell establishes (`exec` walks
the process tree, the sidecar reads cgroups); given those facts, the folding is here, and
so is what a pod's units are held to (`declared_units`, `claimed_units`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from enforcer.core.declaration import Declaration
from enforcer.core.dra import (
    Allocations,
    GpuUnit,
    with_ceilings,
)
from enforcer.core.model import (
    IDLE,
    Activity,
    GpuShare,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
)
from enforcer.core.pod import ContainerRef, container_limits
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


def attribute_declared(
    sample: Sample,
    container_of: Mapping[ProcessKey, str],
    limits: Mapping[str, int],
    gpus: Mapping[str, int],
    cmdlines: Mapping[ProcessKey, str] | None = None,
) -> tuple[UnitUsage, ...]:
    """`attribute`, with each container of `gpus` held per GPU instead (KAI's
    `gpu-fraction-num-devices`: one share on each of N GPUs, never N on one): its limit, cut
    into `gpus[name]` equal shares, on each of the GPUs where it holds most, as units
    `<container>@<gpu>`; on any further GPU, 0. Its usage on none: no unit yet."""
    spread = {name: count for name, count in gpus.items() if name in limits}
    if not spread:  # every tick of almost every pod: nothing else to fold
        return attribute(sample, container_of, limits, cmdlines)
    held: dict[str, dict[str, int]] = {}
    for usage in sample.processes:
        name = container_of.get(usage.key)
        if name in spread:
            on = held.setdefault(name, {})
            on[usage.device_uuid] = on.get(usage.device_uuid, 0) + (usage.used_bytes or 0)
    shares = tuple(
        GpuUnit(gpu, (name,), limits[name] // count, ())
        for name, count in spread.items()
        for gpu, _ in sorted(held.get(name, {}).items(), key=lambda g: (-g[1], g[0]))[:count]
    )
    whole = {key: name for key, name in container_of.items() if name not in spread}
    rest = {name: limit for name, limit in limits.items() if name not in spread}
    return (
        *attribute(sample, whole, rest, cmdlines),
        *attribute_per_gpu(sample, container_of, Allocations(shares), set(spread), cmdlines),
    )


def attribute_per_gpu(
    sample: Sample,
    container_of: Mapping[ProcessKey, str],
    allocations: Allocations,
    held_to_zero: AbstractSet[str],
    cmdlines: Mapping[ProcessKey, str] | None = None,
) -> tuple[UnitUsage, ...]:
    """Units of one GPU each (DRA): every allocation's unit, with its containers' usage on
    that GPU; and, for a container of `held_to_zero`, its usage on any GPU that no
    allocation gives it, as a unit `<container>@<gpu>` with a limit of 0.

    Containers in `allocations.unresolved` are left out: which GPUs are theirs is unknown.
    """
    limits = {u.name: (u.limit_bytes, u.gpu) for u in allocations.units}
    members: dict[str, dict[ProcessKey, list[tuple[str, int | None]]]] = {n: {} for n in limits}
    for usage in sample.processes:
        container = container_of.get(usage.key)
        if container is None or container in allocations.unresolved:
            continue
        unit = allocations.unit_for(container, usage.device_uuid)
        if unit is not None:
            name = unit.name
        elif container in held_to_zero:
            name = str(Unit((container,), usage.device_uuid))
            limits.setdefault(name, (0, usage.device_uuid))
        else:
            continue
        per_device = members.setdefault(name, {}).setdefault(usage.key, [])
        per_device.append((usage.device_uuid, usage.used_bytes))
    units = []
    for name, (limit, gpu) in limits.items():
        processes = [
            ProcessTotal(
                key,
                sum(b for _, b in per if b is not None),
                tuple(per),
                (cmdlines or {}).get(key, ""),
            )
            for key, per in members.get(name, {}).items()
        ]
        processes.sort(key=lambda p: -p.used_bytes)
        units.append(UnitUsage(name, limit, tuple(processes), device_uuid=gpu))
    return tuple(units)


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


def declared_units(
    sample: Sample,
    pod: PodProcesses,
    terms: PodTerms,
    requests: Mapping[str, int],
    ceilings: Mapping[str, int],
    lending: bool,
) -> PodUnits:
    """Each container held to what it declares (`requests` and the `ceilings` above them,
    in bytes on this tick's GPUs: `Declaration.in_bytes`): to its ceiling while the agent
    decides reclaims (`lending`), else to its request. A container that declares nothing
    is held to 0, unless undeclared containers are allowed; one whose portion of a GPU is
    not counted yet (no GPU's memory known) is not checked at all. A container spread over
    GPUs (`Declaration.gpus`) is held per GPU, as its request is owed there."""
    held = {**requests, **(ceilings if lending else {})}
    counted = [ref for ref in pod.containers if ref.name not in terms.declared.portions]
    limits = container_limits(held, counted, terms.undeclared_allowed)
    gpus = terms.declared.gpus
    units = attribute_declared(sample, pod.container_of, limits, gpus, pod.cmdlines)
    borrowers = {
        unit.name: requests[name] // gpus.get(name, 1)
        for unit in units
        if (name := Unit.of(unit.name).containers[0]) in ceilings
    }
    return _of_pod(sample, pod, units, borrowers, sum(held.values()))


def claimed_units(
    sample: Sample,
    pod: PodProcesses,
    terms: PodTerms,
    claimed: Allocations | None,
    lending: bool,
) -> PodUnits:
    """DRA: each container held on each GPU to what the pod's claims give it there, raised
    to its ceiling while the agent decides reclaims (`lending`; `dra.with_ceilings`). On a
    GPU that no claim gives it, a container is held to 0; where undeclared containers are
    allowed, only one that declared VRAM (0 too) or holds a claim is. Until the claims have
    been read (`claimed` None), no container is enforced on any GPU."""
    if claimed is None:
        everyone = frozenset(terms.spec_containers) | {ref.name for ref in pod.containers}
        claimed = Allocations(unresolved=everyone)
    found, requests = with_ceilings(claimed, terms.declared.ceilings if lending else {})
    held: set[str] = set() if terms.undeclared_allowed else {r.name for r in pod.containers}
    held = (held | set(terms.declared.requests) | found.claiming) - found.unresolved
    units = attribute_per_gpu(sample, pod.container_of, found, held, pod.cmdlines)
    return _of_pod(sample, pod, units, requests, sum(u.limit_bytes for u in found.units))


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
