"""The chart's node agent as it runs on a GPU node: its DaemonSet's pod on the real node,
from the image built from the Dockerfile.

What makes the node a GPU node here is played at the outermost boundary only: the label
GPU feature discovery sets (`nvidia.com/gpu.present=true`, the chart's agent
nodeSelector), and NVIDIA's container runtime (`nvidia_runtime.py`), which hands the
agent's container the fake NVML where it would hand it the driver's. A test changes what
that NVML shows by writing `state_file`, as it does for an agent on the host.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from kubernetes import client

from tests.e2e.node import RealNode
from tests.helpers import wait_for

GPU_LABEL = "nvidia.com/gpu.present"
SELECTOR = "app.kubernetes.io/component=agent"


def label_gpu_node(node: RealNode) -> None:
    """What GPU feature discovery says of a node with NVIDIA GPUs."""
    assert node.core is not None
    node.core.patch_node(node.name, {"metadata": {"labels": {GPU_LABEL: "true"}}})


class AgentPod:
    """The agent pod of the release in `namespace` on `node`, once it runs and is ready."""

    def __init__(self, node: RealNode, namespace: str, state_file: Path, port: int = 9478) -> None:
        self.node, self.namespace, self.state_file, self.port = node, namespace, state_file, port
        try:
            wait_for(self._ready, timeout=120, what="the agent's pod to be ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self._why()}") from None

    def pod(self) -> client.V1Pod | None:
        assert self.node.core is not None
        pods = self.node.core.list_namespaced_pod(self.namespace, label_selector=SELECTOR).items
        return pods[0] if pods else None

    def _ready(self) -> bool:
        pod = self.pod()
        conditions = (pod.status.conditions or []) if pod is not None else []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    def _why(self) -> str:
        pod = self.pod()
        return f"its pod: {pod.status if pod else None}; its log ends:\n{self.log()[-3000:]}"

    @property
    def address(self) -> str:
        pod = self.pod()
        assert pod is not None and pod.status.pod_ip, "the agent's pod has no address"
        return f"{pod.status.pod_ip}:{self.port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def log(self) -> str:
        """What the agent's container wrote, every run of it, from the kubelet's log files
        (this API server cannot dial the kubelet by name for `kubectl logs`)."""
        pod = self.pod()
        if pod is None:
            return ""
        found = self.node.dir / "pods" / f"{self.namespace}_{pod.metadata.name}_{pod.metadata.uid}"
        runs = sorted((found / "agent").glob("*.log"), key=lambda p: int(p.stem))
        # CRI log lines: time, stream, F(ull) or P(artial), then the text.
        lines = [line.split(" ", 3) for run in runs for line in run.read_text().splitlines()]
        return "".join(p[3] + ("\n" if p[2] == "F" else "") for p in lines if len(p) == 4)
