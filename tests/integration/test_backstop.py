"""The agent's attributor for a pod whose sidecar is silent, over the host's real /proc and
a real cgroup named as containerd names a container's: which process is the container's
init (for `restart`), and membership proven again before a signal; and the escalation of a
victim the agent signalled, which outlives the pod's hand-back to its sidecar."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest

from enforcer.core.declaration import Declaration, Declares
from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample, UnitUsage
from enforcer.core.owed import owed
from enforcer.core.payloads import Pod
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml_source import NvmlSource
from enforcer.edge.procfs import ProcFs
from enforcer.edge.tenants import TenantCache
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from enforcer.modes.agent import Passes, PodSteps, Sampler
from enforcer.modes.backstop import Backstop, SilentPodAttributor
from enforcer.modes.lender import Lender
from enforcer.modes.node_view import NodeView
from tests.helpers import children, wait_for
from tests.pods_api import PodsApi, serving

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

CID = secrets.token_hex(32)  # its own: another run on the machine finds no process of it
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def in_box(box: Path, argv: list[str], **options: Any) -> subprocess.Popen[Any]:
    """A child of this process (the runtime's shim, here) that starts inside `box`."""
    return subprocess.Popen(
        ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(box), *argv], **options
    )


def moved_in(box: Path, worker: subprocess.Popen[Any]) -> ProcessKey:
    """`worker`'s identity, once it is in `box`."""
    wait_for(lambda: str(worker.pid) in (box / "cgroup.procs").read_text(), what="the move")
    st = ProcFs().stat(worker.pid)
    assert st is not None
    return ProcessKey(worker.pid, st.start_time)


