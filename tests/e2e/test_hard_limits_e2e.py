"""The node agent's hard limits against a real kube-apiserver, with real cgroups.

The agent runs as shipped (deploy/rbac/agent.yaml), with `--cgroup-root` on a scratch
tree in the cgroup v2 hierarchy laid out as the kubelet's systemd driver lays it out, named
after the Pod's real UID and made after the Pod exists. The fake NVML plays an R615 driver
on two 80 GiB GPUs and records every limit it is asked to set; a worker in a container
reads those records as its first instruction.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.model import GiB
from tests.e2e.actors import AgentProcess, records
from tests.e2e.cluster import ApiServer
from tests.e2e.podsim import CGROUP2, SimPod
from tests.fakenvml import LIMIT_MAX, FakeGpuState, limit_records
from tests.helpers import wait_for

NODE = "gpu-node-hard"
WORKER = Path(__file__).resolve().parents[1] / "integration" / "worker.py"

pytestmark = pytest.mark.skipif(
    not (CGROUP2 / "cgroup.procs").exists(), reason="no cgroup v2 hierarchy on this machine"
)


@pytest.fixture(scope="module", autouse=True)
def node_object(admin: client.ApiClient) -> None:
    """The Node the pods are bound to: the controller-manager's pod GC deletes pods bound to
    a Node that does not exist."""
    core = client.CoreV1Api(admin)
    try:
        core.read_node(NODE)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=NODE)))


@pytest.fixture
def namespace(core: client.CoreV1Api, request: pytest.FixtureRequest) -> str:
    name = f"hard-{request.node.name[5:30].replace('_', '-').strip('-')}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def start_agent(
    apiserver: ApiServer,
    token: str,
    tmp: Path,
    lib: Path,
    root: Path,
    supported: bool = True,
    charges: bool = True,
) -> AgentProcess:
    state = FakeGpuState.single_gpu()
    state.add_device()
    state.support_memory_limits(supported, charges)
    return AgentProcess(
        apiserver,
        token,
        NODE,
        tmp,
        lib,
        "--no-advertise",
        "--no-labels",
        "--cgroup-root",
        str(root),
        "--cgroup-scan",
        "200ms",
        state=state,
    )


@pytest.fixture
def pod(core: client.CoreV1Api, namespace: str) -> Iterator[SimPod]:
    p = SimPod(
        core,
        namespace,
        "trainer",
        ["train", "helper"],
        limits={"train": "12Gi", "helper": "4Gi"},
        node_name=NODE,
        kubelet=True,
    )
    yield p
    p.close()


def limited(agent: AgentProcess, cgroup: Path, limit: int) -> bool:
    found = records(agent, cgroup)
    return len(found) == 2 and all(v == (0, limit) for v in found.values())


def events(core: client.CoreV1Api, pod: SimPod) -> list[Any]:
    return [
        e
        for e in core.list_namespaced_event(pod.namespace).items
        if e.involved_object.uid == pod.uid
    ]


def hard_limit_gauges(agent: AgentProcess) -> dict[tuple[str, str, str, str], float]:
    """(namespace, pod, container, GPU) -> bytes, from the agent's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.labels["namespace"], s.labels["pod"], s.labels["container"], s.labels["gpu"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "vram_enforcer_hard_limit_bytes"
        for s in family.samples
    }


def test_pod_and_container_limits_follow_the_pod_from_its_first_cgroup_to_its_deletion(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    pod: SimPod,
    tmp_path: Path,
) -> None:
    agent = start_agent(apiserver, agent_rbac, tmp_path, fake_nvml_lib, pod.root)
    try:
        # The pod's total on the pod's cgroup, before any container of it has started.
        wait_for(
            lambda: limited(agent, pod.pod_slice, 16 * GiB), timeout=20, what="the pod's hard limit"
        )
        # A container's first instruction runs under the pod's limit already.
        report = tmp_path / "train.json"
        pod.start(
            "train",
            [sys.executable, str(WORKER), "--report", str(report)],
            env={"FAKE_NVML_STATE": str(agent.state_file)},
        )
        started = json.loads(
            wait_for(lambda: _read(report.with_name("train.json.main")), what="the worker's report")
        )
        assert any(
            r["cgroup"] == str(pod.pod_slice) and r["hard"] == 16 * GiB for r in started["limits"]
        )
        # The container's own limit, on the cgroup named by its container ID.
        first = pod.cgroup("train")
        wait_for(lambda: limited(agent, first, 12 * GiB), what="the container's hard limit")
        # The hard tier is claimed once the driver shows it counts the pod's processes:
        # nothing is said while they hold too little to tell.
        assert not [e for e in events(core, pod) if e.reason.startswith("VRAM")]
        uses(agent, pod, "train", 2 * GiB)
        wait_for(
            lambda: any(e.reason == "VRAMHardLimit" for e in events(core, pod)),
            what="the VRAMHardLimit Event",
        )
        (event,) = [e for e in events(core, pod) if e.reason.startswith("VRAM")]
        assert event.type == "Normal"
        assert "the pod may allocate at most 16.00 GiB on GPU-" in event.message
        # Per container, proven on its own leaf against its own usage.
        assert "container train: driver-limit, at most 12.00 GiB on GPU-" in event.message
        assert "the driver charges 2.00 GiB on GPU-00000000" in event.message
        assert "where NVML lists 2.00 GiB for its processes" in event.message
        gauges = hard_limit_gauges(agent)
        gpus = {
            "GPU-00000000-fake-4000-8000-000000000000",
            "GPU-00000001-fake-4000-8000-000000000001",
        }
        assert gauges == {
            **{(pod.namespace, "trainer", "train", g): 12 * GiB for g in gpus},
            **{(pod.namespace, "trainer", "(pod)", g): 16 * GiB for g in gpus},
        }
        # A restart: a new container ID, a new cgroup; the limit follows.
        pod.restart("train")
        pod.start("train", [sys.executable, "-c", "import time; time.sleep(60)"])
        wait_for(
            lambda: limited(agent, pod.cgroup("train"), 12 * GiB),
            what="the restarted container's hard limit",
        )
        assert pod.cgroup("train") != first
        # The pod goes while its cgroups are still there: the agent clears what it set.
        core.delete_namespaced_pod(pod.name, pod.namespace, grace_period_seconds=0)
        for cgroup in (pod.pod_slice, pod.cgroup("train")):
            wait_for(
                lambda cgroup=cgroup: limited(agent, cgroup, LIMIT_MAX),
                what=f"the limit on {cgroup} cleared",
            )
        wait_for(lambda: not hard_limit_gauges(agent), what="the gauges to go with the pod")
        assert "Traceback" not in agent.log()
        # Only what it set: the helper's cgroup, never made, and nothing outside the pod.
        touched = {r["cgroup"] for r in limit_records(agent.state_file)}
        assert touched == {str(pod.pod_slice), str(first), str(pod.cgroup("train"))}
    finally:
        assert agent.stop() == 0


