"""The allocation gate's decision over plain data: what the tree holds (the sampler's last
pass plus what was let through since), and when it refuses at once or looks again.
`BEFORE` is a call's arrival before the views' passes (at 10.0 and later)."""

from __future__ import annotations

import random

from enforcer.core import messages
from enforcer.core.alloc_gate import MAX_GRANTS, SETTLE, Verdict, View, decide

GIB = 1 << 30
BEFORE = 9.0


def test_an_allocation_up_to_the_limit_is_allowed_one_byte_more_is_refused() -> None:
    view = View(4 * GIB).saw(GIB, at=10.0)
    assert decide(3 * GIB, view, 11.0) == (Verdict.ALLOW, GIB)
    assert decide(3 * GIB + 1, view, BEFORE) == (Verdict.REFUSE, GIB)


def test_one_allocation_larger_than_the_limit_is_refused_whatever_the_view() -> None:
    assert decide(5 * GIB, View(4 * GIB), 1.0) == (Verdict.REFUSE, 0)
    assert decide(5 * GIB, View(4 * GIB).saw(0, at=10.0), 11.0) == (Verdict.REFUSE, 0)


def test_what_was_let_through_counts_until_a_pass_that_began_settle_after_it() -> None:
    view = View(4 * GIB).saw(0, at=10.0).granted(10.01, 3 * GIB)
    assert view.held() == 3 * GIB
    assert view.saw(3 * GIB, at=10.01 + SETTLE / 2).held() == 6 * GIB  # counted twice, meanwhile
    later = view.saw(3 * GIB, at=10.01 + 2 * SETTLE)
    assert (later.held(), later.grants) == (3 * GIB, ())


def test_over_the_limit_with_grants_not_yet_sampled_it_looks_again_then_refuses() -> None:
    view = View(4 * GIB).saw(0, at=10.0).granted(10.01, 3 * GIB)
    assert decide(2 * GIB, view, BEFORE) == (Verdict.RECHECK, 3 * GIB)
    assert decide(2 * GIB, view.saw(3 * GIB, at=11.0), BEFORE) == (Verdict.REFUSE, 3 * GIB)


def test_a_free_just_before_the_call_makes_room_once_a_pass_that_began_after_it_shows_it() -> None:
    """Frees are not gated: 2 GiB freed, then 2 GiB asked at 10.5, the last pass (10.0)
    older than the free. The call waits for a pass begun after it arrived, never refused on
    the older one; that pass shows the free, or that nothing was freed."""
    view = View(4 * GIB).saw(int(3.9 * GIB), at=10.0)
    assert decide(2 * GIB, view, 10.5) == (Verdict.RECHECK, int(3.9 * GIB))
    assert decide(2 * GIB, view.saw(int(3.9 * GIB), at=10.5), 10.5)[0] == Verdict.RECHECK
    assert decide(2 * GIB, view.saw(int(1.9 * GIB), at=10.6), 10.5)[0] == Verdict.ALLOW
    assert decide(2 * GIB, view.saw(int(3.9 * GIB), at=10.6), 10.5)[0] == Verdict.REFUSE


def test_a_retry_after_an_out_of_memory_is_judged_on_a_pass_that_began_after_it() -> None:
    """PyTorch frees its cache on an out-of-memory and asks again: the retry arrived after
    the refusal, so after the free, and a pass before it cannot refuse it."""
    view = View(4 * GIB).saw(int(3.5 * GIB), at=10.0)
    assert decide(GIB, view, BEFORE)[0] == Verdict.REFUSE  # the pass began after the call
    assert decide(GIB, view, 10.02)[0] == Verdict.RECHECK  # the retry, freed meanwhile
    assert decide(GIB, view.saw(GIB, at=10.03), 10.02) == (Verdict.ALLOW, GIB)
    assert decide(GIB, view.saw(int(3.5 * GIB), at=10.03), 10.02)[0] == Verdict.REFUSE


def test_before_the_first_pass_only_grants_are_held_and_nothing_is_fresh() -> None:
    view = View(4 * GIB).granted(1.0, 3 * GIB)
    assert decide(GIB, view, 0.5) == (Verdict.ALLOW, 3 * GIB)
    assert decide(2 * GIB, view, 0.5)[0] == Verdict.RECHECK


def test_an_unread_pass_changes_nothing_usage_it_could_not_see_never_makes_room() -> None:
    """A pass that could not read (NVML down) leaves the last good pass and the grants; one
    begun after the call refuses it on them, as it shows no free; grants it could not show
    still wait for a good pass."""
    view = View(4 * GIB).saw(3 * GIB, at=10.0)
    assert decide(2 * GIB, view, BEFORE)[0] == Verdict.REFUSE
    assert decide(2 * GIB, view, 11.0)[0] == Verdict.RECHECK
    unread = view.tried(11.5)
    assert (unread.sampled_bytes, unread.sampled_at) == (3 * GIB, 10.0)
    assert decide(2 * GIB, unread, 11.0) == (Verdict.REFUSE, 3 * GIB)
    granted = view.granted(10.5, int(0.5 * GIB))
    assert decide(GIB, granted.tried(11.5), 11.0) == (Verdict.RECHECK, int(3.5 * GIB))


