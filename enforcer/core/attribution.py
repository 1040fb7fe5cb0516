"""Pure attribution: per-process, per-device usage folded into the units that carry limits.

Which unit a process belongs to is a fact the imperative shell establishes (`exec` walks
the process tree, the sidecar reads cgroups); given those facts, the folding is here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import (
    IDLE,
    Activity,
    GpuShare,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
)


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
            name = f"{container}@{usage.device_uuid}"
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
