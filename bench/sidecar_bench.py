"""Sidecar benchmarks: end-to-end detection latency inside a pod, CPU share, RSS.

Uses the pod-on-this-machine harness of the e2e tests (tests/e2e/podsim.py): the real
kube-apiserver, the real agent on the host side (fake NVML, 100 ms), the sidecar in the
pod's PID namespace (100 ms). A driver process in the "trainer" container forks one victim
per trial; the benchmark makes the fake NVML report the victim over the limit and times
until the victim's SIGTERM handler runs (CLOCK_MONOTONIC on both sides).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.common import GiB, enforcer_argv, percentile, proc_cpu_seconds, proc_status_kib
from tests.e2e.cluster import ApiServer, apiserver_binary, etcd_binary
from tests.e2e.podsim import SimPod
from tests.fakenvml import FakeGpuState
from tests.helpers import wait_for

DRIVER = r"""
import os, signal, sys, time
r, w = os.pipe()
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        def on_term(signum, frame):
            os.write(w, f"{time.monotonic_ns()}\n".encode())
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("forked", flush=True)
        while True:
            time.sleep(1)
    hit = b""
    while not hit.endswith(b"\n"):
        hit += os.read(r, 64)
    os.waitpid(pid, 0)
    print(f"hit {hit.decode().strip()}", flush=True)
