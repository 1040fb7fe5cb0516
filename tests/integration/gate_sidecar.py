"""The sidecar's allocation gate holder in a process of its own: `gate_sidecar.py PATH
[USAGE]`, run in a PID namespace of its own (`unshare --pid --fork`), as the pod's is, so
that the agent, outside it, may connect; with USAGE, a socket listening there too, where
the agent dials the sidecar's usage link first (nothing is answered on it). One line
{"held", "agent", "reading",
"let_on"} on stdout each time one of them changes."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from enforcer.edge.gate_holder import Holder


class _Errors:
    def inc(self, amount: float = 1) -> None:
        print(json.dumps({"bug": amount}), flush=True)


def main() -> int:
    holder = Holder(Path(sys.argv[1]), _Errors())
    usage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if len(sys.argv) > 2:
        usage.bind(sys.argv[2])
        usage.listen(4)
    holder.start()
    said: dict[str, object] = {}
    while True:
        now: dict[str, object] = {
            "held": len(holder.held()),
            "agent": holder.agent_connected,
            "reading": holder.reading,
            "let_on": holder.let_on,
        }
        if now != said:
            said = now
            print(json.dumps(now), flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
