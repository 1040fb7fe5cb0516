"""The NVML wrapper and NvmlSource through the real pynvml, against the fake libnvidia-ml."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from enforcer.core.model import (
    GiB,
    HeldLimit,
    LimitOutcome,
    LimitResult,
    MiB,
    ProcessKey,
    Sample,
    SourceDown,
)
from enforcer.edge.nvml import MEMORY_LIMIT_MAX, Nvml, NvmlLost, NvmlQueryError, NvmlUnavailable
from enforcer.edge.nvml_source import NvmlSource
from enforcer.edge.pid_view import PidView, boot_ticks
from enforcer.edge.procfs import ProcFs
from tests.helpers import copy_proc_fixture, older_than_a_tick, set_start_time, wait_for
from tests.hung_fuse import hung_fuse

T = TypeVar("T")


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


def test_one_lost_gpu_leaves_the_others_read(fake_nvml: Any, nvml: Nvml) -> None:
    """A GPU off the bus fails its own queries; the pass goes on with the others, and says
    which one failed. Only every GPU failing fails the pass."""
    st = fake_nvml.state
    st.add_device()
    st.set_process(0, 100, GiB)
    st.set_process(1, 101, 2 * GiB)
    fake_nvml.write()
    nvml.init()
    assert len(nvml.snapshot().processes) == 2
    lost = st.devices[1]["uuid"]
    st.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", "GPU_IS_LOST", device_index=1)
    fake_nvml.write()
    snap = nvml.snapshot()
    assert [(p.pid, p.used_bytes) for p in snap.processes] == [(100, GiB)]
    assert [uuid for uuid, _ in snap.failed] == [lost] and "GPU is lost" in snap.failed[0][1]
    device = snap.devices[1]
    assert (device.uuid, device.total_bytes, device.used_bytes) == (lost, 80 * GiB, None)
    st.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    fake_nvml.write()
    with pytest.raises(NvmlLost, match="GPU is lost"):
        nvml.snapshot()


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
    fake_nvml.state.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", "TIMEOUT")
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
        fake_nvml.state.set_process(0, older_than_a_tick(child.pid), GiB)
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
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    fake_nvml.write()
    down = NvmlSource(nvml, PidView.host(ProcFs())).sample()
    assert isinstance(down, SourceDown)
    assert "GPU is lost" in down.reason


def test_pid_view_translates_through_a_fixture_namespace() -> None:
    proc = ProcFs(Path(__file__).parents[1] / "fixtures" / "proc" / "host")
    pod = PidView.of_process(proc, 4990)  # the pod's pause process
    assert (pod.ns_inode, pod.level) == (4026532999, 1)

    def seen_by(view: PidView, host_pid: int) -> int | None:
        chain = proc.ns_chain(host_pid)
        assert chain is not None
        return view.sees(chain)

    assert seen_by(pod, 5000) == 7
    assert seen_by(pod, 4990) == 1
    assert seen_by(pod, 4242) is None  # a host process: invisible to the pod
    assert seen_by(PidView.host(proc), 5000) == 5000


def test_an_exited_process_is_dropped_even_while_nvml_still_lists_it(
    fake_nvml: Any, nvml: Nvml
) -> None:
    child = subprocess.Popen(["sleep", "60"])
    fake_nvml.state.set_process(0, older_than_a_tick(child.pid), GiB)
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


def test_a_process_born_in_the_tick_nvml_first_listed_its_pid_is_not_proven(
    fake_nvml: Any, nvml: Nvml, tmp_path: Path
) -> None:
    """The first sighting is remembered: a start at that tick or later is not the listed
    process, however many passes later it is read."""
    proc = copy_proc_fixture("host", tmp_path / "proc")
    set_start_time(proc, 4242, 1)
    fake_nvml.state.set_process(0, 4242, GiB)
    fake_nvml.write()
    nvml.init()

    def first_pass() -> tuple[NvmlSource, int] | None:
        """A source whose first pass ran within one clock tick, so that we know that tick."""
        source = NvmlSource(nvml, PidView.host(ProcFs(proc)))
        before = boot_ticks()
        sample = source.sample()
        assert isinstance(sample, Sample) and [p.key.pid for p in sample.processes] == [4242]
        return (source, before) if boot_ticks() == before else None

    source, first_seen = wait_for(first_pass, what="a first pass within one tick")

    def charged() -> list[int]:
        sample = source.sample()
        assert isinstance(sample, Sample)
        return [p.key.pid for p in sample.processes]

    set_start_time(proc, 4242, first_seen)  # the pid now names a process born in that tick
    assert charged() == []
    set_start_time(proc, 4242, first_seen - 1)  # born a tick earlier: there when NVML looked
    assert charged() == [4242]
    set_start_time(proc, 4242, first_seen + 5)
    assert charged() == []


STALE_LISTING = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from enforcer.core.model import GiB
    from enforcer.edge.nvml import Nvml
    from enforcer.edge.nvml_source import NvmlSource
    from enforcer.edge.procfs import ProcFs
    from enforcer.edge.pid_view import PidView, boot_ticks
    from tests.fakenvml import FakeGpuState
    from tests.helpers import older_than_a_tick

    state = FakeGpuState(json.loads(open(os.environ["FAKE_NVML_STATE"]).read()))
    nvml = Nvml()
    nvml.init()
    source = NvmlSource(nvml, PidView.host(ProcFs()))
    pids = lambda: sorted({p.key.pid for p in source.sample().processes})

    old = subprocess.Popen(["sleep", "60"])
    state.set_process(0, older_than_a_tick(old.pid), 3 * GiB)
    state.write(__import__("pathlib").Path(os.environ["FAKE_NVML_STATE"]))
    print(pids() == [old.pid], end=" ")
    old.kill(); old.wait()  # NVML goes on listing its pid, as a lagging driver does
    time.sleep(0.02)  # so that the newcomer starts in a later clock tick
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(old.pid - 1))
    new = subprocess.Popen(["sleep", "60"])
    assert new.pid == old.pid, (new.pid, old.pid)
    older_than_a_tick(new.pid)
    print(pids(), pids())  # the newcomer inherits nothing, on this pass or the next
    new.kill()
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_a_newcomer_on_a_stale_listed_pid_inherits_nothing(fake_nvml: Any) -> None:
    """Real pid reuse in a fresh PID namespace (ns_last_pid), while NVML still lists the pid."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            STALE_LISTING,
            str(root),
        ],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["True", "[]", "[]"], out.stderr


