"""Which connection makes way when a server is full (core/fairness.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.fairness import Bounds, Holding, making_way

BOUNDS = Bounds(connections=8, per_peer=4)


def held(**peers: tuple[int, float]) -> dict[str, Holding]:
    return {peer.replace("_", "."): Holding(n, since) for peer, (n, since) in peers.items()}


def test_there_is_room_until_a_bound_is_reached() -> None:
    assert making_way({}, 0, "kubelet", BOUNDS) is None
    assert making_way(held(a=(3, 0.0)), 3, "a", BOUNDS) is None


def test_a_peer_at_its_own_bound_gives_up_one_of_its_own() -> None:
    assert making_way(held(a=(4, 0.0)), 4, "a", BOUNDS) == "a"


def test_when_full_the_peer_holding_the_most_makes_way_for_one_holding_fewer() -> None:
    full = held(a=(4, 5.0), b=(3, 1.0), c=(1, 0.0))
    assert making_way(full, 8, "kubelet", BOUNDS) == "a"
    assert making_way(full, 8, "c", BOUNDS) == "a"


def test_ties_go_to_the_peer_whose_connection_has_waited_longest() -> None:
    full = held(a=(2, 5.0), b=(2, 1.0), c=(2, 3.0), d=(2, 2.0))
    assert making_way(full, 8, "kubelet", BOUNDS) == "b"


def test_a_peer_holding_as_many_as_anyone_gives_up_its_own_never_a_smaller_ones() -> None:
    full = held(a=(2, 0.0), b=(2, 0.0), c=(2, 0.0), d=(2, 9.0))
    assert making_way(full, 8, "d", BOUNDS) == "d"
    many = {f"10.0.0.{i}": Holding(1, float(i)) for i in range(8)}
    assert making_way(many, 8, "10.0.0.7", BOUNDS) == "10.0.0.7"


@given(
    st.dictionaries(
        st.sampled_from([f"10.0.0.{i}" for i in range(12)]),
        st.tuples(st.integers(1, 4), st.floats(0, 100)),
        max_size=12,
    ),
    st.sampled_from([f"10.0.0.{i}" for i in range(13)]),
)
def test_a_newcomer_only_ever_takes_from_a_peer_holding_more_or_from_itself(
    peers: dict[str, tuple[int, float]], newcomer: str
) -> None:
    holdings = {p: Holding(n, s) for p, (n, s) in peers.items()}
    total = sum(h.held for h in holdings.values())
    mine = holdings[newcomer].held if newcomer in holdings else 0
    loser = making_way(holdings, total, newcomer, BOUNDS)
    if total < BOUNDS.connections and mine < BOUNDS.per_peer:
        assert loser is None
    elif loser is not None and loser != newcomer:
        assert holdings[loser].held > mine
        assert holdings[loser].held == max(h.held for p, h in holdings.items() if p != newcomer)
    else:
        assert loser == newcomer and mine > 0  # never a peer that holds fewer
