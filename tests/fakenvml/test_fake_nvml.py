"""The fake library itself, driven through the real pynvml: it must keep NVML's contract."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from tests.fakenvml.plugin import FakeNvml

GiB = 1024**3


def test_calls_before_init_are_uninitialized(fake_nvml: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_init_is_reference_counted(fake_nvml: FakeNvml) -> None:
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 1
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_state_is_reread_while_running(fake_nvml: FakeNvml) -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle) == []
    fake_nvml.state.set_process(0, 4242, 3 * GiB)
    fake_nvml.state.set_process(0, 4243, None)
    fake_nvml.write()
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 3 * GiB), (4243, None)]
    assert procs[0].gpuInstanceId == 0xFFFFFFFF
    assert pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used == 3 * GiB
    pynvml.nvmlShutdown()


def test_injected_errors_map_to_pynvml_classes(fake_nvml: FakeNvml) -> None:
    fake_nvml.state.inject_error("nvmlDeviceGetUUID", "GPU_IS_LOST", device_index=0)
    fake_nvml.state.inject_error("nvmlSystemGetDriverVersion", "NO_PERMISSION")
    fake_nvml.write()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(handle)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlSystemGetDriverVersion()
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    pynvml.nvmlShutdown()


def test_a_vanished_gpu_handle_reports_gpu_lost(fake_nvml: FakeNvml) -> None:
    fake_nvml.state.add_device()
    fake_nvml.write()
    pynvml.nvmlInit()
    second = pynvml.nvmlDeviceGetHandleByIndex(1)
    fake_nvml.state.devices.pop()
    fake_nvml.write()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(second)
    pynvml.nvmlShutdown()


def test_mig_handles(fake_nvml: FakeNvml) -> None:
    fake_nvml.state.enable_mig(
        0,
        [
            {
                "uuid": "MIG-1",
                "name": "MIG 1g.10gb",
                "total_bytes": 10 * GiB,
                "gpu_instance_id": 9,
                "compute_instance_id": 0,
                "compute_processes": [{"pid": 7, "used_bytes": GiB}],
            }
        ],
    )
    fake_nvml.write()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
    assert pynvml.nvmlDeviceGetUUID(mig) == "MIG-1"
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == 9
    (proc,) = pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
    assert (proc.pid, proc.usedGpuMemory, proc.gpuInstanceId) == (7, GiB, 9)
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert pynvml.nvmlDeviceGetUUID(parent) == pynvml.nvmlDeviceGetUUID(gpu)
    pynvml.nvmlShutdown()


def test_no_mig_support_is_not_supported(fake_nvml: FakeNvml) -> None:
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))
    pynvml.nvmlShutdown()


def test_unparseable_state_fails_init_and_says_why(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": [}')
    code = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print(type(e).__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**fake_nvml.env(), "FAKE_NVML_STATE": str(bad)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.strip() == "NVMLError_Unknown"
    assert "fake-nvml: cannot use" in out.stderr and "at byte" in out.stderr


def test_missing_state_is_driver_not_loaded(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    code = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n    print(type(e).__name__)"
    env = {**fake_nvml.env(), "FAKE_NVML_STATE": str(tmp_path / "missing.json")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.strip() == "NVMLError_DriverNotLoaded"


def test_large_values_survive_exactly(fake_nvml: FakeNvml) -> None:
    fake_nvml.state.set_process(0, 1, 2**63 + 12345)
    fake_nvml.write()
    pynvml.nvmlInit()
    (p,) = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert p.usedGpuMemory == 2**63 + 12345
    pynvml.nvmlShutdown()


def _limits(path: Path, soft: int = 0, hard: int = 0) -> pynvml.c_nvmlSetMemoryLimits_v1_t:
    return pynvml.c_nvmlSetMemoryLimits_v1_t(str(path).encode(), soft, hard)


def _read_limits(handle: object, path: Path) -> tuple[int, int, int]:
    got = pynvml.c_nvmlGetMemoryLimits_v1_t(str(path).encode(), 0, 0, 0)
    pynvml.nvmlDeviceGetMemoryLimits_v1(handle, got)
    return got.softLimit, got.hardLimit, got.currentUsed


def test_memory_limits_are_not_supported_before_r615(fake_nvml: FakeNvml, cgroup2: Path) -> None:
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2, 0, GiB))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        _read_limits(gpu, cgroup2)
    pynvml.nvmlShutdown()
    assert fake_nvml.limit_records() == []


def test_memory_limits_are_recorded_read_back_and_cleared(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    fake_nvml.state.support_memory_limits()
    child = subprocess.Popen(["sleep", "60"])
    (cgroup2 / "cgroup.procs").write_text(str(child.pid))
    fake_nvml.state.set_process(0, child.pid, 3 * GiB)
    fake_nvml.state.set_process(0, os.getpid(), 5 * GiB)  # outside the cgroup
    fake_nvml.write()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        with pytest.raises(pynvml.NVMLError_NotFound):
            _read_limits(gpu, cgroup2)
        pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2, 0, 4 * GiB))
        assert _read_limits(gpu, cgroup2) == (0, 4 * GiB, 3 * GiB)
        (record,) = fake_nvml.limit_records()
        assert record == {
            "device": fake_nvml.state.devices[0]["uuid"],
            "cgroup": str(cgroup2),
            "inode": cgroup2.stat().st_ino,
            "soft": 0,
            "hard": 4 * GiB,
            "asked_hard": 4 * GiB,
            "ancestors": [],  # the root cgroup has no dmem.min
            "pid": os.getpid(),
        }
        pynvml.nvmlDeviceSetMemoryLimits_v1(
            gpu, _limits(cgroup2, 0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
        )
        # Cleared: "No limit is set when softLimit is 0 and hardLimit is MAX" (nvml.h)
        assert _read_limits(gpu, cgroup2) == (0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX, 3 * GiB)
    finally:
        pynvml.nvmlShutdown()
        child.kill()
        child.wait()


def test_a_driver_that_charges_nothing_holds_the_limit_and_reads_0(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    """The stand-in for a driver that binds only MPS clients: the limit is there, and the
    cgroup's own processes are not charged to it."""
    fake_nvml.state.support_memory_limits(charges=False)
    child = subprocess.Popen(["sleep", "60"])
    (cgroup2 / "cgroup.procs").write_text(str(child.pid))
    fake_nvml.state.set_process(0, child.pid, 3 * GiB)
    fake_nvml.write()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2, 0, 4 * GiB))
        assert _read_limits(gpu, cgroup2) == (0, 4 * GiB, 0)
    finally:
        pynvml.nvmlShutdown()
        child.kill()
        child.wait()


