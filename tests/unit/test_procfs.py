"""`/proc` readers over a checked-in fixture tree, plus the same readers on the live /proc."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from enforcer.core.cgroups import parse_cgroup
from enforcer.edge.procfs import INITIAL_PID_NS, ProcFs, parse_char_majors, parse_nspid, parse_stat

FIXTURE = Path(__file__).parent.parent / "fixtures" / "proc" / "host"


@pytest.fixture
def proc() -> ProcFs:
    return ProcFs(FIXTURE)


def test_stat_fields(proc: ProcFs) -> None:
    st = proc.stat(4242)
    assert st is not None
    assert (st.pid, st.comm, st.state, st.ppid, st.start_time) == (4242, "python", "S", 1, 500000)


def test_comm_with_spaces_and_parentheses(proc: ProcFs) -> None:
    st = proc.stat(4243)
    assert st is not None
    assert st.comm == "my (weird) proc"
    assert st.ppid == 4242
    assert st.start_time == 500100


def test_missing_process_reads_as_none(proc: ProcFs) -> None:
    assert proc.stat(99999) is None
    assert proc.start_time(99999) is None
    assert proc.nspid(99999) is None
    assert proc.cgroup(99999) is None
    assert proc.cmdline(99999) is None
    assert proc.pid_ns(99999) is None


def test_cmdline_and_zombie_fallback(proc: ProcFs) -> None:
    assert proc.cmdline(4242) == "python train.py --epochs 3"
    assert proc.cmdline(4300) == "[worker]"


def test_nspid_and_pid_namespace(proc: ProcFs) -> None:
    assert proc.nspid(4242) == (4242,)
    assert proc.nspid(5000) == (5000, 7)
    assert proc.nspid(5001) == (5001, 8, 1)
    assert proc.pid_ns(4242) == INITIAL_PID_NS
    assert proc.pid_ns(5000) == 4026532999
    assert proc.pid_ns_ancestor(5000, 0) == 4026532999


def test_cgroup_v2_line(proc: ProcFs) -> None:
    (entry,) = proc.cgroup(5000) or ()
    assert entry.hierarchy_id == 0
    assert entry.controllers == ()
    assert entry.path.endswith("cri-containerd-" + "a1b2c3d4e5f60718" * 4 + ".scope")


def test_parse_cgroup_v1() -> None:
    text = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"
    entries = parse_cgroup(text)
    assert [e.controllers for e in entries] == [("pids",), ("memory",), ("name=systemd",), ()]
    assert {e.path for e in entries} == {"/docker/abc", "/"}


def test_descendants_and_ancestry(proc: ProcFs) -> None:
    assert proc.descendants(4242) == {4243, 4300}
    assert proc.descendants(1) >= {4242, 4243, 4300, 4990, 5000, 5001}
    assert proc.is_descendant(4243, 4242)
    assert proc.is_descendant(5001, 4990)
    assert not proc.is_descendant(4242, 4242)
    assert not proc.is_descendant(5000, 4242)


def test_a_ppid_loop_terminates(proc: ProcFs) -> None:
    assert not proc.is_descendant(7000, 1)


def test_pids_lists_only_numeric_entries(proc: ProcFs) -> None:
    assert sorted(proc.pids()) == [1, 4242, 4243, 4300, 4990, 5000, 5001, 7000, 7001]


def test_parse_stat_rejects_nothing_it_should_accept() -> None:
    st = parse_stat("7 (a) b) c) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 42 0 0")
    assert (st.comm, st.state, st.ppid, st.start_time) == ("a) b) c", "S", 1, 42)


def test_parse_nspid_prefers_nstgid() -> None:
    assert parse_nspid("NStgid:\t10\t2\nNSpid:\t11\t3\n") == (10, 2)
    assert parse_nspid("NSpid:\t11\t3\n") == (11, 3)
    assert parse_nspid("Name:\tx\n") is None


def test_live_proc_matches_psutil_start_and_tree() -> None:
    """The same readers on the real /proc: our own child, its start time and its parent."""
    code = "print('up', flush=True); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        # Popen returns once exec has begun; the new command line is set a moment later
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        live = ProcFs()
        st = live.stat(child.pid)
        assert st is not None
        assert st.ppid == os.getpid()
        assert live.is_descendant(child.pid, os.getpid())
        assert child.pid in live.descendants(os.getpid())
        assert live.cmdline(child.pid) == f"{sys.executable} -c {code}"
        ticks = os.sysconf("SC_CLK_TCK")
        import psutil

        boot = psutil.boot_time()
        assert abs(boot + st.start_time / ticks - psutil.Process(child.pid).create_time()) < 0.05
        assert live.pid_ns("self") == live.pid_ns(child.pid)
    finally:
        child.kill()
        child.communicate()
    assert ProcFs().stat(child.pid) is None or ProcFs().stat(child.pid).start_time != st.start_time  # type: ignore[union-attr]


def test_a_zombie_leader_with_threads_left_has_not_exited() -> None:
    """Field 20 is the thread count: a leader that ended its own thread reads Z, while the
    process it leads runs on."""
    fields = "1 0 7 7 0 -1 0 0 0 0 0 0 0 0 20 0 {threads} 0 42 0 0"
    leader = parse_stat("7 (python) Z " + fields.format(threads=3))
    dead = parse_stat("7 (python) Z " + fields.format(threads=1))
    assert (leader.threads, leader.exited) == (3, False)
    assert (dead.threads, dead.exited) == (1, True)
    assert not parse_stat("7 (python) S " + fields.format(threads=1)).exited


def test_nvidia_majors_from_proc_devices() -> None:
    devices = (
        "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-uvm\n237 nvidia-caps\n"
        "  4 tty\n\nBlock devices:\n  7 loop\n199 nvidia-fake-block\n"
    )
    assert parse_char_majors(devices, "nvidia") == {195, 236, 237}
    assert parse_char_majors("Character devices:\n  1 mem\n", "nvidia") == frozenset()
