"""A limit NVIDIA's container toolkit hook set first, on the real kubelet: the node agent
leaves it as it was and explains it (issue 44, items 2 and 4, and its "Done when").

A real node (kubelet, containerd with its CDI support, runc) with a stand-in of NVIDIA's
device plugin that hands each container its GPUs as CDI devices, and a CDI spec that
attaches to each GPU a `createRuntime` hook: the stand-in of NVIDIA's
`apply-cuda-memory-limits` (`toolkit_hook.py`), as the toolkit's own spec does. The fake
NVML plays an R615 driver on two 80 GiB GPUs; the hook and the node agent (on the host,
as shipped: deploy/rbac/agent.yaml, `--cgroup-root` on the kubelet's tree) share it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.model import GiB
from tests.e2e.actors import AgentProcess
from tests.e2e.cluster import ApiServer
from tests.e2e.deviceplugin import RESOURCE as GPU
from tests.e2e.deviceplugin import DevicePlugin
from tests.e2e.node import PAUSE_IMAGE, RealNode, missing
from tests.e2e.podsim import CGROUP2
from tests.fakenvml import LIBRARY, FakeGpuState, limit_records
from tests.helpers import wait_for

NODE = "toolkit-node"
HOOK = Path(__file__).with_name("toolkit_hook.py")
KIND = "k8s.device-plugin.nvidia.com/gpu"  # the CDI kind of NVIDIA's device plugin
VRAM = "vram-enforcer.io/vram"
NAMESPACE = "toolkit-hook"
OWNER = "nvidia-container-toolkit"


class ToolkitNode:
    """The node, its device plugin and its agent; the GPUs' CDI spec written first."""

    def __init__(self, apiserver: ApiServer, token: str, lib: Path, tmp: Path) -> None:
        state = FakeGpuState.single_gpu()
        state.add_device()
        state.support_memory_limits()
        self.gpus = [str(d["uuid"]) for d in state.devices]
        (tmp / "agent").mkdir()
        self.state_file = tmp / "agent" / "gpu.json"  # AgentProcess's: the hook's too
        self.hook_log = tmp / "hook.jsonl"
        self.lib = lib / LIBRARY
        for directory in ("cdi", "node"):
            (tmp / directory).mkdir()
        (tmp / "cdi" / "nvidia-toolkit.json").write_text(json.dumps(self.cdi_spec()))
        self.node = RealNode(apiserver, tmp / "node", name=NODE, cdi=tmp / "cdi")
        assert self.node.core is not None
        self.core: client.CoreV1Api = self.node.core
        self.plugin: DevicePlugin | None = None
        self.agent: AgentProcess | None = None
        try:
            self.plugin = DevicePlugin(self.gpus, cdi_kind=KIND)
            root = CGROUP2 / self.node.cgroup_root.lstrip("/")
            flags = ("--no-labels", "--cgroup-root", str(root), "--cgroup-scan", "200ms")
            self.agent = AgentProcess(
                apiserver, token, NODE, tmp / "agent", lib, *flags, state=state
            )
            wait_for(
                lambda: {GPU, VRAM} <= set(self.core.read_node(NODE).status.allocatable or {}),
                timeout=30,
                what="the node to count the plugin's GPUs and the agent's VRAM",
            )
        except BaseException:
            self.close()
            raise

    def cdi_spec(self) -> dict[str, Any]:
        """What the toolkit's spec attaches to each GPU: its hook, with that GPU's UUID."""
        hook = [sys.executable, str(HOOK), "--library", str(self.lib), "--log", str(self.hook_log)]
        return {
            "cdiVersion": "0.6.0",
            "kind": KIND,
            "devices": [
                {
                    "name": uuid,
                    "containerEdits": {
                        "hooks": [
                            {
                                "hookName": "createRuntime",
                                "path": sys.executable,
                                "args": [*hook, "--gpu-id", uuid],
                                "env": [f"FAKE_NVML_STATE={self.state_file}"],
                            }
                        ]
                    },
                }
                for uuid in self.gpus
            ],
        }

    def hooked(self) -> list[dict[str, Any]]:
        """What the hook did, one line per call."""
        if not self.hook_log.exists():
            return []
        return [json.loads(line) for line in self.hook_log.read_text().splitlines()]

    def held(self, cgroup: str, gpu: str) -> tuple[int, int]:
        """(soft, hard): what NVML's Get answers for `cgroup` on `gpu`."""
        out = subprocess.run(
            [
                sys.executable,
                str(HOOK),
                "--library",
                str(self.lib),
                "--gpu-id",
                gpu,
                "--get",
                cgroup,
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "FAKE_NVML_STATE": str(self.state_file)},
        )
        found = json.loads(out.stdout)
        return found["soft"], found["hard"]

    def foreign_gauges(self) -> dict[tuple[str, str], float]:
        """(GPU, owner) -> bytes: `vram_enforcer_foreign_limit_bytes` of the agent."""
        assert self.agent is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.agent.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.labels["gpu"], s.labels["owner"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "vram_enforcer_foreign_limit_bytes"
            for s in family.samples
        }

    def close(self) -> None:
        """The agent stopped (it must exit 0), then the plugin and the node, whatever
        happens to the one before."""
        code = 0
        try:
            if self.agent is not None:
                code = self.agent.stop()
        finally:
            try:
                if self.plugin is not None:
                    self.plugin.close()
            finally:
                self.node.close()
        assert code == 0, self.agent.log() if self.agent is not None else ""

    def start(self, env: dict[str, str]) -> client.V1Pod:
        """A pod of one container on the node's two GPUs that declares 12Gi, with `env`,
        once its container runs."""
        with contextlib.suppress(client.ApiException):  # made by an earlier test
            self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        container = {
            "name": "train",
            "image": PAUSE_IMAGE,
            "imagePullPolicy": "Never",
            "resources": {"limits": {GPU: "2", VRAM: "12Gi"}},
            "env": [{"name": k, "value": v} for k, v in env.items()],
        }
        body = {
            "metadata": {"name": "trainer"},
            "spec": {"nodeName": NODE, "containers": [container]},
        }
        self.core.create_namespaced_pod(NAMESPACE, body)

        def running() -> client.V1Pod | None:
            pod = self.core.read_namespaced_pod("trainer", NAMESPACE)
            statuses = pod.status.container_statuses or []
            return pod if statuses and statuses[0].state.running else None

        try:
            found: client.V1Pod = wait_for(running, timeout=90, what="the trainer to run")
        except AssertionError as exc:
            pod = self.core.read_namespaced_pod("trainer", NAMESPACE)
            raise AssertionError(
                f"{exc}: {pod.status}; the hook did {self.hooked()}; containerd's log ends:\n"
                f"{self.node.log('containerd')[-3000:]}"
            ) from None
        return found

    def limits_set(self, cgroup: str) -> list[tuple[str, int, int, str]]:
        """Each Set on `cgroup` (by inode), oldest first: (GPU, soft, hard, by whom)."""
        assert self.agent is not None
        inode, agent = os.stat(cgroup).st_ino, self.agent.proc.pid
        return [
            (r["device"], r["soft"], r["hard"], "agent" if r["pid"] == agent else "hook")
            for r in limit_records(self.state_file)
            if r["inode"] == inode
        ]


