"""How soon the agent's sidecar watch says a pod is unguarded when its own workload stops or
kills its sidecar (root in the pod can: they share a PID namespace).

The sidecar is a real process that listens in a pod's namespaces of its own, in a cgroup
named as the kubelet names the sidecar's container, and runs the sidecar's real client
(`test_agent_pods.Caller`); the agent's real socket server and dialer connect to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from enforcer.core.declaration import ENFORCED, LIMITS_ENV, Declares
from enforcer.core.model import GiB, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import directory
from enforcer.core.sidecar_presence import SILENT_AFTER
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import ServerHooks, UsageServer
from enforcer.modes.agent import _served
from enforcer.modes.backstop import Backstop
from enforcer.modes.node_view import NodeView
from enforcer.modes.sidecar_watch import SidecarNews, SidecarProcesses, SidecarWatch
from tests.helpers import scratch_cgroup, wait_for
from tests.integration.conftest import TELEMETRY, dialer, serving
from tests.integration.test_agent_pods import UA, Caller
from tests.integration.test_backstop import SLEEP, in_box, moved_in

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, pidfds)")

# Its own container ID: the dialer looks for it among every process of this machine, where
# other runs of the suite may have sidecars of the IDs that other tests use.
A = secrets.token_hex(32)
POD = cast(
    Pod,
    {
        "metadata": {
            "uid": UA,
            "namespace": "team",
            "name": "pod-a",
            "labels": {"vram-enforcer.io/enforced": "true"},
        },
        "spec": {"containers": [{"name": "vram-enforcer"}, {"name": "trainer"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "vram-enforcer",
                    "containerID": f"containerd://{A}",
                    "state": {"running": {}},
                },
                {
                    "name": "trainer",
                    "containerID": f"containerd://{'7' * 64}",
                    "state": {"running": {}},
                },
            ],
        },
    },
)


class Recorded:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def record(self, about: object, reason: str, message: str, warning: bool) -> None:
        self.messages.append(message)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Caller]:
    with scratch_cgroup() as cgroups:
        found = Caller(tmp_path / "unused", cgroups, UA, A, listen=True)
        try:
            wait_for(found.listening, what="the sidecar to listen")
            yield found
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(found.pid, signal.SIGCONT)
            found.stop()


@pytest.fixture
def news() -> SidecarNews:
    return SidecarNews()


@pytest.fixture
def server(tmp_path: Path, news: SidecarNews) -> Iterator[UsageServer]:
    """The agent's usage server, which tells `news` of a caller that hung up, as the
    agent's tells its sidecar watch."""
    with serving(tmp_path / "agent.sock", ServerHooks(hung_up=news.hung_up)) as s:
        yield s


def watching(server: UsageServer, news: SidecarNews, every: float) -> SidecarWatch:
    """The agent's watch over POD's sidecar, wired to the server as the agent wires it."""
    return SidecarWatch(
        lambda: {UA: POD},
        server,
        news,
        Recorded(),  # type: ignore[arg-type]
        TELEMETRY,
        (dialer(), SidecarProcesses(ProcFs())),
        every=every,
    )


def connected(watch: SidecarWatch, server: UsageServer) -> Any:
    watch.check()
    return A in server.connected and not watch.silent


def test_a_stopped_sidecar_leaves_its_pod_unguarded_within_one_check(
    server: UsageServer, news: SidecarNews, sidecar: Caller
) -> None:
    """SIGSTOP leaves the sidecar's connection open, and read for a while (nothing fills
    it here): only its state in /proc (T) tells. Within one check, not SILENT_AFTER."""
    every = 0.5
    watch = watching(server, news, every)
    wait_for(lambda: connected(watch, server), what="the sidecar connected")
    watch.start()
    try:
        os.kill(sidecar.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: UA in watch.silent, timeout=SILENT_AFTER, what="the pod unguarded")
        assert time.monotonic() - stopped < every + 0.5
        assert A in server.connected  # its connection still counted: the state told
        os.kill(sidecar.pid, signal.SIGCONT)
        wait_for(lambda: UA not in watch.silent, what="the pod guarded again")
    finally:
        watch.stop.set()
        watch.join()


def test_a_killed_sidecar_leaves_its_pod_unguarded_as_soon_as_its_connection_closes(
    server: UsageServer, news: SidecarNews, sidecar: Caller
) -> None:
    """A SIGKILL closes the sidecar's connection: the server tells the watch, which looks at
    once rather than at its next check (30 s away here)."""
    watch = watching(server, news, every=30.0)
    wait_for(lambda: connected(watch, server), what="the sidecar connected")
    watch.start()
    try:
        os.kill(sidecar.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: UA in watch.silent, timeout=5, what="the pod unguarded")
        assert time.monotonic() - killed < 0.5
    finally:
        watch.stop.set()  # a daemon thread: it ends when it wakes up next


