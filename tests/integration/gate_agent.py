"""The node agent's allocation gate in a process of its own, so that a test can SIGKILL it
as a restart would: `gate_agent.py DIR CONTAINER CEILING USAGE HOLDER`. A `NodeGate` over
DIR's kubelet root and DIR/run/seccomp.sock, the container held to CEILING, fed passes
showing USAGE, and dialled to the pod's gate holder at HOLDER (as the agent reaches a
sidecar's socket); CONTAINER `*`: every container it is handed (one whose ID the test
cannot know before it runs). One line {"ready": true} on stdout once it serves, then
{"gated": n} each time the count of the container's served processes changes."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from enforcer.modes.node_gate import NodeGate


class _Errors:
    def inc(self, amount: float = 1) -> None:
        print(json.dumps({"bug": amount}), flush=True)


def main() -> int:
    where, cid, ceiling, usage, holder = Path(sys.argv[1]), sys.argv[2], *sys.argv[3:]
    gate = NodeGate(
        where / "kubelet",
        where / "run" / "seccomp.sock",
        Path("/proc"),
        {os.major(os.stat("/dev/null").st_rdev)},
        lambda c: int(ceiling) if cid in (c, "*") else None,
        _Errors(),
        recheck_wait=60.0,
        driver=lambda: "580.142",
        unproven=True,  # no branch is proven yet: the override, as on a test node
    )
    if (why := gate.start()) is not None:
        print(json.dumps({"why_not": why}), flush=True)
        return 1
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    since = time.monotonic()
    sock.connect(holder)
    gate.hold(sock, lambda c: cid in (c, "*"), since)
    print(json.dumps({"ready": True}), flush=True)
    said = -1
    while True:
        gated = gate.gated()
        gate.saw({c: {"GPU-a": int(usage)} for c in gated}, time.monotonic())
        if (n := sum(n for c, n in gated.items() if cid in (c, "*"))) != said:
            said = n
            print(json.dumps({"gated": n}), flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
