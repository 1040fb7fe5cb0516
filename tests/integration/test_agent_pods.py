"""Each sidecar's own pod, from the agent's socket: who is in which pod is proven by the
caller's cgroup (a container ID the kubelet reported in that pod's status), never by what
the caller says.

The callers are real processes, each moved into a cgroup of its own in the v2 hierarchy,
named as the kubelet names a container's (`.../pod<uid>/<container id>`), and each runs
the sidecar's real client (`AgentLink`, asking for its pod). The server is the agent's
real socket server, given the directory that the agent's pod publisher builds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubernetes import client

from enforcer.core.declaration import ENFORCED, SIDECAR, Declares
from enforcer.core.lending import tenants
from enforcer.core.model import Device, GiB, MiB, ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.core.owed import pod_owed
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod_directory import Directory, directory, event_about, kept
from enforcer.core.protocol import SIDECAR_SOCKET
from enforcer.core.sidecar_presence import FIRST_RETRY
from enforcer.edge import sidecar_dialer
from enforcer.edge.events import EventRecorder
from enforcer.edge.kube import api_client
from enforcer.edge.pod_conditions import ConditionWriter
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sidecar_dialer import dial_container
from enforcer.edge.usage_server import (
    LINES_PER_SECOND,
    ServerHooks,
    ServerMetrics,
    UsageServer,
)
from enforcer.modes.agent import _served
from enforcer.modes.last_enforcement import LastEnforcement
from enforcer.modes.pod_metrics import PodCounts
from enforcer.modes.pod_publisher import PodPublisher
from enforcer.modes.sidecar_watch import HANDED_FOR, SidecarNews, SidecarProcesses, SidecarWatch
from tests import pods_api
from tests.helpers import POD_NAMESPACES, children, scratch_cgroup, wait_for
from tests.integration.conftest import TELEMETRY, check_and_dial, dialer, serving

ROOT = Path(__file__).resolve().parents[2]
# Container IDs of this run's own: the agent looks for a container's processes in the whole
# host's /proc, where another run of these tests (CI, a neighbour's) may have its own.
A, B, C = (secrets.token_hex(32) for _ in range(3))
# pod UIDs, as the kubelet names pod cgroups after them
UA, UB, UC, UF = (f"{d * 8}-0000-4000-8000-{d * 12}" for d in "abcf")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, pidfds)")

# A process of the pod that connects to its sidecar's socket, poses as the agent with a pod of
# its choosing, and says whether the sidecar hung up on it.
INTRUDER = textwrap.dedent(
    """
    import json, socket, sys
    sys.path.insert(0, sys.argv[2])
    from enforcer.core.protocol import PodReply, encode_pod
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.settimeout(10)
    try:
        s.sendall(encode_pod(PodReply({"metadata": {"name": "forged"}}, None)))
        answer = s.recv(100)
    except (BrokenPipeError, ConnectionResetError):  # closed before our line, or with it unread
        answer = b""
    print(json.dumps({"intruder": "answered" if answer else "hung up on"}), flush=True)
    """
)
# A process of the sidecar's container (a child of it, or one exec'd into it) that takes its
# socket: removes it and listens on the path itself, to be served as the sidecar.
PLANTED = textwrap.dedent(
    """
    import json, os, socket, sys
    os.read(0, 3)  # "go": in the sidecar's container (its cgroup) by now
    os.unlink(sys.argv[1])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1])
    s.listen()
    print(json.dumps({"planted": os.getpid()}), flush=True)  # its pid in the pod
    held = []
    while True:
        held.append(s.accept()[0])
    """
)
CALLER = (
    textwrap.dedent(
        """
    import json, os, selectors, subprocess, sys
    sys.path.insert(0, sys.argv[2])
    from enforcer.core.protocol import EventRequest
    from enforcer.core.sidecar_report import SidecarReport
    from enforcer.edge.agent_link import AgentLink
    os.read(0, 3)  # "go": moved into its container's cgroup by now
    mode, where = sys.argv[1].split(":", 1)  # dial:PATH, or listen:PATH (the agent dials it)
    # What it starts beside it, in its pod (and its container), when told to
    BESIDE = {"intrude": INTRUDER_CODE, "spawn": "import time; time.sleep(600)", "plant": PLANTED_CODE}
    source = AgentLink(where, 60.0, pod=True, listen=where if mode == "listen" else None)
    seen = 0
    while True:
        source.sample()
        if source.pod_replies != seen:
            seen = source.pod_replies
            reply = source.pod_reply
            pod = reply.pod
            name = None if pod is None else pod["metadata"]["name"]
            print(json.dumps({"pod": name, "problem": reply.problem,
                              "phase": None if pod is None else pod["status"].get("phase"),
                              "managed": None if pod is None else "managedFields" in pod["metadata"]}),
                  flush=True)
        with selectors.DefaultSelector() as s:
            s.register(sys.stdin, selectors.EVENT_READ)
            if (fd := source.fileno()) is not None:
                s.register(fd, selectors.EVENT_READ)
            for key, _ in s.select(1.0):
                if key.fileobj is sys.stdin:  # lines of "reason container message": report them
                    lines = os.read(0, 65536).decode()
                    if not lines:
                        sys.exit(0)  # the test has gone: so does its caller
                    for line in lines.splitlines():
                        if line.startswith("kills "):  # its counts: so many SIGKILLs
                            source.send_report(SidecarReport(actions={"kill": int(line[6:])}))
                            continue
                        if line.startswith("denied "):  # its counts: so many signals refused
                            source.send_report(SidecarReport(refused={"denied": int(line[7:])}))
                            continue
                        if line.startswith("burst "):  # so many reports at once
                            for i in range(int(line[6:])):
                                source.send_event(EventRequest("VRAMNearLimit", f"{i}", True))
                            continue
                        if line in BESIDE:  # a process beside it, in this pod
                            subprocess.Popen([sys.executable, "-c", BESIDE[line], where, sys.argv[2]],
                                             stdin=subprocess.DEVNULL)
                            continue
                        reason, container, message = line.split(" ", 2)
                        source.send_event(EventRequest(reason, message, True,
                                                       None if container == "-" else container))
    """
    )
    .replace("INTRUDER_CODE", repr(INTRUDER))
    .replace("PLANTED_CODE", repr(PLANTED))
)


TEAM = frozenset({"team"})  # the namespace that opted in


def pod(
    name: str,
    uid: str,
    *container_ids: str,
    labels: dict[str, str] | None = None,
    names: tuple[str, ...] = (),
    namespace: str = "team",
    phase: str = "Running",
) -> Pod:
    """A pod that the webhook injected (labelled enforced, of a namespace of TEAM, with its
    sidecar), as the agent's watch keeps it (`kept`), from one as the API server sends it;
    its containers of `container_ids` are named `names`, else the first is the sidecar and
    the others c1, c2, ...; a container `trainer` is in its spec too."""
    if not names and container_ids:
        names = (SIDECAR, *(f"c{i}" for i in range(1, len(container_ids))))
    statuses = [
        {"name": n, "containerID": f"containerd://{cid}"}
        for n, cid in zip(names, container_ids, strict=True)
    ]
    doc: dict[str, Any] = {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "labels": {ENFORCED: "true", **(labels or {})},
            "managedFields": [{"manager": "kubectl"}],
        },
        "spec": {"containers": [{"name": n} for n in dict.fromkeys((*names, "trainer"))]},
        "status": {"phase": phase, "containerStatuses": statuses},
    }
    return kept(cast(Pod, doc))


def node(pods: list[Pod], problem: str | None = None) -> Directory:
    """The directory of replies the agent's pod publisher makes of these pods."""
    return directory(pods, {}, problem, opted_in=TEAM)


