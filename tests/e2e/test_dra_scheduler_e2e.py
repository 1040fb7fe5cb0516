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

import http.client
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils
from prometheus_client import CollectorRegistry, Counter

from enforcer.core.admission import AdmissionSettings
from enforcer.edge.node_pods import WatchedPods
from enforcer.modes.claim_templates import (
    MAX_PER_NAMESPACE,
    PENDING_ENFORCED,
    TemplateMaker,
    claims_of,
)
from tests.e2e import dra
from tests.e2e.actors import Webhook, doctor
from tests.e2e.cluster import ApiServer
from tests.e2e.placement import add_node, bound, unschedulable
from tests.helpers import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMESPACE = "vram-demo"
NODE = "gpu-node"
GPUS = (
    ("GPU-0a1b2c3d-0000-4000-8000-000000000000", "24Gi"),
    ("GPU-0a1b2c3d-0001-4000-8000-000000000001", "24Gi"),
)


@pytest.fixture(scope="module")
def cluster(apiserver: ApiServer) -> Iterator[ApiServer]:
    """`apiserver` (the shared one) only for its skip-or-fail check: this module has its own."""
    with dra.cluster() as server:
        yield server


@pytest.fixture(scope="module")
def api(cluster: ApiServer) -> client.ApiClient:
    api = cluster.client()
    add_node(client.CoreV1Api(api), NODE, None)
    dra.publish(api, NODE, GPUS)
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    )
    return api


def apply(api: client.ApiClient, relative: str) -> list[str]:
    """Create the example's objects as `kubectl create -f` would; returns its pods' names."""
    docs: list[dict[str, Any]] = list(yaml.safe_load_all((EXAMPLES / relative).read_text()))
    for doc in docs:
        utils.create_from_dict(api, doc)
    return [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"]


def allocation(api: client.ApiClient, pod: str, namespace: str = NAMESPACE) -> tuple[str, str]:
    """(device, consumed memory) of the pod's one claim, as the scheduler allocated it."""
    status = client.CoreV1Api(api).read_namespaced_pod(pod, namespace).status
    (claim_status,) = status.resource_claim_statuses
    claim = dra.claims(api, namespace)[claim_status.resource_claim_name]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == dra.DRIVER
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
    # The pending pod would take a GPU of the next test's node, the moment it appears.
    core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)
    wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, what="the pods to be gone")


def test_doctor_says_dra_mode_can_be_used(
    cluster: ApiServer, api: client.ApiClient, tmp_path: Path
) -> None:
    code, checks = doctor(cluster, cluster.admin_token, "default", tmp_path)
    dra_mode = checks["VRAM per GPU (DRA)"]
    assert dra_mode["status"] == "ok", dra_mode
    assert dra_mode["detail"].startswith(
        "2 GPU(s) shareable by memory (gpu.nvidia.com/gpu-node/gpu-0, gpu.nvidia.com/gpu-node/gpu-1): DRA mode can be used"
    )
    assert code == 0


