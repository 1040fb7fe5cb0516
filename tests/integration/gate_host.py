"""Runs rm_standin.py under the allocation gate in a process of its own, so that a test can
run the listener as another user: `gate_host.py LIMIT USAGE STEP...`. The stand-in's lines
come first on stdout, then one line {"outcomes": [...]}."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from enforcer.edge import gate_child
from enforcer.edge.gate_listener import GateListener, Ledger, Outcome
from enforcer.edge.seccomp_filter import program


class _Errors:
    def inc(self, amount: float = 1) -> None:
        print(json.dumps({"bug": amount}), flush=True)


def main() -> int:
    limit, usage, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    standin = str(Path(__file__).with_name("rm_standin.py"))
    spawned = gate_child.spawn(sys.executable, [sys.executable, standin, *steps], program())
    if spawned.listener is None:
        print(json.dumps({"why_not": spawned.why_not}), flush=True)
        spawned.abort()
        return 1
    ledger = Ledger(limit)
    ledger.saw(usage, time.monotonic())
    outcomes: list[Outcome] = []
    major = os.major(os.stat("/dev/null").st_rdev)
    listener = GateListener(
        spawned.listener,
        ledger,
        {major},
        _Errors(),
        count=lambda o, s: outcomes.append(o),
        want_pass=lambda: ledger.saw(usage, time.monotonic()),  # the sampler, asked early
        recheck_wait=60.0,  # a bound for a hang: the pass above comes at once
    )
    listener.start()
    spawned.go()
    _, status = os.waitpid(spawned.pid, 0)
    listener.stop()
    print(json.dumps({"outcomes": outcomes, "exit": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
