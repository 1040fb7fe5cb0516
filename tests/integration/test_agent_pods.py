"""Each sidecar's own pod, from the agent's socket: who is in which pod is proven by the
caller's cgroup (a container ID the kubelet reported in that pod's status), never by what
the caller says.

The callers are real processes, each moved into a cgroup of its own in the v2 hierarchy,
named as the kubelet names a container's (`.../pod<uid>/<container id>`), and each runs
the sidecar's real client (`AgentSource`, asking for its pod). The server is the agent's
real socket server, given the directory that the agent's pod publisher builds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from enforcer.core.model import SourceDown
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod_directory import directory, event_about
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from tests.helpers import scratch_cgroup, wait_for

ROOT = Path(__file__).resolve().parents[2]
A, B, C = ("a" * 64, "b" * 64, "c" * 64)
# pod UIDs, as the kubelet names pod cgroups after them
UA, UB, UC, UF = (f"{d * 8}-0000-4000-8000-{d * 12}" for d in "abcf")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, pidfds)")

CALLER = textwrap.dedent(
    """
    import json, os, selectors, sys
    sys.path.insert(0, sys.argv[2])
    from enforcer.core.protocol import EventRequest
    from enforcer.edge.sources import AgentSource
    os.read(0, 3)  # "go": moved into its container's cgroup by now
    source = AgentSource(sys.argv[1], 60.0, pod=True)
    seen = 0
    while True:
        source.sample()
        if source.pod_replies != seen:
            seen = source.pod_replies
            reply = source.pod_reply
            pod = reply.pod
            name = None if pod is None else pod["metadata"]["name"]
            print(json.dumps({"pod": name, "problem": reply.problem,
                              "labels": None if pod is None else pod["metadata"].get("labels"),
                              "managed": None if pod is None else "managedFields" in pod["metadata"]}),
                  flush=True)
        with selectors.DefaultSelector() as s:
            s.register(sys.stdin, selectors.EVENT_READ)
            if (fd := source.fileno()) is not None:
                s.register(fd, selectors.EVENT_READ)
            for key, _ in s.select(1.0):
                if key.fileobj is sys.stdin:  # lines of "reason container message": report them
                    for line in os.read(0, 65536).decode().splitlines():
                        reason, container, message = line.split(" ", 2)
                        source.send_event(EventRequest(reason, message, True,
                                                       None if container == "-" else container))
    """
)


def pod(name: str, uid: str, *container_ids: str, labels: dict[str, str] | None = None) -> Pod:
    statuses = [{"name": f"c{i}", "containerID": f"containerd://{cid}"}
                for i, cid in enumerate(container_ids)]  # fmt: skip
    doc: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "team", "uid": uid, "labels": labels or {},
                     "managedFields": [{"manager": "kubectl"}]},
        "spec": {"containers": [{"name": f"c{i}"} for i in range(len(container_ids))]},
        "status": {"containerStatuses": statuses},
    }  # fmt: skip
    return cast(Pod, doc)


class Caller:
    """A process in container `cid` of pod `uid` (its cgroup says so), asking for its pod."""

    def __init__(self, socket_path: Path, cgroups: Path, uid: str, cid: str | None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CALLER, str(socket_path), str(ROOT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        if cid is not None:
            where = cgroups / f"kubepods/pod{uid}/{cid}"
            where.mkdir(parents=True, exist_ok=True)
            (where / "cgroup.procs").write_text(str(self.proc.pid))
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def report(self, reason: str, container: str, message: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{reason} {container} {message}\n")
        self.proc.stdin.flush()

    def next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the caller ended"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


TELEMETRY = AgentTelemetry()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UsageServer]:
    t = TELEMETRY
    metrics = ServerMetrics(t.requests, t.connections, t.unexpected)
    s = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=60.0)
    s.start()
    yield s
    s.close()


def pods_pushed() -> float:
    found = TELEMETRY.registry.get_sample_value("vram_enforcer_agent_requests_total",
                                                {"result": "pod"})  # fmt: skip
    return found or 0.0


@pytest.fixture
def cgroups() -> Iterator[Path]:
    with scratch_cgroup() as path:
        yield path


def test_each_caller_gets_the_pod_its_cgroup_proves_and_no_other(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """A process in a container that pod-a lists is told about pod-a; one in pod-b's about
    pod-b; one in a container no pod lists (a pod of another node, or one the kubelet has
    not reported yet) and one in no container at all get no pod, and say why."""
    server.publish_pods(directory([pod("pod-a", UA, A), pod("pod-b", UB, B)], {}, None))
    sock = tmp_path / "agent.sock"
    callers = [Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UB, B),
               Caller(sock, cgroups, UC, C), Caller(sock, cgroups, "", None)]  # fmt: skip
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
    server.publish_pods(directory(pods, {}, None))
    sock = tmp_path / "agent.sock"
    in_a, in_b, late = (Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UB, B),
                        Caller(sock, cgroups, UA, C))  # fmt: skip
    try:
        assert in_a.next()["pod"] == "pod-a" and in_b.next()["pod"] == "pod-b"
        assert late.next()["pod"] is None
        restarted = pod("pod-a", UA, A, C, labels={"restarts": "1"})
        server.publish_pods(directory([restarted, pods[1]], {}, "the API is slow"))
        assert in_a.next() == {"pod": "pod-a", "problem": "the API is slow",
                               "labels": {"restarts": "1"}, "managed": False}  # fmt: skip
        assert late.next()["pod"] == "pod-a"
        assert in_b.next()["problem"] == "the API is slow"  # its reply changed: the problem
        server.publish_pods(directory([restarted, pods[1]], {}, "the API is slow"))
        server.publish_pods(directory([restarted, pods[1]], {}, None))
        assert in_b.next() == {"pod": "pod-b", "problem": None, "labels": {}, "managed": False}
        # 3 pushes each for the two publishes that changed replies, none for the one between
        assert pods_pushed() - before == 6
    finally:
        for c in (in_a, in_b, late):
            c.stop()


def test_two_pods_that_list_one_container_tell_neither(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """Only the kubelet writes a pod's status, but a caller must never be told about a pod
    it is not proven to be in: an ID listed twice proves neither."""
    server.publish_pods(directory([pod("pod-a", UA, A), pod("forged", UF, A)], {}, None))
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
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """Sidecars post no Events: they hand their reports to the agent, which posts each on
    the pod the caller's cgroup proves, about a container only when it is that pod's. A
    caller in no pod of the node posts nothing; a malformed report is dropped and the
    subscription goes on."""
    posted: list[tuple[str, str, str, str | None]] = []
    server.events = lambda p, e: posted.append(
        (p["metadata"]["name"], e.reason, e.message, p_field(event_about(p, e.container)))
    )
    pods = [pod("pod-a", UA, A), pod("pod-b", UB, B)]
    server.publish_pods(directory(pods, {}, None))
    sock = tmp_path / "agent.sock"
    in_a, stranger = Caller(sock, cgroups, UA, A), Caller(sock, cgroups, UC, C)
    try:
        assert in_a.next()["pod"] == "pod-a" and stranger.next()["pod"] is None
        in_a.report("VRAMEnforced", "c0", "sent SIGTERM to pid 7")
        in_a.report("VRAMEnforced", "c9", "about a container pod-a does not have")
        in_a.report("Killing", "c0", "not one of ours")  # dropped, and counted as an error
        stranger.report("VRAMEnforced", "-", "from a container no pod lists")
        in_a.report("VRAMNearLimit", "-", "the pod as a whole")
        wait_for(lambda: len(posted) == 3, what="three Events")
        assert posted == [
            ("pod-a", "VRAMEnforced", "sent SIGTERM to pid 7", "spec.containers{c0}"),
            ("pod-a", "VRAMEnforced", "about a container pod-a does not have", None),
            ("pod-a", "VRAMNearLimit", "the pod as a whole", None),
        ]
        server.publish_pods(directory([pods[0], pod("pod-b", UB, B, labels={"x": "y"})], {}, None))
        server.publish_pods(directory(pods, {}, "still subscribed"))
        assert in_a.next()["problem"] == "still subscribed"  # the bad report cost nothing
    finally:
        in_a.stop()
        stranger.stop()


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
        s = UsageServer(sock, ProcFs(), ServerMetrics(t.requests, t.connections, t.unexpected),
                        stale_after=60.0)  # fmt: skip
        s.events = lambda p, e: posted.append((id(s), e.message))
        s.start()
        s.publish_pods(directory([pod("pod-a", UA, A)], {}, None))
        return s

    first = agent()
    caller = Caller(sock, cgroups, UA, A)
    second = None
    try:
        assert caller.next()["pod"] == "pod-a"
        caller.report("VRAMNearLimit", "c0", "before")
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


def test_a_stopped_sidecar_is_no_longer_counted_as_there(
    server: UsageServer, cgroups: Path, tmp_path: Path
) -> None:
    """A workload that stops its sidecar (SIGSTOP) leaves its connection open: the agent
    must see that nobody reads it. A small send buffer blocks it after a few samples, and
    a blocked subscription does not count; once it reads again, it counts again."""
    server.publish_pods(directory([pod("pod-a", UA, A)], {}, None))
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
