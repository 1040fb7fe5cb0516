"""The sidecar enforcing what DRA allocated, per GPU (`--limits-from dra`).

A cluster of its own: kube-apiserver, kube-controller-manager (claims from templates) and
kube-scheduler, which allocates each pod's claims by consumable capacity. Node
`gpu-node-1` has two 24Gi GPUs, published as NVIDIA's DRA driver publishes them
(`tests/e2e/dra.py`, the stand-in), with the UUIDs of the fake NVML's two devices;
`gpu-node-2` has one GPU published by a driver that gives no UUID attribute. Pods are
`SimPod`s (the tests play the kubelet, as in test_sidecar_e2e.py) that the real
scheduler binds; the agent serves the fake NVML and, as deploy/rbac/agent.yaml lets it,
sends each sidecar its pod, its claims and the node's slices. A sidecar of the pod on the
other node (which this agent does not watch) reads them itself (`--api-access direct`), with
the pod's ServiceAccount under deploy/rbac/sidecar.yaml.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, utils

from enforcer.core.declaration import ENFORCED, OPT_IN
from enforcer.core.model import GiB, MiB
from tests.e2e import dra
from tests.e2e.actors import (
    AgentProcess,
    Node,
    Sidecar,
    alive,
    apply_agent_rbac,
    namespace_with_sidecar_rbac,
    records,
    start_worker,
)
from tests.e2e.cluster import ApiServer
from tests.e2e.placement import add_node, bound
from tests.e2e.podsim import SimPod
from tests.e2e.prometheus import exported
from tests.fakenvml import FakeGpuState
from tests.helpers import wait_for

NAMESPACE = "dra-team"
NODE, OTHER_NODE = "gpu-node-1", "gpu-node-2"


@pytest.fixture(scope="module")
def cluster(apiserver: ApiServer) -> Iterator[ApiServer]:
    """`apiserver` (the shared one) only for its skip-or-fail check: this module has its own."""
    with dra.cluster() as server:
        yield server


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, fake_nvml_lib: Path) -> Iterator[Node]:
    """The agent, with two 24Gi GPUs in the fake NVML."""
    n = Node(tmp_path_factory.mktemp("node"), fake_nvml_lib)
    n.state = FakeGpuState.single_gpu(total_bytes=24 * GiB)
    n.state.add_device(total_bytes=24 * GiB)
    n.state.write(n.state_file)
    n.start_agent()
    yield n
    n.stop_agent()


@pytest.fixture(scope="module")
def api(cluster: ApiServer, node: Node) -> client.ApiClient:
    api = cluster.client()
    core = client.CoreV1Api(api)
    add_node(core, NODE, None)
    add_node(core, OTHER_NODE, None)
    dra.publish(api, NODE, [(d["uuid"], "24Gi") for d in node.state.devices])
    dra.publish(api, OTHER_NODE, [(None, "24Gi")])  # a driver that publishes no UUID
    return api


@pytest.fixture(scope="module")
def agent_token(
    cluster: ApiServer, api: client.ApiClient, node: Node, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The RBAC of deploy/rbac/agent.yaml, and the node's agent started again with it: it
    now watches NODE's pods, and serves each sidecar its own."""
    token = apply_agent_rbac(cluster, api)
    node.stop_agent()
    node.start_agent(
        cluster.kubeconfig(token, tmp_path_factory.mktemp("agent") / "kubeconfig"), NODE
    )
    return token


