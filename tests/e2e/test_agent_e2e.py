"""The node agent against a real kube-apiserver: capacity, labels, resync, RBAC, outages.

The agent runs as a user would run it: `vram-enforcer agent --kubeconfig ...`, with a
ServiceAccount token bound to the ClusterRole in deploy/rbac/agent.yaml, and the fake NVML
reporting two 80 GiB GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from enforcer.core.model import GiB, Sample
from enforcer.core.parsing import parse_quantity
from enforcer.edge.agent_link import AgentLink
from tests.e2e.actors import AgentProcess
from tests.e2e.cluster import ApiServer
from tests.fakenvml import FakeGpuState
from tests.helpers import older_than_a_tick, wait_for

RESOURCE = "vram-enforcer.io/vram"
RESERVED = 512 * 1024**2  # what the fake's driver reserves on each GPU, unless told
EXPECTED = 2 * (80 * GiB - RESERVED - 1 * GiB)  # two GPUs, --reserve 1Gi each
SYNCS = "vram_enforcer_node_syncs_total"
API_ERRORS = 'vram_enforcer_api_errors_total{operation="sync"}'


def make_node(core: client.CoreV1Api, name: str) -> None:
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})
        )
    )


def advertised(core: client.CoreV1Api, node: str, field: str = "capacity") -> int | None:
    status = core.read_node(node).status
    value = (getattr(status, field) or {}).get(RESOURCE) if status else None
    return None if value is None else int(parse_quantity(value, field=field))


@pytest.fixture(scope="module")
def running(
    apiserver: ApiServer,
    admin: client.ApiClient,
    agent_rbac: str,
    fake_nvml_lib: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AgentProcess]:
    make_node(client.CoreV1Api(admin), "gpu-node-1")
    agent = AgentProcess(
        apiserver, agent_rbac, "gpu-node-1", tmp_path_factory.mktemp("agent"), fake_nvml_lib
    )
    yield agent
    assert agent.stop() == 0


def test_capacity_allocatable_and_labels_are_advertised(
    running: AgentProcess, core: client.CoreV1Api
) -> None:
    # Capacity (nodes/status) and labels (nodes) are two PATCHes: wait for the second one.
    def labelled() -> bool:
        return "vram-enforcer.io/gpu.product" in (
            core.read_node("gpu-node-1").metadata.labels or {}
        )

    wait_for(lambda: advertised(core, "gpu-node-1") == EXPECTED, timeout=20, what="capacity")
    wait_for(labelled, timeout=20, what="GPU labels")
    assert advertised(core, "gpu-node-1", "allocatable") == EXPECTED
    labels = core.read_node("gpu-node-1").metadata.labels
    assert labels["vram-enforcer.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["vram-enforcer.io/gpu.count"] == "2"
    assert labels["vram-enforcer.io/gpu.memory"] == "81920"
    assert labels["kubernetes.io/hostname"] == "gpu-node-1"  # other labels untouched


def test_nothing_is_patched_while_nothing_differs(
    running: AgentProcess, core: client.CoreV1Api
) -> None:
    wait_for(lambda: advertised(core, "gpu-node-1") == EXPECTED, timeout=20, what="capacity")
    running.wait_for_more(SYNCS, 1)  # the labels' patch, if it was still pending, is done
    before = core.read_node("gpu-node-1").metadata.resource_version
    running.wait_for_more(SYNCS, 3)  # three resyncs that found nothing to change
    assert core.read_node("gpu-node-1").metadata.resource_version == before


def test_a_kubelet_reset_is_undone_within_a_resync(
    running: AgentProcess, core: client.CoreV1Api
) -> None:
    wait_for(lambda: advertised(core, "gpu-node-1") == EXPECTED, timeout=20, what="capacity")
    pointer = RESOURCE.replace("/", "~1")
    core.patch_node_status(
        "gpu-node-1",
        [
            {"op": "remove", "path": f"/status/capacity/{pointer}"},
            {"op": "remove", "path": f"/status/allocatable/{pointer}"},
        ],
    )
    core.patch_node(
        "gpu-node-1", [{"op": "remove", "path": "/metadata/labels/vram-enforcer.io~1gpu.count"}]
    )
    wait_for(
        lambda: advertised(core, "gpu-node-1") == EXPECTED, timeout=5, what="capacity restored"
    )
    wait_for(
        lambda: advertised(core, "gpu-node-1", "allocatable") == EXPECTED,
        timeout=5,
        what="allocatable",
    )
    wait_for(
        lambda: (
            core.read_node("gpu-node-1").metadata.labels.get("vram-enforcer.io/gpu.count") == "2"
        ),
        timeout=5,
        what="label restored",
    )


def test_an_api_server_outage_is_ridden_out(
    running: AgentProcess, apiserver: ApiServer, core: client.CoreV1Api
) -> None:
    wait_for(lambda: advertised(core, "gpu-node-1") == EXPECTED, timeout=20, what="capacity")
    apiserver.stop()
    try:
        running.wait_for_more(API_ERRORS, 1, timeout=120)  # a resync fails meanwhile
    finally:
        apiserver.start()
    assert running.proc.poll() is None
    pointer = RESOURCE.replace("/", "~1")
    core.patch_node_status("gpu-node-1", [{"op": "remove", "path": f"/status/capacity/{pointer}"}])
    wait_for(
        lambda: advertised(core, "gpu-node-1") == EXPECTED,
        timeout=40,
        what="capacity after the outage",
    )
    assert "Traceback" not in running.log()


def test_the_minimal_role_allows_nothing_else(apiserver: ApiServer, agent_rbac: str) -> None:
    as_agent = client.CoreV1Api(apiserver.client(agent_rbac))
    for forbidden in (
        as_agent.list_node,
        lambda: as_agent.read_namespaced_pod("p", "default"),
        lambda: as_agent.delete_node("gpu-node-1"),
        lambda: as_agent.list_namespaced_secret("vram-enforcer"),
    ):
        with pytest.raises(ApiException) as info:
            forbidden()
        assert info.value.status == 403


def test_resource_unit_and_switches(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    tmp_path: Path,
) -> None:
    make_node(core, "gpu-node-units")
    agent = AgentProcess(
        apiserver,
        agent_rbac,
        "gpu-node-units",
        tmp_path,
        fake_nvml_lib,
        "--resource-unit",
        "1Gi",
        "--no-labels",
    )
    try:
        wait_for(
            lambda: advertised(core, "gpu-node-units") == 157, timeout=20, what="capacity in GiB"
        )
        agent.wait_for_more(SYNCS, 2)
        assert not any(
            k.startswith("vram-enforcer.io/")
            for k in core.read_node("gpu-node-units").metadata.labels
        )
    finally:
        assert agent.stop() == 0


def test_forbidden_is_one_clear_error_and_the_socket_keeps_serving(
    apiserver: ApiServer, core: client.CoreV1Api, fake_nvml_lib: Path, tmp_path: Path
) -> None:
    core.create_namespaced_service_account(
        "vram-enforcer", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody"))
    )
    token = apiserver.token_for("vram-enforcer", "nobody")
    make_node(core, "gpu-node-denied")
    agent = AgentProcess(apiserver, token, "gpu-node-denied", tmp_path, fake_nvml_lib)
    try:
        wait_for(lambda: agent.log().count("RBAC forbids") == 3, timeout=20, what="the RBAC errors")
        agent.wait_for_more(API_ERRORS, 3)  # more resyncs fail: still one line each
        log = agent.log()
        assert log.count("RBAC forbids 'get' on 'nodes'") == 1
        assert log.count("RBAC forbids 'list' on 'pods'") == 1  # the hard limits' pod watch
        assert log.count("RBAC forbids 'list' on 'namespaces'") == 1  # which ones opted in
        assert "deploy/rbac/" in log
        import socket as sk

        s = sk.socket(sk.AF_UNIX)
        s.connect(str(tmp_path / "agent.sock"))
        s.sendall(b'{"v":1,"op":"usage"}\n')
        assert b"processes" in s.makefile("rb").readline()
        s.close()
    finally:
        assert agent.stop() == 0
    assert advertised(core, "gpu-node-denied") is None


def test_a_gpu_off_the_bus_leaves_the_others_enforced_and_is_told_on_the_node(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    tmp_path: Path,
) -> None:
    """GPU 1 answers GPU_IS_LOST (an Xid 79): GPU 0's processes are still served to their
    pods, and the node says which GPU is lost (an Event on the Node, a metric, the log)."""
    make_node(core, "gpu-node-lost")
    state = FakeGpuState.single_gpu()
    state.add_device()
    state.set_process(0, older_than_a_tick(os.getpid()), 3 * GiB)
    agent = AgentProcess(
        apiserver, agent_rbac, "gpu-node-lost", tmp_path, fake_nvml_lib, state=state
    )
    source = AgentLink(str(tmp_path / "agent.sock"), stale_after=5.0)
    lost = state.devices[1]["uuid"]

    def node_events(reason: str) -> list[str]:
        listed = core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name=gpu-node-lost,reason={reason}"
        )
        return [e.message for e in listed.items if e.involved_object.kind == "Node"]

    def served() -> int | None:
        sample = source.sample()
        return (
            sum(p.used_bytes or 0 for p in sample.processes) if isinstance(sample, Sample) else None
        )

    try:
        wait_for(lambda: served() == 3 * GiB, timeout=20, what="GPU 0's process, served")
        state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=1)
        state.write(agent.state_file)
        (told,) = wait_for(lambda: node_events("VRAMGpuUnreadable"), timeout=20, what="the Event")
        assert f"GPU {lost} (index 1) cannot be read" in told and "drain the node" in told
        assert served() == 3 * GiB  # the other GPU is read on, and its pods enforced
        assert (
            agent.counter(
                f'vram_enforcer_gpu_readable{{gpu="1",model="NVIDIA H100 80GB HBM3",parent_uuid="",uuid="{lost}"}}'
            )
            == 0
        )
        assert agent.counter("vram_enforcer_source_up") == 1
        assert f"GPU {lost} (index 1) cannot be read" in agent.log()
        state.clear_errors()
        state.write(agent.state_file)
        wait_for(
            lambda: len(node_events("VRAMGpuUnreadable")) == 2,
            timeout=20,
            what="the Event that it is back",
        )
        assert f"GPU {lost} can be read again" in agent.log()
    finally:
        source.close()
        assert agent.stop() == 0
