"""Pure attribution: per-process, per-device usage folded into the units that carry limits.

Which unit a process belongs to is a fact the imperative shell establishes (`exec` walks
the process tree, the sidecar reads cgroups); given those facts, the folding is here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from enforcer.core.model import ProcessKey, ProcessTotal, Sample, UnitUsage


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