@pytest.fixture(scope="module")
def token(cluster: ApiServer, api: client.ApiClient, agent_token: str) -> str:
    token = namespace_with_sidecar_rbac(cluster, api, NAMESPACE)
    # The agent reads a pod's sidecar environment (its DRA mode, its ceilings) only in the
    # namespaces that opted in, as the webhook's are.
    opted_in = {"metadata": {"labels": {OPT_IN[0]: OPT_IN[1]}}}
    client.CoreV1Api(api).patch_namespace(NAMESPACE, opted_in)
    # trainer 4Gi and helper 2Gi, both of one GPU (the same UUID): neighbours
    utils.create_from_dict(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "tenants", "namespace": NAMESPACE},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": name,
                                "exactly": {
                                    "deviceClassName": dra.DEVICE_CLASS,
                                    "capacity": {"requests": {"memory": size}},
                                },
                            }
                            for name, size in (("trainer", "4Gi"), ("helper", "2Gi"))
                        ],
                        "constraints": [
                            {
                                "requests": ["trainer", "helper"],
                                "matchAttribute": f"{dra.DRIVER}/uuid",
                            }
                        ],
                    }
                }
            },
        },
    )
    utils.create_from_dict(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "vram-8gi", "namespace": NAMESPACE},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "vram",
                                "exactly": {
                                    "deviceClassName": dra.DEVICE_CLASS,
                                    "capacity": {"requests": {"memory": "8Gi"}},
                                },
                            }
                        ]
                    }
                }
            },
        },
    )
    return token


_numbers = itertools.count()


# What the webhook's DRA mode tells a sidecar beside the claims: the sums, which the agent
# must not take for the limits (they are the claims, per GPU).
AS_THE_WEBHOOK_TELLS = {
    "VRAM_ENFORCER_LIMITS": json.dumps({"trainer": 4 * GiB, "helper": 2 * GiB}),
    "VRAM_ENFORCER_LIMITS_FROM": "dra",
}


def scheduled_pod(
    api: client.ApiClient,
    node: str,
    containers: list[str],
    claims: dict[str, tuple[str, str | None]],
    sidecar_env: dict[str, str] | None = None,
) -> SimPod:
    """A SimPod that the scheduler binds to `node`, its claims allocated."""
    core = client.CoreV1Api(api)
    pod = SimPod(
        core,
        NAMESPACE,
        f"dra-{next(_numbers)}",
        containers,
        claims=claims,
        node_selector={"kubernetes.io/hostname": node},
        sidecar_env=sidecar_env,
    )
    try:
        wait_for(
            lambda: bound(core, NAMESPACE, pod.name), timeout=30, what="the scheduler to bind it"
        )
    except AssertionError:
        pod.close()  # its namespaces and cgroups
        raise
    pod.report_status()  # the status as the kubelet writes it once the pod runs
    return pod


def allocated_gpu(api: client.ApiClient, pod: SimPod) -> int:
    """The index of the GPU of the pod's one claim (every result is on it)."""
    status = client.CoreV1Api(api).read_namespaced_pod(pod.name, NAMESPACE).status
    (claim_status,) = status.resource_claim_statuses
    claim = dra.claims(api, NAMESPACE)[claim_status.resource_claim_name]
    (device,) = {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
    return int(device.removeprefix("gpu-"))


def remove(api: client.ApiClient, pod: SimPod) -> None:
    """The pod's processes and cgroups, and the pod itself: its claims go with it, and
    their memory on the GPU is free for the scheduler again."""
    pod.close()
    client.CoreV1Api(api).delete_namespaced_pod(pod.name, NAMESPACE, grace_period_seconds=0)


@pytest.fixture
def tenants(api: client.ApiClient, token: str) -> Iterator[SimPod]:
    pod = scheduled_pod(
        api,
        NODE,
        ["trainer", "helper", "undeclared", "vram-enforcer"],
        {"trainer": ("tenants", "trainer"), "helper": ("tenants", "helper")},
        sidecar_env=AS_THE_WEBHOOK_TELLS,
    )
    as_injected(api, pod)  # the agent serves only the sidecars of pods the webhook injected
    yield pod
    remove(api, pod)


@pytest.fixture
def sidecar(
    tenants: SimPod, node: Node, cluster: ApiServer, token: str, tmp_path: Path
) -> Iterator[Sidecar]:
    s = Sidecar(
        tenants, node, cluster, token, tmp_path, {}, "--limits-from", "dra", "--api-access", "agent"
    )
    yield s
    assert s.stop() == 0


def as_injected(api: client.ApiClient, pod: SimPod) -> None:
    """The label the webhook puts on a pod it injects: the node's agent serves such a pod's
    sidecar (of a namespace that opted in, NAMESPACE here) and its series, no other."""
    body = {"metadata": {"labels": {ENFORCED: "true"}}}
    client.CoreV1Api(api).patch_namespaced_pod(pod.name, NAMESPACE, body)


def served(node: Node, name: str, **labels: str) -> float | None:
    """A sample of the agent's /metrics (None: not there)."""
    return exported(node.metrics(), name, **labels)


def events(api: client.ApiClient, pod: str, reason: str) -> list[Any]:
    listed = client.CoreV1Api(api).list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={pod},reason={reason}"
    )
    return list(listed.items)


