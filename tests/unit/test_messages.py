"""The sentences people read: who, how much of what limit, and what was done."""

from dataclasses import replace

from enforcer.core import messages
from enforcer.core.model import Action, GiB, ProcessKey, ProcessTotal, SignalResult, UnitUsage
from enforcer.core.policy import Enforcement, Notice
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import Reclaim, Share

VICTIM = ProcessTotal(
    ProcessKey(4242, 1), int(4.5 * GiB), (("GPU-0", int(4.5 * GiB)),), "python train.py"
)
UNIT = UnitUsage("main", 4 * GiB, (VICTIM,))


def test_enforcement_line_names_usage_limit_victim_and_signal() -> None:
    e = Enforcement(UNIT, VICTIM, Action.TERMINATE, 5.0)
    text = messages.enforcement(e, "the command tree", SignalResult.SENT)
    assert text == (
        "the command tree uses 4.50 GiB of its 4.00 GiB VRAM limit (112%); sent SIGTERM to "
        "pid 4242 (python train.py), which holds 4.50 GiB; SIGKILL follows in 5s if it has not exited"
    )


def test_refusal_says_why() -> None:
    e = Enforcement(UNIT, VICTIM, Action.KILL, 5.0)
    text = messages.enforcement(e, "container 'x'", SignalResult.IDENTITY_CHANGED)
    assert "did not signal pid 4242" in text
    assert "start time changed" in text
    assert "could not be proven to belong to container 'x'" in messages.enforcement(
        e, "container 'x'", SignalResult.NOT_MEMBER
    )


def test_a_dry_run_says_the_usage_peak_and_limit_what_it_would_have_done_and_that_nothing_was() -> (
    None
):
    e = Enforcement(UNIT, VICTIM, Action.TERMINATE, 5.0, dry_run=True, peak_bytes=5 * GiB)
    assert messages.would_enforce(e, "container 'trainer'") == (
        "container 'trainer' uses 4.50 GiB of its 4.00 GiB VRAM limit (112%), 5.00 GiB at most "
        "since it went over; dry run, so nothing was signalled: would have sent SIGTERM to pid "
        "4242 (python train.py), which holds 4.50 GiB, then SIGKILL after 5s had it not exited"
    )
    killed = messages.would_enforce(replace(e, action=Action.KILL, peak_bytes=0), "x")
    assert killed.endswith(
        "4.50 GiB at most since it went over; dry run, so nothing was "
        "signalled: would have sent SIGKILL to pid 4242 (python train.py), "
        "which holds 4.50 GiB"
    )
    restarted = messages.would_enforce(replace(e, action=Action.RESTART), "x")
    assert "would have restarted it, sending SIGTERM to its init process, pid 4242" in restarted
    lent = Reclaim("GPU-0", Share("main", GiB, 8 * GiB, 3 * GiB), GiB, ("b",), GiB)
    taken = messages.would_enforce(replace(e, reclaim=lent), "x")
    assert taken.startswith("x holds 3.00 GiB on GPU GPU-0, 2.00 GiB above its 1.00 GiB request")
    assert "; dry run, so nothing was signalled: would have taken back what it lent, sending " in (
        taken
    )


def test_a_dry_runs_notices_say_what_would_be_done() -> None:
    over = Notice(Reason.LIMIT_EXCEEDED, UNIT)
    assert messages.notice(over, "x", Action.TERMINATE, 0.9, dry_run=True).endswith(
        "(112%); dry run: it would be enforced (terminate); nothing is signalled"
    )
    later = Notice(Reason.LIMIT_EXCEEDED, UNIT, over_for_left=30.0)
    assert messages.notice(later, "x", Action.KILL, 0.9, dry_run=True).endswith(
        "dry run: it would be enforced (kill) if it stayed over for 30s"
    )


def test_notices() -> None:
    near = Notice(Reason.NEAR_LIMIT, UNIT)
    assert messages.notice(near, "x", Action.TERMINATE, 0.9).endswith(
        "above the 90% warning threshold"
    )
    over = Notice(Reason.LIMIT_EXCEEDED, UNIT, over_for_left=30.0)
    assert "if it stays over for 30s" in messages.notice(over, "x", Action.TERMINATE, 0.9)
    assert "nothing is signalled" in messages.notice(over, "x", Action.WARN, 0.9)


def test_undeclared_usage_and_unknown_usage() -> None:
    assert "declares no VRAM limit" in messages.usage(UnitUsage("c", 0, (VICTIM,)), "container 'c'")
    elsewhere = UnitUsage("c@GPU-1", 0, (VICTIM,), device_uuid="GPU-1")  # DRA: not given GPU-1
    assert messages.usage(elsewhere, "container 'c' on GPU GPU-1") == (
        "container 'c' on GPU GPU-1 uses 4.50 GiB of VRAM but was allocated none there"
    )
    partly = ProcessTotal(ProcessKey(1, 1), 10, (("GPU-0", 10), ("GPU-1", None)))
    assert "plus usage NVML could not report" in messages.usage(UnitUsage("c", 100, (partly,)), "c")


