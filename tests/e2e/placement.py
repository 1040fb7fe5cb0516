"""Nodes as a kubelet and the agent leave them, and what the scheduler made of a pod.

For tests where the real scheduler places pods on Nodes that no kubelet runs.
"""

from __future__ import annotations

from kubernetes import client

RESOURCE = "vram-enforcer.io/vram"


def add_node(core: client.CoreV1Api, name: str, vram: str | None, **labels: str) -> None:
    """A Ready node advertising `vram` (None: none), as the agent and kubelet would leave it.
    The API server taints every new Node not-ready (TaintNodesByCondition); the node
    lifecycle controller lifts it once kubelet reports Ready. No kubelet runs here, so the
    test does both (a merge patch: the controller, where it runs, may have lifted it)."""
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name, labels={"kubernetes.io/hostname": name, **labels}
            )
        )
    )
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110", **({RESOURCE: vram} if vram else {})}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e"}
    core.patch_node_status(
        name, {"status": {"capacity": resources, "allocatable": resources, "conditions": [ready]}}
    )
    core.patch_node(name, {"spec": {"taints": None}})


def bound(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    return core.read_namespaced_pod(name, namespace).spec.node_name  # type: ignore[no-any-return]


def unschedulable(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    """The scheduler's message on a pod it could not place, once it has said it."""
    conditions = core.read_namespaced_pod(name, namespace).status.conditions or []
    for c in conditions:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return str(c.message)
    return None
