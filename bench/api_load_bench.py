"""API load in steady state: the API server's own count of requests, per component.

The real control plane and the real node of the e2e harness (kubelet, containerd, runc),
the chart installed with Helm, the agent serving its node, and `pods` enforced pods
running. The API server writes an audit log (every request, at the Metadata level); after
a warm-up, the requests received in a window are counted by user: the sidecars (their
pods' ServiceAccounts), the agent, the webhook, the kubelet, the control plane. Then the
rates are extrapolated to 1,000 nodes of 10 pods.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from bench.common import ROOT, cluster_missing
from tests.e2e.actors import AgentProcess
from tests.e2e.cluster import ApiServer
from tests.e2e.helm import CHART, helm
from tests.e2e.images import ENFORCER_IMAGE, enforcer_image
from tests.e2e.node import RealNode
from tests.fakenvml import FakeGpuState
from tests.helpers import wait_for

NAMESPACE, TENANTS = "vram-enforcer", "ml"
SOCKET = Path("/run/vram-enforcer/agent.sock")
POLICY = """
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""
HOLDER = "import time; time.sleep(3600)"
NODES, PODS_PER_NODE = 1000, 10


def available() -> str | None:
    if reason := cluster_missing():
        return reason
    if SOCKET.exists():
        return f"{SOCKET} is in use: is another vram-enforcer agent running here?"
    return None


def run(lib_dir: Path, pods: int, window: float, warmup: float = 30.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        policy = tmp / "audit-policy.yaml"
        policy.write_text(POLICY)
        audit = tmp / "audit.log"
        server = ApiServer(
            for_pods=True,
            extra_args=[
                f"--audit-policy-file={policy}",
                f"--audit-log-path={audit}",
                "--audit-log-maxsize=0",
                "--audit-log-format=json",
            ],
        )
        node = None
        made_dir = False
        agent = None
        try:
            server.start()
            server.start_controller_manager()
            config = ROOT / "examples" / "scheduler" / "kube-scheduler-config.yaml"
            server.start_scheduler(yaml.safe_load(config.read_text()))
            (tmp / "image").mkdir()
            (tmp / "node").mkdir()
            image = enforcer_image()
            node = RealNode(server, tmp / "node", images=[image], kube_proxy=True)
            kubeconfig = server.write_kubeconfig(tmp / "admin.kubeconfig")
            core = node.core
            core.create_namespace(
                {"metadata": {"name": TENANTS, "labels": {"vram-enforcer.io/inject": "enabled"}}}
            )
            _install(kubeconfig)
            if not SOCKET.parent.exists():
                SOCKET.parent.mkdir()
                made_dir = True
            gpus = FakeGpuState.single_gpu()
            token = server.token_for(NAMESPACE, f"{NAMESPACE}-agent")
            # --resync 60s: the chart's (AgentProcess's own 1s is the tests')
            flags = ["--socket", str(SOCKET), "--cgroup-root", "/sys/fs/cgroup", "--resync", "60s"]
            agent = AgentProcess(server, token, node.name, tmp, lib_dir, *flags, state=gpus)
            apps = client.AppsV1Api(server.client())
            wait_for(
                lambda: (
                    apps.read_namespaced_deployment(
                        f"{NAMESPACE}-webhook", NAMESPACE
                    ).status.available_replicas
                ),
                timeout=180,
                what="the webhook",
            )
            wait_for(
                lambda: (
                    "vram-enforcer.io/vram" in (core.read_node(node.name).status.allocatable or {})
                ),
                timeout=60,
                what="the agent to advertise VRAM",
            )
            for i in range(pods):
                core.create_namespaced_pod(TENANTS, _pod(f"trainer-{i}"))
            wait_for(
                lambda: _running(core) == pods, timeout=60 + 10 * pods, what="every pod running"
            )
            time.sleep(warmup)  # start-up reads are over: the sidecars have their pods
            start = time.time()
            time.sleep(window)
            end = time.time()
            counted = _count(audit, start, end)
            return {**_report(counted, window, pods), "sidecar_memory": _sidecar_memory(node)}
        finally:
            if agent is not None:
                agent.stop()
            if node is not None:
                node.close()
            server.close()
            if made_dir:
                SOCKET.parent.rmdir()


def _install(kubeconfig: Path) -> None:
    values = {
        "image": {
            "repository": ENFORCER_IMAGE.rsplit(":", 1)[0],
            "tag": "e2e",
            "pullPolicy": "Never",
        },
        "webhook": {"replicas": 1},
        "sidecar": {"namespaces": [TENANTS]},
    }
    helm("install", NAMESPACE, str(CHART), NAMESPACE, str(kubeconfig), json.dumps(values))


def _pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "trainer",
                    "image": ENFORCER_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", HOLDER],
                    "resources": {"limits": {"vram-enforcer.io/vram": "1Gi"}},
                }
            ],
        },
    }


