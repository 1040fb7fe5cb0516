"""The agent's attributor for a pod whose sidecar is silent, over the host's real /proc and
a real cgroup named as containerd names a container's: which process is the container's
init (for `restart`), and membership proven again before a signal; and the escalation of a
victim the agent signalled, which outlives the pod's hand-back to its sidecar."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample, UnitUsage
from enforcer.core.payloads import Pod
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.modes.backstop import Backstop, SilentPodAttributor
from tests.helpers import wait_for

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

CID = "ab" * 32
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def in_box(box: Path, argv: list[str], **options: Any) -> subprocess.Popen[Any]:
    """A child of this process (the runtime's shim, here) that starts inside `box`."""
    return subprocess.Popen(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(box), *argv], **options
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


class Recorded:
    """The agent's recorder, as the backstop's Events reach it."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def record(self, about: object, reason: str, message: str, warning: bool) -> None:
        self.messages.append(message)


def test_a_pod_handed_back_before_the_grace_period_ends_still_gets_its_sigkill(
    cgroup2: Path,
) -> None:
    """A tenant that stops and continues its sidecar hands the pod to the agent and back
    as often as it likes. The victim the agent sent SIGTERM (and that ignores it) is
    followed to its end whoever holds the pod: handed back, held again and handed back
    before the grace period ends, it gets one SIGTERM and its SIGKILL at the deadline."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    procfs = ProcFs()
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
               "print('ready', flush=True); time.sleep(60)"  # fmt: skip
    victim = in_box(box, [sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        st = procfs.stat(victim.pid)
        assert st is not None
        key = ProcessKey(victim.pid, st.start_time)
        sidecar_env = [{"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps({"trainer": GiB})},
                       {"name": "VRAM_ENFORCER_GRACE_PERIOD", "value": "1s"}]  # fmt: skip
        pod = cast(Pod, {"metadata": {"uid": "u", "namespace": "team", "name": "p"},
                         "spec": {"containers": [{"name": "trainer"},
                                                 {"name": "vram-enforcer", "env": sidecar_env}]},
                         "status": {"containerStatuses": [
                             {"name": "trainer", "containerID": f"containerd://{CID}"},
                             {"name": "vram-enforcer",
                              "containerID": f"containerd://{'cd' * 32}"}]}})  # fmt: skip
        silent: set[str] = {"u"}
        recorder = Recorded()
        backstop = Backstop(lambda: {"u": pod}, lambda: frozenset(silent),
                            ("vram-enforcer.io/vram", 1), "vram-enforcer",
                            cast("EventRecorder", recorder), AgentTelemetry(), procfs)  # fmt: skip
        sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 2 * GiB),))
        backstop(sample, lambda: {key: CID})
        signalled = time.monotonic()
        assert any("sent SIGTERM" in m for m in recorder.messages), recorder.messages
        for held in (set(), {"u"}, set()):  # handed back, held again, handed back
            silent.clear()
            silent.update(held)
            backstop(sample, lambda: {key: CID})
        while victim.poll() is None and time.monotonic() < signalled + 5:
            backstop(sample, lambda: {key: CID})  # the sampler's passes
            time.sleep(0.05)
        assert victim.wait(timeout=1) == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - signalled < 1.5  # at the deadline, not later
        assert sum("sent SIGTERM" in m for m in recorder.messages) == 1
        assert any("sent SIGKILL" in m for m in recorder.messages)
    finally:
        victim.kill()
        victim.wait()