class Caller:
    """A process in container `cid` of pod `uid` (its cgroup says so), asking for its pod:
    connecting to the agent's socket, or (`listen`) as a sidecar in a pod's namespaces of
    its own, waiting on its socket for the agent to connect."""

    def __init__(
        self, socket_path: Path, cgroups: Path, uid: str, cid: str | None, listen: bool = False
    ) -> None:
        self.cgroups = cgroups
        self.unread = b""
        command = [sys.executable, "-c", CALLER, f"dial:{socket_path}", str(ROOT)]
        if listen:
            command = [*POD_NAMESPACES, *command[:3], f"listen:{SIDECAR_SOCKET}", str(ROOT)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        # The sidecar's own process (not unshare's, which stays in the host's namespaces).
        self.pid = (
            wait_for(lambda: children(self.proc.pid), what="the pod's first process")[0]
            if listen
            else self.proc.pid
        )
        if cid is not None:
            self.move(self.pid, uid, cid)
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def move(self, pid: int, uid: str, cid: str) -> None:
        where = self.cgroups / f"kubepods/pod{uid}/{cid}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "cgroup.procs").write_text(str(pid))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n")
        self.proc.stdin.flush()

    def listening(self) -> bool:
        return Path(f"/proc/{self.pid}/root{SIDECAR_SOCKET}").exists()

    def report(self, reason: str, container: str, message: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{reason} {container} {message}\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = 30.0) -> dict[str, Any]:
        """The caller's next line; a caller that says nothing for `timeout` fails the test
        rather than hanging it. Read unbuffered, so that a line read ahead is not missed."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.unread:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"the caller said nothing for {timeout}s"
            chunk = os.read(fd, 65536)
            assert chunk, "the caller ended"
            self.unread += chunk
        line, self.unread = self.unread.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stop(self) -> None:
        if self.pid != self.proc.pid:  # the first process of its PID namespace: all go with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()


def pods_pushed() -> float:
    found = TELEMETRY.registry.get_sample_value(
        "vram_enforcer_agent_requests_total", {"result": "pod"}
    )
    return found or 0.0


@pytest.fixture
def cgroups() -> Iterator[Path]:
    with scratch_cgroup() as path:
        yield path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UsageServer]:
    """The usage server of an agent that serves pods: their sidecars alone."""
    with serving(tmp_path / "agent.sock", ServerHooks(sidecars_only=True)) as s:
        yield s


def test_each_caller_gets_the_pod_its_cgroup_proves_and_no_other(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """A process in a container that pod-a lists is told about pod-a; one in pod-b's about
    pod-b; one in a container no pod lists (a pod of another node, or one the kubelet has
    not reported yet) and one in no container at all get no pod, and say why."""
    server.publish_pods(node([pod("pod-a", UA, A), pod("pod-b", UB, B)]))
    sock = tmp_path / "agent.sock"
    callers = [
        Caller(sock, cgroups, UA, A),
        Caller(sock, cgroups, UB, B),
        Caller(sock, cgroups, UC, C),
        Caller(sock, cgroups, "", None),
    ]
    try:
        in_a, in_b, unknown, outside = (c.next() for c in callers)
        assert (in_a["pod"], in_b["pod"]) == ("pod-a", "pod-b")
        assert in_a["managed"] is False  # trimmed: the largest part of a pod, read by no one
        assert unknown["pod"] is None and f"container {C[:12]}" in unknown["problem"]
        assert outside["pod"] is None and "runs in no container" in outside["problem"]
    finally:
        for c in callers:
            c.stop()


def test_a_change_of_the_pod_is_pushed_to_its_callers_only(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """The agent pushes a pod when its reply changed (a restart gives the container a new
    ID in the status); a caller whose pod did not change is sent nothing; a container that
    appears in a pod's status later (the kubelet's report of a new pod) gets its pod then."""
    pods = [pod("pod-a", UA, A), pod("pod-b", UB, B)]
    before = pods_pushed()
    server.publish_pods(node(pods))
    sock = tmp_path / "agent.sock"
    in_a, in_b, late = (
        Caller(sock, cgroups, UA, A),
        Caller(sock, cgroups, UB, B),
        Caller(sock, cgroups, UA, C),
    )
    try:
        assert in_a.next()["pod"] == "pod-a" and in_b.next()["pod"] == "pod-b"
        assert late.next()["pod"] is None
        restarted = pod("pod-a", UA, A, C, names=(SIDECAR, SIDECAR), phase="Pending")
        server.publish_pods(node([restarted, pods[1]], "the API is slow"))
        assert in_a.next() == {
            "pod": "pod-a",
            "problem": "the API is slow",
            "phase": "Pending",
            "managed": False,
        }
        assert late.next()["pod"] == "pod-a"
        assert in_b.next()["problem"] == "the API is slow"  # its reply changed: the problem
        server.publish_pods(node([restarted, pods[1]], "the API is slow"))
        server.publish_pods(node([restarted, pods[1]]))
        assert in_b.next() == {
            "pod": "pod-b",
            "problem": None,
            "phase": "Running",
            "managed": False,
        }
        # 3 pushes each for the two publishes that changed replies, none for the one between
        # (counted as each is sent: the last two may follow the one read above)
        wait_for(lambda: pods_pushed() - before >= 6, what="six pushes")
        assert pods_pushed() - before == 6
    finally:
        for c in (in_a, in_b, late):
            c.stop()


def test_two_pods_that_list_one_container_tell_neither(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """Only the kubelet writes a pod's status, but a caller must never be told about a pod
    it is not proven to be in: an ID listed twice proves neither."""
    server.publish_pods(node([pod("pod-a", UA, A), pod("forged", UF, A)]))
    caller = Caller(tmp_path / "agent.sock", cgroups, UA, A)
    try:
        assert caller.next()["pod"] is None
    finally:
        caller.stop()


def test_an_agent_without_the_api_says_so(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    caller = Caller(tmp_path / "agent.sock", cgroups, UA, A)
    try:
        reply = caller.next()
        assert reply["pod"] is None and "does not serve pods" in reply["problem"]
    finally:
        caller.stop()


def test_a_report_is_posted_on_the_callers_own_pod_and_nowhere_else(
    cgroups: Path, tmp_path: Path
) -> None:
    """Sidecars post no Events: they hand their reports to the agent, which posts each on
    the pod the caller's cgroup proves, about a container only when it is that pod's. A
    caller in no pod of the node posts nothing; a malformed report is dropped and the
    subscription goes on."""
    posted: list[tuple[str, str, str, str | None]] = []
    events = ServerHooks(
        events=lambda p, e: posted.append(
            (p["metadata"]["name"], e.reason, e.message, p_field(event_about(p, e.container)))
        )
    )
    with serving(tmp_path / "agent.sock", events) as server:
        pods = [pod("pod-a", UA, A), pod("pod-b", UB, B)]
        server.publish_pods(node(pods))
        sock = tmp_path / "agent.sock"
        in_a, stranger = Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UC, C)
        try:
            assert in_a.next()["pod"] == "pod-a" and stranger.next()["pod"] is None
            in_a.report("VRAMEnforced", "trainer", "sent SIGTERM to pid 7")
            in_a.report("VRAMEnforced", "c9", "about a container pod-a does not have")
            in_a.report("Killing", "trainer", "not one of ours")  # dropped, counted as an error
            # The agent's own word, which no process of the pod may forge: dropped too.
            in_a.report("VRAMSidecarSilent", "-", "the sidecar is back, all is well")
            stranger.report("VRAMEnforced", "-", "from a container no pod lists")
            in_a.report("VRAMNearLimit", "-", "the pod as a whole")
            in_a.report("VRAMWouldEnforce", "trainer", "would have sent SIGTERM to pid 7")
            wait_for(lambda: len(posted) == 4, what="four Events")
            assert posted == [
                ("pod-a", "VRAMEnforced", "sent SIGTERM to pid 7", "spec.containers{trainer}"),
                ("pod-a", "VRAMEnforced", "about a container pod-a does not have", None),
                ("pod-a", "VRAMNearLimit", "the pod as a whole", None),
                (
                    "pod-a",
                    "VRAMWouldEnforce",
                    "would have sent SIGTERM to pid 7",
                    "spec.containers{trainer}",
                ),
            ]
            changed = pod("pod-b", UB, B, phase="Pending")
            server.publish_pods(node([pods[0], changed]))
            server.publish_pods(node(pods, "still subscribed"))
            assert in_a.next()["problem"] == "still subscribed"  # the bad report cost nothing
        finally:
            in_a.stop()
            stranger.stop()


def requests(result: str) -> float:
    found = TELEMETRY.registry.get_sample_value(
        "vram_enforcer_agent_requests_total", {"result": result}
    )
    return found or 0.0


def test_only_the_sidecar_of_a_pod_the_webhook_injected_is_served(
    cgroups: Path, tmp_path: Path
) -> None:
    """Issue 42, items 10 and 11. Three callers subscribe: pod-a's sidecar, the workload
    beside it, and the container named like the sidecar of a pod that carries the enforced
    label in a namespace that did not opt in (the webhook never saw it). Only the sidecar
    gets its pod, counts as connected, and has its Event posted and its counts kept; the
    others are told why, and each of their requests is counted as refused."""
    posted: list[tuple[str, str]] = []
    counts = PodCounts()
    hooks = ServerHooks(
        events=lambda p, e: posted.append((p["metadata"]["name"], e.message)),
        reports=counts.keep,
        sidecars_only=True,
    )
    pods = [
        pod("pod-a", UA, A, B, names=(SIDECAR, "trainer")),
        pod("forged", UF, C, namespace="elsewhere"),
    ]
    with serving(tmp_path / "agent.sock", hooks) as server:
        server.publish_pods(node(pods))
        sock = tmp_path / "agent.sock"
        sidecar, workload = Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UA, B)
        stranger = Caller(sock, cgroups, UF, C)
        try:
            assert sidecar.next()["pod"] == "pod-a"
            said = workload.next()
            assert said["pod"] is None
            assert "'trainer' of pod team/pod-a is not its vram-enforcer sidecar" in said["problem"]
            said = stranger.next()
            assert (
                said["pod"] is None and "pod elsewhere/forged was not injected" in said["problem"]
            )
            wait_for(lambda: A in server.connected, what="the sidecar counted as there")
            before = requests("refused")
            for caller in (workload, stranger):
                caller.report("VRAMEnforced", "-", "forged")
                caller.send("kills 9")
            wait_for(lambda: requests("refused") == before + 4, what="four requests refused")
            sidecar.report("VRAMEnforced", "-", "real")
            sidecar.send("kills 1")
            wait_for(lambda: posted == [("pod-a", "real")], what="the sidecar's Event")
            wanted = {("team", "pod-a"): {"kill": 1}}
            by_uid = {p["metadata"]["uid"]: p for p in pods}
            wait_for(
                lambda: {k: r.actions for k, r in counts.of(by_uid).values()} == wanted,
                what="the sidecar's counts",
            )
            assert server.connected == {A} and set(server.peers) == {A}
        finally:
            for caller in (sidecar, workload, stranger):
                caller.stop()


def test_a_caller_that_floods_is_read_a_second_at_a_time_and_loses_nothing(
    cgroups: Path, tmp_path: Path
) -> None:
    """Issue 42, item 10: a sidecar taken over sent 44,000 lines a second, each parsed on the
    socket's one thread. Past LINES_PER_SECOND in a second a connection is not read until
    the next (its lines wait in the kernel), and every line is answered in the end."""
    posted: list[str] = []
    hooks = ServerHooks(events=lambda p, e: posted.append(e.message), sidecars_only=True)
    with serving(tmp_path / "agent.sock", hooks) as server:
        server.publish_pods(node([pod("pod-a", UA, A)]))
        caller = Caller(tmp_path / "agent.sock", cgroups, UA, A)
        try:
            assert caller.next()["pod"] == "pod-a"
            before = requests("limited")
            caller.send(f"burst {3 * LINES_PER_SECOND}")
            wait_for(lambda: requests("limited") > before, what="the caller to be held back")
            wait_for(lambda: len(posted) == 3 * LINES_PER_SECOND, what="every line answered")
            assert posted == [str(i) for i in range(3 * LINES_PER_SECOND)]  # in order
        finally:
            caller.stop()


def p_field(ref: ObjectReference) -> str | None:
    return ref.get("fieldPath")


def test_an_agent_restart_keeps_the_pod_and_delivers_the_reports_made_meanwhile(
    cgroups: Path, tmp_path: Path
) -> None:
    """While the agent is away (a rolling upgrade), the sidecar keeps its pod and what it
    reports waits; the new agent sends the pod again and posts what waited, once."""
    sock, posted = tmp_path / "agent.sock", []
    t = TELEMETRY

    def agent() -> UsageServer:
        s = UsageServer(
            sock,
            ProcFs(),
            ServerMetrics(t.requests, t.connections, t.unexpected),
            stale_after=60.0,
            hooks=ServerHooks(events=lambda p, e: posted.append((id(s), e.message))),
        )
        s.start()
        s.publish_pods(node([pod("pod-a", UA, A)]))
        return s

    first = agent()
    caller = Caller(sock, cgroups, UA, A)
    second = None
    try:
        assert caller.next()["pod"] == "pod-a"
        caller.report("VRAMNearLimit", "trainer", "before")
        wait_for(lambda: posted == [(id(first), "before")], what="the first report")
        first.close()
        caller.report("VRAMUsageUnknown", "-", "while the agent was away")
        second = agent()
        assert caller.next()["pod"] == "pod-a"  # sent again, on the new connection
        wait_for(lambda: len(posted) == 2, what="the report made meanwhile")
        assert posted[1] == (id(second), "while the agent was away")
    finally:
        caller.stop()
        if second is not None:
            second.close()


def test_a_sidecars_counts_are_kept_for_its_own_pod_and_sent_again_to_a_new_agent(
    cgroups: Path, tmp_path: Path
) -> None:
    """The agent serves every pod's metrics, the sidecar none: it sends its counts over its
    connection, and the agent keeps them for the pod the caller's cgroup proves, only from
    that pod's sidecar container (the workload beside it, or a process of no pod, speaks
    for no pod). While the agent is away only the latest counts wait; the new agent gets
    them on the new connection, whether or not they changed since."""
    sock, t = tmp_path / "agent.sock", TELEMETRY
    pods = {UA: pod("pod-a", UA, A, B, names=(SIDECAR, "trainer"))}

    def agent() -> tuple[UsageServer, PodCounts]:
        counts = PodCounts()
        s = UsageServer(
            sock,
            ProcFs(),
            ServerMetrics(t.requests, t.connections, t.unexpected),
            stale_after=60.0,
            hooks=ServerHooks(reports=counts.keep),
        )
        s.start()
        s.publish_pods(node(list(pods.values())))
        return s, counts

    def kills(counts: PodCounts) -> dict[tuple[str, str], Mapping[str, int]]:
        return {key: report.actions for key, report in counts.of(pods).values()}

    first, counts = agent()
    sidecar, workload = Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UA, B)
    stranger, second = Caller(sock, cgroups, UC, C), None
    try:
        for caller in (sidecar, workload, stranger):
            caller.next()
        workload.send("kills 99")
        stranger.send("kills 98")
        sidecar.send("kills 1")
        wait_for(lambda: kills(counts) == {("team", "pod-a"): {"kill": 1}}, what="the counts")
        time.sleep(0.5)  # the workload's and the stranger's were read, and not kept
        assert kills(counts) == {("team", "pod-a"): {"kill": 1}}
        first.close()
        sidecar.send("kills 2")
        sidecar.send("kills 3")  # the latest is what waits
        second, counts = agent()
        assert sidecar.next()["pod"] == "pod-a"
        wait_for(lambda: kills(counts) == {("team", "pod-a"): {"kill": 3}}, what="the new counts")
        assert counts.of({}) == {}  # a pod gone from the node: its counts go too
    finally:
        for caller in (sidecar, workload, stranger):
            caller.stop()
        if second is not None:
            second.close()


def test_a_stopped_sidecar_is_no_longer_counted_as_there(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """A workload that stops its sidecar (SIGSTOP) leaves its connection open: the agent
    must see that nobody reads it. A small send buffer blocks it after a few samples, and
    a blocked subscription does not count; once it reads again, it counts again."""
    server.publish_pods(node([pod("pod-a", UA, A)]))
    caller = Caller(tmp_path / "agent.sock", cgroups, UA, A)
    try:
        assert caller.next()["pod"] == "pod-a"
        wait_for(lambda: A in server.connected, what="the sidecar counted as there")
        os.kill(caller.proc.pid, signal.SIGSTOP)
        for i in range(400):  # samples, as the sampler publishes them, unread now
            server.publish(SourceDown(f"sample {i}"))
            time.sleep(0.002)
        wait_for(lambda: A not in server.connected, what="the stopped sidecar not counted")
        os.kill(caller.proc.pid, signal.SIGCONT)
        wait_for(lambda: A in server.connected, what="the sidecar counted again")
    finally:
        os.kill(caller.proc.pid, signal.SIGCONT)
        caller.stop()


def refused() -> float:
    found = TELEMETRY.registry.get_sample_value(
        "vram_enforcer_agent_requests_total", {"result": "refused"}
    )
    return found or 0.0


def dial(container_id: str) -> socket.socket:
    found = dial_container(ProcFs(), container_id)
    assert isinstance(found, socket.socket), found
    return found


def test_the_agent_connects_to_a_sidecar_in_its_own_filesystem_and_again_after_a_restart(
    cgroups: Path, tmp_path: Path
) -> None:
    """No hostPath: the sidecar listens in its own mount namespace, and the agent reaches
    its socket through /proc/<pid>/root of the process whose cgroup names the sidecar's
    container. The conversation is the one a sidecar that connects has: its pod, pushed,
    and its reports posted on it. A new agent (an upgrade, a crash) connects again."""
    posted: list[str] = []
    t = TELEMETRY

    def agent() -> UsageServer:
        s = UsageServer(
            tmp_path / "agent.sock",
            ProcFs(),
            ServerMetrics(t.requests, t.connections, t.unexpected),
            stale_after=60.0,
            hooks=ServerHooks(
                events=lambda p, e: posted.append(f"{p['metadata']['name']}: {e.message}")
            ),
        )
        s.start()
        s.publish_pods(node([pod("pod-a", UA, A), pod("pod-b", UB, B)]))
        return s

    first = agent()
    sidecar = Caller(tmp_path / "unused", cgroups, UA, A, listen=True)
    second = None
    try:
        wait_for(sidecar.listening, what="the sidecar to listen")
        assert dial_container(ProcFs(), B) == "no process of it runs on this node"
        first.adopt(A, dial(A))
        assert sidecar.next()["pod"] == "pod-a"
        wait_for(lambda: A in first.connected, what="the sidecar counted as there")
        sidecar.report("VRAMEnforced", "trainer", "sent SIGTERM to pid 7")
        wait_for(lambda: posted == ["pod-a: sent SIGTERM to pid 7"], what="the report")
        first.adopt(A, dial(A))  # the agent connects again (it no longer counted the first)
        assert sidecar.next()["pod"] == "pod-a"  # sent on the new connection, taken over
        wait_for(
            lambda: TELEMETRY.registry.get_sample_value("vram_enforcer_agent_connections") == 1,
            what="the old connection closed",
        )
        first.close()
        second = agent()
        sidecar.report("VRAMNearLimit", "-", "while no agent was there")
        second.adopt(A, dial(A))
        assert sidecar.next()["pod"] == "pod-a"
        wait_for(lambda: posted[1:] == ["pod-a: while no agent was there"], what="the report")
    finally:
        sidecar.stop()
        (second or first).close()


def test_a_dial_that_cannot_make_its_socket_leaks_no_descriptor(
    cgroups: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors (EMFILE) when the socket is made, after the walk opened the
    sidecar's: the dial says why and closes the walk's descriptor; an agent that leaked one
    per dial on a full node would run out for good."""
    sidecar = Caller(tmp_path / "unused", cgroups, UA, A, listen=True)
    try:
        wait_for(sidecar.listening, what="the sidecar to listen")
        dial(A).close()  # the walk and the socket work: the failure below is the socket's
        before = sorted(os.listdir("/proc/self/fd"))

        def no_descriptors(*args: object) -> socket.socket:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        monkeypatch.setattr(sidecar_dialer.socket, "socket", no_descriptors)
        found = dial_container(ProcFs(), A)
        monkeypatch.undo()
        assert found == (
            f"cannot connect to {SIDECAR_SOCKET} of the sidecar (pid {sidecar.pid}): "
            "Too many open files"
        )
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        sidecar.stop()


