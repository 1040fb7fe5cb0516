"""The NVML wrapper and NvmlSource through the real pynvml, against the fake libnvidia-ml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from enforcer.model import GiB, ProcessKey, Sample, SourceDown
from enforcer.nvml import Nvml, NvmlLost, NvmlQueryError, NvmlUnavailable
from enforcer.nvml_source import NvmlSource
from enforcer.procfs import ProcFs
from enforcer.sources import PidView
from tests.helpers import copy_proc_fixture, set_start_time


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def nvml(fake_nvml: Any) -> Any:
    session = Nvml()
    yield session
    session.shutdown()


def test_devices_and_processes(fake_nvml: Any) -> None:
    st = fake_nvml.state
    st.add_device(name="NVIDIA A100-SXM4-40GB", total_bytes=40 * GiB, used_bytes=3 * GiB)
    st.set_process(0, 100, 1 * GiB)
    st.set_process(0, 101, None)
    st.set_process(1, 100, 2 * GiB)
    # The same process in the graphics list of a device is one context, counted once.
    st.set_process(1, 100, 2 * GiB, kind="graphics")
    st.set_process(1, 102, 512, kind="graphics")
    fake_nvml.write()
    session = Nvml()
    session.init()
    try:
        snap = session.snapshot()
    finally:
        session.shutdown()
    assert [(d.index, d.name) for d in snap.devices][1] == (1, "NVIDIA A100-SXM4-40GB")
    assert snap.devices[1].total_bytes == 40 * GiB
    assert snap.devices[1].used_bytes == 2 * GiB + 512  # the fake's used memory: its processes
    u0, u1 = snap.devices[0].uuid, snap.devices[1].uuid
    got = {(p.pid, p.device_uuid): p.used_bytes for p in snap.processes}
    assert got == {(100, u0): 1 * GiB, (101, u0): None, (100, u1): 2 * GiB, (102, u1): 512}
    assert session.driver_version


def test_many_processes_come_back_intact(fake_nvml: Any, nvml: Nvml) -> None:
    """Every process after the first must survive pynvml's struct layout."""
    for pid in range(1000, 1100):
        fake_nvml.state.set_process(0, pid, pid * 4096)
    fake_nvml.write()
    nvml.init()
    got = {p.pid: p.used_bytes for p in nvml.snapshot().processes}
    assert got == {pid: pid * 4096 for pid in range(1000, 1100)}


def test_mig_partitions_are_devices_with_their_own_processes(fake_nvml: Any, nvml: Nvml) -> None:
    st = fake_nvml.state
    st.enable_mig(
        0,
        [
            {
                "uuid": "MIG-aaaa",
                "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                "total_bytes": 40 * GiB,
                "used_bytes": GiB,
                "gpu_instance_id": 1,
                "compute_instance_id": 0,
                "compute_processes": [{"pid": 300, "used_bytes": GiB}],
            },
            {
                "uuid": "MIG-bbbb",
                "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                "total_bytes": 40 * GiB,
                "used_bytes": 0,
                "gpu_instance_id": 2,
                "compute_instance_id": 0,
            },
        ],
    )
    fake_nvml.write()
    nvml.init()
    snap = nvml.snapshot()
    parent = snap.devices[0]
    migs = [d for d in snap.devices if d.parent_uuid == parent.uuid]
    assert [m.uuid for m in migs] == ["MIG-aaaa", "MIG-bbbb"]
    assert [(p.pid, p.device_uuid, p.used_bytes) for p in snap.processes] == [
        (300, "MIG-aaaa", GiB)
    ]


def test_unavailable_says_why(fake_nvml: Any) -> None:
    fake_nvml.state.data["init_error"] = "NO_PERMISSION"
    fake_nvml.write()
    with pytest.raises(NvmlUnavailable, match="no permission to talk to the NVIDIA driver"):
        Nvml().init()


def test_gpu_lost_reinitialises_with_backoff_and_recovers(fake_nvml: Any) -> None:
    clock = Clock()
    session = Nvml(clock=clock)
    fake_nvml.state.set_process(0, 100, GiB)
    fake_nvml.write()
    session.init()
    try:
        assert len(session.snapshot().processes) == 1
        fake_nvml.state.inject_error(
            "nvmlDeviceGetComputeRunningProcesses_v3", "GPU_IS_LOST", device_index=0
        )
        fake_nvml.write()
        with pytest.raises(NvmlLost, match="GPU is lost"):
            session.snapshot()
        # Within the backoff, NVML is not even asked.
        with pytest.raises(NvmlLost, match="next attempt in"):
            session.snapshot()
        fake_nvml.state.clear_errors()
        fake_nvml.write()
        clock.now += 60
        assert len(session.snapshot().processes) == 1
    finally:
        session.shutdown()


