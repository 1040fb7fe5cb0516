"""`vram-enforcer exec` benchmarks: detection latency, CPU per tick, RSS, scaling."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    GiB,
    enforcer_argv,
    percentile,
    proc_cpu_seconds,
    proc_status_kib,
    scrape,
)
from tests.fakenvml import FakeGpuState
from tests.helpers import free_port

# The command run under `exec` for the latency benchmark. For each trial it forks a victim
# that reports its pid, then reports the CLOCK_MONOTONIC instant at which SIGTERM arrives.
VICTIM_DRIVER = r"""
import os, signal, sys, time
r, w = os.pipe()
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        def on_term(signum, frame):
            os.write(w, f"{time.monotonic_ns()}\n".encode())
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(1)
    hit = b""
    while not hit.endswith(b"\n"):
        hit += os.read(r, 64)
    os.waitpid(pid, 0)
    print(f"hit {pid} {hit.decode().strip()}", flush=True)
"""

# The command run under `exec` for the cost benchmarks: N idle descendants, then wait.
SLEEPERS = r"""
import subprocess, sys
n = int(sys.argv[1])
kids = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
print(" ".join(str(k.pid) for k in kids), flush=True)
sys.stdin.read()
for k in kids:
    k.kill()
"""


class Enforcer:
    """`vram-enforcer exec` on a fake GPU, running `script` as its command."""

    def __init__(
        self,
        lib_dir: Path,
        tmp: Path,
        interval: str,
        gpus: int,
        script: str,
        *args: str,
        limits: tuple[str, ...] = ("--limit", "1Gi"),
    ) -> None:
        self.state_file = tmp / "gpu.json"
        self.state = FakeGpuState.single_gpu()
        for _ in range(gpus - 1):  # NVML enumerates GPUs once, at start
            self.state.add_device()
        self.state.write(self.state_file)
        self.port = free_port()
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(lib_dir),
            "FAKE_NVML_STATE": str(self.state_file),
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            *enforcer_argv("exec"),
            *limits,
            "--interval",
            interval,
            "--grace-period",
            "10s",
            "--metrics-port",
            str(self.port),
            "--",
            sys.executable,
            "-c",
            script,
            *args,
        ]
        self.log = (tmp / "exec.log").open("w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def write(self) -> float:
        self.state.write(self.state_file)
        return time.monotonic_ns() / 1e9

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


Step = Callable[[FakeGpuState, int], None]


def _over_the_limit(state: FakeGpuState, pid: int) -> None:
    state.set_process(0, pid, 2 * GiB)


def latency(
    lib_dir: Path,
    tmp: Path,
    interval: str,
    trials: int,
    limits: tuple[str, ...] = ("--limit", "1Gi"),
    arm: Step | None = None,
    cross: Step = _over_the_limit,
) -> dict[str, Any]:
    """From the state write that `cross` makes (by default: the victim over a 1 GiB limit)
    to the SIGTERM the victim receives. `arm`, when given, sets the scene first, and two
    intervals pass for it to be seen."""
    seconds = float(interval.removesuffix("ms")) / 1000
    e = Enforcer(lib_dir, tmp, interval, 1, VICTIM_DRIVER, limits=limits)
    samples = []
    try:
        for _ in range(trials):
            e.stdin.write("go\n")
            e.stdin.flush()
            word, pid = e.stdout.readline().split()
            assert word == "ready"
            if arm is not None:
                arm(e.state, int(pid))
                e.write()
                time.sleep(2 * seconds)
            time.sleep(random.uniform(0, seconds))  # a random phase against the tick
            cross(e.state, int(pid))
            crossed = e.write()
            word, hit_pid, hit_ns = e.stdout.readline().split()
            assert word == "hit" and hit_pid == pid
            samples.append(int(hit_ns) / 1e9 - crossed)
            e.state.remove_process(int(pid))
            e.write()
    finally:
        e.close()
    ms = sorted(s * 1000 for s in samples)
    return {
        "interval_ms": seconds * 1000,
        "trials": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1],
        "target_p99_ms": seconds * 1000 + 10,
    }


def tick_cost(lib_dir: Path, tmp: Path, processes: int, window: float) -> dict[str, Any]:
    """CPU per tick and RSS of `exec` with `processes` live GPU processes over 8 devices."""
    e = Enforcer(lib_dir, tmp, "100ms", 8, SLEEPERS, str(processes))
    try:
        pids = [int(p) for p in e.stdout.readline().split()]
        # Older than a clock tick when NVML first lists them, as a real GPU process always
        # is: one born in the tick of that pass is not proven to be the process NVML meant.
        time.sleep(0.05)
        for i, pid in enumerate(pids):
            e.state.set_process(i % 8, pid, 1024**2)  # 1 MiB each: under the limit
        e.write()
        time.sleep(1.0)  # let the new state be picked up and caches warm
        before, cpu0 = scrape(e.port), proc_cpu_seconds(e.proc.pid)
        time.sleep(window)
        after, cpu1 = scrape(e.port), proc_cpu_seconds(e.proc.pid)
        ticks = (
            after["vram_enforcer_tick_duration_seconds_count"]
            - before["vram_enforcer_tick_duration_seconds_count"]
        )
        wall = (
            after["vram_enforcer_tick_duration_seconds_sum"]
            - before["vram_enforcer_tick_duration_seconds_sum"]
        )
        used = after.get("vram_enforcer_container_used_bytes", 0.0)
        assert used == processes * 1024**2, f"expected every process attributed, got {used}"
        return {
            "processes": processes,
            "devices": 8,
            "ticks": int(ticks),
            "cpu_ms_per_tick": (cpu1 - cpu0) * 1000 / ticks,
            "wall_ms_per_tick": wall * 1000 / ticks,
            "cpu_share_of_one_core": (cpu1 - cpu0) / window,
            "rss_mib": proc_status_kib(e.proc.pid, "VmRSS") / 1024,
            "peak_rss_mib": proc_status_kib(e.proc.pid, "VmHWM") / 1024,
        }
    finally:
        e.close()