def test_over_its_claim_on_its_gpu_is_stopped_and_the_neighbour_within_is_not(
    api: client.ApiClient, sidecar: Sidecar, tenants: SimPod, node: Node, tmp_path: Path
) -> None:
    gpu = allocated_gpu(api, tenants)
    uuid = node.state.devices[gpu]["uuid"]
    as_injected(api, tenants)
    trainer = start_worker(tenants, "trainer", tmp_path)
    helper = start_worker(tenants, "helper", tmp_path)
    # 6Gi of a 24Gi GPU in all, and the pod's claims are 6Gi: only the split is wrong
    sidecar.wait_logged("the node agent sent this pod")  # not read from the API
    node.use({trainer: 5 * GiB, helper: 1 * GiB}, device=gpu)
    wait_for(lambda: not alive(trainer), what="the trainer to be terminated")
    assert alive(helper)
    said = f"container 'trainer' on GPU {uuid} uses 5.00 GiB of its 4.00 GiB VRAM limit (125%)"
    sidecar.wait_logged(said, "sent SIGTERM to pid")
    (event,) = wait_for(lambda: events(api, tenants.name, "VRAMEnforced"), what="the Event")
    assert (
        event.message.startswith(said)
        and event.involved_object.field_path == "spec.containers{trainer}"
    )
    # The pod's series, on its node's agent: what the claim gave the helper on its GPU, and
    # what it holds there; and the sidecar's action, from its report to the agent.
    pod = {"namespace": NAMESPACE, "pod": tenants.name}
    helper_there = {**pod, "container": "helper", "gpu": uuid}
    wait_for(
        lambda: served(node, "vram_enforcer_container_gpu_used_bytes", **helper_there) == GiB,
        what="the helper's usage on the agent's /metrics",
    )
    assert served(node, "vram_enforcer_container_gpu_limit_bytes", **helper_there) == 2 * GiB
    assert served(node, "vram_enforcer_container_used_bytes", **pod, container="helper") == GiB
    wait_for(
        lambda: served(node, "vram_enforcer_actions_total", **pod, action="terminate") == 1,
        what="the sidecar's action, reported to the agent",
    )
    assert served(node, "vram_enforcer_sidecar_ticks_total", **pod)
    assert 'container="vram-enforcer"' not in node.metrics()  # never the sidecar's own
    node.use({trainer: None, helper: None})


