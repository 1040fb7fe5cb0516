"""Hard limits: the agent's CPU to keep 110 pods' limits in place, and the overshoot per tier.

The agent runs against a real kube-apiserver (tests/e2e) holding 110 pods bound to its
node, each with two declaring containers, and their cgroups laid out as the kubelet's
systemd driver lays them out, in the cgroup v2 hierarchy. The fake NVML plays an R615
driver on two GPUs. Measured: the time until every limit is set (330 cgroups x 2 GPUs),
and the agent's CPU in the steady state (a scan per --cgroup-scan, nothing to change),
next to the same agent with --hard-limits off.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.common import enforcer_argv, proc_cpu_seconds, proc_status_kib
from enforcer.core.model import GiB
from tests.e2e.cluster import ApiServer, apiserver_binary, etcd_binary
from tests.e2e.podsim import CGROUP2
from tests.fakenvml import FakeGpuState, limit_records
from tests.helpers import remove_cgroup_tree, wait_for

NODE = "bench-node"
PODS = 110


def available() -> str | None:
    if os.geteuid() != 0 or not (CGROUP2 / "cgroup.procs").exists():
        return "needs root and a cgroup v2 hierarchy"
    if apiserver_binary() is None or etcd_binary() is None:
        return "needs kube-apiserver: bash tests/e2e/build-kubernetes.sh"
    return None


def agent_cpu(lib_dir: Path, window: float) -> dict[str, Any]:
    server = ApiServer(apiserver_binary(), etcd_binary())  # type: ignore[arg-type]
    server.start()
    root = CGROUP2 / f"vram-bench-{secrets.token_hex(4)}.slice"
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            core = client.CoreV1Api(server.client())
            dirs = _pods(core, root)
            cgroups = len(dirs) + PODS
            kubeconfig = server.write_kubeconfig(tmp / "kubeconfig")
            on = _measure(lib_dir, tmp / "on", kubeconfig, root, cgroups, window, "auto")
            off = _measure(lib_dir, tmp / "off", kubeconfig, root, cgroups, window, "off")
            # Every container's process holding 1 GiB on the first GPU, as NVML lists it:
            # the agent reads what the driver charges each pod until it has said so.
            with _holders(dirs) as pids:
                busy = _measure(
                    lib_dir, tmp / "busy", kubeconfig, root, cgroups, window, "auto", pids, core
                )
                idle = _measure(
                    lib_dir, tmp / "busy-off", kubeconfig, root, cgroups, window, "off", pids
                )
    finally:
        remove_cgroup_tree(root)
        server.close()
    return {
        "pods": PODS,
        "cgroups": cgroups,
        "gpus": 2,
        "cgroup_scan_s": 1.0,
        "all_set_after_s": on["all_set_after_s"],
        "agent_cpu_share_of_one_core": on["cpu_share"],
        "agent_cpu_share_without_hard_limits": off["cpu_share"],
        "agent_rss_mib": on["rss_mib"],
        "with_processes": PODS * 2,
        "all_proven_after_s": busy["all_proven_after_s"],
        "agent_cpu_share_with_processes": busy["cpu_share"],
        "agent_cpu_share_with_processes_without_hard_limits": idle["cpu_share"],
    }


@contextlib.contextmanager
def _holders(dirs: list[Path]) -> Iterator[tuple[int, ...]]:
    """A sleeping process in each container's cgroup (the v2 hierarchy, ours to use)."""
    procs = []
    try:
        for d in dirs:
            proc = subprocess.Popen(["sleep", "600"])
            procs.append(proc)
            (d / "cgroup.procs").write_text(str(proc.pid))
        yield tuple(p.pid for p in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _pods(core: client.CoreV1Api, root: Path) -> list[Path]:
    """110 pods on NODE, each with two declaring containers; their containers' cgroups."""
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="bench")))
    qos = root / "kubepods.slice" / "kubepods-besteffort.slice"
    made = []
    for i in range(PODS):
        ids = {c: secrets.token_hex(32) for c in ("train", "helper")}
        spec = [
            client.V1Container(
                name=c,
                image="gpu:1",
                resources=client.V1ResourceRequirements(limits={"vram-enforcer.io/vram": "4Gi"}),
            )
            for c in ids
        ]
        pod = core.create_namespaced_pod(
            "bench",
            client.V1Pod(
                metadata=client.V1ObjectMeta(name=f"p{i}"),
                spec=client.V1PodSpec(containers=spec, node_name=NODE),
            ),
        )
        statuses = [
            {
                "name": c,
                "containerID": f"containerd://{cid}",
                "image": "gpu:1",
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "state": {"running": {}},
            }
            for c, cid in ids.items()
        ]
        core.patch_namespaced_pod_status(
            f"p{i}",
            "bench",
            [{"op": "add", "path": "/status/containerStatuses", "value": statuses}],
        )
        pod_dir = qos / f"kubepods-besteffort-pod{pod.metadata.uid.replace('-', '_')}.slice"
        for cid in ids.values():
            (pod_dir / f"cri-containerd-{cid}.scope").mkdir(parents=True)
            made.append(pod_dir / f"cri-containerd-{cid}.scope")
    return made