def ended(workers: list[int], started: list[subprocess.Popen[Any]]) -> None:
    """Kill a test's processes: the workers its processes started, then those."""
    for pid in workers:
        os.kill(pid, 9)
    for proc in started:
        proc.kill()
        proc.wait()


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
        workers = wait_for(lambda: children(init.pid), what="the init's worker")
        time.sleep(0.03)  # a later clock tick: an exec into the container is younger
        started.append(in_box(box, SLEEP))
        exec_shell = started[-1].pid
        wait_for(
            lambda: str(exec_shell) in (box / "cgroup.procs").read_text(),
            what="the exec in the container",
        )
        pod = {
            "status": {
                "containerStatuses": [
                    {"name": "trainer", "containerID": f"containerd://{CID}"},
                    {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"},
                ]
            }
        }
        declared = owed(Declaration({"trainer": GiB}), None, None)
        attributor = SilentPodAttributor(procfs, declared, "vram-enforcer", want_init=True)
        attributor.update(pod, {}, lends=False)  # type: ignore[arg-type]
        # No cgroupfs here: the init is found by a scan of /proc on a thread of its own
        # (tests/integration/test_container_inits.py), for a later look.
        whole = wait_for(
            lambda: (w := attributor.whole(UnitUsage("trainer", GiB))).restart and w,
            what="the init",
        )
        assert whole.restart and [p.key.pid for p in whole.processes] == [init.pid]
        member = attributor.membership("trainer")
        assert member(workers[0]) and member(exec_shell)
        assert not member(os.getpid())  # outside the container
        assert not attributor.membership("vram-enforcer")(init.pid)  # never one of its units
    finally:
        ended(workers, started)


def test_a_share_spread_over_gpus_is_held_on_each_gpu_never_summed_on_one(
    cgroup2: Path,
) -> None:
    """KAI's `gpu-fraction-num-devices: 2` of a silent pod: trainer's 8Gi is 4Gi on each of
    two GPUs. 6Gi on one GPU and nothing on the other is over, though the sum is under."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    worker = in_box(box, SLEEP)
    try:
        key = moved_in(box, worker)
        pod = {
            "status": {
                "containerStatuses": [{"name": "trainer", "containerID": f"containerd://{CID}"}]
            }
        }
        declared = owed(Declaration({"trainer": 8 * GiB}, gpus={"trainer": 2}), None, None)
        attributor = SilentPodAttributor(ProcFs(), declared, "vram-enforcer", want_init=False)
        attributor.update(pod, {key: CID}, lends=False)  # type: ignore[arg-type]
        on_one = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 6 * GiB),))
        units = {u.name: (u.used_bytes, u.limit_bytes) for u in attributor.attribute(on_one)}
        assert units == {"trainer@GPU-a": (6 * GiB, 4 * GiB)}
        assert attributor.membership("trainer@GPU-a")(worker.pid)
    finally:
        worker.kill()
        worker.wait()


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
        key = moved_in(box, worker)
        pod = {
            "status": {
                "containerStatuses": [
                    {"name": "trainer", "containerID": f"containerd://{CID}"},
                    {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"},
                ]
            }
        }
        found = Allocations((GpuUnit("GPU-a", ("trainer",), 4 * GiB, ()),))
        claimed = owed(Declaration(claims=True), found, None)
        attributor = SilentPodAttributor(procfs, claimed, "vram-enforcer", want_init=False)
        attributor.update(pod, {key: CID}, lends=False)  # type: ignore[arg-type]
        sample = Sample(
            0.0, (), (ProcessUsage(key, "GPU-a", 5 * GiB), ProcessUsage(key, "GPU-b", GiB))
        )
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
        self.reasons: list[str] = []

    def record(self, about: object, reason: str, message: str, warning: bool) -> None:
        self.messages.append(message)
        self.reasons.append(reason)


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
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    victim = in_box(box, [sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        st = procfs.stat(victim.pid)
        assert st is not None
        key = ProcessKey(victim.pid, st.start_time)
        sidecar_env = [
            {"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps({"trainer": GiB})},
            {"name": "VRAM_ENFORCER_GRACE_PERIOD", "value": "1s"},
        ]
        pod = cast(
            Pod,
            {
                "metadata": {"uid": "u", "namespace": "team", "name": "p"},
                "spec": {
                    "containers": [
                        {"name": "trainer"},
                        {"name": "vram-enforcer", "env": sidecar_env},
                    ]
                },
                "status": {
                    "containerStatuses": [
                        {"name": "trainer", "containerID": f"containerd://{CID}"},
                        {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"},
                    ]
                },
            },
        )
        silent: set[str] = {"u"}
        recorder = Recorded()
        backstop = Backstop(
            NodeView(
                lambda: {"u": pod}, lambda: frozenset({"team"}), Declares("vram-enforcer.io/vram")
            ),
            lambda: frozenset(silent),
            cast("EventRecorder", recorder),
            AgentTelemetry(),
            procfs,
        )
        sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 2 * GiB),))
        backstop(sample, lambda: {key: CID}, None)
        signalled = time.monotonic()
        assert any("sent SIGTERM" in m for m in recorder.messages), recorder.messages
        for held in (set(), {"u"}, set()):  # handed back, held again, handed back
            silent.clear()
            silent.update(held)
            backstop(sample, lambda: {key: CID}, None)
        while victim.poll() is None and time.monotonic() < signalled + 5:
            backstop(sample, lambda: {key: CID}, None)  # the sampler's passes
            time.sleep(0.05)
        assert victim.wait(timeout=1) == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - signalled < 1.5  # at the deadline, not later
        assert sum("sent SIGTERM" in m for m in recorder.messages) == 1
        assert any("sent SIGKILL" in m for m in recorder.messages)
    finally:
        victim.kill()
        victim.wait()


# The agent's side of the tests below: the backstop, its recorder and its evictor, as the
# agent wires them, running as root without CAP_KILL (argv: the API's URL, the victim's
# pid and start time, the container's ID, the pod, --eviction-timeout in seconds).
EVICTING = """
import json, sys, time
from kubernetes import client
from enforcer.core.declaration import Declares
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample
from enforcer.edge.events import EventRecorder
from enforcer.edge.eviction import Evictor
from enforcer.edge.kube import api_client
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.pod_conditions import ConditionWriter
from enforcer.modes.backstop import Backstop
from enforcer.modes.last_enforcement import LastEnforcement
from enforcer.modes.node_view import NodeView

url, pid, start, cid, pod, timeout = sys.argv[1:]
configuration = client.Configuration()
configuration.host = url
api = api_client(configuration)
telemetry = AgentTelemetry()
recorder = EventRecorder(api, "node-a", "node-a", telemetry.event_failures)
evictor = Evictor(api, recorder, telemetry.unexpected.labels("evictor"), float(timeout))
key = ProcessKey(int(pid), int(start))
sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 2 * GiB),))
writer = ConditionWriter(api, telemetry.condition_failures)
recorder.told = LastEnforcement(
    writer,
    lambda: {"u": json.loads(pod)},
    lambda: (sample, lambda: {key: cid}),
    lambda: None,
    lambda: frozenset({"team"}),
).told
recorder.start()
evictor.start()
writer.start()
node = NodeView(lambda: {"u": json.loads(pod)}, lambda: frozenset({"team"}),
                Declares("vram-enforcer.io/vram"))
