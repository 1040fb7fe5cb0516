"""The real kube-scheduler (1.37) placing VRAM per GPU: DRA consumable capacity (KEP-5075).

A cluster of its own: kube-apiserver, kube-controller-manager (it makes each pod's
ResourceClaim from its template) and kube-scheduler with its default profile. One Node
with two 24Gi GPUs, published as NVIDIA's DRA driver publishes them with
`--consumable-shares=memory` (`tests/e2e/dra.py`, a stand-in for that driver). No kubelet
runs, so pods are bound and never started. What is asserted is the scheduler's own
allocation (which GPU, `consumedCapacity`) and its own reason for the pod it cannot
place, for the manifests of examples/dra/ as shipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from tests.e2e import dra
from tests.e2e.cluster import ApiServer
from tests.e2e.placement import add_node, bound, unschedulable
from tests.helpers import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMESPACE = "vram-demo"
NODE = "gpu-node"
GPUS = (("GPU-0a1b2c3d-0000-4000-8000-000000000000", "24Gi"),
        ("GPU-0a1b2c3d-0001-4000-8000-000000000001", "24Gi"))  # fmt: skip
NO_KUBELET = ("node-lifecycle-controller",)  # see ApiServer.start_controller_manager


@pytest.fixture(scope="module")
def api(apiserver: ApiServer) -> Iterator[client.ApiClient]:
    """`apiserver` (the shared one) only for its skip-or-fail check: this module has its own."""
    server = ApiServer()
    try:
        server.start()
        server.start_controller_manager(without=NO_KUBELET)
        server.start_scheduler(
            {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration"}
        )
        api = server.client()
        add_node(client.CoreV1Api(api), NODE, None)
        dra.device_class(api)
        dra.publish(api, NODE, GPUS)
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
        )
        yield api
    finally:
        server.close()


def apply(api: client.ApiClient, relative: str) -> list[str]:
    """Create the example's objects as `kubectl create -f` would; returns its pods' names."""
    docs: list[dict[str, Any]] = list(yaml.safe_load_all((EXAMPLES / relative).read_text()))
    for doc in docs:
        utils.create_from_dict(api, doc)
    return [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"]


def allocation(api: client.ApiClient, pod: str) -> tuple[str, str]:
    """(device, consumed memory) of the pod's one claim, as the scheduler allocated it."""
    status = client.CoreV1Api(api).read_namespaced_pod(pod, NAMESPACE).status
    (claim_status,) = status.resource_claim_statuses
    claim = dra.claims(api, NAMESPACE)[claim_status.resource_claim_name]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == dra.DRIVER and result["pool"] == NODE
    assert result["shareID"]  # one share of a device that allows several allocations
    return result["device"], result["consumedCapacity"]["memory"]


def test_two_16gi_pods_on_different_gpus_and_a_third_pending_then_4gi_fits(
    api: client.ApiClient,
) -> None:
    core = client.CoreV1Api(api)
    names = apply(api, "dra/three-pods.yaml")

    def settled() -> bool:
        return all(bound(core, NAMESPACE, n) or unschedulable(core, NAMESPACE, n) for n in names)

    wait_for(settled, timeout=60, what="the scheduler to place or refuse every pod")
    placed = [n for n in names if bound(core, NAMESPACE, n)]
    assert len(placed) == 2
    assert sorted(allocation(api, n) for n in placed) == [("gpu-0", "16Gi"), ("gpu-1", "16Gi")]
    (pending,) = set(names) - set(placed)
    message = unschedulable(core, NAMESPACE, pending)
    assert message is not None
    first = message.split(" preemption:")[0]
    # The node has 16Gi left in all, but no GPU has: per-node counting would have placed it.
    assert first == "0/1 nodes are available: 1 cannot allocate all claims."
    assert first in (EXAMPLES / "README.md").read_text()  # what the README shows

    (small,) = apply(api, "dra/small-pod.yaml")
    wait_for(lambda: bound(core, NAMESPACE, small), timeout=30, what="the 4Gi pod to be placed")
    device, memory = allocation(api, small)
    assert memory == "4Gi" and device in {"gpu-0", "gpu-1"}
    assert unschedulable(core, NAMESPACE, pending) is not None  # still no room for 16Gi
