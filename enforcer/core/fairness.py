"""Which connection makes way when a server is full: the rule that keeps a port's capacity
from being any one peer's to take.

Whoever reaches a port may hold connections on it, and a tenant can hold many, from many
pods, each as slow as it likes. A server that turns newcomers away once full leaves its
health check to whoever filled it first (issue 42, item 6: eight pods dripping a byte
every 4 s held every slot of the agent's metrics port, and the kubelet restarted the
agents). So a newcomer is never turned away: one connection makes way for it, taken from
the peer (address) that holds the most, the newcomer's own when it holds as many as
anyone or has reached its own bound. An address that holds fewer than another, like the
kubelet's probes (one connection at a time), always gets in; a peer can only ever push out
one that holds more than it does.

Which of the peer's connections makes way (the one that has waited longest on its peer) is
the server's to say; `Holding.waiting_since` is when that one began to wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bounds:
    connections: int  # at once, from everyone
    per_peer: int  # at once, from one address


@dataclass(frozen=True, slots=True)
class Holding:
    """What one peer holds: its connections, and since when the longest-waiting of them
    has waited (on the monotonic clock)."""

    held: int
    waiting_since: float


def making_way(
    holdings: Mapping[str, Holding], total: int, newcomer: str, bounds: Bounds
) -> str | None:
    """The peer one of whose connections is closed to let `newcomer` in, or None while
    there is room. `holdings`: each peer's, `total` connections in all (their sum: only read
    when the server is full). Ties between the peers that hold the most go to the one whose
    connection has waited longest."""
    own = holdings.get(newcomer)
    held = own.held if own is not None else 0
    if held >= bounds.per_peer:
        return newcomer
    if total < bounds.connections:
        return None
    others = [(peer, h) for peer, h in holdings.items() if peer != newcomer and h.held]
    most = max((h.held for _, h in others), default=0)
    if most <= held:
        return newcomer  # it holds as many as anyone: one of its own makes way
    return min(
        (peer for peer, h in others if h.held == most), key=lambda p: holdings[p].waiting_since
    )