def _measure(
    lib_dir: Path,
    tmp: Path,
    kubeconfig: Path,
    root: Path,
    cgroups: int,
    window: float,
    mode: str,
    pids: tuple[int, ...] = (),
    core: client.CoreV1Api | None = None,
) -> dict[str, float]:
    """With `core`: also the time until every pod's VRAMHardLimit Event is there."""
    tmp.mkdir()
    state = FakeGpuState.single_gpu()
    state.add_device()
    state.support_memory_limits()
    for pid in pids:
        state.set_process(0, pid, GiB)
    state_file = tmp / "gpu.json"
    state.write(state_file)
    started = time.monotonic()
    agent = subprocess.Popen(
        [
            *enforcer_argv("agent"),
            "--node-name",
            NODE,
            "--kubeconfig",
            str(kubeconfig),
            "--no-advertise",
            "--no-labels",
            "--hard-limits",
            mode,
            "--cgroup-root",
            str(root),
            "--socket",
            str(tmp / "agent.sock"),
        ],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)},
        stderr=(tmp / "agent.log").open("w"),
    )
    try:
        all_set = float("nan")
        if mode == "auto":
            wait_for(
                lambda: len(limit_records(state_file)) >= 2 * cgroups,
                timeout=120,
                what="every limit set",
            )
            all_set = time.monotonic() - started
        if core is not None:
            wait_for(lambda: _proven(core) >= PODS, timeout=120, what="every pod's VRAMHardLimit")
            proven = time.monotonic() - started
        if mode != "auto":
            wait_for((tmp / "agent.sock").exists, what="the agent socket")
        time.sleep(2.0)  # past start-up
        cpu0, t0 = proc_cpu_seconds(agent.pid), time.monotonic()
        time.sleep(window)
        cpu1, t1 = proc_cpu_seconds(agent.pid), time.monotonic()
        rss = proc_status_kib(agent.pid, "VmRSS") / 1024
        assert len(limit_records(state_file)) == (2 * cgroups if mode == "auto" else 0)
    finally:
        agent.terminate()
        agent.wait(timeout=15)
    return {
        "all_set_after_s": all_set,
        "cpu_share": (cpu1 - cpu0) / (t1 - t0),
        "rss_mib": rss,
        "all_proven_after_s": proven if core is not None else float("nan"),
    }


def _proven(core: client.CoreV1Api) -> int:
    events = core.list_namespaced_event("bench", field_selector="reason=VRAMHardLimit").items
    return len({e.involved_object.uid for e in events})


def overshoot(latency_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes in use over the limit before the offender is stopped, per tier, for a workload
    allocating at a steady rate: the sampling tier's detection latency times the rate (up
    to what the GPU has free); the hard tier's is nil by the driver's refusal."""
    rows = []
    for rate_gib_s in (1, 10, 100):
        for lat in latency_rows:
            rows.append(
                {
                    "tier": f"sampling @ {lat['interval_ms']:.0f} ms",
                    "rate_gib_per_s": rate_gib_s,
                    "p50_gib": rate_gib_s * lat["p50_ms"] / 1000,
                    "p99_gib": rate_gib_s * lat["p99_ms"] / 1000,
                }
            )
        rows.append(
            {
                "tier": "hard limit (R615+)",
                "rate_gib_per_s": rate_gib_s,
                "p50_gib": 0.0,
                "p99_gib": 0.0,
            }
        )
    return rows