def uses(agent: AgentProcess, pod: SimPod, container: str, used: int) -> None:
    """The container's one process holds `used` on the first GPU, as NVML lists it."""
    (pid,) = wait_for(lambda: pod.host_pids(container), what=f"{container}'s process")
    agent.state.set_process(0, pid, used)
    agent.state.write(agent.state_file)


def test_a_limit_the_driver_does_not_charge_the_pods_processes_to_is_not_claimed(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    pod: SimPod,
    tmp_path: Path,
) -> None:
    """A driver that takes the limit and charges nothing to it, as one that binds only
    MPS clients would for an ordinary process: the pod is told that sampling enforces."""
    agent = start_agent(apiserver, agent_rbac, tmp_path, fake_nvml_lib, pod.root, charges=False)
    try:
        pod.start("train", [sys.executable, "-c", "import time; time.sleep(60)"])
        wait_for(
            lambda: limited(agent, pod.cgroup("train"), 12 * GiB), what="the container's hard limit"
        )
        uses(agent, pod, "train", 2 * GiB)
        wait_for(
            lambda: any(e.reason == "VRAMSamplingOnly" for e in events(core, pod)),
            timeout=20,
            what="the VRAMSamplingOnly Event",
        )
        (event,) = [e for e in events(core, pod) if e.reason.startswith("VRAM")]
        assert "the driver holds the limit on GPU-00000000" in event.message
        assert "charges nothing to it, while NVML lists 2.00 GiB" in event.message
        assert "enforced by sampling" in event.message
        assert "Traceback" not in agent.log()
    finally:
        assert agent.stop() == 0


def test_on_an_older_driver_each_pod_is_told_that_sampling_alone_enforces(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    pod: SimPod,
    tmp_path: Path,
) -> None:
    agent = start_agent(apiserver, agent_rbac, tmp_path, fake_nvml_lib, pod.root, supported=False)
    try:
        wait_for(
            lambda: any(e.reason == "VRAMSamplingOnly" for e in events(core, pod)),
            timeout=20,
            what="the VRAMSamplingOnly Event",
        )
        (event,) = [e for e in events(core, pod) if e.reason.startswith("VRAM")]
        # The node's choice of tier, as doctor and exec say it (tier_choice.choose).
        assert "driver 550.54.15 has no per-cgroup limits: R615+" in event.message
        assert "this node's enforcement tier sampling on " in agent.log()
        assert "enforced by sampling" in event.message
        assert agent.log().count("no hard limit:") == 1  # said once, not per pod or per pass
        assert limit_records(agent.state_file) == []
        assert agent.proc.poll() is None
    finally:
        assert agent.stop() == 0


def test_the_pod_watch_rides_out_an_api_server_restart(
    apiserver: ApiServer,
    agent_rbac: str,
    core: client.CoreV1Api,
    fake_nvml_lib: Path,
    pod: SimPod,
    namespace: str,
    tmp_path: Path,
) -> None:
    agent = start_agent(apiserver, agent_rbac, tmp_path, fake_nvml_lib, pod.root)
    try:
        wait_for(
            lambda: limited(agent, pod.pod_slice, 16 * GiB),
            timeout=20,
            what="the first pod's limit",
        )
        apiserver.restart()
        late = SimPod(
            core,
            namespace,
            "late",
            ["train"],
            limits={"train": "8Gi"},
            node_name=NODE,
            kubelet=True,
            root=pod.root,
        )
        try:
            wait_for(
                lambda: limited(agent, late.pod_slice, 8 * GiB),
                timeout=60,
                what="the late pod's limit",
            )
        finally:
            late.close()
        assert agent.proc.poll() is None
        assert "Traceback" not in agent.log()
    finally:
        assert agent.stop() == 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
