"""A container's budget of gated calls (core/gate_budget.py): a burst read at once, then
the rate, and an idle container's budget full again, never fuller."""

from __future__ import annotations

import pytest

from enforcer.core.gate_budget import BURST, QUANTUM, RATE, Budget


def _waits(budget: Budget, at: float, calls: int) -> tuple[Budget, list[float]]:
    waits = []
    for _ in range(calls):
        budget, wait = budget.take(at)
        waits.append(wait)
    return budget, waits


def test_a_burst_is_read_at_once_and_the_calls_after_it_each_wait_their_share() -> None:
    _, waits = _waits(Budget(rate=10.0, burst=3, quantum=0.0), 100.0, 6)
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3:] == pytest.approx([0.1, 0.2, 0.3])


def test_a_reader_that_waits_each_turn_reads_the_burst_and_then_the_rate() -> None:
    """What a flooding container gets: read as soon as its budget lets it, for 10 s (and a
    hundredth, past the float sum's error)."""
    budget, now, read = Budget(rate=50.0, burst=20, quantum=0.0), 0.0, 0
    while True:
        budget, wait = budget.take(now)
        if now + wait > 10.01:
            break
        now += wait
        read += 1
    assert read == 20 + 50 * 10  # the burst, and one call each 1/rate s, the first at 0


def test_an_idle_container_gets_its_whole_burst_back_and_no_more() -> None:
    budget, _ = _waits(Budget(rate=10.0, burst=3, quantum=0.0), 0.0, 5)  # 2 into its rate
    _, waits = _waits(budget, 1000.0, 4)
    assert waits[:3] == [0.0, 0.0, 0.0] and waits[3] == pytest.approx(0.1)


def test_a_budget_half_spent_refills_at_its_rate() -> None:
    budget, _ = _waits(Budget(rate=10.0, burst=3, quantum=0.0), 0.0, 3)  # the burst spent
    _, waits = _waits(budget, 0.2, 3)  # 2 calls' share back by 0.2
    assert waits[:2] == [0.0, 0.0] and waits[2] == pytest.approx(0.1)


def test_a_wait_under_the_quantum_is_not_waited_and_the_rate_holds_all_the_same() -> None:
    """At 100 calls a second and a quantum of 50 ms, past its burst a reader waits once in
    five or six calls (the sums' float error), 50 to 60 ms, and reads its rate, at most 6
    calls ahead of it."""
    budget, now, read, waited = Budget(rate=100.0, burst=10, quantum=0.05), 0.0, 0, []
    while True:
        budget, wait = budget.take(now)
        if now + wait > 10.0:
            break
        if wait:
            waited.append(wait)
        now += wait
        read += 1
    assert all(0.05 - 1e-9 <= w <= 0.06 + 1e-9 for w in waited), waited
    assert 10 / 0.06 - 1 <= len(waited) <= 10 / 0.05, len(waited)
    assert 10 + 100 * 10 - 6 <= read <= 10 + 100 * 10 + 6, read


def test_the_defaults_are_the_documented_figures() -> None:
    assert (Budget().rate, Budget().burst, Budget().quantum) == (RATE, BURST, QUANTUM)
    assert (RATE, BURST, QUANTUM) == (1000.0, 5000, 0.02)


@pytest.mark.parametrize(
    ("rate", "burst", "quantum"), [(0.0, 10, 0.0), (-1.0, 10, 0.0), (10.0, 0, 0.0), (10, 1, -1)]
)
def test_a_budget_that_could_never_read_a_call_is_refused(
    rate: float, burst: int, quantum: float
) -> None:
    with pytest.raises(ValueError, match="a rate above 0, a burst of 1 or more and a quantum"):
        Budget(rate=rate, burst=burst, quantum=quantum)
