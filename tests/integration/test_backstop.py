"""The agent's attributor for a pod whose sidecar is silent, over the host's real /proc and
a real cgroup named as containerd names a container's: which process is the container's
init (for `restart`), and membership proven again before a signal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample, UnitUsage
from enforcer.edge.procfs import ProcFs
from enforcer.modes.backstop import SilentPodAttributor
from tests.helpers import wait_for

CID = "ab" * 32
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def in_box(box: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    """A child of this process (the runtime's shim, here) that starts inside `box`."""
    return subprocess.Popen(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(box), *argv]
    )


def children(procfs: ProcFs, parent: int) -> list[int]:
    return [p for p in procfs.pids() if (st := procfs.stat(p)) is not None and st.ppid == parent]


def test_the_init_is_the_oldest_process_of_the_container_whose_parent_is_outside_it(
    cgroup2: Path,
) -> None:
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    procfs = ProcFs()
    spawn = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)"
    init = in_box(box, [sys.executable, "-c", spawn, *SLEEP])
    started = [init]
    workers: list[int] = []
    try:
        workers = wait_for(lambda: children(procfs, init.pid), what="the init's worker")
        time.sleep(0.03)  # a later clock tick: an exec into the container is younger
        started.append(in_box(box, SLEEP))
        exec_shell = started[-1].pid
        wait_for(lambda: str(exec_shell) in (box / "cgroup.procs").read_text(),
                 what="the exec in the container")  # fmt: skip
        pod = {"status": {"containerStatuses": [
            {"name": "trainer", "containerID": f"containerd://{CID}"},
            {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"}]}}  # fmt: skip
        attributor = SilentPodAttributor(procfs, {"trainer": GiB}, "vram-enforcer", want_init=True)
        attributor.update(pod, {})  # type: ignore[arg-type]
        whole = attributor.whole(UnitUsage("trainer", GiB))
        assert whole.restart and [p.key.pid for p in whole.processes] == [init.pid]
        member = attributor.membership("trainer")
        assert member(workers[0]) and member(exec_shell)
        assert not member(os.getpid())  # outside the container
        assert not attributor.membership("vram-enforcer")(init.pid)  # never one of its units
    finally:
        for pid in workers:
            os.kill(pid, 9)
        for proc in started:
            proc.kill()
            proc.wait()


def test_with_dra_each_claim_holds_its_containers_on_its_gpu_and_proves_them_there(
    cgroup2: Path,
) -> None:
    """A silent DRA pod: trainer's claim gives it 4Gi on GPU-a, nothing on GPU-b. Its
    process over 4Gi on GPU-a is the claim's unit; its usage on GPU-b is held to 0; and a
    signal for either is proven against trainer's container, the sidecar's never."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    procfs = ProcFs()
    worker = in_box(box, SLEEP)
    try:
        wait_for(lambda: str(worker.pid) in (box / "cgroup.procs").read_text(), what="the move")
        st = procfs.stat(worker.pid)
        assert st is not None
        key = ProcessKey(worker.pid, st.start_time)
        pod = {"status": {"containerStatuses": [
            {"name": "trainer", "containerID": f"containerd://{CID}"},
            {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"}]}}  # fmt: skip
        found = Allocations((GpuUnit("GPU-a", ("trainer",), 4 * GiB, ()),))
        attributor = SilentPodAttributor(procfs, found, "vram-enforcer", want_init=False)
        attributor.update(pod, {key: CID})  # type: ignore[arg-type]
        sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 5 * GiB),
                                  ProcessUsage(key, "GPU-b", GiB)))  # fmt: skip
        units = {u.name: (u.used_bytes, u.limit_bytes) for u in attributor.attribute(sample)}
        assert units == {"trainer@GPU-a": (5 * GiB, 4 * GiB), "trainer@GPU-b": (GiB, 0)}
        assert attributor.label("trainer@GPU-a") == (
            "container 'trainer' on GPU GPU-a (held by the node agent while the pod's "
            "sidecar is silent)"
        )
        assert attributor.ref("trainer@GPU-a").name == "trainer"  # type: ignore[union-attr]
        assert attributor.membership("trainer@GPU-b")(worker.pid)
        assert not attributor.membership("trainer@GPU-a")(os.getpid())
        assert not attributor.membership("vram-enforcer@GPU-a")(worker.pid)
    finally:
        worker.kill()
        worker.wait()