def _holding(device: Path) -> subprocess.Popen[str]:
    """A process that holds `device` open, once it says so."""
    code = (
        f"import time; f = open({str(device)!r}, 'rb'); print('ready', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
    return holder


def _usage(source: NvmlSource) -> dict[int, int | None]:
    sample = source.sample()
    assert isinstance(sample, Sample)
    return {p.key.pid: p.used_bytes for p in sample.processes}


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_listing_of_unknown_age_is_charged_once_its_process_holds_a_gpu_device(
    fake_nvml: Any, nvml: Nvml, tmp_path: Path
) -> None:
    """NVML's first pass has no known age: a pid may have been reused before we looked. Its
    process is charged once it is seen holding a GPU device, judged by the device number (a
    node made under another name is the same device); until then its usage is unknown, not
    free, and it is looked at again on every pass. The looks run off the sampler's thread:
    a pass takes the answers that came back since the pass before."""
    alias = tmp_path / "not-nvidia"  # the device of /dev/null, major 1, under another name
    os.mknod(alias, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    holds = _holding(alias)
    hides = subprocess.Popen(  # holds no device now (its descriptors parked, say)
        [
            sys.executable,
            "-c",
            f"import sys, time; sys.stdin.readline(); f = open({str(alias)!r}, 'rb'); print('ready', flush=True); time.sleep(60)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    later = None
    try:
        for pid in (holds.pid, hides.pid):
            fake_nvml.state.set_process(0, older_than_a_tick(pid), GiB)
        fake_nvml.write()
        nvml.init()
        source = NvmlSource(nvml, PidView.host(ProcFs()), frozenset({1}))
        assert _usage(source) == {holds.pid: None, hides.pid: None}  # looked at meanwhile
        expected = {holds.pid: GiB, hides.pid: None}
        wait_for(lambda: _usage(source) == expected, what="the holder's proof")
        assert _usage(source) == expected  # and the other still looked at
        assert hides.stdin is not None and hides.stdout is not None
        hides.stdin.write("go\n")
        hides.stdin.flush()
        assert hides.stdout.readline() == "ready\n"
        expected = {holds.pid: GiB, hides.pid: GiB}
        wait_for(lambda: _usage(source) == expected, what="the other's proof")
        # A pid first listed after the first pass has a known age: the start time proves it.
        later = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        fake_nvml.state.set_process(0, older_than_a_tick(later.pid), GiB)
        fake_nvml.write()
        assert _usage(source)[later.pid] == GiB
        source.close()
    finally:
        for child in (holds, hides, later):
            if child is not None:
                child.kill()
                child.wait()


HOLDING = textwrap.dedent(
    """
    import os, socket, sys, time
    held = [open(path, "rb") for path in sys.argv[1:]]  # in this order: fds 3, 4, ...
    held += [socket.socket(), *os.pipe(), os.eventfd(0)]  # a socket, a pipe, an anon inode
    print("ready", flush=True)
    time.sleep(60)
    """
)


def _holding_in_order(*paths: Path) -> subprocess.Popen[str]:
    """A process that holds `paths` open (the first at the lowest descriptor), a socket, a
    pipe and an eventfd, once it says so."""
    holder = subprocess.Popen(  # not the test's stdin: /dev/null is the device of major 1
        [sys.executable, "-c", HOLDING, *map(str, paths)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
    return holder


def _within(seconds: float, call: Callable[[], T]) -> T:
    """`call()`'s result, made on a thread of its own; fails if it has not returned within
    `seconds` (a call stuck in the kernel is left behind until the mount goes)."""
    result: list[T] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"still waiting after {seconds}s: stuck in the kernel?"
    return result[0]


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)
def test_a_file_on_a_hung_mount_costs_the_sampler_nothing(
    fake_nvml: Any, nvml: Nvml, tmp_path: Path
) -> None:
    """A listing of unknown age whose process holds a file on a FUSE mount that no longer
    answers (`stat` of it waits in the kernel for ever), before the GPU device: every pass
    returns at once, and the process is proven by its device, its file on the hung mount
    never followed. One that holds nothing but such a file is never proven: its usage
    stays unknown, and every pass still returns at once."""
    alias = tmp_path / "not-nvidia"  # the device of /dev/null, major 1, under another name
    os.mknod(alias, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    holders: list[subprocess.Popen[str]] = []
    try:
        with hung_fuse(tmp_path / "mnt") as fuse:
            holds = _holding_in_order(fuse.file, alias)
            only = _holding_in_order(fuse.file)
            holders += [holds, only]
            fuse.hang()
            for pid in (holds.pid, only.pid):
                fake_nvml.state.set_process(0, older_than_a_tick(pid), GiB)
            fake_nvml.write()
            nvml.init()
            source = NvmlSource(nvml, PidView.host(ProcFs()), frozenset({1}))
            expected = {holds.pid: GiB, only.pid: None}
            wait_for(
                lambda: _within(5, lambda: _usage(source)) == expected,
                what="the holder's proof by its device",
            )
            for _ in range(5):
                assert _within(5, lambda: _usage(source)) == expected
            # The decision alone, on the real /proc: the device is found, the hung file and
            # the socket, pipe and eventfd are not followed, so none of it waits.
            assert _within(5, lambda: ProcFs().holds_device(holds.pid, frozenset({1}))) is True
            assert _within(5, lambda: ProcFs().holds_device(only.pid, frozenset({1}))) is False
            source.close()
            for child in holders:
                child.kill()  # its exit flushes its file there: it waits for the mount to go
    finally:
        for child in holders:
            child.kill()
            child.wait()


def test_without_gpu_devices_every_listing_is_charged(fake_nvml: Any, nvml: Nvml) -> None:
    bystander = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        fake_nvml.state.set_process(0, older_than_a_tick(bystander.pid), GiB)
        fake_nvml.write()
        nvml.init()
        assert _usage(NvmlSource(nvml, PidView.host(ProcFs()), None)) == {bystander.pid: GiB}
    finally:
        bystander.kill()
        bystander.wait()


LEADER_EXITS = textwrap.dedent(
    """
    import ctypes, sys, threading
    def worker():
        sys.stdin.readline()  # runs on, holding the process's memory, until told to stop
    threading.Thread(target=worker).start()
    print("ready", flush=True)
    ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: only the main thread ends
    """
)


def test_a_process_whose_main_thread_exited_is_charged_while_another_thread_runs(
    fake_nvml: Any, nvml: Nvml
) -> None:
    """Its leader reads `Z` in /proc, but the process lives and holds its GPU memory."""
    child = subprocess.Popen(
        [sys.executable, "-c", LEADER_EXITS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        wait_for(
            lambda: (st := ProcFs().stat(child.pid)) is not None and st.state == "Z",
            what="the leader to exit",
        )
        fake_nvml.state.set_process(0, older_than_a_tick(child.pid), GiB)
        fake_nvml.write()
        nvml.init()
        source = NvmlSource(nvml, PidView.host(ProcFs()))
        assert _usage(source) == {child.pid: GiB}
        assert _usage(source) == {child.pid: GiB}  # and on later passes
        child.stdin.write("stop\n")
        child.stdin.flush()
        child.wait(timeout=10)
        assert _usage(source) == {}  # gone for good once its last thread has ended
        source.close()
    finally:
        child.kill()
        child.wait()


def test_a_process_whose_main_thread_exited_is_judged_by_a_thread_that_runs(
    tmp_path: Path,
) -> None:
    """The device proof reads a process's mounts from a live thread: its leader's own
    mountinfo reads EINVAL once it has exited, and the proof said "cannot tell" (None),
    which the sampler takes as proven, for a process holding no device at all (found by
    review of issue 42's change)."""
    alias = tmp_path / "held"
    os.mknod(alias, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    holding = f"f = open({str(alias)!r}, 'rb')\n"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", opens + LEADER_EXITS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for opens in ("", holding)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            wait_for(
                lambda c=child: (st := ProcFs().stat(c.pid)) is not None and st.state == "Z",
                what="the leader to exit",
            )
        bare, holds = children
        assert ProcFs().holds_device(bare.pid, frozenset({1})) is False
        assert ProcFs().holds_device(holds.pid, frozenset({1})) is True
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_memory_limits_set_read_and_clear(fake_nvml: Any, nvml: Nvml, cgroup2: Path) -> None:
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    nvml.init()
    gpu = fake_nvml.state.devices[0]["uuid"]
    assert nvml.memory_limit(gpu, str(cgroup2)) is None
    assert nvml.set_memory_limit(gpu, str(cgroup2), 4 * GiB, GiB) == LimitOutcome(LimitResult.SET)
    assert nvml.memory_limit(gpu, str(cgroup2)) == HeldLimit(4 * GiB, GiB, 0)
    assert [(r["cgroup"], r["soft"], r["hard"]) for r in fake_nvml.limit_records()] == [
        (str(cgroup2), GiB, 4 * GiB)
    ]
    assert nvml.clear_memory_limit(gpu, str(cgroup2)).result is LimitResult.SET
    # NVML answers a cleared cgroup with soft 0 and hard MAX, not NOT_FOUND: "No limit is
    # set when softLimit is 0 and hardLimit is MAX" (nvml.h)
    assert nvml.memory_limit(gpu, str(cgroup2)) is None
    assert fake_nvml.limit_records()[-1]["hard"] == MEMORY_LIMIT_MAX


@pytest.mark.parametrize(
    ("driver_new", "inject", "target", "expected"),
    [
        (False, None, "cgroup", LimitResult.UNSUPPORTED),  # a driver before R615
        (True, "FUNCTION_NOT_FOUND", "cgroup", LimitResult.UNSUPPORTED),  # its library
        (True, "NO_PERMISSION", "cgroup", LimitResult.FORBIDDEN),
        (True, None, "missing", LimitResult.NO_CGROUP),
        (True, None, "no-dmem", LimitResult.NO_DMEM),  # Set's NOT_FOUND
        (True, None, "too-much", LimitResult.REJECTED),
        (True, "TIMEOUT", "cgroup", LimitResult.FAILED),
    ],
)
def test_memory_limit_failures_are_values(
    fake_nvml: Any,
    nvml: Nvml,
    cgroup2: Path,
    driver_new: bool,
    inject: str | None,
    target: str,
    expected: LimitResult,
) -> None:
    fake_nvml.state.support_memory_limits(driver_new)
    fake_nvml.state.without_dmem_below(cgroup2)
    (cgroup2 / "no-dmem").mkdir()
    if inject:
        fake_nvml.state.inject_error("nvmlDeviceSetMemoryLimits_v1", inject)
    fake_nvml.write()
    nvml.init()
    gpu = fake_nvml.state.devices[0]["uuid"]
    path = str(cgroup2 / target) if target in ("missing", "no-dmem") else str(cgroup2)
    outcome = nvml.set_memory_limit(gpu, path, 81 * GiB if target == "too-much" else GiB)
    assert outcome.result is expected
    assert outcome.detail
    assert outcome.final is (expected in (LimitResult.UNSUPPORTED, LimitResult.FORBIDDEN))
    assert fake_nvml.limit_records() == []
    assert nvml.set_memory_limit("GPU-nope", str(cgroup2), GiB).result is LimitResult.FAILED


def test_a_limit_set_elsewhere_reads_as_held_and_a_reservation_left_below_too(
    fake_nvml: Any, nvml: Nvml, cgroup2: Path
) -> None:
    """Only (0, MAX) and NOT_FOUND are "no limit": the soft limit a leaf left in its
    ancestors' dmem.min when it went without being zeroed is held there, hard MAX."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    leaf = cgroup2 / "leaf"
    leaf.mkdir()
    nvml.init()
    gpu = fake_nvml.state.devices[0]["uuid"]
    assert nvml.set_memory_limit(gpu, str(leaf), 4 * GiB, GiB).result is LimitResult.SET
    leaf.rmdir()
    assert nvml.memory_limit(gpu, str(cgroup2)) == HeldLimit(MEMORY_LIMIT_MAX, GiB, 0)


def test_the_driver_reserve_is_read_apart_from_what_is_used(fake_nvml: Any) -> None:
    """NVML's memory info v2 says what the driver reserves, and leaves it out of `used`; a
    driver without v2 counts it in `used`, and how much it is stays unknown."""
    fake_nvml.state.set_reserved(0, 600 * 1024**2)
    fake_nvml.state.set_process(0, os.getpid(), 3 * GiB)
    fake_nvml.write()
    session = Nvml()
    session.init()
    (device,) = session.snapshot().devices
    assert (device.total_bytes, device.used_bytes) == (80 * GiB, 3 * GiB)
    assert device.reserved_bytes == 600 * 1024**2
    session.shutdown()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "FUNCTION_NOT_FOUND")
    fake_nvml.write()
    session.init()
    (device,) = session.snapshot().devices
    assert (device.used_bytes, device.reserved_bytes) == (3 * GiB + 600 * 1024**2, None)
    session.shutdown()


@pytest.mark.parametrize("error", ["NOT_SUPPORTED", "UNKNOWN", "TIMEOUT"])
def test_a_device_whose_memory_info_v2_fails_is_read_with_v1(fake_nvml: Any, error: str) -> None:
    """Memory info v2 answers NOT_SUPPORTED or UNKNOWN where v1 works (WSL): that device is
    read with v1, for that read only (v2 again once it answers), and the others with v2. An
    error that says the GPU is lost stays the device's failure."""
    st = fake_nvml.state
    st.add_device()
    st.set_reserved(0, 600 * MiB)
    st.set_reserved(1, 600 * MiB)
    st.set_process(0, os.getpid(), 3 * GiB)
    st.inject_error("nvmlDeviceGetMemoryInfo_v2", error, device_index=0)
    fake_nvml.write()
    session = Nvml()
    session.init()
    snap = session.snapshot()
    assert snap.failed == ()
    first, second = snap.devices
    assert (first.total_bytes, first.used_bytes, first.reserved_bytes) == (
        80 * GiB,
        3 * GiB + 600 * MiB,  # v1: the driver's reserve is in `used`, its size unknown
        None,
    )
    assert (second.used_bytes, second.reserved_bytes) == (0, 600 * MiB)
    st.clear_errors()
    fake_nvml.write()
    first = session.snapshot().devices[0]
    assert (first.used_bytes, first.reserved_bytes) == (3 * GiB, 600 * MiB)
    st.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    fake_nvml.write()
    snap = session.snapshot()
    assert [uuid for uuid, _ in snap.failed] == [first.uuid] and "GPU is lost" in snap.failed[0][1]
    session.shutdown()


def only_process(**nvml: Any) -> Any:
    """The one process of one snapshot, from a fresh session."""
    session = Nvml(**nvml)
    session.init()
    try:
        (p,) = session.snapshot().processes
    finally:
        session.shutdown()
    return p


def _activity(snap: Any) -> dict[tuple[int, str], Any]:
    return {(p.pid, p.device_uuid): p.activity for p in snap.processes}


def test_per_process_utilisation_read_at_most_once_per_interval(fake_nvml: Any) -> None:
    """Busy processes get NVML's figures, listed idle ones 0, and between reads the last
    read stands (the driver samples no faster)."""
    st = fake_nvml.state
    st.set_process(0, 100, GiB)
    st.set_process(0, 101, GiB)
    st.set_utilization(0, 100, sm=87, memory=41)
    fake_nvml.write()
    clock = Clock()
    session = Nvml(clock=clock, utilisation_every=1.0)
    session.init()
    try:
        gpu = session.snapshot().devices[0].uuid
        first = _activity(session.snapshot())
        assert (first[(100, gpu)].sm_percent, first[(100, gpu)].memory_percent) == (87, 41)
        assert (first[(101, gpu)].sm_percent, first[(101, gpu)].memory_percent) == (0, 0)
        st.set_utilization(0, 100, sm=5, memory=2)
        st.set_utilization(0, 101, sm=60, memory=70)
        fake_nvml.write()
        clock.now += 0.5
        assert _activity(session.snapshot()) == first  # not read again yet
        clock.now += 0.6
        later = _activity(session.snapshot())
        assert (later[(100, gpu)].sm_percent, later[(101, gpu)].memory_percent) == (5, 70)
    finally:
        session.shutdown()


def test_no_sample_since_the_last_read_means_idle(fake_nvml: Any) -> None:
    """NVML answers NOT_FOUND when no process was busy since the timestamp asked for: the
    second read asks from the first one's newest sample, so a frozen driver buffer is idle."""
    st = fake_nvml.state
    st.set_process(0, 100, GiB)
    st.set_utilization(0, 100, sm=50, memory=10)
    st.devices[0]["utilization_timestamp_us"] = 1_000_000
    fake_nvml.write()
    clock = Clock()
    session = Nvml(clock=clock, utilisation_every=1.0)
    session.init()
    try:
        (busy,) = session.snapshot().processes
        assert busy.activity is not None and busy.activity.sm_percent == 50
        clock.now += 1.0
        (idle,) = session.snapshot().processes
        assert idle.activity is not None and (
            idle.activity.sm_percent,
            idle.activity.memory_percent,
        ) == (0, 0)
        assert idle.used_bytes == GiB  # memory is read as before
    finally:
        session.shutdown()


@pytest.mark.parametrize("error", ["FUNCTION_NOT_FOUND", "NOT_SUPPORTED"])
def test_the_older_utilisation_call_serves_when_the_newer_cannot(
    fake_nvml: Any, error: str
) -> None:
    st = fake_nvml.state
    st.set_process(0, 100, GiB)
    st.set_utilization(0, 100, sm=33, memory=44)
    st.inject_error("nvmlDeviceGetProcessesUtilizationInfo", error)
    fake_nvml.write()
    p = only_process(utilisation_every=1.0)
    assert p.activity is not None and (p.activity.sm_percent, p.activity.memory_percent) == (33, 44)


def test_utilisation_unknown_is_none_and_memory_still_counts(fake_nvml: Any) -> None:
    """Neither call works (an old driver, vGPU), or a read fails: utilisation is unknown,
    never 0, and the memory pass is untouched. The next read tries again."""
    st = fake_nvml.state
    st.set_process(0, 100, 2 * GiB)
    st.set_utilization(0, 100, sm=70, memory=20)
    st.inject_error("nvmlDeviceGetProcessesUtilizationInfo", "FUNCTION_NOT_FOUND")
    st.inject_error("nvmlDeviceGetProcessUtilization", "UNKNOWN")
    fake_nvml.write()
    clock = Clock()
    session = Nvml(clock=clock, utilisation_every=1.0)
    session.init()
    try:
        (p,) = session.snapshot().processes
        assert (p.used_bytes, p.activity) == (2 * GiB, None)
        st.clear_errors()
        fake_nvml.write()
        clock.now += 1.0
        (p,) = session.snapshot().processes
        assert p.activity is not None and p.activity.sm_percent == 70
        st.inject_error("nvmlDeviceGetProcessesUtilizationInfo", "NOT_SUPPORTED")
        st.inject_error("nvmlDeviceGetProcessUtilization", "NOT_SUPPORTED")
        fake_nvml.write()
        clock.now += 1.0
        (p,) = session.snapshot().processes
        assert (p.used_bytes, p.activity) == (2 * GiB, None)
    finally:
        session.shutdown()


def test_mig_partitions_have_no_utilisation(fake_nvml: Any) -> None:
    fake_nvml.state.enable_mig(
        0,
        [
            {
                "uuid": "MIG-1",
                "name": "MIG 1g.10gb",
                "total_bytes": 10 * GiB,
                "compute_processes": [{"pid": 7, "used_bytes": GiB, "sm_util": 90}],
            }
        ],
    )
    fake_nvml.write()
    p = only_process(utilisation_every=1.0)
    assert (p.device_uuid, p.used_bytes, p.activity) == ("MIG-1", GiB, None)


def test_utilisation_off_reads_none(fake_nvml: Any) -> None:
    fake_nvml.state.set_process(0, 100, GiB)
    fake_nvml.state.set_utilization(0, 100, sm=70, memory=20)
    fake_nvml.state.inject_error("nvmlDeviceGetProcessesUtilizationInfo", "GPU_IS_LOST")
    fake_nvml.write()
    p = only_process()  # the default: nothing is read, so the injected loss is never met
    assert (p.used_bytes, p.activity) == (GiB, None)


def test_a_process_listed_since_the_last_read_is_not_known_yet(fake_nvml: Any) -> None:
    fake_nvml.state.set_process(0, 100, GiB)
    fake_nvml.write()
    clock = Clock()
    session = Nvml(clock=clock, utilisation_every=1.0)
    session.init()
    try:
        session.snapshot()
        fake_nvml.state.set_process(0, 101, GiB)
        fake_nvml.state.set_utilization(0, 101, sm=90, memory=9)
        fake_nvml.write()
        clock.now += 0.5
        got = _activity(session.snapshot())
        gpu = next(iter(got))[1]
        assert got[(100, gpu)] is not None and got[(101, gpu)] is None  # idle; not measured
        clock.now += 0.5
        got = _activity(session.snapshot())
        assert got[(101, gpu)] is not None and got[(101, gpu)].sm_percent == 90
    finally:
        session.shutdown()