def test_a_failed_reinit_backs_off_further(fake_nvml: Any) -> None:
    clock = Clock()
    session = Nvml(clock=clock)
    session.init()
    fake_nvml.state.data["errors"] = {"*": "GPU_IS_LOST"}
    fake_nvml.state.data["init_error"] = "DRIVER_NOT_LOADED"
    fake_nvml.write()
    with pytest.raises(NvmlLost):
        session.snapshot()
    clock.now += 60
    with pytest.raises(
        NvmlLost, match="re-initialising NVML failed: the NVIDIA kernel driver is not loaded"
    ):
        session.snapshot()
    fake_nvml.state.data["errors"] = {}
    fake_nvml.state.data["init_error"] = None
    fake_nvml.write()
    clock.now += 60
    assert session.snapshot().devices


def test_a_transient_query_error_needs_no_reinit(fake_nvml: Any, nvml: Nvml) -> None:
    nvml.init()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo", "TIMEOUT")
    fake_nvml.write()
    with pytest.raises(NvmlQueryError):
        nvml.snapshot()
    fake_nvml.state.clear_errors()
    fake_nvml.write()
    assert nvml.snapshot().devices


def test_old_drivers_without_v3_process_lists_fall_back_to_v2(fake_nvml: Any, nvml: Nvml) -> None:
    fake_nvml.state.set_process(0, 100, GiB)
    fake_nvml.state.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", "FUNCTION_NOT_FOUND")
    fake_nvml.state.inject_error("nvmlDeviceGetGraphicsRunningProcesses_v3", "FUNCTION_NOT_FOUND")
    fake_nvml.write()
    nvml.init()
    assert [(p.pid, p.used_bytes) for p in nvml.snapshot().processes] == [(100, GiB)]


def test_source_keeps_live_processes_with_their_start_times(fake_nvml: Any, nvml: Nvml) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fake_nvml.state.set_process(0, child.pid, GiB)
        fake_nvml.state.set_process(0, 2**22 + 12345, GiB)  # no such pid
        fake_nvml.write()
        nvml.init()
        sample = NvmlSource(nvml, PidView.host(ProcFs())).sample()
        assert isinstance(sample, Sample)
        start = ProcFs().start_time(child.pid)
        assert [p.key for p in sample.processes] == [ProcessKey(child.pid, start or -1)]
    finally:
        child.kill()
        child.wait()


def test_source_drops_a_process_born_after_nvml_looked(
    fake_nvml: Any, nvml: Nvml, tmp_path: Path
) -> None:
    """NVML saw pid 4242; the /proc entry now under that pid started later: not the same one."""
    proc = copy_proc_fixture("host", tmp_path / "proc")
    set_start_time(proc, 4242, 2**40)  # far in the future
    set_start_time(proc, 4243, 1)  # long ago, however recently this machine booted
    fake_nvml.state.set_process(0, 4242, GiB)
    fake_nvml.state.set_process(0, 4243, GiB)
    fake_nvml.write()
    nvml.init()
    sample = NvmlSource(nvml, PidView.host(ProcFs(proc))).sample()
    assert isinstance(sample, Sample)
    assert [p.key.pid for p in sample.processes] == [4243]


def test_source_down_is_a_value(fake_nvml: Any, nvml: Nvml) -> None:
    nvml.init()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST", device_index=0)
    fake_nvml.write()
    down = NvmlSource(nvml, PidView.host(ProcFs())).sample()
    assert isinstance(down, SourceDown)
    assert "GPU is lost" in down.reason


def test_pid_view_translates_through_a_fixture_namespace() -> None:
    proc = ProcFs(Path(__file__).parents[1] / "fixtures" / "proc" / "host")
    pod = PidView.of_process(proc, 4990)  # the pod's pause process
    assert (pod.ns_inode, pod.level) == (4026532999, 1)
    assert pod.translate(5000) == 7
    assert pod.translate(4990) == 1
    assert pod.translate(4242) is None  # a host process: invisible to the pod
    assert PidView.host(proc).translate(5000) == 5000


def test_an_exited_process_is_dropped_even_while_nvml_still_lists_it(
    fake_nvml: Any, nvml: Nvml
) -> None:
    child = subprocess.Popen(["sleep", "60"])
    fake_nvml.state.set_process(0, child.pid, GiB)
    fake_nvml.write()
    nvml.init()
    source = NvmlSource(nvml, PidView.host(ProcFs()))
    first = source.sample()
    assert isinstance(first, Sample)
    assert [p.key.pid for p in first.processes] == [child.pid]
    child.kill()
    child.wait()
    second = source.sample()  # NVML's list lags behind the exit: the pidfd does not
    assert isinstance(second, Sample)
    assert second.processes == ()
    source.close()
