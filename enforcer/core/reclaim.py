"""Pure reclaim decisions for VRAM requests and ceilings: one GPU's view in, who gives
memory back out.

A container's request is what the scheduler counted and what it always gets; its ceiling
is how far it may go while the GPU has room (above the ceiling, the ordinary limit policy
of `policy.py` applies, with the ceiling as the limit). Memory above a request is lent,
and lent only while the GPU can still give every container on it what it is owed (its
request less what it uses) plus a watermark: the growth that may happen before a reclaim
lands. Whatever else holds memory on the GPU declared no request (in `exec`, every process
outside the command; the driver's own reservation) and may grow too, so the watermark is
kept free for it as well. When the GPU cannot, the
`shortfall` is taken back from the containers above their requests: lowest pod priority
first, then the most bytes over the request, as the kubelet ranks evictions under memory
pressure. A victim is held to its request (its processes stop, the largest first, until it
is back under it), so what it gives back is what it had lent. A container at or under its
request is never chosen.

The decision needs the whole GPU, so it is made once per GPU, by the node agent, which
sees every pod on it; whoever may signal carries it out. Memory that victims already on
their way out still hold counts as coming back, so one shortfall never picks a second
victim while the first exits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from enforcer.core.model import Device, GiB, UnitUsage
from enforcer.core.node import allocatable
from enforcer.core.units import Unit

# The default watermark: what a container within its request may still allocate before a
# reclaim is seen. Sampling every 100 ms sees a crossing within 100 ms at p99 (docs/
# performance.md), in which a workload growing at 10 GiB/s (PyTorch's caching allocator on
# an H100 does) takes 1 GiB; twice that, for a tick that runs late.
DEFAULT_WATERMARK = 2 * GiB


@dataclass(frozen=True, slots=True)
class Share:
    """One container's part of one GPU."""

    unit: str  # the container, as the policy names it (namespace/pod/container)
    request: int  # bytes it is guaranteed
    ceiling: int  # bytes it may reach while the GPU has room (the request: no borrowing)
    used: int  # bytes it holds on this GPU now
    priority: int = 0  # its pod's priority (spec.priority)
    exiting: bool = False  # signalled by an earlier reclaim and not gone yet

    @property
    def borrowed(self) -> int:
        """Bytes held above the request."""
        return max(self.used - self.request, 0)

    @property
    def owed(self) -> int:
        """Bytes of its request it does not use yet, which the GPU must keep for it."""
        return max(self.request - self.used, 0)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the agent sees it: all its memory, all that is used on it (by any
    process, a container's or not), the containers that share it, and what processes
    with no request hold on it (`unrequested`)."""

    uuid: str
    total: int
    used: int
    shares: tuple[Share, ...]
    unrequested: int = 0

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)

    @property
    def requested(self) -> int:
        return sum(s.request for s in self.shares)


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Take back what `victim` lends on `gpu`: the GPU, with `free` bytes free, lacked
    `shortfall` bytes to give `owed_to` (the containers still short of their requests)
    what they are owed, plus the watermark kept for them and, with `for_unrequested`, for
    the processes with no request."""

    gpu: str
    victim: Share
    shortfall: int
    owed_to: tuple[str, ...]
    free: int = 0
    for_unrequested: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do on one GPU: the reclaims, and what they cannot cover (`uncovered`: more
    memory short than all that is lent, e.g. requests that add up to more than the GPU, or
    memory held by processes of no container)."""

    reclaims: tuple[Reclaim, ...] = ()
    uncovered: int = 0


def shortfall(gpu: Gpu, watermark: int) -> int:
    """Bytes that the GPU lacks to give every container what it is owed, plus `watermark`
    (what may still be allocated before the next look). Nothing while nobody is owed
    anything and no process without a request is there to grow: a GPU filled by borrowers
    alone is lent, not short."""
    owed = sum(s.owed for s in gpu.shares)
    if owed == 0 and gpu.unrequested == 0:
        return 0
    return max(owed + watermark - gpu.free, 0)


def rank(shares: Iterable[Share]) -> list[Share]:
    """The containers that may be reclaimed, first to go first: above their request and not
    already exiting; lowest priority, then most bytes borrowed, then by name (the same order on
    every pass)."""
    borrowers = [s for s in shares if s.borrowed > 0 and not s.exiting]
    return sorted(borrowers, key=lambda s: (s.priority, -s.borrowed, s.unit))


def plan(gpu: Gpu, watermark: int = DEFAULT_WATERMARK) -> Plan:
    """Who gives memory back on `gpu`: nobody while it can honour every request plus
    `watermark`; else the ranked borrowers, each held to its request (returning what it
    borrowed), until the shortfall is covered. What exiting victims borrowed is already
    coming back."""
    needed = shortfall(gpu, watermark)
    short = needed - sum(s.borrowed for s in gpu.shares if s.exiting)
    if short <= 0:
        return Plan()
    owed_to = tuple(s.unit for s in gpu.shares if s.owed > 0)
    reclaims = []
    for share in rank(gpu.shares):
        if short <= 0:
            break
        reclaims.append(Reclaim(gpu.uuid, share, needed, owed_to, gpu.free, gpu.unrequested > 0))
        short -= share.borrowed
    return Plan(tuple(reclaims), max(short, 0))


def views(
    devices: Sequence[Device],
    units: Sequence[UnitUsage],
    requests: Mapping[str, int],
    exiting: frozenset[str] = frozenset(),
    priorities: Mapping[str, int] | None = None,
    reserve_bytes: int = 0,
) -> tuple[Gpu, ...]:
    """Each GPU as `plan` needs it, from one tick: the units with a request (`requests`,
    by unit name; the unit's limit is its ceiling), and all else its memory holds as
    `unrequested`: other units' processes, processes this reader cannot see (another PID
    namespace's, one too new to be charged) and the driver's own. Unknown is not free. A
    unit that counts one GPU (DRA), or whose request covers all its GPUs but that uses one
    GPU only (as NVML shows it), has its request there, and is owed what it does not use
    of it. One that uses several lends on each what it holds there, up to all it holds
    above its request, and is owed nothing on any (which GPU would be a guess). A unit
    that uses no GPU yet is owed nothing anywhere. `priorities`: its pod's priority, by
    unit. A GPU's memory is what can be allocated on it (`node.allocatable`: less the
    driver's reserved memory and `reserve_bytes`), as the node advertises it. `--reserve`
    is kept for the node's other processes, whose use NVML counts in `used`: what they use
    of it is counted once, in the reserve, and only what they use beyond it in `used`;
    counted twice, borrowers would be reclaimed that much early. MIG partitions and GPUs in
    MIG mode are left out, as for hard limits: their memory is split already."""
    in_mig_mode = {d.parent_uuid for d in devices if d.parent_uuid}
    gpus = [d for d in devices if d.parent_uuid is None and d.uuid not in in_mig_mode]
    held: dict[tuple[str, str], int] = {}
    for unit in units:
        if unit.name not in requests:
            continue
        for p in unit.processes:
            for uuid, used in p.by_device:
                if used and (unit.device_uuid is None or unit.device_uuid == uuid):
                    held[unit.name, uuid] = held.get((unit.name, uuid), 0) + used
    # Who is on each GPU: what they hold there, and (DRA) whose request is there before use.
    on_gpu: dict[str, dict[str, UnitUsage]] = {}
    by_name = {u.name: u for u in units if u.name in requests}
    for name, uuid in held:
        on_gpu.setdefault(uuid, {})[name] = by_name[name]
    for unit in by_name.values():
        if unit.device_uuid is not None:
            on_gpu.setdefault(unit.device_uuid, {}).setdefault(unit.name, unit)
    gpus_of = Counter(name for name, _ in held)
    result = []
    for d in gpus:
        if d.total_bytes is None or d.used_bytes is None:
            continue  # unknown is not free: nothing is lent or reclaimed on it
        shares = []
        for unit in on_gpu.get(d.uuid, {}).values():
            used = held.get((unit.name, d.uuid), 0)
            request = requests[unit.name]
            if unit.device_uuid is None and gpus_of[unit.name] > 1:
                request = used - min(used, max(unit.used_bytes - request, 0))
            ceiling = max(unit.limit_bytes, request)
            priority = (priorities or {}).get(unit.name, 0)
            shares.append(Share(unit.name, request, ceiling, used, priority, unit.name in exiting))
        others = max(d.used_bytes - sum(s.used for s in shares), 0)
        counted = d.used_bytes - min(others, reserve_bytes)  # the reserve is out of the total
        result.append(Gpu(d.uuid, allocatable(d, reserve_bytes), counted, tuple(shares), others))
    return tuple(result)


def reclaims(gpus: Iterable[Gpu], watermark: int = DEFAULT_WATERMARK) -> dict[str, Reclaim]:
    """The units to hold to their requests now, each with the reclaim that explains it
    (the first GPU's, by UUID, for a unit reclaimed on more than one)."""
    chosen: dict[str, Reclaim] = {}
    for gpu in sorted(gpus, key=lambda g: g.uuid):
        for reclaim in plan(gpu, watermark).reclaims:
            chosen.setdefault(reclaim.victim.unit, reclaim)
    return chosen


def asked(
    gpus: Iterable[Gpu], reclaims: Mapping[str, Reclaim], container: Callable[[str], str | None]
) -> dict[str, Reclaim]:
    """What the agent asks of one pod's units: each of its reclaims (by the ID of the
    victim's container; `container` names the pod's container of an ID, None for none of
    its own) for the unit of that container that, in the pod's own view of the tick
    (`gpus`), holds more than its request on the reclaim's GPU. Whoever carries it out (the
    pod's sidecar, or the agent's backstop while it is silent) acts only where its own view
    agrees: a sample between the two never makes a unit at or under its request stop."""
    lending = {
        (Unit.of(s.unit).containers, g.uuid): s.unit for g in gpus for s in g.shares if s.borrowed
    }
    found: dict[str, Reclaim] = {}
    for cid, reclaim in reclaims.items():
        name = container(cid)
        unit = lending.get(((name,), reclaim.gpu)) if name is not None else None
        if unit is not None:
            found.setdefault(unit, reclaim)
    return found
