"""A container's budget of gated calls (core/gate_budget.py): a burst read at once, then
the rate, and an idle container's budget full again, never fuller."""

from __future__ import annotations

import pytest

from enforcer.core.gate_budget import BURST, RATE, Budget


def _waits(budget: Budget, at: float, calls: int) -> tuple[Budget, list[float]]:
    waits = []
    for _ in range(calls):
        budget, wait = budget.take(at)
        waits.append(wait)
    return budget, waits


def test_a_burst_is_read_at_once_and_the_calls_after_it_each_wait_their_share() -> None:
    _, waits = _waits(Budget(rate=10.0, burst=3), 100.0, 6)
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3:] == pytest.approx([0.1, 0.2, 0.3])


def test_a_reader_that_waits_each_turn_reads_the_burst_and_then_the_rate() -> None:
    """What a flooding container gets: read as soon as its budget lets it, for 10 s (and a
    hundredth, past the float sum's error)."""
    budget, now, read = Budget(rate=50.0, burst=20), 0.0, 0
    while True:
        budget, wait = budget.take(now)
        if now + wait > 10.01:
            break
        now += wait
        read += 1
    assert read == 20 + 50 * 10  # the burst, and one call each 1/rate s, the first at 0


def test_an_idle_container_gets_its_whole_burst_back_and_no_more() -> None:
    budget, _ = _waits(Budget(rate=10.0, burst=3), 0.0, 5)  # 2 calls into its rate
    _, waits = _waits(budget, 1000.0, 4)
    assert waits[:3] == [0.0, 0.0, 0.0] and waits[3] == pytest.approx(0.1)


def test_a_budget_half_spent_refills_at_its_rate() -> None:
    budget, _ = _waits(Budget(rate=10.0, burst=3), 0.0, 3)  # the burst spent at 0
    _, waits = _waits(budget, 0.2, 3)  # 2 calls' share back by 0.2
    assert waits[:2] == [0.0, 0.0] and waits[2] == pytest.approx(0.1)


def test_the_defaults_are_the_documented_figures() -> None:
    assert (Budget().rate, Budget().burst) == (RATE, BURST) == (1000.0, 5000)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 10), (-1.0, 10), (10.0, 0)])
def test_a_budget_that_could_never_read_a_call_is_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="a rate above 0 and a burst of 1 or more"):
        Budget(rate=rate, burst=burst)