def test_long_command_lines_are_shortened() -> None:
    long = ProcessTotal(ProcessKey(1, 1), 1, (("GPU-0", 1),), "x" * 500)
    assert len(messages.process(long)) < 160


def test_tenant_text_is_escaped_unambiguously_and_ordinary_text_left_alone() -> None:
    ordinary = "python train.py --lr 3e-4 --out /data/café/日本 😀"
    assert messages.shown(ordinary, 120) == ordinary
    # Each escape reads one way: a backslash is doubled, a byte that is not UTF-8 (kept by
    # surrogateescape) is \xNN, a character from U+0080 to U+00FF that is not printable is
    # \u00NN, and the invisible ones that reorder or hide text are escaped too.
    assert messages.shown("a\\nb a\nb \x00 \t", 120) == "a\\\\nb a\\nb \\x00 \\t"
    assert messages.shown("\udcff \xff \x85 \u202e \u2028 \U000e0041", 120) == (
        "\\xff \u00ff \\u0085 \\u202e \\u2028 \\U000e0041"
    )
    # Cut where an escape ends, never inside one.
    assert messages.shown("\x1b" * 100, 20) == "\\x1b" * 4 + "..."
    assert messages.shown("\x1b" * 5, 20) == "\\x1b" * 5
    # A sentence of ours is one line already: it passes as it is; one with a control
    # character in it is escaped whole.
    assert messages.one_line("pid 7 (a\\nb)", 20) == "pid 7 (a\\nb)"
    assert messages.one_line("pid 7 (a\\nb)\n", 20) == "pid 7 (a\\\\nb)\\n"
    assert messages.one_line("x" * 30, 20) == "x" * 17 + "..."


def test_a_silent_sidecar_says_why_when_the_agent_could_not_reach_it() -> None:
    unheard = messages.sidecar_silent(10.0)
    assert "does not read what the agent sends" in unheard
    assert "the node agent enforces the pod's" in unheard
    denied = messages.sidecar_silent(10.0, "cannot connect to /proc/7/root/...: Permission denied")
    assert (
        "the agent cannot connect to it (cannot connect to /proc/7/root/...: Permission " in denied
    )
    assert "AppArmor" in denied and "does not read" not in denied


def test_a_reclaim_names_the_gpu_usage_request_ceiling_and_whose_need() -> None:
    lender = Share("ml/a/a", 4 * GiB, 12 * GiB, int(4.5 * GiB))
    owed = Reclaim("GPU-7", lender, 3 * GiB, ("ml/b/b",), 1 * GiB, for_unrequested=True)
    text = messages.notice(Notice(Reason.RECLAIMED, UNIT, reclaim=owed), "x", Action.RESTART, 0.9)
    assert text == (
        "x holds 4.50 GiB on GPU GPU-7, 512.00 MiB above its 4.00 GiB request (ceiling 12.00 "
        "GiB); the GPU has 1.00 GiB free, 3.00 GiB less than it must keep free for what "
        "ml/b/b is still owed of its request and its other users, which declared no request; "
        "taking back what it lent (restart)"
    )
    two = Reclaim("GPU-7", lender, 3 * GiB, ("ml/b/b", "ml/c/c"), 0)
    assert "for what ml/b/b, ml/c/c are still owed; taking" in messages.notice(
        Notice(Reason.RECLAIMED, UNIT, reclaim=two), "x", Action.TERMINATE, 0.9
    )
    warn = messages.notice(Notice(Reason.RECLAIMED, UNIT, reclaim=two), "x", Action.WARN, 0.9)
    assert warn.endswith("; the action is warn, so nothing is signalled")
    # The signal's report carries the why in full: a later report of the same reason (the
    # SIGKILL after the grace period) replaces it as the pod's Event, and starts so too.
    e = Enforcement(UNIT, VICTIM, Action.TERMINATE, 5.0, reclaim=two)
    why = messages.reclaim(two, "x")
    assert messages.enforcement(e, "x", SignalResult.SENT) == (
        f"{why}; taking back what it lent: sent SIGTERM to pid 4242 (python train.py), which "
        "holds 4.50 GiB; SIGKILL follows in 5s if it has not exited"
    )
    assert messages.about(e, "x") == f"{why}; "
    assert messages.about(Enforcement(UNIT, VICTIM, Action.TERMINATE, 5.0), "x") == ""
    # A DRA unit's label names its GPU already: said once.
    assert messages.reclaim(two, "container 'a' on GPU GPU-7").startswith(
        "container 'a' on GPU GPU-7 holds 4.50 GiB, 512.00 MiB above"
    )
