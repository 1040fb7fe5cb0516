"""The agent's backstop: how soon it holds a pod whose own workload stopped its sidecar.

On the harness of `sidecar_bench` (the real kube-apiserver; the agent, at 100 ms, watching
the pod, labelled enforced and running as the webhook and the kubelet make it; the sidecar
in the pod's PID namespace). Per trial, the workload SIGSTOPs its sidecar (root in the pod
can: they share a PID namespace) and a fresh process of it at once holds 2 GiB of its
1 GiB limit; from that state write to the process's SIGTERM. The sidecar is then
continued, and the next trial waits until the agent says it is back. Most of it is
`sidecar_presence.SILENT_AFTER` (10 s): a sidecar that misses replies for a moment is
not taken for stopped.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path
from typing import Any

from kubernetes import client

from bench import sidecar_bench
from bench.common import GiB
from enforcer.core.declaration import ENFORCED
from enforcer.core.messages import sidecar_back
from tests.helpers import wait_for


def run(lib_dir: Path, tmp: Path, trials: int) -> dict[str, Any] | str:
    """The latency per trial; why not, as text, where the harness cannot run here."""
    if reason := sidecar_bench.available():
        return reason
    with sidecar_bench.bench_server() as server:
        core = client.CoreV1Api(server.client())
        with sidecar_bench.beside_agent(server, lib_dir, tmp / "backstop", "bench-backstop",
                                        {"trainer": "1Gi"}) as h:  # fmt: skip
            core.patch_namespaced_pod(
                h.pod.name, "bench", {"metadata": {"labels": {ENFORCED: "true"}}}
            )
            core.patch_namespaced_pod_status(h.pod.name, "bench", {"status": {"phase": "Running"}})
            sidecar, pid = h.start_sidecar(
                "--api-access", "agent", env={"VRAM_ENFORCER_LIMITS": json.dumps({"trainer": GiB})}
            )
            agent_log = h.tmp / "agent.log"

            def stop_and_exceed(victim: int) -> None:
                os.kill(pid, signal.SIGSTOP)
                h.state.set_process(0, victim, 2 * GiB)

            def continued() -> None:
                back = agent_log.read_text().count(sidecar_back())
                os.kill(pid, signal.SIGCONT)
                os.kill(sidecar.pid, signal.SIGCONT)  # nsenter stops itself with its child
                wait_for(lambda: agent_log.read_text().count(sidecar_back()) > back, timeout=30,
                         what="the agent to see the sidecar back")  # fmt: skip

            ms = sorted(h.latencies(trials, stop_and_exceed, after=continued))
    return {"trials": len(ms), "p50_s": statistics.median(ms) / 1000, "max_s": ms[-1] / 1000,
            "all_s": [round(m / 1000, 2) for m in ms]}  # fmt: skip
