from enforcer.core.attribution import (
    attribute,
    gpu_shares,
    reported_only,
    tenants_per_gpu,
    unit_activity,
)
from enforcer.core.model import (
    Activity,
    Device,
    GiB,
    GpuShare,
    ProcessKey,
    ProcessUsage,
    Sample,
    UnitUsage,
)

A, B, C = ProcessKey(10, 100), ProcessKey(11, 110), ProcessKey(12, 120)


def sample(*usages: ProcessUsage) -> Sample:
    return Sample(0.0, (), usages)


def test_usage_is_summed_per_process_over_devices_and_kept_per_device() -> None:
    s = sample(
        ProcessUsage(A, "GPU-0", 1 * GiB),
        ProcessUsage(A, "GPU-1", 2 * GiB),
        ProcessUsage(B, "GPU-0", 512),
    )
    (u,) = attribute(s, {A: "main", B: "main"}, {"main": 4 * GiB}, {A: "python a.py"})
    assert u.used_bytes == 3 * GiB + 512
    assert [p.key for p in u.processes] == [A, B]  # largest first
    assert u.processes[0].by_device == (("GPU-0", 1 * GiB), ("GPU-1", 2 * GiB))
    assert u.processes[0].cmdline == "python a.py"


def test_unknown_usage_is_kept_as_unknown() -> None:
    s = sample(ProcessUsage(A, "GPU-0", None), ProcessUsage(A, "GPU-1", 5))
    (u,) = attribute(s, {A: "main"}, {"main": 10})
    (p,) = u.processes
    assert p.used_bytes == 5
    assert p.unknown_devices == ("GPU-0",)
    assert u.has_unknown


def test_unattributed_processes_and_units_without_limits_are_left_out() -> None:
    s = sample(
        ProcessUsage(A, "GPU-0", 1), ProcessUsage(B, "GPU-0", 2), ProcessUsage(C, "GPU-0", 4)
    )
    units = attribute(s, {A: "a", B: "no-limit"}, {"a": 10, "idle": 5})
    assert [(u.name, u.used_bytes) for u in units] == [("a", 1), ("idle", 0)]


def test_a_reported_only_unit_counts_every_member_and_is_never_enforceable() -> None:
    s = sample(
        ProcessUsage(A, "GPU-0", 3), ProcessUsage(B, "GPU-0", 4), ProcessUsage(C, "GPU-0", 8)
    )
    u = reported_only("pod", s, [A, B], 5, {B: "python b.py"})
    assert (u.name, u.used_bytes, u.limit_bytes) == ("pod", 7, 5)
    assert [p.key for p in u.processes] == [B, A]
    assert u.processes[0].cmdline == "python b.py"
    assert not u.enforceable


def test_gpu_shares_sum_memory_and_utilisation_per_unit_and_gpu() -> None:
    s = sample(
        ProcessUsage(A, "GPU-0", 3 * GiB, (), Activity(60, 20)),
        ProcessUsage(B, "GPU-0", 1 * GiB, (), Activity(25, 5)),
        ProcessUsage(B, "GPU-1", 2 * GiB, (), Activity(0, 0)),
        ProcessUsage(C, "MIG-2", None, (), None),
    )
    units = attribute(
        s, {A: "trainer", B: "trainer", C: "tools"}, {"trainer": 8 * GiB, "tools": GiB}
    )
    assert sorted(gpu_shares(units, s), key=lambda g: (g.unit, g.gpu)) == [
        GpuShare("tools", "MIG-2", 0, None),  # NVML cannot tell there: unknown, not idle
        GpuShare("trainer", "GPU-0", 4 * GiB, Activity(85, 25)),
        GpuShare("trainer", "GPU-1", 2 * GiB, Activity(0, 0)),
    ]


def test_a_units_activity_is_summed_over_its_processes_and_gpus_or_unknown() -> None:
    s = sample(
        ProcessUsage(A, "GPU-0", 3 * GiB, (), Activity(60, 20)),
        ProcessUsage(B, "GPU-0", 1 * GiB, (), Activity(25, 5)),
        ProcessUsage(B, "GPU-1", 2 * GiB, (), Activity(10, 1)),
        ProcessUsage(C, "GPU-0", GiB, (), None),  # listed since NVML's last read
    )
    limits = {"trainer": 8 * GiB, "tools": GiB, "idle": GiB}
    units = {u.name: u for u in attribute(s, {A: "trainer", B: "trainer", C: "tools"}, limits)}
    assert unit_activity(units["trainer"], s) == Activity(95, 26)
    assert unit_activity(units["tools"], s) is None  # cannot tell: not idle
    assert unit_activity(units["idle"], s) is None  # on no GPU: nothing to tell


def test_a_gpu_bound_unit_has_a_share_on_its_gpu_even_when_idle() -> None:
    unit = UnitUsage("a+b@GPU-0", 4 * GiB, (), device_uuid="GPU-0")
    assert gpu_shares([unit], sample()) == (GpuShare("a+b@GPU-0", "GPU-0", 0, Activity(0, 0)),)


def test_tenants_are_counted_per_gpu_once_each() -> None:
    devices = tuple(Device(i, f"GPU-{i}", "H100", 80 * GiB, 0) for i in range(3))
    s = Sample(
        0.0,
        devices,
        (
            ProcessUsage(A, "GPU-0", GiB),
            ProcessUsage(B, "GPU-0", GiB),  # one container, twice
            ProcessUsage(C, "GPU-0", GiB),
            ProcessUsage(C, "GPU-1", GiB),
            ProcessUsage(ProcessKey(99, 1), "GPU-1", GiB),  # exited: its tenant is not known
        ),
    )
    tenant_of = {A: "container:x", B: "container:x", C: "container:y"}
    assert tenants_per_gpu(s, tenant_of) == {"GPU-0": 2, "GPU-1": 1, "GPU-2": 0}
