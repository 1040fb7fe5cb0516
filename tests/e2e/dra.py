"""A stand-in for NVIDIA's DRA driver (the outermost boundary): what it publishes.

With `--consumable-shares=memory` (its `ConsumableShares` gate), NVIDIA's kubelet plugin
publishes one ResourceSlice per node, pool named after the node, with a device `gpu-<index>`
per GPU that allows several allocations and offers its memory as consumable capacity
(default the whole GPU, any multiple of 1Mi up to it), and the DeviceClass `gpu.nvidia.com`
that selects its devices. These are the same objects; nothing of the driver runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from kubernetes import client, utils

from tests.e2e.cluster import ApiServer

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"


@contextlib.contextmanager
def cluster() -> Iterator[ApiServer]:
    """A cluster of its own for DRA: kube-apiserver, kube-controller-manager (it makes each
    pod's ResourceClaim from its template) without the node lifecycle controller (no
    kubelet sends heartbeats here), kube-scheduler with its default profile, and the
    driver's DeviceClass."""
    server = ApiServer()
    try:
        server.start()
        server.start_controller_manager(without=("node-lifecycle-controller",))
        server.start_scheduler(
            {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration"}
        )
        device_class(server.client())
        yield server
    finally:
        server.close()


def device_class(api: client.ApiClient) -> None:
    """The DeviceClass the driver's chart installs (once per cluster)."""
    utils.create_from_dict(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DEVICE_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        },
    )


def gpu_device(
    index: int, uuid: str | None, memory: str, product: str = "NVIDIA L4"
) -> dict[str, Any]:
    """One GPU as the driver lists it, shareable by memory (`uuid` None: a driver that does
    not publish one)."""
    device = {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid},
            "index": {"int": index},
            "minor": {"int": index},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
        },
        "capacity": {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": "0", "max": memory, "step": "1Mi"},
                },
            },
        },
    }
    if uuid is None:
        del device["attributes"]["uuid"]  # type: ignore[attr-defined]
    return device


def publish(api: client.ApiClient, node: str, gpus: Sequence[tuple[str | None, str]]) -> None:
    """The node's ResourceSlice: one device per (uuid, memory) in `gpus`, in index order."""
    devices = [gpu_device(i, uuid, memory) for i, (uuid, memory) in enumerate(gpus)]
    utils.create_from_dict(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        },
    )


def claims(api: client.ApiClient, namespace: str) -> dict[str, dict[str, Any]]:
    """The namespace's ResourceClaims by name, as the API server's JSON."""
    listed = client.ResourceV1Api(api).list_namespaced_resource_claim(namespace)
    return {c["metadata"]["name"]: c for c in api.sanitize_for_serialization(listed)["items"]}
