"""The policy is a pure function: every rule is checked with plain data and a fake 'now'."""

import math
from dataclasses import replace

from enforcer.core.model import Action, GiB, ProcessKey, ProcessTotal, UnitUsage
from enforcer.core.policy import (
    REARM_FRACTION,
    Decision,
    PolicyConfig,
    UnitState,
    choose_victim,
    decide,
)
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import Reclaim, Share


def proc(pid: int, used: int, start: int | None = None, unknown: bool = False) -> ProcessTotal:
    by_device: tuple[tuple[str, int | None], ...] = (("GPU-0", used),)
    if unknown:
        by_device += (("GPU-1", None),)
    return ProcessTotal(ProcessKey(pid, start if start is not None else pid * 10), used, by_device)


def unit(*processes: ProcessTotal, limit: int = 4 * GiB, name: str = "main") -> UnitUsage:
    return UnitUsage(name, limit, processes)


def run(units: list[UnitUsage], config: PolicyConfig, steps: list[float]) -> list[Decision]:
    """Feed the same usage at each time in `steps`, threading the state through."""
    state: dict[str, UnitState] = {}
    out = []
    for now in steps:
        d = decide(units, config, state, now)
        state = dict(d.state)
        out.append(d)
    return out


def test_under_the_warn_threshold_nothing_happens() -> None:
    d = decide([unit(proc(1, 3 * GiB))], PolicyConfig(), {}, 0.0)
    assert d.notices == ()
    assert d.enforcements == ()


def test_near_limit_warns_once_per_crossing() -> None:
    near = unit(proc(1, int(3.7 * GiB)))
    decisions = run([near], PolicyConfig(warn_at=0.9), [0, 1, 2])
    assert [n.reason for n in decisions[0].notices] == [Reason.NEAR_LIMIT]
    assert decisions[1].notices == ()
    assert decisions[2].notices == ()


def test_near_warning_rearms_only_below_the_hysteresis_band() -> None:
    config = PolicyConfig(warn_at=0.9)
    threshold = 4 * GiB * 0.9
    state: dict[str, UnitState] = {}
    seen = []
    for used in (
        threshold,
        threshold * 0.97,
        threshold,
        threshold * REARM_FRACTION * 0.99,
        threshold,
    ):
        d = decide([unit(proc(1, math.ceil(used)))], config, state, 0.0)
        state = dict(d.state)
        seen.append([n.reason for n in d.notices])
    # Dipping just under the threshold does not re-arm; dipping below the band does.
    assert seen == [[Reason.NEAR_LIMIT], [], [], [], [Reason.NEAR_LIMIT]]


def test_over_the_limit_terminates_the_largest_process() -> None:
    u = unit(proc(1, 1 * GiB), proc(2, 3 * GiB), proc(3, 1 * GiB))
    d = decide([u], PolicyConfig(grace_period=7.0), {}, 0.0)
    assert [n.reason for n in d.notices] == [Reason.LIMIT_EXCEEDED]
    (e,) = d.enforcements
    assert e.victim.key.pid == 2
    assert e.action is Action.TERMINATE
    assert e.grace_period == 7.0


def test_exactly_at_the_limit_is_allowed() -> None:
    d = decide([unit(proc(1, 4 * GiB))], PolicyConfig(), {}, 0.0)
    assert d.enforcements == ()


def test_tie_goes_to_the_youngest_process() -> None:
    u = unit(proc(1, 3 * GiB, start=100), proc(2, 3 * GiB, start=900), limit=5 * GiB)
    assert choose_victim(u, frozenset()) is not None
    assert choose_victim(u, frozenset()).key.pid == 2  # type: ignore[union-attr]


def test_a_process_with_only_unknown_usage_is_never_chosen() -> None:
    unknown_only = ProcessTotal(ProcessKey(9, 90), 0, (("GPU-0", None),))
    u = unit(unknown_only, proc(1, 5 * GiB))
    d = decide([u], PolicyConfig(), {}, 0.0)
    assert [e.victim.key.pid for e in d.enforcements] == [1]
    assert choose_victim(unit(unknown_only, limit=0), frozenset()) is None


def test_unknown_usage_is_not_counted_as_zero_but_never_inflates_the_total() -> None:
    u = unit(proc(1, 3 * GiB, unknown=True))
    assert u.used_bytes == 3 * GiB
    assert u.has_unknown
    assert decide([u], PolicyConfig(), {}, 0.0).enforcements == ()


