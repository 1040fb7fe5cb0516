"""Pure decisions about what a node advertises: VRAM capacity and GPU labels, and the
patches that bring a Node object there (and nothing when it is there already).

What counts: every *schedulable* device, that is each GPU not in MIG mode and each MIG
partition of a GPU in MIG mode (a pod's process lands on one of those, never on the MIG
parent). Capacity is the sum over those devices of what can be allocated on each: its
total memory less the driver's reserved memory and `reserve`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal

from enforcer.core.model import Device, MiB
from enforcer.core.parsing import ConfigError, parse_quantity
from enforcer.core.payloads import NodeStatus, PatchOperation

LABEL_PRODUCT = "vram-enforcer.io/gpu.product"
LABEL_COUNT = "vram-enforcer.io/gpu.count"
LABEL_MEMORY = "vram-enforcer.io/gpu.memory"
# The allocation gate on this node (`agent --allocation-gate on`): `pending` once its
# profile and socket are up, `v1` once the runtime has handed it a gated container (the
# node's runc and libseccomp proven to do so), on a driver branch proven on a GPU;
# `unproven` on another branch (the gate off), `forced` there with
# `--allocation-gate-unproven`; absent where the gate does not run otherwise.
LABEL_ALLOCATION_GATE = "vram-enforcer.io/allocation-gate"
LABELS = (LABEL_PRODUCT, LABEL_COUNT, LABEL_MEMORY, LABEL_ALLOCATION_GATE)

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def schedulable(devices: Sequence[Device]) -> list[Device]:
    """GPUs without MIG partitions, and MIG partitions; never a MIG parent."""
    parents = {d.parent_uuid for d in devices if d.parent_uuid}
    return [d for d in devices if d.uuid not in parents]


def allocatable(device: Device, reserve_bytes: int = 0) -> int:
    """Bytes of a device that processes can be given: its total less what the driver and
    firmware reserve (NVML's `reserved`: a pod counted on it would be OOM-killed below its
    request, as in KAI-Scheduler issue #2212) and less `reserve_bytes`, the operator's."""
    return max(0, (device.total_bytes or 0) - (device.reserved_bytes or 0) - reserve_bytes)


def node_vram(devices: Sequence[Device], reserve_bytes: int) -> int:
    """Bytes to advertise: the sum over schedulable devices of what can be allocated."""
    return sum(allocatable(d, reserve_bytes) for d in schedulable(devices))


def to_units(value_bytes: int, unit_bytes: int) -> int:
    """Whole `--resource-unit`s, rounded down: never advertise memory that is not there."""
    return value_bytes // unit_bytes


def label_value(text: str) -> str:
    """A Kubernetes label value: [A-Za-z0-9._-], at most 63, alphanumeric at both ends."""
    value = _LABEL_VALUE_BAD.sub("-", text.strip())[:63]
    return value.strip("-_.")


def gpu_labels(devices: Sequence[Device]) -> dict[str, str]:
    """`gpu.product` (or `mixed`), `gpu.count`, `gpu.memory`: MiB of the smallest device,
    so that a node selector on it guarantees every device is big enough."""
    devs = schedulable(devices)
    if not devs:
        return {LABEL_COUNT: "0"}
    names = {d.name for d in devs}
    product = label_value(names.pop()) if len(names) == 1 else "mixed"
    smallest = min((d.total_bytes or 0) for d in devs)
    return {
        LABEL_PRODUCT: product,
        LABEL_COUNT: str(len(devs)),
        LABEL_MEMORY: str(smallest // MiB),
    }


def _same_quantity(current: object, desired: int) -> bool:
    if not isinstance(current, str):
        return False
    try:
        return parse_quantity(current, field="status") == Decimal(desired)
    except ConfigError:
        return False


def capacity_patch(status: NodeStatus | None, resource: str, value: int) -> list[PatchOperation]:
    """JSON patch ops setting `resource` in status.capacity and status.allocatable.

    Values are compared as quantities (the API server stores `85899345920` as `80Gi`), so a
    node that already advertises the value gets no patch at all: nothing flaps.
    """
    ops: list[PatchOperation] = []
    pointer = _pointer(resource)
    status = status or {}
    for field, current in (
        ("capacity", status.get("capacity")),
        ("allocatable", status.get("allocatable")),
    ):
        if current is None:
            ops.append({"op": "add", "path": f"/status/{field}", "value": {resource: str(value)}})
        elif not _same_quantity(current.get(resource), value):
            ops.append({"op": "add", "path": f"/status/{field}/{pointer}", "value": str(value)})
    return ops


def label_ops(
    current: Mapping[str, str] | None, desired: Mapping[str, str]
) -> list[PatchOperation]:
    """JSON patch ops for metadata.labels; our labels that are no longer desired go away."""
    if current is None:
        return (
            [{"op": "add", "path": "/metadata/labels", "value": dict(desired)}] if desired else []
        )
    ops: list[PatchOperation] = [
        {"op": "add", "path": f"/metadata/labels/{_pointer(k)}", "value": v}
        for k, v in desired.items()
        if current.get(k) != v
    ]
    ops += [
        {"op": "remove", "path": f"/metadata/labels/{_pointer(k)}"}
        for k in LABELS
        if k in current and k not in desired
    ]
    return ops


def _pointer(key: str) -> str:
    """A map key as one JSON-pointer segment (RFC 6901): `~` is `~0`, `/` is `~1`."""
    return key.replace("~", "~0").replace("/", "~1")
