"""A hostile tenant, round 3 (issue 42, items 1 and 7): a pod's filesystem is its author's.

The attack that ran end to end: a pod in a namespace that did not opt in, labelled enforced,
with a container named like the sidecar whose `/run/vram-enforcer/sidecar.sock` is a link to
`/proc/<victim sidecar>/root/run/vram-enforcer/sidecar.sock`. The agent dialled it, followed
the link into the victim's socket, refused it only after `connect()` had reached the victim,
and the victim, which took the newer connection for its agent's, hung up its live one: the
victim's pod was unguarded, and its borrower held to its request at once. Each layer is held
here against the real agent (its socket server, its sidecar watch and dialer, its view of
the node) and a real sidecar (`AgentLink`, listening in a pod's namespaces of its own):

- the forged pod is not the webhook's, and is never dialled;
- a link in a sidecar's filesystem is never followed, nor a mount that may not answer
  entered: nothing reaches the socket it points to;
- a sidecar keeps its live link through a connection that delivers nothing;
- a dial that hangs in the kernel costs the watch nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from enforcer.core.declaration import ENFORCED, SIDECAR, Declares
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import Directory, directory
from enforcer.core.protocol import SIDECAR_SOCKET, SIDECAR_SOCKET_DIR
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sidecar_dialer import Dialer, Refused, dial_container
from enforcer.edge.tenant_fs import Planted, open_in
from enforcer.edge.usage_server import ServerHooks, UsageServer
from enforcer.modes.node_view import NodeView
from enforcer.modes.pod_metrics import PodCounts
from enforcer.modes.sidecar_watch import SidecarNews, SidecarProcesses, SidecarWatch
from tests.helpers import POD_NAMESPACES, children, end_namespace, scratch_cgroup, wait_for
from tests.hung_fuse import hung_fuse_at
from tests.integration.conftest import TELEMETRY, serving
from tests.integration.test_agent_pods import Caller
from tests.integration.test_sidecar_watch import Recorded

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, namespaces)")

# Container IDs and pod UIDs of this run's own (the dialer looks at every process of the host)
VICTIM, FORGED = secrets.token_hex(32), secrets.token_hex(32)
UV, UF = f"{secrets.token_hex(4)}-0000-4000-8000-{'1' * 12}", f"{secrets.token_hex(4)}-0-4-8-0"
TEAM = frozenset({"team"})


def injected_pod(
    name: str, uid: str, namespace: str, sidecar: str, labels: dict[str, str] | None = None
) -> Pod:
    """A running pod with a native sidecar in container `sidecar`, labelled enforced (the
    webhook's mark, or a tenant's copy of it) and a workload."""
    return cast(
        Pod,
        {
            "metadata": {
                "uid": uid,
                "namespace": namespace,
                "name": name,
                "labels": labels if labels is not None else {ENFORCED: "true"},
            },
            "spec": {
                "initContainers": [{"name": SIDECAR, "restartPolicy": "Always"}],
                "containers": [{"name": "trainer"}],
            },
            "status": {
                "phase": "Running",
                "initContainerStatuses": [
                    {
                        "name": SIDECAR,
                        "containerID": f"containerd://{sidecar}",
                        "state": {"running": {}},
                    }
                ],
                "containerStatuses": [
                    {
                        "name": "trainer",
                        "containerID": f"containerd://{secrets.token_hex(32)}",
                        "state": {"running": {}},
                    }
                ],
            },
        },
    )


@contextlib.contextmanager
def in_its_own_namespaces(
    script: str, cgroup: Path | None = None, then: str = "exec sleep 600"
) -> Iterator[int]:
    """A process in a mount and PID namespace of its own, with a tmpfs over /run and the
    emptyDir's directory made, that runs `script` (sh) there and `then` (it sleeps); moved
    into `cgroup` (a container's, as the kubelet names it). Yields its pid."""
    command = [*POD_NAMESPACES, "sh", "-c", f"{script} && echo ready && {then}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        pid = wait_for(lambda: children(proc.pid), what="the pod's first process")[0]
        if cgroup is not None:
            cgroup.mkdir(parents=True, exist_ok=True)
            (cgroup / "cgroup.procs").write_text(str(pid))
        yield pid
    finally:
        end_namespace(proc, pid)


@pytest.fixture
def cgroups() -> Iterator[Path]:
    with scratch_cgroup() as path:
        yield path


@pytest.fixture
def news() -> SidecarNews:
    return SidecarNews()


@pytest.fixture
def server(tmp_path: Path, news: SidecarNews) -> Iterator[UsageServer]:
    hooks = ServerHooks(reports=PodCounts().keep, hung_up=news.hung_up, sidecars_only=True)
    with serving(tmp_path / "agent.sock", hooks) as s:
        yield s


@pytest.fixture
def victim(tmp_path: Path, cgroups: Path) -> Iterator[Caller]:
    """The victim's sidecar: listening in its pod's namespaces, in its container's cgroup."""
    found = Caller(tmp_path / "unused", cgroups, UV, VICTIM, listen=True)
    try:
        wait_for(found.listening, what="the victim's sidecar to listen")
        yield found
    finally:
        found.stop()


def link_to(victim: Caller) -> str:
    """What the forged container plants at its own sidecar socket's path."""
    return f"ln -s /proc/{victim.pid}/root{SIDECAR_SOCKET} {SIDECAR_SOCKET}"


def directory_of(pods: dict[str, Pod]) -> Directory:
    return directory(pods.values(), {}, None, opted_in=TEAM)


def recording(dialled: list[str]) -> Dialer:
    """The agent's dialer, noting each container it dials."""

    def dial(cid: str) -> Any:
        dialled.append(cid)
        return dial_container(ProcFs(), cid)

    return Dialer(dial, lambda: None, TELEMETRY.unexpected.labels("sidecar-dial"))


def watching(
    pods: Callable[[], Mapping[str, Pod] | None],
    server: UsageServer,
    news: SidecarNews,
    dials: Dialer,
    clock: Callable[[], float] = time.monotonic,
) -> SidecarWatch:
    """The agent's sidecar watch over `pods`, wired to `server` as the agent wires it."""
    recorder = cast("EventRecorder", Recorded())
    return SidecarWatch(
        pods, server, news, recorder, TELEMETRY, (dials, SidecarProcesses(ProcFs())), clock=clock
    )


def served(watch: SidecarWatch, server: UsageServer) -> bool:
    """One more check of the watch (which takes the dials that ended), and whether the
    victim's sidecar is connected."""
    watch.check()
    return VICTIM in server.connected


def requests(result: str) -> float:
    found = TELEMETRY.registry.get_sample_value(
        "vram_enforcer_agent_requests_total", {"result": result}
    )
    return found or 0.0


def test_a_forged_sidecar_elsewhere_is_never_dialled(
    server: UsageServer, news: SidecarNews, victim: Caller, cgroups: Path
) -> None:
    """The attack as it ran, against the agent's view of the node's pods (the real
    `NodeView.injected`): the victim's pod is of a namespace that opted in, the forged one of
    another. The victim is dialled, served and heard through check after check; the forged
    pod is never dialled; no hang-up is ever told, no pod is unguarded."""
    pods = {
        UV: injected_pod("victim", UV, "team", VICTIM),
        UF: injected_pod("forged", UF, "elsewhere", FORGED),
    }
    node = NodeView(lambda: pods, lambda: TEAM, Declares("vram-enforcer.io/vram"))
    server.publish_pods(directory_of(pods))
    dialled: list[str] = []
    dials = recording(dialled)
    watch = watching(node.injected, server, news, dials)
    with in_its_own_namespaces(link_to(victim), cgroups / f"kubepods/pod{UF}/{FORGED}"):
        wait_for(lambda: served(watch, server), what="the victim served")
        assert victim.next()["pod"] == "victim"
        for _ in range(5):
            watch.check()
            wait_for(lambda: not dials.in_flight, what="no dial in flight")
        assert dialled == [VICTIM]
        assert server.connected == {VICTIM} and not news.hang_ups() and not watch.silent


def test_a_link_in_a_sidecars_filesystem_is_never_followed(victim: Caller, cgroups: Path) -> None:
    """Were the forged pod dialled all the same (say, created before its namespace opted
    in), its link would be refused before anything is connected to: the dial ends at the
    link, and the victim's socket is never reached. So does a link one directory up. The
    victim's own socket is reached as ever."""
    own = dial_container(ProcFs(), VICTIM)
    assert isinstance(own, socket.socket), own
    own.close()
    box = cgroups / f"kubepods/pod{UF}/{FORGED}"
    with in_its_own_namespaces(link_to(victim), box):
        found = dial_container(ProcFs(), FORGED)
        assert isinstance(found, Refused), found
        assert f"{SIDECAR_SOCKET} is a symbolic link: not followed" in str(found)
    up = f"rmdir {SIDECAR_SOCKET_DIR} && ln -s /proc/{victim.pid}/root{SIDECAR_SOCKET_DIR} /run"
    other = secrets.token_hex(32)  # a container of its own: the last one's may not be gone yet
    with in_its_own_namespaces(up, cgroups / f"kubepods/pod{UF}/{other}"):
        found = dial_container(ProcFs(), other)
        assert isinstance(found, Refused), found
        assert f"{SIDECAR_SOCKET_DIR} is a symbolic link: not followed" in str(found)


def test_a_sidecar_keeps_its_live_link_through_a_connection_that_delivers_nothing(
    server: UsageServer, news: SidecarNews, victim: Caller
) -> None:
    """The victim's side of the attack: a process outside its PID namespace (the agent that
    followed the link, then refused what it found) connects to its socket and closes it
    unread. The sidecar takes it (it subscribes on it), and must not hang up its live link
    for it: the agent would take that for a killed sidecar, and hold its pod at once."""
    pods = {UV: injected_pod("victim", UV, "team", VICTIM)}
    server.publish_pods(directory_of(pods))
    watch = watching(lambda: pods, server, news, recording([]))
    wait_for(lambda: served(watch, server), what="the victim served")
    assert victim.next()["pod"] == "victim"
    assert news.watched == {VICTIM}
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stray:
            stray.connect(f"/proc/{victim.pid}/root{SIDECAR_SOCKET}")
            wait_for(
                lambda s=stray: select.select([s], [], [], 0)[0],
                what="the sidecar to take the stray connection (its subscription on it)",
            )
    before = requests("report")
    victim.send("kills 1")  # a report: on the live link, which the agent still holds
    wait_for(lambda: requests("report") > before, what="the report on the live link")
    assert not news.hang_ups() and server.connected == {VICTIM}


def said_hung(watch: SidecarWatch) -> bool:
    """Whether the watch, checking once more, says the hung dial does not answer."""
    watch.check()
    return "does not answer" in watch._failed.get(FORGED, "")


def in_thread(call: Any) -> Any:
    """`call()` on a thread of its own, failing the test if it has not returned in 10 s (a
    hang in the kernel would otherwise hang the suite); its result."""
    found: list[Any] = []
    worker = threading.Thread(target=lambda: found.append(call()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert found, "it hung"
    return found[0]


@pytest.mark.parametrize("where", [SIDECAR_SOCKET_DIR, "/run"])
def test_a_mount_that_never_answers_is_not_entered(where: str) -> None:
    """The walk to a sidecar's socket meets a FUSE mount whose server never replies: it says
    so at once, and looks nothing up inside it (the ordinary resolution waits for ever)."""
    with hung_fuse_at(where) as pid:
        pinned = Pinned.open(pid)
        assert isinstance(pinned, Pinned)
        with pinned:
            found = in_thread(lambda: open_in(ProcFs(), pinned, SIDECAR_SOCKET, stat.S_IFSOCK))
        assert isinstance(found, Planted), found
        assert f"{where} is on a fuse mount, which may never answer: not entered" in str(found)


def test_a_dial_that_hangs_in_the_kernel_costs_the_watch_nothing(
    server: UsageServer, news: SidecarNews, victim: Caller
) -> None:
    """Item 7. A dial that hangs in the kernel (here, an ordinary `stat` of a path in a hung
    FUSE mount: what the dialer's walk no longer does) runs on a thread of its own: the
    watch's checks go on completing, the victim's sidecar is dialled and served meanwhile,
    and the hung one is said, once, after its deadline."""
    with hung_fuse_at(SIDECAR_SOCKET_DIR) as hung_pid:
        hung_path = f"/proc/{hung_pid}/root{SIDECAR_SOCKET}"

        def dial(cid: str) -> Any:
            if cid == FORGED:
                os.stat(hung_path)  # waits in the kernel until the FUSE server ends
            return dial_container(ProcFs(), cid)

        pods = {
            UV: injected_pod("victim", UV, "team", VICTIM),
            UF: injected_pod("hung", UF, "team", FORGED),
        }
        server.publish_pods(directory_of(pods))
        now = [0.0]
        dials = Dialer(dial, lambda: None, TELEMETRY.unexpected.labels("sidecar-dial"), 1.0)
        watch = watching(lambda: pods, server, news, dials, clock=lambda: now[0])
        assert in_thread(lambda: served(watch, server)) is False  # a check ends; dials started
        wait_for(lambda: in_thread(lambda: served(watch, server)), what="the victim served")
        assert FORGED in dials.in_flight
        wait_for(lambda: said_hung(watch), what="the hang said")
    wait_for(lambda: not dials.in_flight, what="the hung dial to end with its mount")