backstop = Backstop(node, lambda: frozenset({"u"}), recorder, telemetry, ProcFs(), evictor.evict)
for _ in range(5):  # the sampler's passes: one eviction for all of them
    backstop(sample, lambda: {key: cid}, None)
    time.sleep(0.1)
ends = time.monotonic() + 10
while (evictor.pending or writer.waiting) and time.monotonic() < ends:
    time.sleep(0.05)
evictor.stop.set()
writer.stop.set()
recorder.close(5)
"""


def _refused_signal(
    cgroup2: Path, api: PodsApi, timeout: str, pod_spec: dict[str, Any] | None = None
) -> list[tuple[str, Any]]:
    """The victim runs as another uid in the pod's container, over its limit, and the
    agent's side (`EVICTING`, with `--eviction-timeout` `timeout`) has no CAP_KILL: the
    kernel refuses its SIGTERM (EPERM), as a security module does. What the agent asked of
    `api`, its POSTs (Events, evictions) then its DELETEs; the victim is never signalled.
    The pod's sidecar environment gives it a grace period of 7s."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    procfs = ProcFs()
    victim = in_box(
        box, ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "sleep", "60"]
    )
    try:
        wait_for(lambda: procfs.cmdline(victim.pid) == "sleep 60", what="the victim's exec")
        st = procfs.stat(victim.pid)
        assert st is not None
        sidecar_env = [
            {"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps({"trainer": GiB})},
            {"name": "VRAM_ENFORCER_GRACE_PERIOD", "value": "7s"},
        ]
        pod = {
            "metadata": {"uid": "u", "namespace": "team", "name": "p"},
            "spec": {
                **(pod_spec or {}),
                "containers": [{"name": "trainer"}, {"name": "vram-enforcer", "env": sidecar_env}],
            },
            "status": {
                "containerStatuses": [
                    {"name": "trainer", "containerID": f"containerd://{CID}"},
                    {"name": "vram-enforcer", "containerID": f"containerd://{'cd' * 32}"},
                ]
            },
        }
        agent = subprocess.run(
            [
                "setpriv",
                "--inh-caps",
                "-all",
                "--bounding-set",
                "-kill",
                sys.executable,
                "-c",
                EVICTING,
                api.url,
                str(victim.pid),
                str(st.start_time),
                CID,
                json.dumps(pod),
                timeout,
            ],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert agent.returncode == 0, agent.stderr
        assert victim.poll() is None  # the kernel refused: never signalled
        return [*api.posts, *api.deletes]
    finally:
        victim.kill()
        victim.wait()


# --- a borrower whose sidecar hung up (issue 42, item 1) -----------------------------------

NEIGHBOUR_ID = "cd" * 32


def declaring(uid: str, name: str, container: str, cid: str, env: dict[str, int]) -> Pod:
    """A pod of one container, declared in its sidecar's environment as the webhook writes
    it (`env`: variable -> {container: bytes})."""
    variables = [{"name": k, "value": json.dumps({container: v})} for k, v in env.items()]
    return cast(
        Pod,
        {
            "metadata": {"uid": uid, "namespace": "team", "name": name},
            "spec": {
                "containers": [{"name": container}, {"name": "vram-enforcer", "env": variables}]
            },
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": container, "containerID": f"containerd://{cid}"}],
            },
        },
    )


def sampling(
    source: object,
    server: UsageServer,
    telemetry: AgentTelemetry,
    containers: Callable[[], Mapping[ProcessKey, str]],
    steps: PodSteps,
) -> Sampler:
    """The agent's sampler, whose passes (`_pass`, as its thread runs each) read `source` as
    their NVML pass and `containers` as each GPU process's container ID."""
    tenants = cast(TenantCache, SimpleNamespace(count=lambda sample: {}, containers=containers))
    return Sampler(cast(NvmlSource, source), server, telemetry, 1.0, Passes(), tenants, steps=steps)


class _Source:
    """The sampler's NVML source: what the test sets, as a new sample on each pass."""

    def __init__(self) -> None:
        self.now: Sample = Sample(0.0, (), ())

    def sample(self) -> Sample:
        return self.now


NEIGHBOUR = ProcessKey(1, 1)  # not signalled by anyone: its pod's sidecar is heard
BORROWING = {"VRAM_ENFORCER_LIMITS": GiB, "VRAM_ENFORCER_CEILINGS": 4 * GiB}


@dataclass
class LendingNode:
    """A node's agent as its sampler runs it: each pass (`sampler._pass()`) reads `source`,
    then lends, and holds the pods whose sidecars are silent (`backstop`, whose Events
    `recorder` has)."""

    source: _Source
    backstop: Backstop
    recorder: Recorded
    sampler: Sampler


@contextlib.contextmanager
def lending_node(borrower: Pod, key: ProcessKey, tmp_path: Path) -> Iterator[LendingNode]:
    """`borrower` (pod `u`, its sidecar silent, its process `key` in container ID CID) and a
    neighbour owed 8 GiB (its process NEIGHBOUR, its sidecar heard), on one GPU."""
    source = _Source()
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=60.0)
    try:
        pods = {
            "u": borrower,
            "n": declaring("n", "serve", "server", NEIGHBOUR_ID, {"VRAM_ENFORCER_LIMITS": 8 * GiB}),
        }
        node = NodeView(
            lambda: pods, lambda: frozenset({"team"}), Declares("vram-enforcer.io/vram")
        )
        recorder = Recorded()
        backstop = Backstop(
            node, lambda: frozenset({"u"}), cast("EventRecorder", recorder), telemetry, ProcFs()
        )
        lender = Lender(node, threading.Event(), 2 * GiB, telemetry)
        containers = {key: CID, NEIGHBOUR: NEIGHBOUR_ID}
        steps = PodSteps(lender, backstop)
        sampler = sampling(source, server, telemetry, lambda: containers, steps)
        yield LendingNode(source, backstop, recorder, sampler)
    finally:
        server.close()


