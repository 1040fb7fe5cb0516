"""Verified signalling against real processes: identity, membership, escalation, PID reuse."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.model import Action, ProcessKey, ProcessTotal, SignalResult, UnitUsage
from enforcer.policy import Enforcement
from enforcer.procfs import ProcFs
from enforcer.signals import Escalation, Signaller, Terminator

PROC = ProcFs()
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    children: list[subprocess.Popen[str]] = []
    yield children
    for c in children:
        if c.poll() is None:
            c.kill()
        c.wait()


def start(
    children: list[subprocess.Popen[str]],
    code: str = "import time; print('ready', flush=True); time.sleep(60)",
) -> tuple[subprocess.Popen[str], ProcessKey]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    children.append(child)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    start_time = PROC.start_time(child.pid)
    assert start_time is not None
    return child, ProcessKey(child.pid, start_time)


def enforcement(
    key: ProcessKey, action: Action = Action.TERMINATE, grace: float = 0.3
) -> Enforcement:
    victim = ProcessTotal(key, 100, (("GPU-0", 100),), "python")
    return Enforcement(UnitUsage("main", 10, (victim,)), victim, action, grace)


def always(pid: int) -> bool:
    return True


def test_sigterm_reaches_a_verified_process(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn)
    assert Signaller(PROC, frozenset()).send(key, signal.SIGTERM, always) is SignalResult.SENT
    assert child.wait(timeout=5) == -15


def test_wrong_start_time_is_refused_and_the_process_lives(
    spawn: list[subprocess.Popen[str]],
) -> None:
    child, key = start(spawn)
    stale = ProcessKey(key.pid, key.start_time - 1)
    assert (
        Signaller(PROC, frozenset()).send(stale, signal.SIGKILL, always)
        is SignalResult.IDENTITY_CHANGED
    )
    time.sleep(0.1)
    assert child.poll() is None


def test_non_member_is_refused(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn)
    result = Signaller(PROC, frozenset()).send(key, signal.SIGKILL, lambda pid: False)
    assert result is SignalResult.NOT_MEMBER
    assert child.poll() is None


def test_protected_and_gone() -> None:
    s = Signaller(PROC, frozenset({12345}))
    sig = signal.SIGKILL
    assert s.send(ProcessKey(1, 1), sig, always) is SignalResult.PROTECTED
    assert (
        s.send(ProcessKey(os.getpid(), PROC.start_time(os.getpid()) or 0), sig, always)
        is SignalResult.PROTECTED
    )
    assert s.send(ProcessKey(12345, 1), sig, always) is SignalResult.PROTECTED
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert s.send(ProcessKey(dead.pid, 1), sig, always) in (
        SignalResult.GONE,
        SignalResult.IDENTITY_CHANGED,
    )


def test_a_zombie_counts_as_gone(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn, "print('ready', flush=True)")
    deadline = time.monotonic() + 5
    while (
        (st := PROC.stat(child.pid)) is not None and st.state != "Z" and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert Signaller(PROC, frozenset()).send(key, signal.SIGTERM, always) is SignalResult.GONE


def test_terminate_escalates_to_sigkill_for_a_process_ignoring_sigterm(
    spawn: list[subprocess.Popen[str]],
) -> None:
    child, key = start(spawn, IGNORE_TERM)
    t = Terminator(Signaller(PROC, frozenset()))
    now = time.monotonic()
    assert t.start(enforcement(key, grace=0.3), always, now) is SignalResult.SENT
    assert t.busy() == {key}
    assert t.next_deadline() == pytest.approx(now + 0.3)
    assert t.poll(now + 0.1) == []  # SIGTERM ignored, grace not over
    assert child.poll() is None
    events = t.poll(now + 0.31)
    assert [e.kind for e in events] == [Escalation.KILLED]
    assert child.wait(timeout=5) == -9
    assert [e.kind for e in t.poll(now + 0.4)] == [Escalation.EXITED]
    assert t.busy() == frozenset()


def test_a_process_that_exits_on_sigterm_is_not_killed_again(
    spawn: list[subprocess.Popen[str]],
) -> None:
    child, key = start(spawn)
    t = Terminator(Signaller(PROC, frozenset()))
    now = time.monotonic()
    t.start(enforcement(key, grace=10), always, now)
    assert child.wait(timeout=5) == -15
    assert [e.kind for e in t.poll(now + 0.01)] == [Escalation.EXITED]
    assert t.next_deadline() is None


def test_kill_action_sends_sigkill_at_once(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn, IGNORE_TERM)
    t = Terminator(Signaller(PROC, frozenset()))
    assert t.start(enforcement(key, Action.KILL), always, time.monotonic()) is SignalResult.SENT
    assert child.wait(timeout=5) == -9
    t.close()


def test_escalation_is_abandoned_when_membership_is_lost(
    spawn: list[subprocess.Popen[str]],
) -> None:
    child, key = start(spawn, IGNORE_TERM)
    member = {"yes": True}
    t = Terminator(Signaller(PROC, frozenset()))
    now = time.monotonic()
    t.start(enforcement(key, grace=0.1), lambda pid: member["yes"], now)
    member["yes"] = False
    assert [e.kind for e in t.poll(now + 1)] == [Escalation.ABANDONED]
    assert child.poll() is None


PID_REUSE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from enforcer.model import ProcessKey, SignalResult
    from enforcer.procfs import ProcFs
    from enforcer.signals import Signaller

    proc = ProcFs()
    old = subprocess.Popen(["sleep", "60"])
    key = ProcessKey(old.pid, proc.start_time(old.pid))
    old.kill(); old.wait()
    time.sleep(0.02)  # a new start time needs at least one clock tick to pass
    # Make the next fork in this PID namespace reuse the victim's pid.
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(key.pid - 1))
    new = subprocess.Popen(["sleep", "60"])
    assert new.pid == key.pid, (new.pid, key.pid)
    result = Signaller(proc, frozenset()).send(key, signal.SIGKILL, lambda pid: True)
    time.sleep(0.05)
    print(result.value, new.poll() is None)
    new.kill(); new.wait()
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_real_pid_reuse_is_refused() -> None:
    """In a fresh PID namespace, force the kernel to hand the victim's pid to a new process."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID_REUSE, str(root)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["identity-changed", "True"], out.stderr
