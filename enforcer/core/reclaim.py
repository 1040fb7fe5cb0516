"""Pure reclaim decisions for VRAM requests and ceilings: one GPU's view in, who gives
memory back out.

A container's request is what the scheduler counted and what it always gets; its ceiling
is how far it may go while the GPU has room (above the ceiling, the ordinary limit policy
of `policy.py` applies, with the ceiling as the limit). Memory above a request is lent,
and lent only while the GPU can still give every container on it what it is owed (its
request less what it uses) plus a watermark: the growth that may happen before a reclaim
lands. When it cannot, the `shortfall` is taken back from the containers above their
requests: lowest pod priority first, then the most bytes over the request, as the kubelet
ranks evictions under memory pressure. A container at or under its request is never
chosen.

The decision needs the whole GPU, so it is made once per GPU, by the node agent, which
sees every pod on it; whoever may signal carries it out. Memory that victims already on
their way out still hold counts as coming back, so one shortfall never picks a second
victim while the first exits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from enforcer.core.model import GiB

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
    ceiling: int  # bytes it may reach while the GPU has room (the request: no bursting)
    used: int  # bytes it holds on this GPU now
    priority: int = 0  # its pod's priority (spec.priority)
    exiting: bool = False  # signalled by an earlier reclaim and not gone yet

    @property
    def lent(self) -> int:
        """Bytes held above the request."""
        return max(self.used - self.request, 0)

    @property
    def owed(self) -> int:
        """Bytes of its request it does not use yet, which the GPU must keep for it."""
        return max(self.request - self.used, 0)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the agent sees it: all its memory, all that is used on it (by any
    process, a container's or not), and the containers that share it."""

    uuid: str
    total: int
    used: int
    shares: tuple[Share, ...]


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Take back what `victim` holds on `gpu`: the GPU lacked `shortfall` bytes to give
    `owed_to` (the containers still short of their requests) what they are owed, plus the
    watermark."""

    gpu: str
    victim: Share
    shortfall: int
    owed_to: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do on one GPU: the reclaims, and what they cannot cover (`uncovered`: more
    memory short than all that is lent, e.g. requests that add up to more than the GPU, or
    memory held by processes of no container)."""

    reclaims: tuple[Reclaim, ...] = ()
    uncovered: int = 0


def shortfall(gpu: Gpu, watermark: int) -> int:
    """Bytes that the GPU lacks to give every container what it is owed, plus `watermark`
    (what lenders may still allocate before the next look). Nothing while nobody is owed
    anything: a GPU filled by lenders alone is lent, not short."""
    owed = sum(s.owed for s in gpu.shares)
    if owed == 0:
        return 0
    return max(owed + watermark - (gpu.total - gpu.used), 0)


def rank(shares: Iterable[Share]) -> list[Share]:
    """The containers that may be reclaimed, first to go first: above their request and not
    already exiting; lowest priority, then most bytes lent, then by name (the same order on
    every pass)."""
    lending = [s for s in shares if s.lent > 0 and not s.exiting]
    return sorted(lending, key=lambda s: (s.priority, -s.lent, s.unit))


def plan(gpu: Gpu, watermark: int = DEFAULT_WATERMARK) -> Plan:
    """Who gives memory back on `gpu`: nobody while it can honour every request plus
    `watermark`; else the ranked lenders, each returning all it holds (its processes
    stop), until the shortfall is covered. What exiting victims hold is already coming
    back."""
    needed = shortfall(gpu, watermark)
    short = needed - sum(s.used for s in gpu.shares if s.exiting)
    if short <= 0:
        return Plan()
    owed_to = tuple(s.unit for s in gpu.shares if s.owed > 0)
    reclaims = []
    for share in rank(gpu.shares):
        if short <= 0:
            break
        reclaims.append(Reclaim(gpu.uuid, share, needed, owed_to))
        short -= share.used
    return Plan(tuple(reclaims), max(short, 0))
