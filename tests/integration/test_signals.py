"""Verified signalling against real processes: identity, membership, escalation, PID reuse."""

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.core.model import Action, ProcessKey, ProcessTotal, SignalResult, UnitUsage
from enforcer.core.policy import Enforcement
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Escalation, Signaller, Terminator
from tests.helpers import wait_for

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


def terminator() -> Terminator:
    return Terminator(Signaller(PROC, frozenset()))


def test_sigterm_reaches_a_verified_process(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn)
    t = terminator()
    assert t.start(enforcement(key, grace=10), always, time.monotonic()) is SignalResult.SENT
    assert child.wait(timeout=5) == -15
    t.close()


def test_wrong_start_time_is_refused_and_the_process_lives(
    spawn: list[subprocess.Popen[str]],
) -> None:
    child, key = start(spawn)
    stale = ProcessKey(key.pid, key.start_time - 1)
    result = terminator().start(enforcement(stale, Action.KILL), always, time.monotonic())
    assert result is SignalResult.IDENTITY_CHANGED
    time.sleep(0.1)
    assert child.poll() is None


def test_non_member_is_refused(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn)
    result = terminator().start(enforcement(key, Action.KILL), lambda pid: False, time.monotonic())
    assert result is SignalResult.NOT_MEMBER
    assert child.poll() is None


def test_protected_and_gone() -> None:
    t = Terminator(Signaller(PROC, frozenset({12345})))
    now = time.monotonic()
    me = ProcessKey(os.getpid(), PROC.start_time(os.getpid()) or 0)
    for key in (ProcessKey(1, 1), me, ProcessKey(12345, 1)):
        assert t.start(enforcement(key, Action.KILL), always, now) is SignalResult.PROTECTED
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert t.start(enforcement(ProcessKey(dead.pid, 1), Action.KILL), always, now) in (
        SignalResult.GONE,
        SignalResult.IDENTITY_CHANGED,
    )


def test_a_zombie_counts_as_gone(spawn: list[subprocess.Popen[str]]) -> None:
    child, key = start(spawn, "print('ready', flush=True)")
    wait_for(lambda: (st := PROC.stat(child.pid)) is not None and st.state == "Z", what="a zombie")
    assert terminator().start(enforcement(key), always, time.monotonic()) is SignalResult.GONE


def test_a_thread_id_is_not_proven_and_nothing_raises(spawn: list[subprocess.Popen[str]]) -> None:
    """pidfd_open refuses a thread id (ENOENT): that is "not proven", not an exception."""
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    child, _ = start(spawn, code)
    tid = wait_for(
        lambda: [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
    )[0]
    key = ProcessKey(tid, PROC.start_time(tid) or 0)
    result = terminator().start(enforcement(key, Action.KILL), always, time.monotonic())
    assert result is SignalResult.UNVERIFIED
    assert child.poll() is None


# The start of the scripts below, run in a process of their own: the enforcer's signalling
# path, with a victim of their own.
IMPORTS = """
import os, resource, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from enforcer.core.model import Action, ProcessKey, ProcessTotal, UnitUsage
from enforcer.core.policy import Enforcement
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Signaller, Terminator
"""

OUT_OF_FDS = IMPORTS + textwrap.dedent(
    """

    proc = ProcFs()
    victim = subprocess.Popen(["sleep", "60"])
    key = ProcessKey(victim.pid, proc.start_time(victim.pid))
    total = ProcessTotal(key, 100, (("GPU-0", 100),))
    t = Terminator(Signaller(proc, frozenset()))
    hoard = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    try:
        while True:
            hoard.append(open("/dev/null"))
    except OSError:
        pass
    print(proc.stat(victim.pid), end=" ")  # EMFILE while reading /proc: None, no exception
    result = t.start(Enforcement(UnitUsage("u", 1, (total,)), total, Action.KILL, 0), lambda pid: True, 0.0)
    for f in hoard:
        f.close()
    time.sleep(0.05)
    print(result.value, victim.poll() is None)
    victim.kill()
    """
)


def test_out_of_file_descriptors_is_not_proven_and_nothing_raises() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", OUT_OF_FDS, str(root)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["None", "unverified", "True"], out.stderr


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


PID_REUSE = IMPORTS + textwrap.dedent(
    """

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
    victim = ProcessTotal(key, 100, (("GPU-0", 100),))
    enforcement = Enforcement(UnitUsage("u", 1, (victim,)), victim, Action.KILL, 0.0)
    result = Terminator(Signaller(proc, frozenset())).start(enforcement, lambda pid: True, 0.0)
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