def test_a_process_of_the_pod_cannot_pose_as_the_agent(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """A root workload shares the sidecar's PID namespace (and, here, its filesystem): it
    connects to the sidecar's socket with a pod of its own making. The sidecar hangs up on
    it (a caller it can name is in its own PID namespace, so not the agent), and takes its
    pod from the agent alone."""
    server.publish_pods(node([pod("pod-a", UA, A)]))
    sidecar = Caller(tmp_path / "unused", cgroups, UA, A, listen=True)
    try:
        wait_for(sidecar.listening, what="the sidecar to listen")
        sidecar.send("intrude")
        assert sidecar.next() == {"intruder": "hung up on"}
        server.adopt(A, dial(A))
        assert sidecar.next()["pod"] == "pod-a"  # the first pod it took: the agent's
        sidecar.send("intrude")  # again, while the agent is connected
        assert sidecar.next() == {"intruder": "hung up on"}
        server.publish_pods(node([pod("pod-a", UA, A, phase="Pending")]))
        assert sidecar.next()["phase"] == "Pending"  # still the agent's connection
        assert A in server.connected
    finally:
        sidecar.stop()


def test_a_socket_that_another_container_listens_on_is_closed_unread(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """The agent finds the sidecar by its container's cgroup, then the socket in that
    process's filesystem. If the socket there is held by a process of another container (a
    pid reused meanwhile, or a workload's socket in the sidecar's place), the agent closes
    the connection without a word, and serves the sidecar that is proven: the dialer, for
    a listener that is not the container's first process, and the server, for one of
    another container, whoever connected."""
    server.publish_pods(node([pod("pod-a", UA, A), pod("pod-b", UB, B)]))
    listener = Caller(tmp_path / "unused", cgroups, UB, B, listen=True)  # the socket: B's
    try:
        wait_for(listener.listening, what="the socket")
        listener.send("spawn")  # a process of container A, in the same filesystem
        spawned = wait_for(lambda: children(listener.pid), what="the spawned process")[0]
        listener.move(spawned, UA, A)
        found = dial_container(ProcFs(), A)
        assert not isinstance(found, socket.socket), "a socket of container B served as A's"
        assert f"(pid {listener.pid}) is not the container's first process" in str(found)
        before = refused()
        past_the_dialer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        past_the_dialer.connect(f"/proc/{spawned}/root{SIDECAR_SOCKET}")
        server.adopt(A, past_the_dialer)
        wait_for(lambda: refused() == before + 1, what="the connection refused")
        assert A not in server.connected and B not in server.connected
        server.adopt(B, dial(B))  # the same socket, for the container that holds it
        assert listener.next()["pod"] == "pod-b"
    finally:
        listener.stop()


def injected(uid: str, sidecar: str) -> Pod:
    """A running pod that the webhook injected, whose sidecar runs in container `sidecar`."""
    doc = cast(dict[str, Any], pod("pod-a", uid))
    doc["spec"]["initContainers"] = [{"name": SIDECAR}]
    doc["status"]["initContainerStatuses"] = [
        {"name": SIDECAR, "containerID": f"containerd://{sidecar}", "state": {"running": {}}}
    ]
    return cast(Pod, doc)


@pytest.mark.parametrize("planted_by", ["exec", "child"])
def test_a_process_of_the_sidecars_container_that_takes_its_socket_is_refused(
    server: UsageServer,
    cgroups: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    planted_by: str,
) -> None:
    """With `pods/exec` (in Kubernetes' default `edit` role) a tenant runs a process in the
    sidecar's container, whose parent is outside it (`exec`), or a child of the sidecar's
    (`child`): either shares the sidecar's cgroup and its filesystem. It removes the
    sidecar's socket and listens on the path itself, to be served the pod's usage and its
    pod as the sidecar, and to hand the agent reports of its own. The container's ID is the
    sidecar's, but the listener is not the container's first process: the agent refuses it,
    on every attempt (counted), and says so once. The sidecar's own listener, before, was
    taken."""
    server.publish_pods(node([pod("pod-a", UA, A)]))
    sidecar = Caller(tmp_path / "unused", cgroups, UA, A, listen=True)
    now = [0.0]
    # The agent dials A whenever its watch finds it unconnected: here, always (as after an
    # agent restart, or once the sidecar's connection is gone).
    links = SimpleNamespace(connected=frozenset(), peers={}, adopt=server.adopt)
    dials = dialer()
    watch = SidecarWatch(
        lambda: {UA: injected(UA, A)},
        cast(Any, links),
        SidecarNews(),
        cast("EventRecorder", None),
        TELEMETRY,
        (dials, SidecarProcesses(ProcFs())),
        clock=lambda: now[0],
    )
    planter = None
    try:
        wait_for(sidecar.listening, what="the sidecar to listen")
        check_and_dial(watch, dials)
        assert sidecar.next()["pod"] == "pod-a"  # its own listener: served
        if planted_by == "exec":  # as the runtime runs an exec: into its namespaces, then cgroup
            planter = subprocess.Popen(
                [
                    "nsenter",
                    f"--target={sidecar.pid}",
                    "--mount",
                    "--pid",
                    sys.executable,
                    "-c",
                    PLANTED,
                    SIDECAR_SOCKET,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            planted = wait_for(lambda: children(planter.pid), what="the exec'd process")[0]
            sidecar.move(planted, UA, A)
            assert planter.stdin is not None and planter.stdout is not None
            planter.stdin.write("go\n")
            planter.stdin.flush()
            assert "planted" in json.loads(planter.stdout.readline())
        else:
            sidecar.send("plant")
            assert "planted" in sidecar.next()
            planted = children(sidecar.pid)[0]
        before = refused()
        with caplog.at_level(logging.INFO, logger="enforcer.modes.sidecar_watch"):
            # The next two attempts, once the connection handed to the server has had its
            # time to be taken on (HANDED_FOR), then twice FIRST_RETRY later (the wait after
            # the first attempt, at 0, has doubled).
            for now[0] in (HANDED_FOR, HANDED_FOR + 2 * FIRST_RETRY):
                check_and_dial(watch, dials)
        assert refused() == before + 2, "a listener that is not the sidecar was served"
        (said,) = [r for r in caplog.records if r.name == "enforcer.modes.sidecar_watch"]
        assert said.levelno == logging.WARNING
        assert f"(pid {planted}) is not the container's first process (pid {sidecar.pid})" in (
            said.getMessage()
        )
    finally:
        sidecar.stop()  # the first process of the pod's PID namespace: the planted one goes too
        if planter is not None:
            planter.kill()
            planter.wait()


def test_a_pod_with_the_webhooks_marks_outside_the_opted_in_namespaces_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Such a pod is neither served nor held (its namespace's label was taken away, or it
    was made to look injected before its namespace opted in): nothing enforces it by
    sampling, and the agent's log says so, once, naming it; the pod publisher serves the
    other pods' sidecars as before."""
    pods = {UA: pod("pod-a", UA, A), UF: pod("forged", UF, C, namespace="elsewhere")}
    published: list[Directory] = []
    watch = SimpleNamespace(snapshot=lambda: pods, error="")
    publisher = PodPublisher(
        cast(Any, watch),
        published.append,
        None,
        threading.Event(),
        TELEMETRY,
        opted_in=lambda: TEAM,
    )
    with caplog.at_level(logging.WARNING, logger="enforcer.modes.pod_publisher"):
        publisher.publish_once()
        publisher.publish_once()
    (said,) = caplog.records
    assert "pod elsewhere/forged carries the marks" in said.getMessage()
    assert "Recreate it in a namespace that opted in" in said.getMessage()
    assert set(published[-1].replies) == {A}


@contextlib.contextmanager
def conditions_kept(
    in_pod: Pod, trainer: str, tmp_path: Path
) -> Iterator[tuple[pods_api.PodsApi, EventRecorder]]:
    """The agent's Events and conditions, wired as the agent wires them (`_served`, the
    recorder's `told`) against a stand-in of the API server, for `in_pod` (pod `UA`, its
    container `trainer` holding 5.10 GiB), served on `tmp_path / "agent.sock"`."""
    owed = pod_owed(
        in_pod, Declares("vram-enforcer.io/vram"), opted_in=TEAM, basis=None, claims=None
    )
    holder = ProcessKey(4242, 1)
    sample = Sample(
        0.0,
        (Device(0, "GPU-a", "H100", 16 * GiB, 6 * GiB),),
        (ProcessUsage(holder, "GPU-a", 5 * GiB + 102 * MiB),),
    )
    with pods_api.serving([]) as api:
        configuration = client.Configuration()
        configuration.host = api.url
        kube = api_client(configuration)
        recorder = EventRecorder(kube, "node-a", "node-a", TELEMETRY.event_failures)
        writer = ConditionWriter(kube, TELEMETRY.condition_failures)
        recorder.told = LastEnforcement(
            writer,
            lambda: {UA: in_pod},
            lambda: (sample, lambda: {holder: trainer}),
            lambda: tenants([(in_pod, owed)], {}),
            lambda: frozenset({"team"}),
        ).told
        recorder.start()
        writer.start()
        try:
            with serving(tmp_path / "agent.sock", _served(recorder).hooks) as server:
                server.publish_pods(node([in_pod]))
                yield api, recorder
        finally:
            writer.stop.set()
            recorder.close()


def declaring_trainer() -> tuple[Pod, str]:
    """Pod-a, whose container `trainer` (its ID, the second) declares 4 GiB."""
    trainer = secrets.token_hex(32)
    in_pod = pod("pod-a", UA, A, trainer, names=(SIDECAR, "trainer"))
    cast(dict[str, Any], in_pod["spec"]["containers"][1])["resources"] = {
        "limits": {"vram-enforcer.io/vram": "4Gi"}
    }
    return in_pod, trainer


def test_an_enforcement_stays_on_the_callers_own_pod_as_a_condition_in_the_agents_words(
    cgroups: Path, tmp_path: Path
) -> None:
    """A sidecar's report of an enforcement (issue 43, item 5) is kept on its own pod as the
    condition `vram-enforcer.io/Enforced`, patched by the agent on pods/status (a
    strategic-merge patch: merged by type, on the pod's UID). What it says is the agent's:
    the container and its instance from the pod's status, what the agent's last NVML pass
    saw it hold, and what the pod declares; the report's text, the tenant's, is not in it.
    A warning, and a caller in no pod, set none."""
    in_pod, trainer = declaring_trainer()
    with conditions_kept(in_pod, trainer, tmp_path) as (api, _):
        sock = tmp_path / "agent.sock"
        in_a, stranger = Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UC, C)
        try:
            assert in_a.next()["pod"] == "pod-a" and stranger.next()["pod"] is None
            in_a.report("VRAMNearLimit", "trainer", "a warning: nothing was done")
            stranger.report("VRAMEnforced", "-", "from a container no pod lists")
            in_a.report("VRAMEnforced", "trainer", "all is well, you were never stopped")
            wait_for(lambda: api.patches, what="the pod's condition")
            wait_for(lambda: len(api.posts) == 2, what="the two Events of pod-a")
        finally:
            in_a.stop()
            stranger.stop()
    ((path, kind, body),) = api.patches
    assert (path, kind) == (
        "/api/v1/namespaces/team/pods/pod-a/status",
        "application/strategic-merge-patch+json",
    )
    assert body["metadata"] == {"uid": UA}
    ((cond),) = body["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "vram-enforcer.io/Enforced",
        "True",
        "VRAMEnforced",
    )
    message = cond["message"]
    assert message.startswith("container 'trainer' was enforced over its VRAM limit"), message
    assert "the node agent saw it hold 5.10 GiB of its 4.00 GiB limit (127%)" in message
    assert f"its instance containerd://{trainer}" in message
    assert "never stopped" not in message  # the tenant's words stay in its Event
    assert cond["lastTransitionTime"] in message


def test_a_flood_of_reports_hides_no_enforcement_of_the_agents_own(
    cgroups: Path, tmp_path: Path
) -> None:
    """A workload that forges its sidecar's reports (found by review of issue 43): 40
    VRAMNearLimit empty its pod's budget of Events, but not the agent's own: the backstop's
    VRAMEnforced after them is posted, and sets the condition."""
    in_pod, trainer = declaring_trainer()
    with conditions_kept(in_pod, trainer, tmp_path) as (api, recorder):
        in_a = Caller(tmp_path / "agent.sock", cgroups, UA, A)
        try:
            assert in_a.next()["pod"] == "pod-a"
            for i in range(40):
                in_a.report("VRAMNearLimit", "trainer", f"near, time {i}")
            wait_for(lambda: len(api.posts) == 25, what="the reports' budget spent")
            recorder.record(event_about(in_pod, "trainer"), "VRAMEnforced", "the backstop's", True)
            wait_for(lambda: api.patches, what="the pod's condition")
            wait_for(lambda: len(api.posts) == 26, what="the agent's own Event")
        finally:
            in_a.stop()
    assert api.posts[-1][1]["reason"] == "VRAMEnforced"
    ((_, _, body),) = api.patches
    assert body["status"]["conditions"][0]["reason"] == "VRAMEnforced"


class Kept:
    """The condition writer's place: each condition as it would be written."""

    def __init__(self) -> None:
        self.written: list[dict[str, str] | None] = []

    def set(self, about: ObjectReference, build: Callable[[], dict[str, str] | None]) -> None:
        self.written.append(build())


def test_a_would_be_report_on_a_pod_not_in_a_dry_run_sets_no_condition() -> None:
    """A forged VRAMWouldEnforce (a reason a sidecar may report) on an enforcing pod would
    have said "would have been enforced (dry-run): nothing was signalled" on it (found by
    review of issue 43): the reason is the pod's policy's, as the agent reads it. On a pod
    in a dry run, it, and a VRAMEnforced, say would-be."""
    in_pod, _ = declaring_trainer()
    dry, _ = declaring_trainer()
    sidecar = cast(dict[str, Any], dry["spec"]["containers"][0])
    sidecar["env"] = [{"name": "VRAM_ENFORCER_DRY_RUN", "value": "true"}]
    kept = Kept()
    told = LastEnforcement(
        cast(ConditionWriter, kept),
        lambda: {UA: in_pod, "dry": dry},
        lambda: None,
        lambda: None,
        lambda: frozenset({"team"}),
    ).told
    about = event_about(in_pod, "trainer")
    told(about, "VRAMWouldEnforce")
    assert kept.written == []
    told(about, "VRAMEnforced")
    told({**about, "uid": "dry"}, "VRAMWouldEnforce")
    told({**about, "uid": "dry"}, "VRAMEnforced")
    assert [(c or {}).get("reason") for c in kept.written] == [
        "VRAMEnforced",
        "VRAMWouldEnforce",
        "VRAMWouldEnforce",
    ]


def test_a_flood_of_forged_enforcements_is_no_flood_of_condition_writes() -> None:
    """A sidecar's reports set the pod's condition only within their budget of Events (found
    by review of issue 43's fixes): 100 forged VRAMEnforced are 25 condition writes at most,
    not 100 status patches; the agent's own enforcements are told past any budget."""
    told: list[tuple[str, bool]] = []
    recorder = EventRecorder(
        cast(Any, object()), "node-a", "node-a", TELEMETRY.event_failures
    )  # never started: nothing is posted, only told
    recorder.told = lambda about, reason: told.append((reason, about.get("fieldPath") == "x"))
    about: ObjectReference = {"kind": "Pod", "uid": UA, "name": "pod-a", "fieldPath": "x"}
    for _ in range(100):
        recorder.record(about, "VRAMEnforced", "forged", True, from_sidecar=True)
    assert len(told) == 25
    for _ in range(30):
        recorder.record(about, "VRAMEnforced", "the agent's", True)
    assert len(told) == 25 + 30
