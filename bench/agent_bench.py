"""Node agent benchmarks: socket round trips at 1 and 110 callers, CPU share, RSS.

Each caller is a real "pod": PID 1 of its own PID namespace (`unshare`), owning one GPU
process that the fake NVML lists by host pid. So every caller is attested by the kernel
and gets its own reply, cut from the shared sample for its namespace, as in production.
"""

from __future__ import annotations

import json
import os
import socket
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
    scrape,
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
        [
            *enforcer_argv("agent"),
            "--node-name",
            "bench",
            "--kubeconfig",
            str(kubeconfig),
            "--socket",
            str(sock),
            "--interval",
            "100ms",
        ],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)},
        stderr=(tmp / "agent.log").open("w"),
        cwd=ROOT,
    )
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
            pods.append(
                subprocess.Popen(
                    [
                        "unshare",
                        "--pid",
                        "--fork",
                        "--mount-proc",
                        "--kill-child",
                        sys.executable,
                        str(CALLER),
                        "--socket",
                        str(tmp / "agent.sock"),
                        "--seconds",
                        str(seconds),
                        *(["--subscribe"] if subscribe else []),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
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


def utilisation_cost(lib_dir: Path, tmp: Path, window: float) -> dict[str, Any]:
    """The agent's CPU while 110 busy processes on 8 GPUs are sampled every 100 ms, with
    per-process utilisation read every 1 s (the default), every pass (100 ms), and never;
    tenants are counted on every pass in all three. No caller asks: this is the pass."""
    state = FakeGpuState.single_gpu(total_bytes=80 * GiB)
    for _ in range(7):
        state.add_device()
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(110)]
    try:
        for i, p in enumerate(sleepers):
            state.set_process(i % 8, p.pid, GiB)
            state.set_utilization(i % 8, p.pid, sm=1 + i % 90, memory=i % 50)
        time.sleep(0.05)  # the sleepers start before the agent first lists them
        shares = {}
        for every in ("1s", "100ms", "0"):
            shares[every] = _pass_cpu(lib_dir, tmp / f"util-{every}", state, every, window)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    return {
        "processes": len(sleepers),
        "gpus": 8,
        "interval_ms": 100,
        "cpu_share_utilization_1s": shares["1s"],
        "cpu_share_utilization_every_pass": shares["100ms"],
        "cpu_share_utilization_off": shares["0"],
    }


def _pass_cpu(lib_dir: Path, tmp: Path, state: FakeGpuState, every: str, window: float) -> float:
    tmp.mkdir()
    state_file = tmp / "gpu.json"
    state.write(state_file)
    sock = tmp / "agent.sock"
    port = free_port()
    agent = subprocess.Popen(
        [
            *enforcer_argv("agent"),
            "--no-advertise",
            "--no-labels",
            "--no-serve-pods",
            "--hard-limits",
            "off",
            "--socket",
            str(sock),
            "--interval",
            "100ms",
            "--utilization-interval",
            every,
            "--metrics-port",
            str(port),
            "--metrics-address",
            "127.0.0.1",
        ],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)},
        stderr=(tmp / "agent.log").open("w"),
        cwd=ROOT,
    )
    try:
        wait_for(sock.exists, what="the agent socket")
        time.sleep(1.5)  # start-up and the first utilisation read are not the steady state
        tenants = scrape(port).get("vram_enforcer_gpu_tenants")
        assert tenants == 8, f"the agent did not count its tenants: {tenants}"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            s.sendall(b'{"v":1,"op":"usage"}\n')
            reply = json.loads(s.makefile("rb").readline())
        busy = sum("sm" in p for p in reply["processes"])
        assert busy == (0 if every == "0" else 110), f"utilisation of {busy} processes"
        cpu0, t0 = proc_cpu_seconds(agent.pid), time.monotonic()
        time.sleep(window)
        cpu1, t1 = proc_cpu_seconds(agent.pid), time.monotonic()
    finally:
        agent.terminate()
        agent.wait(timeout=15)
    return (cpu1 - cpu0) / (t1 - t0)