def test_utilisation_per_container_and_gpu_on_the_agents_metrics(
    api: client.ApiClient, sidecar: Sidecar, tenants: SimPod, node: Node, tmp_path: Path
) -> None:
    """NVML's per-process utilisation, attributed by the agent like memory: summed per
    container and GPU, beside that container's memory there."""
    as_injected(api, tenants)
    gpu = allocated_gpu(api, tenants)
    uuid = node.state.devices[gpu]["uuid"]
    trainer = [start_worker(tenants, "trainer", tmp_path) for _ in range(2)]
    helper = start_worker(tenants, "helper", tmp_path)
    node.use({trainer[0]: GiB, trainer[1]: GiB, helper: GiB}, device=gpu)
    for pid, (sm, mem) in zip([*trainer, helper], [(50, 20), (25, 5), (10, 40)], strict=True):
        node.state.set_utilization(gpu, pid, sm=sm, memory=mem)
    node.state.write(node.state_file)
    there = {"namespace": NAMESPACE, "pod": tenants.name, "container": "trainer", "gpu": uuid}
    sm = "vram_enforcer_container_gpu_sm_utilization_ratio"
    wait_for(lambda: served(node, sm, **there) == 0.75, what="the trainer's SM utilisation")
    metrics = node.metrics()
    assert (
        exported(metrics, "vram_enforcer_container_gpu_memory_utilization_ratio", **there) == 0.25
    )
    assert exported(metrics, "vram_enforcer_container_gpu_used_bytes", **there) == 2 * GiB
    assert exported(metrics, sm, **{**there, "container": "helper"}) == 0.1
    assert all(alive(pid) for pid in [*trainer, helper])  # each within its claim
    node.use(dict.fromkeys([*trainer, helper]))


def test_usage_on_a_gpu_it_was_not_given_is_caught(
    api: client.ApiClient, sidecar: Sidecar, tenants: SimPod, node: Node, tmp_path: Path
) -> None:
    other = 1 - allocated_gpu(api, tenants)
    uuid = node.state.devices[other]["uuid"]
    helper, sneaky = (
        start_worker(tenants, "helper", tmp_path),
        start_worker(tenants, "undeclared", tmp_path),
    )
    node.use({helper: 1 * MiB}, device=other)
    wait_for(lambda: not alive(helper), what="the helper's process on the other GPU to be stopped")
    sidecar.wait_logged(
        f"container 'helper' on GPU {uuid} uses 1.00 MiB of VRAM but was allocated none there"
    )
    node.use({sneaky: 1 * MiB}, device=other)  # a container with no claim at all
    wait_for(lambda: not alive(sneaky), what="the undeclared container's process to be stopped")
    node.use({helper: None, sneaky: None})


def test_with_its_sidecar_stopped_the_agent_holds_each_claim_to_its_allocation_on_its_gpu(
    api: client.ApiClient, sidecar: Sidecar, tenants: SimPod, node: Node, tmp_path: Path
) -> None:
    """The attack from inside a DRA pod: root there, the workload stops its sidecar (they
    share a PID namespace), then its trainer takes 5Gi of the 4Gi its claim gives it on
    its GPU. The agent, which read the pod's claims for its replies, holds each claim to
    its allocation on its GPU itself: the trainer is stopped, the helper within its 2Gi
    is not, and the Event says who acted."""
    gpu = allocated_gpu(api, tenants)
    uuid = node.state.devices[gpu]["uuid"]
    sidecar.wait_logged("the node agent sent this pod")  # the agent has read the claims
    # What the webhook and the kubelet would have written: injected, and running.
    core = client.CoreV1Api(api)
    core.patch_namespaced_pod(tenants.name, NAMESPACE, {"metadata": {"labels": {ENFORCED: "true"}}})
    core.patch_namespaced_pod_status(tenants.name, NAMESPACE, {"status": {"phase": "Running"}})
    trainer = start_worker(tenants, "trainer", tmp_path)
    helper = start_worker(tenants, "helper", tmp_path)
    (in_pod,) = tenants.host_pids("vram-enforcer")
    os.kill(in_pod, signal.SIGSTOP)
    try:
        held = (
            f"pod {NAMESPACE}/{tenants.name}: its sidecar is silent; the agent enforces "
            f"its limits itself (container 'helper' on GPU {uuid}: 2.00 GiB, container "
            f"'trainer' on GPU {uuid}: 4.00 GiB)"
        )
        wait_for(lambda: held in node.log.read_text(), timeout=60, what="the agent to hold it")
        node.use({trainer: 5 * GiB, helper: 1 * GiB}, device=gpu)
        wait_for(lambda: not alive(trainer), timeout=20, what="the agent to stop the trainer")
        assert alive(helper)
        (event,) = wait_for(lambda: events(api, tenants.name, "VRAMEnforced"), what="the Event")
        assert event.message.startswith(
            f"container 'trainer' on GPU {uuid} (held by the node agent while the pod's "
            "sidecar is silent) uses 5.00 GiB of its 4.00 GiB VRAM limit"
        ), event.message
        assert event.involved_object.field_path == "spec.containers{trainer}"
    finally:
        os.kill(in_pod, signal.SIGCONT)
        os.kill(sidecar.proc.pid, signal.SIGCONT)  # nsenter, which stops itself with its child
        node.use({trainer: None, helper: None})