def test_a_grant_whose_call_was_interrupted_is_not_held() -> None:
    view = View(4 * GIB).granted(1.0, GIB).granted(1.1, GIB)
    assert view.ungranted(1.0, GIB).grants == ((1.1, GIB),)
    assert view.ungranted(7.0, GIB) == view


def test_grants_are_bounded_the_oldest_merged_and_counted_until_the_newer_expires() -> None:
    view = View(4 * GIB)
    for i in range(MAX_GRANTS + 1):
        view = view.granted(float(i), 1)
    assert len(view.grants) == MAX_GRANTS
    assert view.grants[0] == (1.0, 2) and view.held() == MAX_GRANTS + 1


def test_a_refusal_is_one_line_naming_the_call_the_size_the_limit_and_what_was_held() -> None:
    view = View(4 * GIB).saw(int(2.9 * GIB), at=10.0).granted(10.02, int(0.2 * GIB))
    line = messages.allocation_refused("RM_ALLOC/NVOS64 class 0x40", 2 * GIB, 42, 43, view, 10.04)
    assert line == (
        "refused a GPU allocation of 2.00 GiB (RM_ALLOC/NVOS64 class 0x40, pid 42 thread 43): "
        "the command tree holds 3.10 GiB (2.90 GiB sampled 40 ms ago + 204.80 MiB let through "
        "since) of its 4.00 GiB limit; it got the driver's out-of-memory status (NV_ERR_NO_MEMORY)"
    )


def test_a_pass_settles_what_was_let_through_and_what_was_freed_before_the_call() -> None:
    view = View(4 * GIB).granted(1.0, GIB).granted(2.0, GIB)
    assert view.settled_after(0.5) == 2.0 + SETTLE
    assert view.settled_after(9.0) == 9.0
    assert View(4 * GIB).settled_after(3.0) == 3.0


def test_a_long_run_of_grants_passes_and_undoings_keeps_the_answers_of_the_whole_sum() -> None:
    """`since()` is a running total: it must stay what summing the grants gives, through
    merges past MAX_GRANTS, passes read or not, undone grants and times out of order."""
    rng = random.Random(45)  # noqa: S311 (a fixed sequence, not a secret)
    # The first grant is stamped before the pass's cutoff: the first merge counts it anew.
    view, now = View(64 * GIB).saw(0, at=10.0).granted(9.0, GIB), 10.0

    def summed(v: View) -> int:
        cutoff = float("-inf") if v.sampled_at is None else v.sampled_at - SETTLE
        return sum(n for at, n in v.grants if at > cutoff)

    merged = 0
    for step in range(MAX_GRANTS + 2000):
        now += rng.uniform(0, 2 * SETTLE / MAX_GRANTS)
        roll = rng.random()
        merged += len(view.grants) == MAX_GRANTS
        if roll < 0.001 and step > MAX_GRANTS:  # none before: the first merges meet 9.0
            view = view.saw(rng.randrange(8 * GIB), now - rng.uniform(0, 2 * SETTLE))
        elif roll < 0.003:
            view = view.tried(now)
        elif roll < 0.01 and view.grants:
            view = view.ungranted(*rng.choice(view.grants))
        else:  # now and then a grant stamped before the last pass's cutoff
            view = view.granted(now - rng.choice((0.0, 0.0, 0.0, 4 * SETTLE)), rng.randrange(GIB))
        if step % 7 == 0:  # summing each time would make the test itself quadratic
            since = summed(view)
            assert view.since() == since == _anew(view).since(), step
            ask, arrived = rng.randrange(16 * GIB), now - rng.uniform(0, 4 * SETTLE)
            assert decide(ask, view, arrived) == _decided(ask, view, since, arrived), step
    assert merged > 100  # the bound was reached, and merging kept the total


def _anew(view: View) -> View:
    """The same view made from its fields, its total counted from the grants."""
    return View(view.limit_bytes, view.sampled_bytes, view.sampled_at, view.grants, view.tried_at)


def _decided(ask: int, view: View, since: int, arrived: float) -> tuple[Verdict, int]:
    """decide() as it would read without the running total: the grants summed on each call."""
    held = view.sampled_bytes + since
    if held + ask <= view.limit_bytes:
        return Verdict.ALLOW, held
    tried = view.tried_at
    fresh = view.sampled_at is not None and tried is not None and not since and tried > arrived
    if ask > view.limit_bytes or fresh:
        return Verdict.REFUSE, held
    return Verdict.RECHECK, held