def test_over_for_tolerates_a_short_spike() -> None:
    over = unit(proc(1, 5 * GiB))
    fine = unit(proc(1, 1 * GiB))
    config = PolicyConfig(over_for=2.0)
    d0 = decide([over], config, {}, 0.0)
    assert [n.reason for n in d0.notices] == [Reason.LIMIT_EXCEEDED]
    assert d0.notices[0].over_for_left == 2.0
    d1 = decide([over], config, d0.state, 1.5)
    assert d1.enforcements == ()
    d2 = decide([fine], config, d1.state, 1.9)
    assert d2.enforcements == ()
    # A new excursion starts its own window.
    d3 = decide([over], config, d2.state, 3.0)
    assert d3.enforcements == ()
    assert [n.reason for n in d3.notices] == [Reason.LIMIT_EXCEEDED]
    d4 = decide([over], config, d3.state, 5.0)
    assert [e.victim.key.pid for e in d4.enforcements] == [1]


def test_exceeded_is_reported_once_per_excursion() -> None:
    decisions = run([unit(proc(1, 5 * GiB))], PolicyConfig(action=Action.WARN), [0, 1, 2])
    assert [len(d.notices) for d in decisions] == [1, 0, 0]
    assert all(d.enforcements == () for d in decisions)


def test_warn_action_never_enforces() -> None:
    decisions = run([unit(proc(1, 50 * GiB))], PolicyConfig(action=Action.WARN), [0, 10, 100])
    assert all(d.enforcements == () for d in decisions)


def test_no_new_victim_while_one_is_still_exiting() -> None:
    u = unit(proc(1, 3 * GiB), proc(2, 3 * GiB, start=5))
    first = decide([u], PolicyConfig(), {}, 0.0)
    (e,) = first.enforcements
    busy = frozenset({e.victim.key})
    assert decide([u], PolicyConfig(), first.state, 1.0, busy).enforcements == ()
    # Once it has gone and usage is still over, the next largest is chosen.
    rest = unit(*(p for p in u.processes if p.key != e.victim.key))
    rest = replace(rest, limit_bytes=1 * GiB)
    (nxt,) = decide([rest], PolicyConfig(), first.state, 2.0).enforcements
    assert nxt.victim.key != e.victim.key


def test_dry_run_reports_the_would_be_victim_once() -> None:
    decisions = run([unit(proc(1, 5 * GiB))], PolicyConfig(dry_run=True), [0, 1, 2])
    assert [len(d.enforcements) for d in decisions] == [1, 0, 0]
    assert decisions[0].enforcements[0].dry_run


