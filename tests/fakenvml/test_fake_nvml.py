"""The fake library itself, driven through the real pynvml: it must keep NVML's contract."""

from __future__ import annotations

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
    fake_nvml.state.enable_mig(0, [{"uuid": "MIG-1", "name": "MIG 1g.10gb", "total_bytes": 10 * GiB,
                                    "gpu_instance_id": 9, "compute_instance_id": 0,
                                    "compute_processes": [{"pid": 7, "used_bytes": GiB}]}])  # fmt: skip
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
    out = subprocess.run([sys.executable, "-c", code], env={**fake_nvml.env(), "FAKE_NVML_STATE": str(bad)},
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
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