def test_a_claim_that_cannot_be_mapped_to_a_gpu_is_reported_and_signals_nothing(
    api: client.ApiClient,
    node: Node,
    cluster: ApiServer,
    token: str,
    agent_token: str,
    tmp_path: Path,
) -> None:
    """The pod is OTHER_NODE's, whose agent this node's is not: it serves only its own
    node's pods' sidecars, so the sidecar here is served by an agent without the API."""
    pod = scheduled_pod(
        api, OTHER_NODE, ["trainer", "undeclared", "vram-enforcer"], {"trainer": ("vram-8gi", None)}
    )
    node.stop_agent()
    node.start_agent()
    used: dict[int, int | None] = {}
    try:
        sidecar = Sidecar(
            pod,
            node,
            cluster,
            token,
            tmp_path,
            {},
            "--limits-from",
            "dra",
            "--api-access",
            "direct",
            env={"NODE_NAME": OTHER_NODE},
        )
        trainer = start_worker(pod, "trainer", tmp_path)
        sneaky = start_worker(pod, "undeclared", tmp_path)
        used.update({trainer: 20 * GiB, sneaky: 1 * MiB})
        node.use(used)
        # the sidecar sees the usage and enforces: the container with no claim is stopped...
        wait_for(lambda: not alive(sneaky), what="the undeclared container's process to be stopped")
        # ...but the one whose GPU cannot be proven is not, and the pod says why
        (event,) = wait_for(
            lambda: events(api, pod.name, "VRAMAllocationUnknown"), what="the Event"
        )
        assert (
            "names device gpu.nvidia.com/gpu-node-2/gpu-0, which no ResourceSlice of this node lists with a 'uuid' attribute"
            in event.message
        )
        assert "container 'trainer' is not enforced on any GPU" in event.message
        assert event.type == "Warning"
        assert alive(trainer)
        # Events go out from a background thread: the kill comes first, its Event after it
        enforced = wait_for(lambda: events(api, pod.name, "VRAMEnforced"), what="the kill's Event")
        assert {e.involved_object.field_path for e in enforced} == {"spec.containers{undeclared}"}
        assert sidecar.stop() == 0
    finally:
        node.use(dict.fromkeys(used))
        pod.close()
        node.stop_agent()
        node.start_agent(cluster.kubeconfig(agent_token, tmp_path / "kubeconfig"), NODE)


def told(container: str, claim: int, ceiling: int | None = None) -> dict[str, str]:
    """What the webhook's DRA mode writes into the sidecar of a pod of one declaring
    container: its declaration, and its ceiling from the annotation."""
    env = {
        "VRAM_ENFORCER_LIMITS": json.dumps({container: claim}),
        "VRAM_ENFORCER_LIMITS_FROM": "dra",
    }
    if ceiling is not None:
        env["VRAM_ENFORCER_CEILINGS"] = json.dumps({container: ceiling})
    return env


