"""A supervisor that keeps N workers on the GPU, each under the limit, each ignoring SIGTERM,
and replaces any that dies: the tenant that defeats one victim at a time.

It plays the driver too, at the outermost boundary: it lists its live workers, with their
memory, in the fake NVML's state (each once it is a clock tick old, as a real GPU process
is by the time NVML lists it).
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fakenvml import FakeGpuState

WORKER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """Left behind by a failing test (exec killed), nothing of this runs on."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--report", type=Path, required=True)
    args = p.parse_args()
    die_with(os.getppid())
    me = os.getpid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state_file = Path(os.environ["FAKE_NVML_STATE"])
    workers: list[subprocess.Popen[bytes]] = []
    started = 0
    while True:
        workers = [w for w in workers if w.poll() is None]
        while len(workers) < args.workers:
            workers.append(
                subprocess.Popen([sys.executable, "-c", WORKER], preexec_fn=lambda: die_with(me))  # noqa: PLW1509 - no threads here
            )
            started += 1
        time.sleep(0.03)  # a tick old before it is listed
        state = FakeGpuState(json.loads(state_file.read_text()))
        state.devices[0]["compute_processes"] = []
        for w in workers:
            if w.poll() is None:
                state.set_process(0, w.pid, args.bytes)
        state.write(state_file)
        report = args.report.with_name(args.report.name + ".tmp")
        report.write_text(json.dumps({"pid": me, "started": started}))
        report.replace(args.report)


if __name__ == "__main__":
    main()