def test_memory_limits_are_validated_like_the_driver(
    fake_nvml: FakeNvml, cgroup2: Path, tmp_path: Path
) -> None:
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.enable_mig(0, [{"uuid": "MIG-1", "total_bytes": 10 * GiB}])
    fake_nvml.write()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    try:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # above the GPU's memory
            pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2, 0, 81 * GiB))
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # soft above hard
            pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2, 2 * GiB, GiB))
        with pytest.raises(pynvml.NVMLError_OperatingSystem):  # not a cgroup v2 directory
            pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(tmp_path, 0, GiB))
        with pytest.raises(pynvml.NVMLError_OperatingSystem):  # gone
            pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(cgroup2 / "gone", 0, GiB))
        with pytest.raises(pynvml.NVMLError_NotSupported):  # "MIG handles are not supported"
            pynvml.nvmlDeviceSetMemoryLimits_v1(mig, _limits(cgroup2, 0, GiB))
    finally:
        pynvml.nvmlShutdown()
    assert fake_nvml.limit_records() == []


def test_a_cgroup_made_again_at_the_same_path_starts_without_limits(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    inner = cgroup2 / "unit"
    inner.mkdir()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        pynvml.nvmlDeviceSetMemoryLimits_v1(gpu, _limits(inner, 0, GiB))
        assert _read_limits(gpu, inner)[1] == GiB
        inner.rmdir()
        inner.mkdir()
        with pytest.raises(pynvml.NVMLError_NotFound):
            _read_limits(gpu, inner)
    finally:
        pynvml.nvmlShutdown()


def test_process_utilization_follows_nvml_h(fake_nvml: FakeNvml) -> None:
    """Both per-process utilisation calls: the size handshake (pynvml's own), samples only
    for busy processes and newer than the caller's last timestamp, NOT_FOUND otherwise."""
    fake_nvml.state.set_process(0, 4242, 3 * GiB)
    fake_nvml.state.set_process(0, 4243, GiB)
    fake_nvml.state.set_utilization(0, 4242, sm=87, memory=40)
    fake_nvml.state.devices[0]["utilization_timestamp_us"] = 1_700_000_000_000_000
    fake_nvml.write()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for call in (
        pynvml.nvmlDeviceGetProcessesUtilizationInfo,
        pynvml.nvmlDeviceGetProcessUtilization,
    ):
        (sample,) = call(handle, 0)
        assert (sample.pid, sample.smUtil, sample.memUtil) == (4242, 87, 40)
        assert sample.timeStamp == 1_700_000_000_000_000
        with pytest.raises(pynvml.NVMLError_NotFound):
            call(handle, 1_700_000_000_000_000)
    fake_nvml.state.set_utilization(0, 4242, sm=0, memory=0)
    fake_nvml.write()
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0)
    pynvml.nvmlShutdown()