def test_the_agent_holds_each_claim_to_its_allocation_on_its_gpu(
    cluster: ApiServer,
    api: client.ApiClient,
    agent_token: str,
    token: str,
    fake_nvml_lib: Path,
    tmp_path: Path,
) -> None:  # `token`: the namespace, and its templates
    """Hard limits from DRA: an R615 driver (the fake NVML records each limit), the agent as
    shipped (deploy/rbac/agent.yaml), the kubelet's cgroup layout named by the pod's UID.
    The trainer's claim is 8Gi and its ceiling 12Gi: the hard limit is the ceiling, on the
    claim's GPU only, with soft limit 0 (no reservation that outlives the cgroup)."""
    # As the webhook's DRA mode writes it: the sidecar is told the sums too, and the agent
    # must still hold the pod to its claim on its GPU alone.
    pod = SimPod(
        client.CoreV1Api(api),
        NAMESPACE,
        "dra-hard",
        ["trainer", "vram-enforcer"],
        claims={"trainer": ("vram-8gi", None)},
        sidecar_env=told("trainer", 8 * GiB, 12 * GiB),
        node_selector={"kubernetes.io/hostname": NODE},
        kubelet=True,
    )
    agent = None
    try:
        wait_for(lambda: bound(client.CoreV1Api(api), NAMESPACE, pod.name), what="the binding")
        pod.report_status()
        state = FakeGpuState.single_gpu(total_bytes=24 * GiB)  # the GPUs of NODE's slice
        state.add_device(total_bytes=24 * GiB)
        state.support_memory_limits(True)
        gpu = state.devices[allocated_gpu(api, pod)]["uuid"]
        agent = AgentProcess(
            cluster,
            agent_token,
            NODE,
            tmp_path,
            fake_nvml_lib,
            "--no-advertise",
            "--no-labels",
            "--cgroup-root",
            str(pod.root),
            "--cgroup-scan",
            "200ms",
            state=state,
        )
        soft_hard = (0, 12 * GiB)
        # the pod's cgroup and the container's: on the allocated GPU, none on the other
        wait_for(lambda: records(agent, pod.pod_slice) == {gpu: soft_hard}, what="the pod's limit")
        pod.start("trainer", [sys.executable, "-c", "import time; time.sleep(60)"])
        wait_for(
            lambda: records(agent, pod.cgroup("trainer")) == {gpu: soft_hard},
            what="the container's limit",
        )
        # Claimed once the driver shows that it charges the trainer's memory there.
        (pid,) = wait_for(lambda: pod.host_pids("trainer"), what="the trainer's process")
        state.set_process(allocated_gpu(api, pod), pid, GiB)
        state.write(agent.state_file)
        (event,) = wait_for(lambda: events(api, pod.name, "VRAMHardLimit"), what="the Event")
        assert event.message.startswith(
            f"hard limit in place: the pod may allocate at most 12.00 GiB on {gpu}"
        )
    finally:
        if agent is not None:
            agent.stop()
        remove(api, pod)


def pinned_template(api: client.ApiClient, size: str, uuid: str) -> str:
    """A template of one `size` claim that only the GPU `uuid` can satisfy."""
    name = f"pinned-{size.lower()}"
    utils.create_from_dict(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "vram",
                                "exactly": {
                                    "deviceClassName": dra.DEVICE_CLASS,
                                    "selectors": [
                                        {
                                            "cel": {
                                                "expression": f'device.attributes["{dra.DRIVER}"].uuid == "{uuid}"'
                                            }
                                        }
                                    ],
                                    "capacity": {"requests": {"memory": size}},
                                },
                            }
                        ]
                    }
                }
            },
        },
    )
    return name


