"""The fake library itself, driven through the real pynvml: it must keep NVML's contract."""

from __future__ import annotations

import os
import subprocess
import sys
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
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 3 * GiB
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
            "pid": os.getpid(),
        }
        pynvml.nvmlDeviceSetMemoryLimits_v1(
            gpu, _limits(cgroup2, 0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
        )
        with pytest.raises(pynvml.NVMLError_NotFound):
            _read_limits(gpu, cgroup2)  # cleared
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
