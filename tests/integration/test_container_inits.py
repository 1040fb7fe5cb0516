"""A container's init found from its own cgroup (issue 35, item 9): real processes in real
cgroups laid out as the kubelet and containerd lay them out, below a scratch cgroup v2
directory that stands for the host's cgroupfs; and the backstop, whose sampler thread never
scans the whole of /proc for one."""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.core.declaration import Declaration
from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.owed import owed
from enforcer.edge.cgroupfs import ContainerCgroups
from enforcer.edge.procfs import ProcFs
from enforcer.modes.backstop import SilentPodAttributor
from tests.helpers import children, wait_for
from tests.integration.test_backstop import SLEEP, ended, in_box

UID = "0a1b2c3d-0000-4000-8000-00000000abcd"
SPAWN = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)"


class Counted(ProcFs):
    """The host's /proc, noting which pids and which of their entries were read, and on
    which thread `/proc` was listed whole."""

    def __init__(self, cgroups: ContainerCgroups | None = None) -> None:
        super().__init__("/proc", cgroups)
        self.read: set[int] = set()
        self.entries: set[str] = set()
        self.listed_on: list[int] = []

    def _read_bytes(self, pid: int | str, name: str, most: int = sys.maxsize) -> bytes | None:
        if isinstance(pid, int) or pid.isdigit():
            self.read.add(int(pid))
            self.entries.add(name)
        return super()._read_bytes(pid, name, most)

    def pids(self) -> list[int]:
        self.listed_on.append(threading.get_ident())
        return super().pids()


def key_of(pid: int) -> ProcessKey:
    st = ProcFs().stat(pid)
    assert st is not None
    return ProcessKey(pid, st.start_time)


Container = tuple[str, Path, ProcessKey, list[int]]


@pytest.fixture
def container(cgroup2: Path) -> Iterator[Container]:
    """Below `cgroup2` (the host's cgroupfs here), a pod's cgroup as the kubelet's systemd
    driver names it, with a container in it and another container beside it. The init runs
    in a cgroup of the container's own (`payload`), with a worker it started; a process
    exec'd into the container later runs in the container's directory itself. Yields the
    container's ID (a new one each time: a process of an earlier test may linger there, a
    zombie), its directory, its init, and the pids of all its processes."""
    cid, other_id = secrets.token_hex(32), secrets.token_hex(32)
    pod = cgroup2 / "kubepods.slice" / "kubepods-burstable.slice"
    pod = pod / f"kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    box, other = pod / f"cri-containerd-{cid}.scope", pod / f"cri-containerd-{other_id}.scope"
    (box / "payload").mkdir(parents=True)
    other.mkdir()
    started = [in_box(box / "payload", [sys.executable, "-c", SPAWN, *SLEEP])]
    workers: list[int] = []
    try:
        workers = wait_for(lambda: children(started[0].pid), what="the init's worker")
        started.append(in_box(other, SLEEP))  # a neighbour, never read
        time.sleep(0.03)  # a later clock tick: the exec is younger than the init
        started.append(in_box(box, SLEEP))
        wait_for(
            lambda: str(started[-1].pid) in (box / "cgroup.procs").read_text(),
            what="the exec in the container",
        )
        wait_for(
            lambda: str(started[1].pid) in (other / "cgroup.procs").read_text(),
            what="the neighbour in its container",
        )
        yield cid, box, key_of(started[0].pid), [started[0].pid, *workers, started[-1].pid]
    finally:
        ended(workers, started)


def test_the_init_is_found_from_its_containers_cgroups_without_reading_any_other_process(
    container: Container,
) -> None:
    """Only the container's own processes (all its cgroups', the nested one's too) and their
    parents are read: /proc is never listed, and the neighbour's process never read."""
    cid, box, init, members = container
    procfs = Counted(ContainerCgroups(box.parents[3]))
    assert procfs.container_inits({cid}) == {cid: init}
    assert procfs.listed_on == []
    assert procfs.read <= {*members, os.getpid()}
    empty = secrets.token_hex(32)  # a container whose cgroup holds no process: said so, unscanned
    (box.parent / f"cri-containerd-{empty}.scope").mkdir()
    assert procfs.container_inits({empty}) == {empty: "no process of it runs on this node"}
    assert procfs.listed_on == []


def test_where_the_containers_cgroup_cannot_be_read_the_init_is_found_by_a_scan(
    container: Container,
) -> None:
    """No cgroupfs where it is looked for, or a container larger than the bound: the scan
    of /proc, which finds the same init."""
    cid, box, init, _ = container
    nowhere = Counted(ContainerCgroups(box.parents[3] / "nowhere"))
    assert nowhere.cgroup_inits({cid}) == {}
    assert nowhere.container_inits({cid}) == {cid: init}
    assert nowhere.listed_on
    bounded = Counted(ContainerCgroups(box.parents[3]))
    assert bounded.cgroup_inits({cid}, most=4) == {}  # 2 directories and 3 processes
    assert bounded.cgroup_inits({cid}, most=5) == {cid: init}
    assert bounded.listed_on == []


def _over(procfs: ProcFs, cid: str, members: list[int]) -> tuple[SilentPodAttributor, Sample]:
    """The silent pod's attributor for `restart`, and a sample where its worker is over."""
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "trainer", "containerID": f"containerd://{cid}"},
                {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"},
            ]
        }
    }
    held = owed(Declaration(), Allocations((GpuUnit("GPU-a", ("trainer",), GiB, ()),)), None)
    attributor = SilentPodAttributor(procfs, held, "vram-enforcer", want_init=True)
    worker = key_of(members[1])
    attributor.update(pod, {worker: cid}, lends=False)  # type: ignore[arg-type]
    return attributor, Sample(0.0, (), (ProcessUsage(worker, "GPU-a", 2 * GiB),))


def test_the_backstop_finds_an_over_containers_init_from_its_cgroup_on_the_sampler_thread(
    container: Container,
) -> None:
    """Nor does it read a process's `cmdline` (or `environ`, `maps`): those take the
    process's memory map's lock, which a thread of it can hold while it waits on a hung
    mount. The init is named by its `comm`, from `stat` (issue 42, the sampler's sibling of
    item 7)."""
    cid, box, init, members = container
    procfs = Counted(ContainerCgroups(box.parents[3]))
    attributor, sample = _over(procfs, cid, members)
    (unit,) = attributor.attribute(sample)
    assert unit.init_process is not None and unit.init_process.key == init
    assert procfs.listed_on == []
    assert attributor.whole(unit).processes == (unit.init_process,)
    assert procfs.entries <= {"stat", "cgroup"}, procfs.entries
    assert unit.init_process.cmdline == ProcFs().comm(init.pid) == "python"


def test_without_the_cgroupfs_the_backstop_scans_proc_off_the_sampler_thread(
    container: Container,
) -> None:
    """The pass that finds the unit over does not wait for a scan: it has no init yet (and
    `restart` signals nothing), and a later pass has the one a scan on another thread found."""
    cid, box, init, members = container
    procfs = Counted(ContainerCgroups(box.parents[3] / "nowhere"))
    attributor, sample = _over(procfs, cid, members)
    (first,) = attributor.attribute(sample)
    assert first.init_process is None
    found = wait_for(lambda: attributor.attribute(sample)[0].init_process, what="the init")
    assert found.key == init
    assert procfs.listed_on and threading.get_ident() not in procfs.listed_on
