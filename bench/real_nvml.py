"""What one sample costs against a real NVIDIA driver (run on a GPU machine):

    python bench/real_nvml.py [--processes 8] [--samples 500]

Starts N CUDA processes (PyTorch, 256 MiB each), then times `Nvml.snapshot()` (the NVML
calls alone) and `NvmlSource.sample()` (NVML plus pid pinning and /proc) back to back.
The fake-NVML benchmarks in bench/run.py measure the enforcer; this measures the driver.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, percentile
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs

ALLOC = ROOT / "tests" / "gpu" / "alloc.py"


def timed(call: Callable[[], object], samples: int) -> dict[str, float]:
    call()  # warm up
    ms: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        call()
        ms.append((time.perf_counter_ns() - t0) / 1e6)
    ms.sort()
    return {"p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "max_ms": ms[-1]}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--samples", type=int, default=500)
    args = p.parse_args()
    workers = [
        subprocess.Popen(
            [sys.executable, str(ALLOC), "256", "1", "600"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(args.processes)
    ]
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline().startswith("allocated")
        nvml = Nvml()
        nvml.init()
        source = NvmlSource(nvml, PidView.host(ProcFs()), gpu_device_majors())
        seen = nvml.snapshot()
        result = {
            "driver": nvml.driver_version,
            "devices": [d.name for d in seen.devices],
            "cuda_processes": args.processes,
            "processes_listed": len(seen.processes),
            "snapshot": timed(nvml.snapshot, args.samples),
            "sample": timed(source.sample, args.samples),
        }
        source.close()
        nvml.shutdown()
    finally:
        for w in workers:
            w.kill()
            w.wait()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
