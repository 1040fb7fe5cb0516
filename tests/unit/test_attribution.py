from enforcer.core.attribution import attribute, reported_only
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample

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
