"""The agent's NVML pass in process (`NvmlSource.sample()`: 110 processes on 8 GPUs of the
fake NVML, each pinned and proven, as on every pass of a running agent), and one look at a
process's open files (`ProcFs.holds_device`, what proves a listing of unknown age, off the
sampler's thread since issue 42): 200 open files with the device last.

Run in a process of its own, which loads the fake libnvidia-ml (the harness does not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT

_MEASURE = """
import json, os, subprocess, sys, time
from pathlib import Path
from tests.fakenvml import FakeGpuState
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import NvmlSource
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs

passes, state_file = int(sys.argv[1]), Path(os.environ["FAKE_NVML_STATE"])
state = FakeGpuState.single_gpu(total_bytes=80 * 1024**3)
for _ in range(7):
    state.add_device()
state.write(state_file)
sleepers = [
    subprocess.Popen(["sleep", "600"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    for _ in range(110)
]
holder = subprocess.Popen(
    [sys.executable, "-c", "import sys, time; held = [open(sys.executable, 'rb') for _ in "
     "range(200)] + [open('/dev/null', 'rb')]; print(flush=True); time.sleep(600)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
holder.stdout.readline()
nvml = Nvml()
nvml.init()
source = NvmlSource(nvml, PidView.host(ProcFs()), frozenset({1}))
source.sample()  # the first pass lists nothing: what follows has a known age
time.sleep(0.05)
for i, p in enumerate(sleepers):
    state.set_process(i % 8, p.pid, 1024**3)
state.write(state_file)
sample = source.sample()
assert len(sample.processes) == 110 and all(p.used_bytes for p in sample.processes)
started = time.perf_counter()
for _ in range(passes):
    source.sample()
per_pass = (time.perf_counter() - started) / passes
procfs = ProcFs()
started = time.perf_counter()
for _ in range(100):
    assert procfs.holds_device(holder.pid, frozenset({1}))
per_look = (time.perf_counter() - started) / 100
for p in [*sleepers, holder]:
    p.kill()
    p.wait()
source.close()
nvml.shutdown()
print(json.dumps({"pass_us": per_pass * 1e6, "look_200_files_us": per_look * 1e6}))
"""


def run(lib_dir: Path, tmp: Path, passes: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(lib_dir),
        "FAKE_NVML_STATE": str(tmp / "sampler-gpu.json"),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(passes)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return {"processes": 110, "gpus": 8, "passes": passes, **figures}


def show(row: dict[str, Any]) -> None:
    print(
        f"NVML pass in process, {row['processes']} processes / {row['gpus']} GPUs: "
        f"{row['pass_us']:.0f} us; one look at 200 open files (off the sampler's thread): "
        f"{row['look_200_files_us']:.0f} us"
    )
