"""The agent's backstop: how soon it holds a pod whose own workload stopped or killed its
sidecar.

On the harness of `sidecar_bench` (the real kube-apiserver; the agent, at 100 ms, watching
the pod, labelled enforced and running as the webhook and the kubelet make it; the sidecar
in the pod's PID namespace). Per trial, the workload SIGSTOPs its sidecar, or SIGKILLs it
(root in the pod can: they share a PID namespace), and a fresh process of it at once holds
2 GiB of its 1 GiB limit; from that state write to the process's SIGTERM, on which it
exits. The sidecar is then continued, or started again, and the next trial waits until the
agent says it is back. A stopped sidecar is seen in /proc (`T`) at the watch's next check,
once a second; a killed one hangs up its connection, and the watch looks at once
(`sidecar_presence.unguarded`); then the sampler's next pass signals.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from bench import sidecar_bench
from bench.common import GiB
from enforcer.core.declaration import ENFORCED
from enforcer.core.messages import sidecar_back
from tests.helpers import wait_for


def run(lib_dir: Path, tmp: Path, trials: int) -> dict[str, Any] | str:
    """The latency per trial, for a stopped sidecar and (`killed`) a killed one; why not, as
    text, where the harness cannot run here."""
    if reason := sidecar_bench.available():
        return reason
    with sidecar_bench.bench_server() as server:
        core = client.CoreV1Api(server.client())
        with sidecar_bench.beside_agent(
            server, lib_dir, tmp / "backstop", "bench-backstop", {"trainer": "1Gi"}
        ) as h:
            core.patch_namespaced_pod(
                h.pod.name, "bench", {"metadata": {"labels": {ENFORCED: "true"}}}
            )
            core.patch_namespaced_pod_status(h.pod.name, "bench", {"status": {"phase": "Running"}})

            def start() -> tuple[Any, int]:
                env = {"VRAM_ENFORCER_LIMITS": json.dumps({"trainer": GiB})}
                return h.start_sidecar("--api-access", "agent", env=env)

            sidecar, pid = start()
            agent_log = h.tmp / "agent.log"

            def back_after(resume: Callable[[], None]) -> None:
                back = agent_log.read_text().count(sidecar_back())
                resume()
                wait_for(
                    lambda: agent_log.read_text().count(sidecar_back()) > back,
                    timeout=30,
                    what="the agent to see the sidecar back",
                )

            def continued() -> None:
                os.kill(pid, signal.SIGCONT)
                os.kill(sidecar.pid, signal.SIGCONT)  # nsenter stops itself with its child

            def restarted() -> None:
                nonlocal sidecar, pid
                sidecar.wait(timeout=10)
                sidecar, pid = start()

            def exceed(victim: int, sig: signal.Signals) -> None:
                os.kill(pid, sig)
                h.state.set_process(0, victim, 2 * GiB)

            stopped = h.latencies(
                trials, lambda v: exceed(v, signal.SIGSTOP), after=lambda: back_after(continued)
            )
            killed = h.latencies(
                trials, lambda v: exceed(v, signal.SIGKILL), after=lambda: back_after(restarted)
            )
    return {**_figures(stopped), "killed": _figures(killed)}


def _figures(ms: list[float]) -> dict[str, Any]:
    ms = sorted(ms)
    return {
        "trials": len(ms),
        "p50_s": statistics.median(ms) / 1000,
        "max_s": ms[-1] / 1000,
        "all_s": [round(m / 1000, 2) for m in ms],
    }