def test_a_sidecar_whose_signal_the_kernel_refused_leaves_its_pod_to_the_agent(
    tmp_path: Path, sidecar: Caller
) -> None:
    """Issue 42, item 4: the workload runs under another security label than its sidecar's,
    and the kernel refuses the sidecar's signal (EPERM). The sidecar's report says so at
    once, and the agent, wired as it wires itself (`agent._served`), holds the pod: the
    watch says it is unguarded, naming why, though the sidecar runs and is heard."""
    recorder = Recorded()
    served = _served(recorder)  # type: ignore[arg-type]
    with serving(tmp_path / "agent.sock", served.hooks) as server:
        server.publish_pods(directory([POD], {}, None, opted_in=frozenset({"team"})))
        watch = SidecarWatch(
            lambda: {UA: POD},
            server,
            served.news,
            recorder,  # type: ignore[arg-type]
            TELEMETRY,
            (dialer(), SidecarProcesses(ProcFs())),
        )
        wait_for(lambda: connected(watch, server), what="the sidecar connected")
        sidecar.send("denied 1")
        wait_for(lambda: (watch.check(), UA in watch.silent)[1], what="the pod held")
        assert A in server.connected  # heard all the same: the refusal told
        assert any("the kernel refuses the signals" in m for m in recorder.messages)


def test_a_pending_pods_init_container_is_held_by_the_agent_when_its_sidecar_never_answers(
    cgroup2: Path,
) -> None:
    """Issue 35: the GPU job runs in a regular init container, `fetch`, while its pod is
    still Pending, its native sidecar started; the sidecar never answers the agent. After
    SILENT_AFTER the watch says the pod is unguarded, and the backstop holds `fetch` to its
    limit: its process over it gets SIGTERM."""
    fetch, side = secrets.token_hex(32), secrets.token_hex(32)
    box = cgroup2 / f"cri-containerd-{fetch}.scope"
    box.mkdir()
    procfs = ProcFs()
    worker = in_box(box, SLEEP)
    try:
        key = moved_in(box, worker)
        env = [{"name": LIMITS_ENV, "value": json.dumps({"fetch": GiB})}]
        pod = cast(
            Pod,
            {
                "metadata": {
                    "uid": "u-init",
                    "namespace": "team",
                    "name": "pod-init",
                    "labels": {ENFORCED: "true"},
                },
                "spec": {
                    "initContainers": [{"name": "vram-enforcer", "env": env}, {"name": "fetch"}],
                    "containers": [{"name": "trainer"}],
                },
                "status": {
                    "phase": "Pending",
                    "initContainerStatuses": [
                        {
                            "name": "vram-enforcer",
                            "containerID": f"containerd://{side}",
                            "state": {"running": {}},
                        },
                        {
                            "name": "fetch",
                            "containerID": f"containerd://{fetch}",
                            "state": {"running": {}},
                        },
                    ],
                    "containerStatuses": [{"name": "trainer", "state": {"waiting": {}}}],
                },
            },
        )
        now, recorder = [0.0], Recorded()
        links = SimpleNamespace(connected=frozenset(), peers={}, adopt=lambda cid, conn: None)
        watch = SidecarWatch(
            lambda: {"u-init": pod},
            links,
            SidecarNews(),
            recorder,  # type: ignore[arg-type]
            TELEMETRY,
            (dialer(), SidecarProcesses(procfs)),
            clock=lambda: now[0],
        )
        backstop = Backstop(
            NodeView(
                lambda: {"u-init": pod},
                lambda: frozenset({"team"}),
                Declares("vram-enforcer.io/vram"),
            ),
            lambda: watch.silent,
            recorder,
            TELEMETRY,
            procfs,
        )
        sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 2 * GiB),))
        for now[0] in (0.0, SILENT_AFTER - 0.1):
            watch.check()
            backstop(sample, lambda: {key: fetch}, None)
        assert not watch.silent and worker.poll() is None  # its sidecar is given the delay
        now[0] = SILENT_AFTER
        watch.check()
        assert watch.silent == {"u-init"}
        backstop(sample, lambda: {key: fetch}, None)
        assert worker.wait(timeout=5) == -signal.SIGTERM
        assert any("sent SIGTERM" in m for m in recorder.messages), recorder.messages
    finally:
        worker.kill()
        worker.wait()
