"""The agent's Node: its VRAM capacity and GPU labels, brought to what NVML reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kubernetes import client

from enforcer.core.model import Device
from enforcer.core.node import capacity_patch, gpu_labels, label_ops, node_vram, to_units
from enforcer.core.payloads import Node, PatchOperation
from enforcer.edge.kube import NODE, call
from enforcer.edge.latest import Latest


class NodeAdvertiser:
    """Brings a Node's VRAM capacity and GPU labels to what NVML reports, and only then."""

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        *,
        resource_name: str,
        resource_unit: int,
        reserve_bytes: int,
        advertise: bool = True,
        labels: bool = True,
        deadline: float = 30.0,
    ) -> None:
        self._api = api
        self._node = node_name
        self._resource = resource_name
        self._unit = resource_unit
        self._reserve = reserve_bytes
        self._advertise = advertise
        self._labels = labels
        self._deadline = deadline
        self._node_labels: Mapping[str, str] = {}  # the Node's, as last read (swapped whole)
        # Labels of the agent's own beside the GPUs' (the allocation gate's), set by others
        self.extra_labels: Latest[Mapping[str, str]] = Latest({})

    def last_labels(self) -> Mapping[str, str]:
        """The Node's labels as `sync` last read them (none before)."""
        return self._node_labels

    def desired_bytes(self, devices: Sequence[Device]) -> int:
        return to_units(node_vram(devices, self._reserve), self._unit) * self._unit

    def sync(self, devices: Sequence[Device]) -> tuple[int, int]:
        """Patch what differs; returns (status ops, label ops) applied. Raises KubeError."""
        node = self._read()
        self._node_labels = dict((node.get("metadata") or {}).get("labels") or {})
        status_ops: list[PatchOperation] = []
        label_changes: list[PatchOperation] = []
        if self._advertise:
            units = to_units(node_vram(devices, self._reserve), self._unit)
            status_ops = capacity_patch(node.get("status"), self._resource, units)
        if self._labels:
            labels = (node.get("metadata") or {}).get("labels")
            label_changes = label_ops(labels, {**gpu_labels(devices), **self.extra_labels.get()})
        if status_ops:
            call(
                self._api,
                "PATCH",
                NODE + "/status",
                "nodes/status",
                body=status_ops,
                params={"name": self._node},
                deadline=self._deadline,
            )
        if label_changes:
            call(
                self._api,
                "PATCH",
                NODE,
                "nodes",
                body=label_changes,
                params={"name": self._node},
                deadline=self._deadline,
            )
        return len(status_ops), len(label_changes)

    def _read(self) -> Node:
        node: Node = call(
            self._api, "GET", NODE, "nodes", params={"name": self._node}, deadline=self._deadline
        )
        return node