def test_the_one_line_declaration_becomes_a_claim_placed_per_gpu(
    cluster: ApiServer, tmp_path: Path
) -> None:
    """The webhook in DRA mode: `limits: {vram-enforcer.io/vram: 16Gi}` as users write it,
    on a node of its own with two 24Gi GPUs."""
    admin = cluster.client()
    core = client.CoreV1Api(admin)
    node, namespace = "gpu-node-oneline", "vram-oneline"
    add_node(core, node, None)
    dra.publish(admin, node, [(u.replace("0a1b", "1a1b"), m) for u, m in GPUS])
    core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(
                name=namespace, labels={"vram-enforcer.io/inject": "enabled"}
            )
        )
    )
    webhook = Webhook(cluster, tmp_path, "--dra-device-class", dra.DEVICE_CLASS)
    try:
        webhook.register(admin)

        def one_line(name: str, vram: str, **options: str) -> Any:
            return core.create_namespaced_pod(
                namespace,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name},
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": node},
                        "containers": [
                            {
                                "name": "app",
                                "image": "busybox:1.36",
                                "command": ["sleep", "3600"],
                                "resources": {"limits": {"vram-enforcer.io/vram": vram}},
                            }
                        ],
                    },
                },
                **options,
            )

        # admission writes nothing (a server-side dry run no more than any other)
        one_line("dry", "2Gi", dry_run="All")
        names = [one_line(f"p{i}", "16Gi").metadata.name for i in (1, 2, 3)]
        stored = core.read_namespaced_pod("p1", namespace)
        (app,) = stored.spec.containers
        assert "vram-enforcer.io/vram" not in (app.resources.limits or {})
        assert [c.name for c in app.resources.claims] == ["vram-app"]
        (claim,) = stored.spec.resource_claims
        assert claim.resource_claim_template_name == "vram-enforcer-16gi"
        (sidecar,) = [c for c in stored.spec.init_containers if c.name == "vram-enforcer"]
        assert {"name": "VRAM_ENFORCER_LIMITS_FROM", "value": "dra"} in [
            {"name": e.name, "value": e.value} for e in sidecar.env
        ]

        def made() -> list[Any]:  # by the webhook, from the pods the API holds
            return (
                client.ResourceV1Api(admin).list_namespaced_resource_claim_template(namespace).items
            )  # type: ignore[no-any-return]

        (template,) = wait_for(made, timeout=30, what="the template, once for the three pods")
        assert template.metadata.name == "vram-enforcer-16gi"  # not the dry run's 2gi
        assert template.metadata.labels == {"app.kubernetes.io/managed-by": "vram-enforcer"}

        def settled() -> bool:  # a pod may first wait for its claim to be made: not final
            placed = [n for n in names if bound(core, namespace, n)]
            refused = [
                m for n in names if "allocate" in (m := unschedulable(core, namespace, n) or "")
            ]
            return len(placed) == 2 and len(refused) == 1

        wait_for(settled, timeout=60, what="two pods placed and one refused for lack of room")
        placed = [n for n in names if bound(core, namespace, n)]
        got = sorted(allocation(admin, n, namespace) for n in placed)
        assert got == [("gpu-0", "16Gi"), ("gpu-1", "16Gi")]
        (pending,) = set(names) - set(placed)
        message = unschedulable(core, namespace, pending) or ""
        assert "1 cannot allocate all claims" in message
    finally:
        webhook.close(admin)


def test_templates_are_made_only_from_pods_the_api_holds_in_opted_in_namespaces(
    cluster: ApiServer, tmp_path: Path
) -> None:
    """The confused deputy, closed: a review sent straight to the webhook's port (anyone who
    reaches its Service can) makes nothing, in any namespace; a pending pod marked as ours
    in a namespace that has not opted in gets no template either; one in an opted-in
    namespace does."""
    admin = cluster.client()
    core, resource = client.CoreV1Api(admin), client.ResourceV1Api(admin)
    for name, labels in (
        ("vram-deputy-in", {"vram-enforcer.io/inject": "enabled"}),
        ("vram-deputy-out", {}),
    ):
        core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels))
        )
    webhook = Webhook(cluster, tmp_path, "--dra-device-class", dra.DEVICE_CLASS)
    try:
        forged = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "x",
                "namespace": "vram-deputy-out",
                "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "object": {
                    "metadata": {"name": "p"},
                    "spec": {
                        "containers": [
                            {
                                "name": "a",
                                "image": "x",
                                "resources": {"limits": {"vram-enforcer.io/vram": "7Gi"}},
                            }
                        ]
                    },
                },
            },
        }
        context = ssl.create_default_context(cafile=str(webhook.ca[0]))
        conn = http.client.HTTPSConnection("127.0.0.1", webhook.port, context=context, timeout=10)
        conn.request(
            "POST", "/mutate", body=json.dumps(forged), headers={"Content-Type": "application/json"}
        )
        assert json.loads(conn.getresponse().read())["response"]["allowed"] is True  # patched
        marked = {
            "metadata": {"name": "p", "labels": {"vram-enforcer.io/enforced": "true"}},
            "spec": {
                "containers": [
                    {"name": "a", "image": "x", "resources": {"claims": [{"name": "vram-a"}]}}
                ],
                "resourceClaims": [
                    {"name": "vram-a", "resourceClaimTemplateName": "vram-enforcer-7gi"}
                ],
            },
        }
        for namespace in ("vram-deputy-out", "vram-deputy-in"):
            core.create_namespaced_pod(namespace, marked)
        wait_for(
            lambda: resource.list_namespaced_resource_claim_template("vram-deputy-in").items,
            timeout=30,
            what="the opted-in namespace's template",
        )
        assert resource.list_namespaced_resource_claim_template("vram-deputy-out").items == []
        assert (
            "not making ResourceClaimTemplate 'vram-enforcer-7gi' in namespace "
            "'vram-deputy-out': the namespace has not opted in" in webhook.log.read_text()
        )
    finally:
        webhook.close(admin)