def test_a_borrower_above_its_claim_is_reclaimed_when_the_scheduler_hands_out_what_it_borrowed(
    api: client.ApiClient, node: Node, cluster: ApiServer, token: str, tmp_path: Path
) -> None:
    """On one 24Gi GPU: a borrower's claim is 2Gi with a 16Gi ceiling, and it holds 12Gi; a
    neighbour's claim is 8Gi, of which it holds 1Gi. 11Gi are free, and the neighbour is
    owed 7Gi plus the 2Gi watermark: the borrower is left alone. Then the scheduler places
    a third claim of 4Gi there, from the 14Gi no claim had: 13Gi are now needed, 2 more
    than are free. The agent, which read every claim on the node, asks the borrower's
    sidecar for what it lent, and the sidecar stops it, saying why on its pod. The
    neighbour is untouched."""
    uuid = node.state.devices[0]["uuid"]
    lender = scheduled_pod(
        api,
        NODE,
        ["burst", "vram-enforcer"],
        {"burst": (pinned_template(api, "2Gi", uuid), None)},
        sidecar_env=told("burst", 2 * GiB, 16 * GiB),
    )
    owed = scheduled_pod(
        api,
        NODE,
        ["grow", "vram-enforcer"],
        {"grow": (pinned_template(api, "8Gi", uuid), None)},
        sidecar_env=told("grow", 8 * GiB),
    )
    newcomer = None
    as_injected(api, lender)  # its series, on the agent's /metrics
    sidecar = Sidecar(
        lender,
        node,
        cluster,
        token,
        tmp_path,
        {"burst": 2 * GiB},
        "--limits-from",
        "dra",
        "--api-access",
        "agent",
        env={"VRAM_ENFORCER_CEILINGS": json.dumps({"burst": 16 * GiB})},
    )
    try:
        assert (allocated_gpu(api, lender), allocated_gpu(api, owed)) == (0, 0)
        borrower = start_worker(lender, "burst", tmp_path)
        grower = start_worker(owed, "grow", tmp_path)
        sidecar.wait_logged(
            "the node agent decides reclaims: containers may borrow up to "
            "their ceilings (burst 16.00 GiB)"
        )
        node.use({borrower: 12 * GiB, grower: 1 * GiB}, device=0)
        there = {"namespace": NAMESPACE, "pod": lender.name, "container": "burst", "gpu": uuid}
        over = "vram_enforcer_container_gpu_over_request_bytes"
        wait_for(
            lambda: served(node, over, **there) == 10 * GiB, what="the agent to show 10Gi lent"
        )
        # what its claim was allocated there: it borrows the rest, up to its ceiling
        assert served(node, "vram_enforcer_container_gpu_limit_bytes", **there) == 2 * GiB
        del there["gpu"]  # its ceiling is above its one claim, on that claim's GPU
        assert served(node, "vram_enforcer_container_ceiling_bytes", **there) == 16 * GiB
        time.sleep(1.0)  # 20 of the agent's passes, and of the sidecar's ticks
        assert alive(borrower) and not events(api, lender.name, "VRAMReclaimed")
        newcomer = scheduled_pod(api, NODE, ["c"], {"c": (pinned_template(api, "4Gi", uuid), None)})
        (reclaimed, *_) = wait_for(
            lambda: events(api, lender.name, "VRAMReclaimed"),
            timeout=30,
            what="the VRAMReclaimed Event",
        )
        wait_for(lambda: not alive(borrower), what="the borrower to be stopped")
        assert alive(grower)
        assert not events(api, owed.name, "VRAMReclaimed")
        assert not events(api, owed.name, "VRAMEnforced")
        assert reclaimed.message.startswith(
            f"container 'burst' on GPU {uuid} holds 12.00 GiB, 10.00 GiB above its 2.00 GiB "
            "request (ceiling 16.00 GiB); the GPU has 10.50 GiB free, 2.50 GiB less than it "
            f"must keep free for what {NAMESPACE}/{owed.name}/grow, "
            f"{NAMESPACE}/{newcomer.name}/c are still owed"
        ), reclaimed.message
        assert reclaimed.involved_object.field_path == "spec.containers{burst}"
        reclaims = {"namespace": NAMESPACE, "pod": lender.name, "needed_by": "requests"}
        wait_for(
            lambda: (served(node, "vram_enforcer_reclaims_total", **reclaims) or 0) >= 1,
            what="the sidecar's reclaim, reported to the agent",
        )
        node.use({borrower: None, grower: None})
        assert sidecar.stop() == 0
    finally:
        for pod in (lender, owed, newcomer):
            if pod is not None:
                remove(api, pod)
