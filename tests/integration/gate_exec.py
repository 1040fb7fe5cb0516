"""`vram-enforcer` with /dev/null's device major standing in for NVIDIA's: the allocation gate
judges calls on NVIDIA's device nodes only, and this machine has none, so the stand-in
(rm_standin.py) issues the driver's requests on /dev/null. Only what the tier probe reads
from /proc/devices is changed; everything else is the real CLI: `gate_exec.py exec ...` (the
exec tests, and the gate arms of the overshoot benchmark, bench/gate_bench.py).

With GATE_EXEC_FAULT set, the gate's receiver is made to fail, once, as a bug would:
`crash` (its thread stops past its guard before it serves anything) or `stall` (it waits
3 s with a call unread before it serves); `trampoline-killed`: the trampoline is SIGKILLed
once it has handed over the listener fd, before it is told to run the command (as the
OOM killer or a stray `kill` would)."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from enforcer import cli
from enforcer.edge import gate_child, tier_probe
from enforcer.edge.gate_listener import GateListener

NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)
STALL = 3.0


def _faulty(fault: str) -> None:
    receive = GateListener._receive
    failed: list[str] = []

    def _receive(self: GateListener) -> None:
        if not failed:
            failed.append(fault)
            if fault == "crash":
                raise RuntimeError("a bug past the guard")
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            poller.poll()  # a call waits, unread
            time.sleep(STALL)
        receive(self)

    GateListener._receive = _receive  # type: ignore[method-assign]


def _killed_trampoline() -> None:
    start = gate_child.spawn

    def spawn(path: str, argv: list[str], program: bytes) -> gate_child.Spawned:
        spawned = start(path, argv, program)
        os.kill(spawned.pid, signal.SIGKILL)
        os.waitid(os.P_PID, spawned.pid, os.WEXITED | os.WNOWAIT)  # gone, not yet reaped
        return spawned

    gate_child.spawn = spawn


if __name__ == "__main__":
    tier_probe.gpu_device_majors = lambda procfs=None: frozenset({NULL_MAJOR})
    if (fault := os.environ.get("GATE_EXEC_FAULT")) == "trampoline-killed":
        _killed_trampoline()
    elif fault:
        _faulty(fault)
    sys.exit(cli.main())