"""


def available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (PID namespaces, cgroups)"
    if apiserver_binary() is None or etcd_binary() is None:
        return "needs kube-apiserver: bash tests/e2e/build-kubernetes.sh"
    return None


NODE = "bench-node"


def run(lib_dir: Path, trials: int, window: float) -> dict[str, Any]:
    """The sidecar as injected (its pod and Events through the agent), then as 0.1 ran
    (`--api-access direct`: the pod read and Events posted with its own API client)."""
    with tempfile.TemporaryDirectory() as tmp_name, bench_server() as server:
        tmp = Path(tmp_name)
        found = _run(server, lib_dir, tmp / "agent", trials, window, "agent")
        found["direct"] = _run(server, lib_dir, tmp / "direct", trials, window, "direct")
        return found


@contextlib.contextmanager
def bench_server() -> Iterator[ApiServer]:
    """The real kube-apiserver (with etcd), with the namespace `bench`."""
    server = ApiServer(apiserver_binary(), etcd_binary())  # type: ignore[arg-type]
    server.start()
    try:
        core = client.CoreV1Api(server.client())
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="bench")))
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def beside_agent(
    server: ApiServer,
    lib_dir: Path,
    tmp: Path,
    name: str,
    limits: dict[str, str] | None = None,
    sidecar_env: dict[str, str] | None = None,
) -> Iterator[Harness]:
    """The agent (fake NVML, watching NODE's pods through `server`) and a pod of a driver
    container and the sidecar's, its status reported as the kubelet would: the agent
    finds the sidecar's pod by it."""
    tmp.mkdir()
    core = client.CoreV1Api(server.client())
    state_file, state = tmp / "gpu.json", FakeGpuState.single_gpu()
    state.write(state_file)
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)}
    kubeconfig = server.kubeconfig(server.admin_token, tmp / "kc")
    agent = subprocess.Popen(
        [
            *enforcer_argv("agent"),
            "--no-advertise",
            "--no-labels",
            "--hard-limits",
            "off",
            "--node-name",
            NODE,
            "--kubeconfig",
            str(kubeconfig),
            "--socket",
            str(tmp / "agent.sock"),
        ],
        env=env,
        stderr=(tmp / "agent.log").open("w"),
    )
    wait_for((tmp / "agent.sock").exists, what="the agent")
    pod = SimPod(
        core,
        "bench",
        name,
        ["trainer", "vram-enforcer"],
        node_name=NODE,
        limits=limits,
        sidecar_env=sidecar_env,
    )
    pod.report_status()
    try:
        driver = pod.start(
            "trainer",
            [sys.executable, "-c", DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert driver.stdout is not None and driver.stdin is not None
        assert driver.stdout.readline().strip() == "ready"
        (driver_pid,) = pod.host_pids("trainer")
        yield Harness(tmp, pod, kubeconfig, state, state_file, driver, driver_pid)
    finally:
        pod.close()
        agent.terminate()
        agent.wait(timeout=10)


@dataclasses.dataclass
class Harness:
    tmp: Path
    pod: SimPod
    kubeconfig: Path
    state: FakeGpuState
    state_file: Path
    driver: subprocess.Popen[str]
    driver_pid: int

    def start_sidecar(
        self, *flags: str, env: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], int]:
        """The sidecar in the pod, talking to the agent; (its process, its host pid) once
        it enforces."""
        log = self.tmp / "sidecar.log"
        sidecar = self.pod.start(
            "vram-enforcer",
            [
                *enforcer_argv("sidecar"),
                "--kubeconfig",
                str(self.kubeconfig),
                "--interval",
                "100ms",
                "--log-format",
                "text",
                *flags,
            ],
            env={
                "POD_NAME": self.pod.name,
                "POD_NAMESPACE": self.pod.namespace,
                "POD_UID": self.pod.uid,
                "VRAM_ENFORCER_AGENT_SOCKET": str(self.tmp / "agent.sock"),
                **env,
            },
            stderr=log.open("w"),
        )
        (pid,) = wait_for(lambda: self.pod.host_pids("vram-enforcer"), what="the sidecar")
        wait_for(lambda: "enforcing" in log.read_text(), timeout=20, what="the sidecar to start")
        time.sleep(1.0)
        return sidecar, pid

    def latencies(
        self,
        trials: int,
        cross: Callable[[int], None],
        before: Callable[[int], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> list[float]:
        """Per trial: a fresh victim forked by the driver; `cross(victim)` writes the NVML
        state that must get it signalled; ms from that write to its SIGTERM handler.
        `before(victim)`, if given, is written first and held for a second: a state that
        must not get it signalled (the driver would say so, and the trial fail). `after()`
        runs once each trial is over."""
        assert self.driver.stdin is not None and self.driver.stdout is not None
        found = []
        for _ in range(trials):
            self.driver.stdin.write("go\n")
            self.driver.stdin.flush()
            assert self.driver.stdout.readline().strip() == "forked"
            (victim,) = set(self.pod.host_pids("trainer")) - {self.driver_pid}
            if before is not None:
                before(victim)
                self.state.write(self.state_file)
                time.sleep(1.0)
                assert victim in self.pod.host_pids("trainer"), "signalled before the crossing"
            time.sleep(random.uniform(0, 0.1))  # a random phase against both ticks
            cross(victim)
            self.state.write(self.state_file)
            crossed = time.monotonic_ns()
            word, hit = self.driver.stdout.readline().split()
            assert word == "hit"
            found.append((int(hit) - crossed) / 1e6)
            self.state.remove_process(victim)
            self.state.write(self.state_file)
            if after is not None:
                after()
        return found


def _run(
    server: ApiServer, lib_dir: Path, tmp: Path, trials: int, window: float, access: str
) -> dict[str, Any]:
    with beside_agent(server, lib_dir, tmp, f"bench-{access}") as h:
        sidecar, sidecar_pid = h.start_sidecar(
            "--api-access", access, env={"VRAM_ENFORCER_LIMITS": json.dumps({"trainer": GiB})}
        )
        latencies = h.latencies(trials, lambda victim: h.state.set_process(0, victim, 2 * GiB))
        # Steady state for the CPU share: one compliant GPU process in the pod.
        h.state.set_process(0, h.driver_pid, GiB // 2)
        h.state.write(h.state_file)
        time.sleep(2.0)
        cpu0 = proc_cpu_seconds(sidecar_pid)
        time.sleep(window)
        cpu1 = proc_cpu_seconds(sidecar_pid)
        rss, peak = (
            proc_status_kib(sidecar_pid, "VmRSS") / 1024,
            proc_status_kib(sidecar_pid, "VmHWM") / 1024,
        )
        os.kill(sidecar_pid, 15)
        sidecar.wait(timeout=10)
    ms = sorted(latencies)
    return {
        "api_access": access,
        "trials": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1],
        "target_p99_ms": 100 + 100 + 10,
        "cpu_share_of_one_core": (cpu1 - cpu0) / window,
        "rss_mib": rss,
        "peak_rss_mib": peak,
    }