def test_a_dry_run_reports_the_most_the_unit_held_since_it_went_over() -> None:
    """The peak of this excursion, as sampled, up to when the action would have come: past
    the tolerance window the unit holds less than it did in it. A dip under the limit
    starts another excursion, with its own peak."""
    config = PolicyConfig(dry_run=True, over_for=2.0)
    state: dict[str, UnitState] = {}
    reported = []
    for now, used in ((0, 5), (1, 7), (2, 6), (3, 3), (4, 5), (6, 5)):
        d = decide([unit(proc(1, used * GiB))], config, state, float(now))
        state = dict(d.state)
        reported += [(now, e.peak_bytes // GiB, e.dry_run) for e in d.enforcements]
    assert reported == [(2, 7, True), (6, 5, True)]


def test_kill_action_is_passed_through() -> None:
    (e,) = decide([unit(proc(1, 5 * GiB))], PolicyConfig(action=Action.KILL), {}, 0).enforcements
    assert e.action is Action.KILL


def test_zero_limit_means_any_usage_is_a_violation() -> None:
    (e,) = decide([unit(proc(1, 1), limit=0)], PolicyConfig(), {}, 0.0).enforcements
    assert e.victim.key.pid == 1
    assert decide([unit(limit=0)], PolicyConfig(), {}, 0.0).notices == ()


def test_units_are_independent_and_vanished_units_are_forgotten() -> None:
    a = unit(proc(1, 5 * GiB), name="a")
    b = unit(proc(2, 1 * GiB), name="b")
    d = decide([a, b], PolicyConfig(), {"gone": UnitState(near_warned=True)}, 0.0)
    assert [e.unit.name for e in d.enforcements] == ["a"]
    assert set(d.state) == {"a", "b"}


def test_falling_below_the_limit_after_enforcement_rearms_reports() -> None:
    over, under = unit(proc(1, 5 * GiB)), unit(proc(1, 1 * GiB))
    d1 = decide([over], PolicyConfig(), {}, 0.0)
    d2 = decide([under], PolicyConfig(), d1.state, 1.0)
    d3 = decide([over], PolicyConfig(), d2.state, 2.0)
    assert [n.reason for n in d3.notices] == [Reason.LIMIT_EXCEEDED]
    assert len(d3.enforcements) == 1


def test_restart_signals_the_containers_init_process() -> None:
    init = ProcessTotal(ProcessKey(40, 400), 0, (), "/bin/sh /entrypoint.sh")
    u = replace(unit(proc(41, 5 * GiB)), init_process=init)
    (e,) = decide([u], PolicyConfig(action=Action.RESTART), {}, 0.0).enforcements
    assert e.victim == init
    assert e.action is Action.RESTART
    # While it is being restarted, nothing more is signalled.
    assert (
        decide(
            [u], PolicyConfig(action=Action.RESTART), {}, 1.0, frozenset({init.key})
        ).enforcements
        == ()
    )


def test_restart_without_a_known_init_process_signals_nobody() -> None:
    assert (
        decide([unit(proc(41, 5 * GiB))], PolicyConfig(action=Action.RESTART), {}, 0.0).enforcements
        == ()
    )


def test_an_unenforceable_unit_is_reported_never_enforced() -> None:
    u = replace(unit(proc(1, 5 * GiB)), enforceable=False)
    d = decide([u], PolicyConfig(action=Action.KILL), {}, 0.0)
    assert [n.reason for n in d.notices] == [Reason.LIMIT_EXCEEDED]
    assert d.enforcements == ()


def test_a_unit_still_over_one_grace_period_after_its_first_victim_loses_every_process() -> None:
    """A supervisor that replaces each worker it loses keeps the unit over its limit for as
    long as one victim at a time is taken: one grace period on, the whole unit goes."""
    config = PolicyConfig(grace_period=5.0)
    workers = unit(proc(1, 3 * GiB), proc(2, 3 * GiB, start=5))
    first = decide([workers], config, {}, 0.0)
    (victim,) = first.enforcements
    assert not victim.whole_unit
    busy = frozenset({victim.victim.key})  # still exiting, and NVML still lists it
    replaced = unit(*workers.processes, proc(3, 3 * GiB, start=60))  # and a new worker
    assert decide([replaced], config, first.state, 4.9, busy).enforcements == ()
    due = decide([replaced], config, first.state, 5.0, busy)  # busy or not
    (whole,) = due.enforcements
    assert whole.whole_unit and whole.action is Action.KILL
    assert whole.victim.key == ProcessKey(3, 60)  # the largest (youngest on a tie), reported
    # Not again at once (every process is on its way out): the next time only after
    # another grace period over the limit.
    everyone = frozenset(p.key for p in replaced.processes)
    assert decide([replaced], config, due.state, 9.9, everyone).enforcements == ()
    (again,) = decide([replaced], config, due.state, 10.0, everyone).enforcements
    assert again.whole_unit


def test_leaving_the_limit_ends_the_excursion_and_its_escalation() -> None:
    config = PolicyConfig(grace_period=5.0)
    over, under = unit(proc(1, 5 * GiB)), unit(proc(2, 1 * GiB, start=30))
    d = decide([over], config, {}, 0.0)
    d = decide([under], config, d.state, 3.0)
    d = decide([unit(proc(3, 5 * GiB, start=60))], config, d.state, 6.0)
    (e,) = d.enforcements
    assert not e.whole_unit  # a new excursion starts with one victim again


def test_dry_run_and_warn_never_take_a_whole_unit() -> None:
    for config in (PolicyConfig(dry_run=True), PolicyConfig(action=Action.WARN)):
        decisions = run([unit(proc(1, 5 * GiB))], config, [0, 10, 20, 30])
        assert not any(e.whole_unit for d in decisions for e in d.enforcements)


def test_with_kill_a_whole_unit_is_taken_no_sooner_than_a_second_after_its_victim() -> None:
    """NVML takes a tick or two to show a killed victim's memory released."""
    config = PolicyConfig(action=Action.KILL, grace_period=0.0)
    first = decide([unit(proc(1, 5 * GiB))], config, {}, 0.0)
    assert (
        decide([unit(proc(2, 5 * GiB))], config, first.state, 0.5).enforcements[0].whole_unit
        is False
    )
    (whole,) = decide([unit(proc(2, 5 * GiB))], config, first.state, 1.0).enforcements
    assert whole.whole_unit


def lent(victim: str = "main", gpu: str = "GPU-1") -> Reclaim:
    """A reclaim of `victim` on `gpu` (the numbers only feed the message)."""
    return Reclaim(gpu, Share(victim, GiB, 8 * GiB, 3 * GiB), GiB, ("other",), GiB)


def test_a_reclaim_stops_the_largest_process_on_that_gpu_at_once() -> None:
    """Under its limit, no tolerance window: the neighbours it borrowed from are short."""
    on_gpu1 = ProcessTotal(ProcessKey(2, 20), GiB, (("GPU-1", GiB),))
    borrower = unit(proc(1, 2 * GiB), on_gpu1, limit=8 * GiB)
    config = PolicyConfig(over_for=30.0)
    d = decide([borrower], config, {}, 0.0, reclaims={"main": lent()})
    assert d.notices == ()  # the signal's report says why
    (enf,) = d.enforcements
    assert enf.victim == on_gpu1 and enf.reclaim == lent() and not enf.whole_unit
    # Asked again while the victim exits: nothing new, no second notice.
    again = decide([borrower], config, d.state, 1.0, frozenset({on_gpu1.key}), {"main": lent()})
    assert again.notices == () and again.enforcements == ()
    # Never the whole unit, however long the GPU stays short: one victim at a time.
    later = decide([borrower], config, again.state, 100.0, reclaims={"main": lent()})
    assert [e.whole_unit for e in later.enforcements] == [False]


def test_a_reclaim_that_ends_rearms_its_report() -> None:
    borrower = unit(proc(1, 3 * GiB), limit=8 * GiB)
    first = decide([borrower], PolicyConfig(), {}, 0.0, reclaims={"main": lent(gpu="GPU-0")})
    safe = decide([borrower], PolicyConfig(), first.state, 1.0)
    assert safe.notices == () and safe.enforcements == ()
    second = decide(
        [borrower], PolicyConfig(), safe.state, 2.0, reclaims={"main": lent(gpu="GPU-0")}
    )
    assert [e.reclaim for e in second.enforcements] == [lent(gpu="GPU-0")]
    # Nothing to signal (the victim still exiting, from an earlier tick): one notice says it.
    busy = frozenset({borrower.processes[0].key})
    waiting = decide([borrower], PolicyConfig(), safe.state, 2.0, busy, {"main": lent(gpu="GPU-0")})
    assert [n.reason for n in waiting.notices] == [Reason.RECLAIMED] and not waiting.enforcements
    again = decide(
        [borrower], PolicyConfig(), waiting.state, 3.0, busy, {"main": lent(gpu="GPU-0")}
    )
    assert again.notices == ()


def test_a_reclaim_with_warn_or_dry_run_signals_nothing() -> None:
    borrower = unit(proc(1, 3 * GiB), limit=8 * GiB)
    warn = run_reclaim(borrower, PolicyConfig(action=Action.WARN))
    assert [len(d.notices) for d in warn] == [1, 0] and not any(d.enforcements for d in warn)
    dry = run_reclaim(borrower, PolicyConfig(dry_run=True))
    assert [[e.dry_run for e in d.enforcements] for d in dry] == [[True], []]


def test_over_its_ceiling_the_limit_rules_not_the_reclaim() -> None:
    over = unit(proc(1, 9 * GiB), limit=8 * GiB)
    d = decide([over], PolicyConfig(over_for=5.0), {}, 0.0, reclaims={"main": lent()})
    assert [n.reason for n in d.notices] == [Reason.LIMIT_EXCEEDED] and d.enforcements == ()


def run_reclaim(u: UnitUsage, config: PolicyConfig) -> list[Decision]:
    state: dict[str, UnitState] = {}
    out = []
    for now in (0.0, 1.0):
        d = decide([u], config, state, now, reclaims={"main": lent("main", "GPU-0")})
        state = dict(d.state)
        out.append(d)
    return out