def _sidecar_memory(node: RealNode) -> dict[str, Any]:
    """Each sidecar's memory as its container's cgroup counts it (the kubelet's and runc's
    cgroup, the image built from the Dockerfile): anonymous memory now, and the peak of
    all it was charged (page cache included) since it started; the largest of each, MiB."""
    anon, peak = [], []
    for pod in node.core.list_namespaced_pod(TENANTS).items:
        (side,) = [s for s in pod.status.init_container_statuses or [] if s.name == "vram-enforcer"]
        found = _container_cgroup(node, pod.metadata.uid, side.container_id.split("://")[1])
        stat = dict(line.split() for line in (found / "memory.stat").read_text().splitlines())
        if (found / "memory.current").exists():  # cgroup v2
            anon.append(int(stat["anon"]))
            peak.append(int((found / "memory.peak").read_text()))
        else:
            anon.append(int(stat["total_rss"]))
            peak.append(int((found / "memory.max_usage_in_bytes").read_text()))
    mib = 1024 * 1024
    return {
        "sidecars": len(anon),
        "anon_mib_max": max(anon) / mib,
        "anon_mib_median": sorted(anon)[len(anon) // 2] / mib,
        "peak_mib_max": max(peak) / mib,
    }


def _container_cgroup(node: RealNode, pod_uid: str, container_id: str) -> Path:
    """The container's memory cgroup below the kubelet's root (cgroupfs driver)."""
    for hierarchy in (
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup/unified"),
        Path("/sys/fs/cgroup"),
    ):
        kubepods = hierarchy / node.cgroup_root.lstrip("/") / "kubepods"
        found = [
            *kubepods.glob(f"pod{pod_uid}/{container_id}"),
            *kubepods.glob(f"*/pod{pod_uid}/{container_id}"),
        ]
        if found and (found[0] / "memory.stat").exists():
            return found[0]
    raise FileNotFoundError(f"no memory cgroup for container {container_id} of pod {pod_uid}")


def _running(core: client.CoreV1Api) -> int:
    return sum(p.status.phase == "Running" for p in core.list_namespaced_pod(TENANTS).items)


def _component(user: str) -> str:
    if user.startswith(f"system:serviceaccount:{TENANTS}:"):
        return "sidecars (tenant ServiceAccounts)"
    if user == f"system:serviceaccount:{NAMESPACE}:{NAMESPACE}-agent":
        return "agent"
    if user.startswith(f"system:serviceaccount:{NAMESPACE}:"):
        return "webhook"
    if user.startswith("system:node:") or user == "admin":
        # The harness runs the kubelet, kube-proxy and this benchmark as its admin user.
        return "kubelet, kube-proxy and the benchmark (the harness's admin)"
    if user.startswith("system:serviceaccount:kube-system:") or user in (
        "system:kube-controller-manager",
        "system:kube-scheduler",
    ):
        return "control plane"
    return "others (the benchmark, the API server itself)"


def _count(audit: Path, start: float, end: float) -> dict[str, Counter[str]]:
    """Requests received in [start, end), by component, then by verb and resource."""
    found: dict[str, Counter[str]] = {}
    for line in audit.read_text().splitlines():
        event = json.loads(line)
        if event.get("stage") not in ("ResponseComplete", "ResponseStarted", "Panic"):
            continue
        if event.get("stage") == "ResponseStarted" and event.get("verb") != "watch":
            continue  # counted at ResponseComplete
        if event.get("stage") == "ResponseComplete" and event.get("verb") == "watch":
            continue  # counted when it started
        at = datetime.fromisoformat(
            event["requestReceivedTimestamp"].replace("Z", "+00:00")
        ).timestamp()
        if not start <= at < end:
            continue
        ref = event.get("objectRef") or {}
        what = f"{event['verb']} {ref.get('resource', event.get('requestURI', '?').split('?')[0])}"
        if ref.get("subresource"):
            what += f"/{ref['subresource']}"
        component = _component(event["user"]["username"])
        found.setdefault(component, Counter())[what] += 1
    return found


def _report(counted: dict[str, Counter[str]], window: float, pods: int) -> dict[str, Any]:
    rows = {}
    for component, by_what in sorted(counted.items()):
        total = sum(by_what.values())
        rows[component] = {
            "requests": total,
            "per_second": total / window,
            "by_request": dict(by_what.most_common()),
        }
    sidecars = rows.get("sidecars (tenant ServiceAccounts)", {}).get("per_second", 0.0)
    agent = rows.get("agent", {}).get("per_second", 0.0)
    return {
        "window_s": window,
        "pods": pods,
        # Watches open before the window are not counted: the agent holds one of the node's
        # pods, renewed every 300 s (timeoutSeconds), 0.003/s.
        "components": rows,
        # One node here: a node's agent and its pods' sidecars scale with the fleet.
        "at_1000_nodes_of_10_pods": {
            "sidecars_per_second": sidecars / pods * NODES * PODS_PER_NODE,
            "agents_per_second": agent * NODES,
        },
    }