@pytest.fixture
def toolkit_node(
    apiserver: ApiServer, agent_rbac: str, fake_nvml_lib: Path, tmp_path: Path
) -> Iterator[ToolkitNode]:
    reason = missing()
    if reason:
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    node = ToolkitNode(apiserver, agent_rbac, fake_nvml_lib, tmp_path)
    try:
        yield node
    finally:
        node.close()


def test_a_limit_nvidias_hook_set_at_creation_is_left_as_it_was_and_explained(
    toolkit_node: ToolkitNode,
) -> None:
    """The container's spec carries the toolkit's variables (as gpu-fractioning's injector
    or an operator writes them): 8 GiB on each GPU, soft 0, below the 12 GiB it declares.
    NVIDIA's hook sets that on the container's own cgroup, on each of its GPUs, while the
    container is created, before its first instruction; the agent finds a limit it did not
    set, never writes that cgroup, and says whose limit it is and what it holds."""
    node, core = toolkit_node, toolkit_node.core
    pod = node.start({"NVIDIA_GPU_MEMORY_REQUEST": "0", "NVIDIA_GPU_MEMORY_LIMIT": "8192"})
    container_id = pod.status.container_statuses[0].container_id.split("://")[1]
    # The hook ran once per GPU, on the container's cgroup, while runc created it: the
    # container's init had not yet become the workload.
    calls = node.hooked()
    assert sorted(c["gpu"] for c in calls) == sorted(node.gpus), calls
    (leaf,) = {c["cgroup"] for c in calls}
    assert leaf.endswith(f"/pod{pod.metadata.uid}/{container_id}"), leaf
    for call in calls:
        assert (call["container"], call["status"]) == (container_id, "creating"), call
        assert call["comm"].startswith("runc:"), call  # runc's init, not yet pause
        assert (call["soft"], call["hard"]) == (0, 8 * GiB), call

    # The agent looked at it and explained it: whose limit, and what it holds.
    def explained() -> list[Any]:
        return [
            e
            for e in core.list_namespaced_event(NAMESPACE).items
            if e.involved_object.uid == pod.metadata.uid and e.reason == "VRAMForeignLimit"
        ]

    try:
        events = wait_for(explained, timeout=60, what="the VRAMForeignLimit Event")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the Sets on {leaf}: {node.limits_set(leaf)}") from None
    assert OWNER in events[0].message and "8.00 GiB" in events[0].message, events[0].message
    foreign = {(gpu, OWNER): float(8 * GiB) for gpu in node.gpus}
    wait_for(lambda: node.foreign_gauges() == foreign, what="the foreign limit's series")
    # Left as it was: the driver holds the hook's value, and only the hook ever set it.
    for gpu in node.gpus:
        assert node.held(leaf, gpu) == (0, 8 * GiB)
    assert sorted(node.limits_set(leaf)) == [(gpu, 0, 8 * GiB, "hook") for gpu in sorted(node.gpus)]
    assert node.agent is not None
    assert "Traceback" not in node.agent.log()
