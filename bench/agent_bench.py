"""Node agent benchmarks: socket round trips at 1 and 110 callers, CPU share, RSS.

Each caller is a real "pod": PID 1 of its own PID namespace (`unshare`), owning one GPU
process that the fake NVML lists by host pid. So every caller is attested by the kernel
and gets its own reply, cut from the shared sample for its namespace, as in production.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    GiB,
    enforcer_argv,
    percentile,
    proc_cpu_seconds,
    proc_status_kib,
    release_and_collect,
)
from tests.fakenvml import FakeGpuState
from tests.helpers import children, free_port, wait_for

CALLER = Path(__file__).with_name("caller.py")


def _start_agent(
    lib_dir: Path, tmp: Path, state: FakeGpuState
) -> tuple[subprocess.Popen[bytes], Path]:
    state_file = tmp / "gpu.json"
    state.write(state_file)
    sock = tmp / "agent.sock"
    # The API part runs as in production (the kubernetes client loaded, the advertiser
    # retrying against a server that is not there), so RSS includes the client.
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: x\n  cluster: {server: "
        f"'https://127.0.0.1:{free_port()}'}}\nusers:\n- name: x\n  user: {{token: t}}\n"
        "contexts:\n- name: x\n  context: {cluster: x, user: x}\ncurrent-context: x\n"
    )
    agent = subprocess.Popen(
        [*enforcer_argv("agent"), "--node-name", "bench", "--kubeconfig", str(kubeconfig),
         "--socket", str(sock), "--interval", "100ms"],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)},
        stderr=(tmp / "agent.log").open("w"), cwd=ROOT,
    )  # fmt: skip
    wait_for(sock.exists, what="the agent socket")
    return agent, state_file


def round_trips(
    lib_dir: Path, tmp: Path, callers: int, seconds: float, subscribe: bool = False
) -> dict[str, Any]:
    state = FakeGpuState.single_gpu(total_bytes=1024 * GiB)
    agent, state_file = _start_agent(lib_dir, tmp, state)
    pods = []
    try:
        for _ in range(callers):
            pods.append(subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, str(CALLER),
                 "--socket", str(tmp / "agent.sock"), "--seconds", str(seconds),
                 *(["--subscribe"] if subscribe else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        for pod in pods:
            assert pod.stdout is not None
            assert pod.stdout.readline().startswith("ready")
            (init,) = wait_for(lambda pod=pod: children(pod.pid), what="pod init")
            (gpu_pid,) = wait_for(lambda init=init: children(init), what="gpu process")
            state.set_process(0, gpu_pid, GiB)
        state.write(state_file)
        time.sleep(0.5)  # the next NVML pass picks them up
        cpu0, t0 = proc_cpu_seconds(agent.pid), time.monotonic()
        micros = release_and_collect(pods)
        cpu1, t1 = proc_cpu_seconds(agent.pid), time.monotonic()
        rss = proc_status_kib(agent.pid, "VmRSS") / 1024
        peak = proc_status_kib(agent.pid, "VmHWM") / 1024
    finally:
        for pod in pods:
            pod.kill()
            pod.wait()
        agent.terminate()
        agent.wait(timeout=15)
    ms = sorted(m / 1000 for m in micros)
    return {
        "mode": "subscribe" if subscribe else "request",
        "callers": callers,
        "requests": len(ms),
        "requests_per_second": len(ms) / (t1 - t0),
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1],
        "agent_cpu_share_of_one_core": (cpu1 - cpu0) / (t1 - t0),
        "agent_rss_mib": rss,
        "agent_peak_rss_mib": peak,
    }
