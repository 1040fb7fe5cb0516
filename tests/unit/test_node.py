"""What a node advertises, and the patches that get it there without flapping."""

from dataclasses import replace

from enforcer.core.model import Device, GiB, MiB
from enforcer.core.node import (
    LABEL_ALLOCATION_GATE,
    LABEL_COUNT,
    LABEL_MEMORY,
    LABEL_PRODUCT,
    capacity_patch,
    gpu_labels,
    label_ops,
    label_value,
    node_vram,
    schedulable,
    to_units,
)

H100 = "NVIDIA H100 80GB HBM3"


def gpu(i: int, total: int = 80 * GiB, name: str = H100) -> Device:
    return Device(i, f"GPU-{i}", name, total, 0)


def mig(parent: Device, n: int, total: int) -> Device:
    return Device(
        parent.index, f"MIG-{parent.uuid}-{n}", f"{parent.name} MIG 3g.40gb", total, 0, parent.uuid
    )


def test_capacity_is_total_minus_reserve_per_gpu() -> None:
    assert node_vram([gpu(0), gpu(1)], reserve_bytes=1 * GiB) == 158 * GiB
    assert node_vram([gpu(0, total=GiB // 2)], reserve_bytes=GiB) == 0  # never negative


def test_capacity_leaves_out_what_the_driver_reserves() -> None:
    """NVML's `reserved` can never be allocated (KAI-Scheduler issue #2212): it is out of the
    capacity as `--reserve` is; a driver that does not say (None) leaves the total."""
    reserved = replace(gpu(0), reserved_bytes=512 * MiB)
    assert node_vram([reserved, gpu(1)], reserve_bytes=GiB) == 158 * GiB - 512 * MiB
    assert node_vram([replace(gpu(0), reserved_bytes=81 * GiB)], reserve_bytes=0) == 0


def test_mig_partitions_replace_their_parent() -> None:
    parent = gpu(0)
    parts = [mig(parent, 0, 40 * GiB), mig(parent, 1, 39 * GiB)]
    devices = [parent, *parts, gpu(1)]
    assert [d.uuid for d in schedulable(devices)] == [p.uuid for p in parts] + ["GPU-1"]
    assert node_vram(devices, 0) == 40 * GiB + 39 * GiB + 80 * GiB
    labels = gpu_labels(devices)
    assert labels[LABEL_COUNT] == "3"
    assert labels[LABEL_MEMORY] == str(39 * GiB // MiB)  # the smallest schedulable device
    assert labels[LABEL_PRODUCT] == "mixed"


def test_labels_for_a_homogeneous_node() -> None:
    assert gpu_labels([gpu(0), gpu(1)]) == {
        LABEL_PRODUCT: "NVIDIA-H100-80GB-HBM3",
        LABEL_COUNT: "2",
        LABEL_MEMORY: "81920",
    }
    assert gpu_labels([]) == {LABEL_COUNT: "0"}


def test_label_values_are_valid() -> None:
    assert label_value("  NVIDIA A100-SXM4-40GB (rev 2)  ") == "NVIDIA-A100-SXM4-40GB-rev-2"
    assert len(label_value("x" * 100)) == 63


def test_units_round_down() -> None:
    assert to_units(158 * GiB + 5, GiB) == 158
    assert to_units(5, 1) == 5


def test_capacity_patch_adds_to_both_fields_and_escapes_the_name() -> None:
    ops = capacity_patch(
        {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}, "vram-enforcer.io/vram", 3
    )
    assert ops == [
        {"op": "add", "path": "/status/capacity/vram-enforcer.io~1vram", "value": "3"},
        {"op": "add", "path": "/status/allocatable/vram-enforcer.io~1vram", "value": "3"},
    ]


def test_capacity_patch_creates_missing_maps() -> None:
    ops = capacity_patch({}, "x.io/vram", 7)
    assert ops == [
        {"op": "add", "path": "/status/capacity", "value": {"x.io/vram": "7"}},
        {"op": "add", "path": "/status/allocatable", "value": {"x.io/vram": "7"}},
    ]
    assert capacity_patch(None, "x.io/vram", 7) == ops


def test_equal_quantities_in_another_form_need_no_patch() -> None:
    status = {"capacity": {"x.io/vram": "158Gi"}, "allocatable": {"x.io/vram": "169651208192"}}
    assert capacity_patch(status, "x.io/vram", 158 * GiB) == []
    assert capacity_patch(status, "x.io/vram", 158 * GiB + 1) != []
    assert capacity_patch({"capacity": {"x.io/vram": "garbage"}, "allocatable": {}}, "x.io/vram", 1)


def test_label_ops() -> None:
    desired = {LABEL_COUNT: "2", LABEL_MEMORY: "81920"}
    assert label_ops(None, desired) == [{"op": "add", "path": "/metadata/labels", "value": desired}]
    assert label_ops(dict(desired), desired) == []
    ops = label_ops({LABEL_COUNT: "1", LABEL_PRODUCT: "old", "team": "ml"}, desired)
    assert {
        "op": "add",
        "path": "/metadata/labels/vram-enforcer.io~1gpu.count",
        "value": "2",
    } in ops
    assert {
        "op": "add",
        "path": "/metadata/labels/vram-enforcer.io~1gpu.memory",
        "value": "81920",
    } in ops
    assert {"op": "remove", "path": "/metadata/labels/vram-enforcer.io~1gpu.product"} in ops
    assert all("team" not in op["path"] for op in ops)


def test_the_allocation_gates_label_goes_when_the_gate_no_longer_says_it() -> None:
    """Issue 45, step 2: an agent restarted with the gate off (or where it cannot run)
    removes the label its last run wrote; others' labels stay."""
    current = {LABEL_ALLOCATION_GATE: "v1", LABEL_COUNT: "2", "team": "ml"}
    assert label_ops(current, {LABEL_COUNT: "2"}) == [
        {"op": "remove", "path": "/metadata/labels/vram-enforcer.io~1allocation-gate"}
    ]
    assert label_ops(current, {LABEL_COUNT: "2", LABEL_ALLOCATION_GATE: "v1"}) == []