def test_a_namespace_gets_a_bounded_number_of_templates(
    cluster: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = cluster.client()
    namespace = "vram-deputy-many"
    client.CoreV1Api(admin).create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(
                name=namespace, labels={"vram-enforcer.io/inject": "enabled"}
            )
        )
    )
    settings = AdmissionSettings(
        "img", "native", "vram-enforcer.io/vram", 1, dra_class=dra.DEVICE_CLASS
    )
    maker = TemplateMaker(admin, settings, Counter("u", "test", registry=CollectorRegistry()))
    sizes = range(1, MAX_PER_NAMESPACE + 3)
    pods = {
        str(i): {
            "metadata": {"namespace": namespace, "name": f"p{i}"},
            "spec": {
                "resourceClaims": [
                    {"name": "vram-a", "resourceClaimTemplateName": f"vram-enforcer-{i}gi"}
                ]
            },
        }
        for i in sizes
    }
    maker.make(pods)
    maker.make(pods)  # again: what exists is not made twice, what is refused is said once
    made = client.ResourceV1Api(admin).list_namespaced_resource_claim_template(namespace).items
    assert len(made) == MAX_PER_NAMESPACE
    assert caplog.text.count(f"already has {MAX_PER_NAMESPACE} VRAM sizes of ours") == 2


def test_pending_pods_are_listed_in_pages_held_as_their_claims_and_read_once_a_resync(
    cluster: ApiServer,
) -> None:
    """A creation storm leaves thousands of pods pending: the webhook's view of them comes
    in pages and holds only their namespace and claims (whole, they took the webhook past
    its memory limit), and a pass reads a pod again only at the next resync."""
    admin = cluster.client()
    namespace = "vram-storm"
    core = client.CoreV1Api(admin)
    core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(
                name=namespace, labels={"vram-enforcer.io/inject": "enabled"}
            )
        )
    )

    def marked(i: int) -> dict[str, Any]:
        return {
            "metadata": {"name": f"p{i}", "labels": {"vram-enforcer.io/enforced": "true"}},
            "spec": {
                "containers": [
                    {
                        "name": "a",
                        "image": "x",
                        "env": [{"name": "BIG", "value": "x" * 1000}],
                        "resources": {"claims": [{"name": "vram-a"}]},
                    }
                ],
                "resourceClaims": [
                    {"name": "vram-a", "resourceClaimTemplateName": "vram-enforcer-3gi"}
                ],
            },
        }

    for i in range(5):
        core.create_namespaced_pod(namespace, marked(i))
    changed = threading.Event()
    query = {
        **PENDING_ENFORCED,
        "fieldSelector": f"{PENDING_ENFORCED['fieldSelector']},metadata.namespace={namespace}",
    }
    pods = WatchedPods(admin, query, (changed,), keep=claims_of, page=2)
    pods.start()
    try:
        seen = wait_for(
            lambda: (s := pods.snapshot()) is not None and len(s) == 5 and s, what="the list"
        )
        core.create_namespaced_pod(namespace, marked(5))  # ... and one the watch brings
        seen = wait_for(lambda: len(s := pods.snapshot() or {}) == 6 and s, what="the watch")
        expected = {
            "metadata": {"namespace": namespace},
            "spec": {
                "resourceClaims": [
                    {"name": "vram-a", "resourceClaimTemplateName": "vram-enforcer-3gi"}
                ]
            },
        }
        assert list(seen.values()) == [expected] * 6
    finally:
        pods.close()
    settings = AdmissionSettings(
        "img", "native", "vram-enforcer.io/vram", 1, dra_class=dra.DEVICE_CLASS
    )
    now = [0.0]
    maker = TemplateMaker(
        admin, settings, Counter("u2", "test", registry=CollectorRegistry()), clock=lambda: now[0]
    )
    maker.pods.start()  # the webhook's own view of pending pods holds the same
    try:
        wait_for(
            lambda: (
                [
                    p
                    for p in (maker.pods.snapshot() or {}).values()
                    if p["metadata"].get("namespace") == namespace
                ]
                == [expected] * 6
            ),
            what="the webhook's view of the pending pods",
        )
    finally:
        maker.pods.close()
    resource = client.ResourceV1Api(admin)

    def templates() -> list[str]:
        return [
            t.metadata.name
            for t in resource.list_namespaced_resource_claim_template(namespace).items
        ]

    maker.make(seen)
    assert templates() == ["vram-enforcer-3gi"]
    resource.delete_namespaced_resource_claim_template("vram-enforcer-3gi", namespace)
    now[0] += 3600  # past every cache of what exists
    maker.make(seen, everything=False)  # a change: these pods were done, none is read again
    assert templates() == []
    maker.make(seen)  # the resync reads them all: the template deleted meanwhile is made again
    assert templates() == ["vram-enforcer-3gi"]
