"""On a real node: kubelet 1.37 and containerd run the pods (tests/e2e/node.py).

- A pod with a native sidecar (an init container with restartPolicy Always, which the
  webhook injects by default) starts both, sidecar first, and stops both on deletion.
- The node agent's hard limits land on the cgroups that this kubelet and runc really make
  (the cgroupfs driver's `pod<uid>` and container-ID directories, in the v2 hierarchy),
  found from --cgroup-root /sys/fs/cgroup as the chart mounts it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from enforcer.core.model import GiB
from tests.e2e.actors import AgentProcess
from tests.e2e.cluster import ApiServer
from tests.e2e.node import PAUSE_IMAGE, RealNode, missing
from tests.fakenvml import FakeGpuState, limit_records
from tests.helpers import wait_for

RESOURCE = "vram-enforcer.io/vram"


@pytest.fixture(scope="module")
def node(apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    reason = missing()
    if reason:
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    real = RealNode(apiserver, tmp_path_factory.mktemp("node"))
    yield real
    real.close()


def pause(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": PAUSE_IMAGE, "imagePullPolicy": "Never", **extra}


def phase(core: client.CoreV1Api, namespace: str, name: str) -> str:
    return str(core.read_namespaced_pod(name, namespace).status.phase)


def gone(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as exc:
        return exc.status == 404
    return False


def test_a_native_sidecar_runs_beside_the_workload_and_stops_with_it(node: RealNode) -> None:
    core = node.core
    core.create_namespaced_pod("default", {"metadata": {"name": "native"}, "spec": {
        "nodeName": node.name, "terminationGracePeriodSeconds": 1,
        "initContainers": [pause("vram-enforcer", restartPolicy="Always")],
        "containers": [pause("trainer")]}})  # fmt: skip
    wait_for(lambda: phase(core, "default", "native") == "Running", timeout=60,
             what="the pod to run on the real node")  # fmt: skip
    pod = core.read_namespaced_pod("native", "default")
    (side,) = pod.status.init_container_statuses
    (main,) = pod.status.container_statuses
    assert side.name == "vram-enforcer" and side.started and side.state.running
    assert main.state.running
    assert side.state.running.started_at <= main.state.running.started_at  # the sidecar first
    core.delete_namespaced_pod("native", "default")
    wait_for(lambda: gone(core, "default", "native"), timeout=60, what="the pod to be gone")


def test_hard_limits_land_on_the_cgroups_the_real_kubelet_makes(
    node: RealNode, apiserver: ApiServer, agent_rbac: str, fake_nvml_lib: Path, tmp_path: Path
) -> None:
    core = node.core
    vram = {RESOURCE: "16Gi"}  # what the agent would advertise; the kubelet admits by it
    core.patch_node_status(node.name, {"status": {"capacity": vram, "allocatable": vram}})
    state = FakeGpuState.single_gpu()
    state.support_memory_limits()
    agent = AgentProcess(apiserver, agent_rbac, node.name, tmp_path, fake_nvml_lib, "--no-advertise", "--no-labels",
                         "--cgroup-root", "/sys/fs/cgroup", "--cgroup-scan", "200ms", state=state)  # fmt: skip
    try:
        core.create_namespaced_pod("default", {"metadata": {"name": "limited"}, "spec": {
            "nodeName": node.name, "terminationGracePeriodSeconds": 1,
            "containers": [pause("trainer", resources={"limits": {RESOURCE: "2Gi"}})]}})  # fmt: skip
        wait_for(
            lambda: phase(core, "default", "limited") == "Running",
            timeout=60,
            what="the pod to run",
        )
        pod = core.read_namespaced_pod("limited", "default")
        container_id = pod.status.container_statuses[0].container_id.split("://")[1]

        def limited() -> dict[str, int]:
            return {r["cgroup"]: r["hard"] for r in limit_records(agent.state_file)}

        wait_for(
            lambda: len(limited()) == 2, timeout=30, what="the pod's and the container's limits"
        )
        found = limited()
        pod_dir = next(c for c in found if c.endswith(f"/pod{pod.metadata.uid}"))
        assert f"{node.cgroup_root}/kubepods/besteffort/pod{pod.metadata.uid}" in pod_dir
        assert found[pod_dir] == 2 * GiB
        assert found[f"{pod_dir}/{container_id}"] == 2 * GiB
        core.delete_namespaced_pod("limited", "default")
        wait_for(lambda: gone(core, "default", "limited"), timeout=60, what="the pod to be gone")
        assert "Traceback" not in agent.log()
    finally:
        assert agent.stop() == 0