def test_a_borrower_whose_sidecar_hung_up_is_held_to_its_ceiling_and_reclaimed_when_needed(
    cgroup2: Path, tmp_path: Path
) -> None:
    """The borrower requests 1 GiB and may borrow up to 4; it holds 3 on a 16 GiB GPU where
    a neighbour is owed 7 more of its 8. Its sidecar hangs up: the agent's backstop holds the
    pod, as its sidecar would have, to its ceiling while the GPU has room (it was held to
    its request at once: SIGTERM for the memory it had borrowed legitimately). Once 6 GiB
    more are taken by a process of no pod, the neighbour's request cannot be met: the
    lender asks the borrower back on that GPU in the same pass, and the backstop stops its
    largest process there, a reclaim. Run as the agent's sampler runs both on each pass."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    worker = in_box(box, SLEEP)
    try:
        key = moved_in(box, worker)
        borrower = declaring("u", "borrower", "trainer", CID, BORROWING)
        with lending_node(borrower, key, tmp_path) as agent:
            agent.source.now = gpu(key, 0)  # 12 GiB free: the neighbour's 7, and 2 of watermark
            for _ in range(3):
                agent.sampler._pass()  # one NVML pass, as the sampler's thread runs it
            (unit,) = agent.backstop._held["u"]._pipeline.last_units  # it saw its usage
            assert (unit.name, unit.used_bytes, unit.limit_bytes) == ("trainer", 3 * GiB, 4 * GiB)
            assert worker.poll() is None and agent.recorder.messages == []
            agent.source.now = gpu(key, 6 * GiB)  # 6 GiB free: 3 short of the neighbour's due
            agent.sampler._pass()
            assert worker.wait(timeout=5) == -signal.SIGTERM
            assert agent.recorder.reasons == ["VRAMReclaimed"], agent.recorder.messages
            assert "sent SIGTERM" in agent.recorder.messages[0], agent.recorder.messages
    finally:
        worker.kill()
        worker.wait()


def gpu(key: ProcessKey, others: int) -> Sample:
    """A 16 GiB GPU where the borrower's `key` holds 3 GiB, the neighbour 1, and processes
    of no pod `others`."""
    used = 3 * GiB + GiB + others
    return Sample(
        0.0,
        (Device(0, "GPU-a", "H100", 16 * GiB, used),),
        (ProcessUsage(key, "GPU-a", 3 * GiB), ProcessUsage(NEIGHBOUR, "GPU-a", GiB)),
    )


def _evicted_events(asked: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    events = [body for path, body in asked if path == "/api/v1/namespaces/team/events"]
    denied = [e["message"] for e in events if e["reason"] == "VRAMEnforced"]
    assert any("denied" in m for m in denied), denied  # the signal was refused first
    return [e for e in events if e["reason"] == "VRAMEvicted"]


EVICTION = {
    "apiVersion": "policy/v1",
    "kind": "Eviction",
    "metadata": {"name": "p", "namespace": "team"},
    "deleteOptions": {"gracePeriodSeconds": 7, "preconditions": {"uid": "u"}},
}


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_a_pod_whose_signal_the_kernel_refuses_is_evicted_once_with_an_event(
    cgroup2: Path,
) -> None:
    """The pod, still over its limit, is evicted through the API (policy/v1, on the pod's
    UID, with its policy's grace period, not the hour its spec asks), once over several
    passes, and an Event on its container says why."""
    with serving([]) as api:
        asked = _refused_signal(cgroup2, api, "60", {"terminationGracePeriodSeconds": 3600})
    assert [(path, body) for path, body in asked if path.endswith("/eviction")] == [
        ("/api/v1/namespaces/team/pods/p/eviction", EVICTION)
    ]
    assert api.deletes == []
    said = _evicted_events(asked)
    assert len(said) == 1, said
    assert said[0]["involvedObject"]["fieldPath"] == "spec.containers{trainer}"
    message = said[0]["message"]
    assert "container 'trainer'" in message and "2.00 GiB" in message, message
    assert "1.00 GiB VRAM limit" in message and "kernel refused the signal" in message
    assert "evicted instead, with a grace period of 7s" in message
    # The agent's own enforcement stays on the pod as its condition, the latest last.
    (path, _, body) = api.patches[-1]
    assert path == "/api/v1/namespaces/team/pods/p/status"
    (kept,) = body["status"]["conditions"]
    assert kept["reason"] == "VRAMEvicted", kept
    assert kept["message"].startswith(
        "container 'trainer' was over its VRAM limit and out of reach of signals"
    )
    assert "the node agent saw it hold 2.00 GiB" in kept["message"]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_a_pod_whose_budget_refuses_its_eviction_for_ever_is_deleted_with_its_policys_grace(
    cgroup2: Path,
) -> None:
    """A PodDisruptionBudget of the tenant's that allows no disruption refuses the eviction
    (429) for ever. The refusal is said, and once it has lasted `--eviction-timeout` (2s
    here), the pod is deleted as the kubelet's node-pressure eviction stops a pod, whatever
    its budgets: on its UID, with its policy's grace period; an Event says so (issue 42,
    item 9)."""
    with serving([]) as api:
        api.refuse_evictions = True
        asked = _refused_signal(cgroup2, api, "2", {"terminationGracePeriodSeconds": 3600})
    evictions = [body for path, body in asked if path.endswith("/eviction")]
    assert evictions and all(body == EVICTION for body in evictions), evictions
    assert api.deletes == [
        (
            "/api/v1/namespaces/team/pods/p",
            {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "gracePeriodSeconds": 7,
                "preconditions": {"uid": "u"},
            },
        )
    ]
    said = [e["message"] for e in _evicted_events(asked)]
    assert any("refused for now" in m and "disruption budget" in m for m in said), said
    (deleted,) = [m for m in said if "deleted instead" in m]
    assert "container 'trainer'" in deleted and "kernel refused the signal" in deleted
    assert "after its eviction was refused for 2s" in deleted, deleted
    assert "whatever its PodDisruptionBudgets" in deleted and "grace period of 7s" in deleted