def test_process_utilization_is_not_supported_under_mig(fake_nvml: FakeNvml) -> None:
    fake_nvml.state.set_process(0, 4242, GiB)
    fake_nvml.state.set_utilization(0, 4242, sm=50, memory=5)
    fake_nvml.state.enable_mig(0, [])
    fake_nvml.write()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0)
    pynvml.nvmlShutdown()


@contextlib.contextmanager
def _sleeping_in(*cgroups: Path) -> Iterator[list[int]]:
    """The pids of one process sleeping in each cgroup (moved there before the test goes
    on), killed afterwards."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        for cgroup in cgroups:
            children.append(subprocess.Popen(["sleep", "60"]))
            (cgroup / "cgroup.procs").write_text(str(children[-1].pid))
        yield [child.pid for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()


@contextlib.contextmanager
def _session() -> Iterator[object]:
    """An NVML session on the fake's first GPU (its handle), shut down afterwards."""
    pynvml.nvmlInit()
    try:
        yield pynvml.nvmlDeviceGetHandleByIndex(0)
    finally:
        pynvml.nvmlShutdown()


def _set(handle: object, path: Path, soft: int, hard: int) -> None:
    pynvml.nvmlDeviceSetMemoryLimits_v1(handle, _limits(path, soft, hard))


def test_a_cgroup_without_dmem_files_is_not_found_to_set_and_not_supported_to_read(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    """NVIDIA's MPS v3 page: Set on a cgroup with no dmem files says "not found"; the Dynamo
    guide: Get there says "Not Supported". The root cgroup has none (the kernel gives them to
    non-root cgroups only); below a subtree_control without dmem, none has."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.without_dmem_below(cgroup2)
    fake_nvml.write()
    leaf = cgroup2 / "leaf"
    leaf.mkdir()
    with _session() as gpu:
        for path in (leaf, cgroup2.parent):  # below it, and the root cgroup
            with pytest.raises(pynvml.NVMLError_NotFound):
                _set(gpu, path, 0, GiB)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                _read_limits(gpu, path)
        _set(gpu, cgroup2, 0, GiB)  # its own files are its parent's to give: it has them
        assert _read_limits(gpu, cgroup2)[:2] == (0, GiB)
    assert [r["cgroup"] for r in fake_nvml.limit_records()] == [str(cgroup2)]


def test_soft_limits_add_up_in_every_ancestor_and_stay_when_a_leaf_goes_unzeroed(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    """The driver keeps each ancestor's dmem.min at the sum of its leaves' soft limits; a
    leaf removed without zeroing it first leaves its share there (MPS v3, "Known
    limitations"): the residue reads as the ancestors' soft limit."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    pod = cgroup2 / "pod"
    a, b = pod / "a", pod / "b"
    for path in (pod, a, b):
        path.mkdir()
    top = pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX
    with _session() as gpu:
        with pytest.raises(pynvml.NVMLError_NotFound):
            _read_limits(gpu, pod)
        _set(gpu, a, GiB, 4 * GiB)
        _set(gpu, b, 2 * GiB, 4 * GiB)
        assert _read_limits(gpu, pod) == (3 * GiB, top, 0)
        assert _read_limits(gpu, cgroup2) == (3 * GiB, top, 0)
        _set(gpu, b, 0, top)  # zeroed first, as NVIDIA says to
        b.rmdir()
        a.rmdir()  # not zeroed: what it reserved stays
        assert _read_limits(gpu, pod) == (GiB, top, 0)
        assert _read_limits(gpu, cgroup2) == (GiB, top, 0)
    (record,) = [r for r in fake_nvml.limit_records() if r["cgroup"] == str(a)]
    assert record["ancestors"] == [pod.stat().st_ino, cgroup2.stat().st_ino]


@pytest.mark.parametrize(("backend", "charged"), [("dmem", 4 * GiB), ("misc", GiB)])
def test_on_the_misc_backend_a_parent_is_not_charged_for_a_limited_child(
    fake_nvml: FakeNvml, cgroup2: Path, backend: str, charged: int
) -> None:
    """dmem charges a cgroup for its whole subtree; on the misc backend "limits do not nest":
    a process below a cgroup with a limit of its own counts there, not in the parent."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.limits_backend(backend)
    leaf = cgroup2 / "leaf"
    leaf.mkdir()
    with _sleeping_in(cgroup2, leaf) as (outside, inside), _session() as gpu:
        fake_nvml.state.set_process(0, outside, GiB)
        fake_nvml.state.set_process(0, inside, 3 * GiB)
        fake_nvml.write()
        _set(gpu, cgroup2, 0, 8 * GiB)
        _set(gpu, leaf, 0, 4 * GiB)
        assert _read_limits(gpu, cgroup2)[2] == charged
        assert _read_limits(gpu, leaf)[2] == 3 * GiB


def test_what_is_charged_is_what_proc_says_runs_there_less_managed_memory(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    """`currentUsed` is not the listing by construction: a listed pid that is not in the
    cgroup by /proc/<pid>/cgroup (gone, or moved out) is not charged, nor is
    cudaMallocManaged memory, which the cgroup limit does not count (MPS v3 page)."""
    fake_nvml.state.support_memory_limits()
    with _sleeping_in(cgroup2, cgroup2) as (child, moved), _session() as gpu:
        fake_nvml.state.set_process(0, child, 3 * GiB, managed_bytes=GiB)
        fake_nvml.state.set_process(0, moved, GiB)
        fake_nvml.state.set_process(0, 2**22 + 12345, GiB)  # above pid_max: no such process
        fake_nvml.write()
        _set(gpu, cgroup2, 0, 8 * GiB)
        assert _read_limits(gpu, cgroup2)[2] == 3 * GiB
        (cgroup2.parent / "cgroup.procs").write_text(str(moved))
        assert _read_limits(gpu, cgroup2)[2] == 2 * GiB


def test_a_hard_limit_below_usage_is_silently_left_as_it_was(
    fake_nvml: FakeNvml, cgroup2: Path
) -> None:
    """dmem leaves dmem.max unchanged when asked for less than the cgroup holds, and says
    nothing (the patch "cgroup/dmem: Return error when setting max below current usage"):
    Set succeeds, Get shows the old value."""
    fake_nvml.state.support_memory_limits()
    with _sleeping_in(cgroup2) as (child,), _session() as gpu:
        fake_nvml.state.set_process(0, child, 3 * GiB)
        fake_nvml.write()
        _set(gpu, cgroup2, 0, 2 * GiB)
        assert _read_limits(gpu, cgroup2)[:2] == (0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
        _set(gpu, cgroup2, 0, 6 * GiB)
        _set(gpu, cgroup2, GiB, 2 * GiB)  # the soft limit is written, the hard one kept
        assert _read_limits(gpu, cgroup2)[:2] == (GiB, 6 * GiB)
    assert [(r["hard"], r["asked_hard"]) for r in fake_nvml.limit_records()] == [
        (pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX, 2 * GiB),
        (6 * GiB, 6 * GiB),
        (6 * GiB, 2 * GiB),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")
@pytest.mark.parametrize(("backend", "refused"), [("dmem", True), ("misc", False)])
def test_a_read_only_mount_refuses_a_set_on_dmem(
    fake_nvml: FakeNvml, cgroup2: Path, tmp_path: Path, backend: str, refused: bool
) -> None:
    """The driver writes the cgroup's dmem files, which a read-only mount refuses (EROFS):
    NVML's OPERATING_SYSTEM, its one code for the OS refusing (README.md says why). Reading
    through it works; the misc backend keeps its limits inside the driver."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.limits_backend(backend)
    fake_nvml.write()
    view = tmp_path / "ro"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(cgroup2), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        with _session() as gpu:
            _set(gpu, cgroup2, 0, 2 * GiB)
            if refused:
                with pytest.raises(pynvml.NVMLError_OperatingSystem):
                    _set(gpu, view, 0, GiB)
            else:
                _set(gpu, view, 0, GiB)
            assert _read_limits(gpu, view)[1] == (2 * GiB if refused else GiB)
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_memory_info_v2_keeps_the_driver_reserve_apart(fake_nvml: FakeNvml) -> None:
    """v1's used is "the sum of Reserved and Allocated"; v2 reports `reserved` on its own."""
    fake_nvml.state.set_process(0, 4242, 3 * GiB)
    fake_nvml.state.set_reserved(0, GiB // 2)
    fake_nvml.write()
    with _session() as gpu:
        v1 = pynvml.nvmlDeviceGetMemoryInfo(gpu)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2)
    assert (v1.total, v1.used, v1.free) == (80 * GiB, 3.5 * GiB, 76.5 * GiB)
    assert (v2.total, v2.reserved, v2.used, v2.free) == (80 * GiB, GiB // 2, 3 * GiB, 76.5 * GiB)
