"""The allocation gate reads and writes the memory of the task that made the call, and no
other, when the caller's process changes under it: a process that exits and a new one that
calls after it, and a process that execs a new image between two calls. Each call past the
limit must be refused with the status written into the caller's own block (a read or write
of another memory shows as a call let go on, its status untouched), and the listener keeps
no handle on a process that is gone."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from enforcer.edge import gate_child
from enforcer.edge.gate_listener import GateListener, Ledger, Outcome
from enforcer.edge.seccomp_filter import program

GIB = 1 << 30
STANDIN = str(Path(__file__).with_name("rm_standin.py"))
NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)
DEADLINE = 60.0  # s: a bound for a hang, never a measure

# The stand-in's steps in this process, then (the last argument) in the image it execs.
THEN_EXEC = """
import os, runpy, sys
standin, out, *steps, then = sys.argv[1:]
sys.argv = [standin, out, *steps]
runpy.run_path(standin, run_name="__main__")
os.execv(sys.executable, [sys.executable, standin, out, then])
"""
# Each argument a stand-in of its own, one after the other (each a new process).
IN_TURN = """
import subprocess, sys
standin, out, *steps = sys.argv[1:]
for s in steps:
    subprocess.run([sys.executable, standin, out, s], pass_fds=[int(out[4:])], check=True)
"""


class _Errors:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, amount: float = 1) -> None:
        self.count += int(amount)


def _gated(script: str, *steps: str) -> tuple[list[dict[str, Any]], list[Outcome], set[int]]:
    """Run `script` with the stand-in's steps under the gate (limit 4 GiB, nothing held):
    the stand-in's lines, the listener's outcomes, and the pids of the processes behind
    the /proc/<pid>/mem files the listener still held open once they were all gone."""
    out_r, out_w = os.pipe()
    os.set_inheritable(out_w, True)
    argv = [sys.executable, "-c", script, STANDIN, f"out={out_w}", *steps]
    spawned = gate_child.spawn(sys.executable, argv, program())
    os.close(out_w)
    assert spawned.listener is not None, spawned.why_not
    ledger = Ledger(4 * GIB)
    ledger.saw(0, time.monotonic())
    outcomes: list[Outcome] = []
    errors = _Errors()
    listener = GateListener(
        spawned.listener, ledger, {NULL_MAJOR}, errors, count=lambda o, s: outcomes.append(o)
    )
    listener.start()
    try:
        assert spawned.go() == 0
        with os.fdopen(out_r) as lines:
            found = [json.loads(line) for line in lines]  # to EOF: every process has ended
        _, status = os.waitpid(spawned.pid, 0)
        listener.stop()  # the answer wakes the caller before the listener closes its file
        held = _mem_files()
    finally:
        listener.stop()
        os.close(spawned.listener)
    assert os.waitstatus_to_exitcode(status) == 0 and errors.count == 0
    return found, outcomes, held


def _mem_files() -> set[int]:
    """The pids whose /proc/<pid>/mem this process holds open."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed since
        parts = target.split("/")
        if len(parts) == 4 and parts[1] == "proc" and parts[3] == "mem":
            held.add(int(parts[2]))
    return held


def refused(line: dict[str, Any]) -> bool:
    """A full GPU's answer, written into the caller's own block."""
    return (line["ret"], line["status"]) == (0, 0x51)


def continued(line: dict[str, Any]) -> bool:
    return (line["ret"], line["errno"], line["status"]) == (-1, errno.ENOTTY, 0xFFFFFFFF)


def test_after_an_exec_the_new_images_calls_are_read_and_refused_in_its_own_memory() -> None:
    """The old image's memory is gone after the exec: a handle on it would read nothing,
    and the new image's call would go on unjudged."""
    lines, outcomes, held = _gated(THEN_EXEC, f"size={GIB}", f"size={5 * GIB}", f"size={5 * GIB}")
    assert continued(lines[0]) and refused(lines[1])  # the first image
    assert refused(lines[2])  # the image it exec'd, the same process
    assert outcomes == [Outcome.ALLOWED, Outcome.REFUSED, Outcome.REFUSED]
    assert held == set()


def test_a_process_that_ended_and_a_new_one_after_it_are_each_judged_in_their_own_memory() -> None:
    steps = [f"size={GIB}", f"size={5 * GIB}", f"size={2 * GIB}", f"size={5 * GIB}"]
    lines, outcomes, held = _gated(IN_TURN, *steps)
    assert [continued(lines[0]), refused(lines[1]), continued(lines[2]), refused(lines[3])] == [
        True
    ] * 4
    assert outcomes == [Outcome.ALLOWED, Outcome.REFUSED, Outcome.ALLOWED, Outcome.REFUSED]
    assert held == set()  # no handle on the processes that are gone
