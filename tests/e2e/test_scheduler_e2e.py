"""The real kube-scheduler (1.37) placing pods by vram-enforcer.io/vram.

A cluster of its own (so that no other test's Nodes take part): kube-apiserver and
kube-scheduler run with examples/scheduler/kube-scheduler-config.yaml as shipped (only its
kubeconfig path and leader election are set for the test), which also proves that the
scheduler accepts the file. Nodes advertise VRAM as the agent does; no kubelet runs, so
pods are bound and never started. What is asserted is the scheduler's own placement and
its own FailedScheduling message, against what examples/README.md promises.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from tests.e2e.cluster import ApiServer
from tests.e2e.placement import RESOURCE, add_node, bound, unschedulable
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def core(apiserver: ApiServer) -> Iterator[client.CoreV1Api]:
    """`apiserver` (the shared one) only for its skip-or-fail check: this module has its own."""
    server = ApiServer()
    try:
        server.start()
        server.start_scheduler(
            yaml.safe_load((EXAMPLES / "scheduler/kube-scheduler-config.yaml").read_text())
        )
        yield client.CoreV1Api(server.client())
    finally:
        server.close()


def test_three_of_the_four_pods_fit_on_the_4gi_and_8gi_nodes(core: client.CoreV1Api) -> None:
    add_node(core, "demo-node-4gi", "4Gi", pool="demo")
    add_node(core, "demo-node-8gi", "8Gi", pool="demo")
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="vram-demo")))
    pods: list[dict[str, Any]] = list(
        yaml.safe_load_all((EXAMPLES / "pods/three-pods.yaml").read_text())
    )
    for pod in pods:
        utils.create_from_dict(core.api_client, pod)
    names = [p["metadata"]["name"] for p in pods]

    def settled() -> bool:
        return all(
            bound(core, "vram-demo", n) or unschedulable(core, "vram-demo", n) for n in names
        )

    wait_for(settled, timeout=60, what="the scheduler to place or refuse every pod")
    placed = sorted(node for n in names if (node := bound(core, "vram-demo", n)))
    assert placed == ["demo-node-4gi", "demo-node-8gi", "demo-node-8gi"]
    (message,) = [m for n in names if (m := unschedulable(core, "vram-demo", n))]
    first = message.split(" preemption:")[0]
    assert first == f"0/2 nodes are available: 2 Insufficient {RESOURCE}."
    assert first in (EXAMPLES / "README.md").read_text()  # what the README shows

    # kubectl describe pod shows it: the scheduler's Event (events.k8s.io, so the reporting
    # controller rather than the legacy source names it)
    def reported() -> bool:
        events = core.list_namespaced_event(
            "vram-demo", field_selector="reason=FailedScheduling"
        ).items
        return any(
            e.message.startswith(first)
            and "default-scheduler" in (e.reporting_component, e.source.component)
            for e in events
        )

    wait_for(reported, what="the FailedScheduling Event")


@pytest.mark.parametrize(("profile", "same_node"), [("vram-binpack", True), ("vram-spread", False)])
def test_the_example_profiles_pack_or_spread_by_vram(
    core: client.CoreV1Api, profile: str, same_node: bool
) -> None:
    """Two empty 16 Gi nodes of their own; a first pod lands on one, and the profile decides
    whether the second joins it (MostAllocated) or takes the other (LeastAllocated)."""
    pool = profile
    for side in ("a", "b"):
        add_node(core, f"{pool}-{side}", "16Gi", pool=pool)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=pool)))
    for i in (1, 2):
        core.create_namespaced_pod(
            pool,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name=f"p{i}"),
                spec=client.V1PodSpec(
                    scheduler_name=profile,
                    node_selector={"pool": pool},
                    containers=[
                        client.V1Container(
                            name="c",
                            image="gpu:1",
                            resources=client.V1ResourceRequirements(limits={RESOURCE: "6Gi"}),
                        )
                    ],
                ),
            ),
        )
        wait_for(lambda i=i: bound(core, pool, f"p{i}"), timeout=30, what=f"{profile} to bind p{i}")
    assert (bound(core, pool, "p1") == bound(core, pool, "p2")) is same_node
