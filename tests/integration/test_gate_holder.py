"""The allocation gate's second holder (issue 45, step 2; design §3.1): the pod's sidecar
holds a copy of each of its containers' listener fds, so that the agent's exit does not
fail their gated calls with ENOSYS. Real processes: the agent's `NodeGate` in a process of
its own (`gate_agent.py`, SIGKILLed as a crash or a rollout would), the sidecar's `Holder`
in a PID namespace of its own as the pod's (`gate_sidecar.py`), the stand-in of the
driver's callers under a real seccomp filter in a container's cgroup; the test plays runc."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from enforcer.core.gate_budget import Budget
from enforcer.core.payloads import Pod
from enforcer.core.protocol import GATE_HOLDER_SOCKET, SIDECAR_SOCKET
from enforcer.edge import gate_child, gate_holder
from enforcer.edge.gate_holder import (
    LEASE,
    Held,
    Holder,
    acknowledge,
    beat,
    hand_over,
    is_listener_fd,
    pass_fd,
    same_file,
    take_fd,
)
from enforcer.edge.gate_listener import let_go_on
from enforcer.edge.procfs import ProcFs
from enforcer.edge.seccomp_filter import program
from enforcer.edge.sidecar_dialer import Dialled
from enforcer.edge.telemetry import SidecarTelemetry
from enforcer.modes import node_gate
from enforcer.modes import sidecar as sidecar_mode
from enforcer.modes.node_gate import dial_sidecar
from tests.helpers import POD_NAMESPACES, children, configured, wait_for
from tests.integration import test_node_gate
from tests.integration.test_node_gate import (  # proven: a fixture
    CID,
    GIB,
    NO_MEMORY,
    UID,
    UNTOUCHED,
    Node,
    Process,
    proven,  # noqa: F401
)

HERE = Path(__file__).parent
STANDIN = str(HERE / "rm_standin.py")
DEADLINE = 60.0  # s: a bound for a hang, never a measure
OVER = f"form=nvos64,class=0x40,size={2 * GIB}"  # 3 GiB held + 2 GiB > the 4 GiB ceiling


class Lines:
    """JSON lines read from `fd` as they come (a child's stdout, the stand-in's pipe)."""

    def __init__(self, fd: int) -> None:
        self._fd, self._buf = fd, b""

    def next(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._fd], [], [], DEADLINE)
            assert ready, "it hung"
            chunk = os.read(self._fd, 4096)
            assert chunk, "it ended early"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        line: dict[str, Any] = json.loads(raw)
        assert "bug" not in line, line
        return line

    def until(self, want: dict[str, Any]) -> dict[str, Any]:
        """The first line that has every key of `want` at its value."""
        while True:
            line = self.next()
            if all(line.get(k) == v for k, v in want.items()):
                return line


class Child(Lines):
    """A child process of the test, its stdout's lines read as they come."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        super().__init__(proc.stdout.fileno())
        self.proc = proc


class Standin(Process):
    """The stand-in, its lines read one at a time."""

    def line(self) -> dict[str, Any]:
        if not hasattr(self, "lines"):
            self.lines = Lines(self.out)
        return self.lines.next()


container = test_node_gate.container  # a container's cgroup as the kubelet names it


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start(spawned: list[subprocess.Popen[bytes]], argv: list[str]) -> Child:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    spawned.append(proc)
    return Child(proc)


def _agent(spawned: list[subprocess.Popen[bytes]], where: Path, holder: Path) -> Child:
    where.mkdir()
    argv = [sys.executable, str(HERE / "gate_agent.py"), str(where), CID, str(4 * GIB)]
    agent = _start(spawned, [*argv, str(3 * GIB), str(holder)])
    agent.until({"ready": True})
    return agent


def _hand_over(process: Process, where: Path) -> None:
    process.hand_over(where / "run" / "seccomp.sock", CID)


def _gated_pod(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]]
) -> tuple[Path, Child, Child, Standin, int]:
    """A pod's sidecar (its holder's path, its lines), the agent serving it, and the
    stand-in under the gate (calls: one, then two after each byte written to the pipe)."""
    holder = tmp_path / "gate-holder.sock"
    sidecar = _start(
        spawned,
        ["unshare", "--pid", "--fork", sys.executable, str(HERE / "gate_sidecar.py"), str(holder)],
    )
    sidecar.until({"held": 0, "agent": False})
    agent = _agent(spawned, tmp_path / "a", holder)
    go_r, go_w = os.pipe()
    os.set_inheritable(go_r, True)
    process = Standin([OVER, f"wait={go_r}", OVER, OVER, f"wait={go_r}", OVER], container)
    os.close(go_r)
    _hand_over(process, tmp_path / "a")  # the test's copy (runc's) closed: the agent's is one
    agent.until({"gated": 1})
    sidecar.until({"held": 1, "agent": True})  # the sidecar's copy: the second
    return holder, sidecar, agent, process, go_w


def test_the_agent_killed_the_calls_go_on_through_the_sidecar_and_a_new_agent_judges_them(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The agent SIGKILLed: its copy of the container's fd closes, and the sidecar's copy
    keeps the filter's listener alive; it lets each gated call go on (never ENOSYS, never
    a hang). A new agent connects: the sidecar hands it the fd, and it judges the calls
    again (refused past the ceiling)."""
    holder, sidecar, first, process, go_w = _gated_pod(tmp_path, container, spawned)
    try:
        assert process.spawned.go() == 0
        line = process.line()
        assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # the agent judged it

        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        sidecar.until({"held": 1, "agent": False})
        os.write(go_w, b"g")
        for _ in range(2):
            line = process.line()
            assert line["errno"] != errno.ENOSYS, line
            assert (line["ret"], line["errno"], line["status"]) == (-1, errno.ENOTTY, UNTOUCHED), (
                line
            )
        sidecar.until({"let_on": 2})

        second = _agent(spawned, tmp_path / "b", holder)  # it takes the fd from the sidecar
        second.until({"gated": 1})
        sidecar.until({"held": 1, "agent": True})
        os.write(go_w, b"g")
        line = process.line()
        assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # judged again
        os.close(go_w)
        # The stand-in done: every task under the filter gone, the sidecar's copy closed too.
        _, status = os.waitpid(process.spawned.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        sidecar.until({"held": 0})
    finally:
        _reap(process.spawned.pid)


def test_the_agent_stopped_the_sidecar_lets_the_calls_go_on_and_hands_them_back_when_it_runs(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The agent SIGSTOPped with its connection to the sidecar open (stuck, or stopped by
    a debugger): it no longer renews its lease, and within `LEASE` the sidecar lets each
    gated call go on (a call never waits for ever on a reader that does not read). The
    agent SIGCONTed: its next renewal stops the sidecar's reading, and the agent judges
    the calls again (refused past the ceiling), the sidecar's count unchanged."""
    _, sidecar, agent, process, go_w = _gated_pod(tmp_path, container, spawned)
    try:
        assert process.spawned.go() == 0
        line = process.line()
        assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # the agent judged it

        os.killpg(agent.proc.pid, signal.SIGSTOP)
        sidecar.until({"agent": True, "reading": True})  # its connection still open
        os.write(go_w, b"g")
        for _ in range(2):
            line = process.line()
            assert (line["ret"], line["errno"], line["status"]) == (-1, errno.ENOTTY, UNTOUCHED), (
                line
            )
        sidecar.until({"let_on": 2})

        os.killpg(agent.proc.pid, signal.SIGCONT)
        sidecar.until({"agent": True, "reading": False, "let_on": 2})
        os.write(go_w, b"g")
        line = process.line()
        assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # judged again
        _, status = os.waitpid(process.spawned.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sidecar.until({"held": 0})["let_on"] == 2  # none let on after the handback
    finally:
        os.close(go_w)
        _reap(process.spawned.pid)


def test_a_sidecar_stopped_and_continued_by_its_tenant_never_lets_a_call_go_on_unjudged(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The tenant stops its own sidecar (the pod shares its PID namespace) so that its
    holder's promise lapses, and continues it to have the holder let its calls go on: the
    agent, unacknowledged, stops reading, so the call waits meanwhile; the continued holder
    reads the agent's renewal, which waited for it, before any call, and keeps off; the
    agent judges the call (refused), and the holder has let none go on."""
    _, sidecar, _agent, process, go_w = _gated_pod(tmp_path, container, spawned)
    try:
        assert process.spawned.go() == 0
        line = process.line()
        assert (line["ret"], line["status"]) == (0, NO_MEMORY), line
        os.killpg(sidecar.proc.pid, signal.SIGSTOP)
        time.sleep(LEASE + 0.1)  # the holder's promise, and the agent's lease, lapse
        os.write(go_w, b"g")
        assert not select.select([process.out], [], [], 0.5)[0]  # nobody reads: it waits
        os.killpg(sidecar.proc.pid, signal.SIGCONT)
        os.close(go_w)  # the last call follows the two
        for _ in range(3):
            line = process.line()
            assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # judged
        _, status = os.waitpid(process.spawned.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sidecar.until({"held": 0})["let_on"] == 0
    finally:
        _reap(process.spawned.pid)


def test_the_agent_reads_no_fd_a_holder_has_a_copy_of_once_its_lease_lapses(
    tmp_path: Path, container: Path
) -> None:
    """The other side of one reader at a time: a holder that does not acknowledge the
    agent's renewals (a sidecar stopped, or slow) reads the fds from `LEASE` after the
    agent connected; the agent then leaves each call to it, unread, and judges again only
    once a renewal is acknowledged."""
    node = Node(tmp_path)
    node.tenants[CID] = 4 * GIB
    go_r, go_w = os.pipe()
    os.set_inheritable(go_r, True)
    process = Standin([f"wait={go_r}", OVER, f"wait={go_r}", OVER], container)
    os.close(go_r)
    ours, theirs = socketpair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener = process.spawned.listener
    assert listener is not None
    try:
        with node.passes({CID: {"GPU-a": 3 * GIB}}):
            hand_over(theirs, [Held(listener, CID, process.spawned.pid)])
            since = time.monotonic()
            node.gate.hold(ours, {CID}.__contains__, since)
            assert process.spawned.go() == 0
            # Not acknowledged: the lease lapses at since + LEASE, whatever the load.
            time.sleep(max(0.0, since + LEASE - time.monotonic()) + 0.1)
            os.write(go_w, b"g")
            ready, _, _ = select.select([listener], [], [], DEADLINE)
            assert ready  # the call waits, the enforcer saw it
            # Left to the holder: still unanswered a while later (the agent would have
            # refused it at once), then let go on by the test, as the holder does.
            assert not select.select([process.out], [], [], 0.5)[0]
            assert let_go_on(listener)
            line = process.line()
            assert (line["ret"], line["status"]) == (-1, UNTOUCHED), line
            with _acking(theirs):  # read by the agent once a renewal is acknowledged
                os.write(go_w, b"g")
                line = process.line()
                assert (line["ret"], line["status"]) == (0, NO_MEMORY), line  # judged again
    finally:
        node.gate.stop()
        os.close(go_w)
        os.close(listener)
        for sock in socketpair:
            sock.close()
        _reap(process.spawned.pid)


@contextlib.contextmanager
def _acking(sock: socket.socket) -> Iterator[None]:
    """The holder's side of the lease on `sock`: each renewal acknowledged at once."""
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            if select.select([sock], [], [], 0.02)[0]:
                raw = sock.recv(512)
                if not raw:
                    return
                if (number := beat(raw, "renew")) is not None:
                    acknowledge(sock, number)

    acker = threading.Thread(target=run)
    acker.start()
    try:
        yield
    finally:
        done.set()
        acker.join()


def test_a_holder_refuses_a_connection_from_inside_its_pod(tmp_path: Path) -> None:
    """A process of the pod (in the holder's PID namespace) could take the fds and answer
    its own calls: it is refused before anything is handed over."""
    path = tmp_path / "gate-holder.sock"
    holder = Holder(path, _NoBugs())
    holder.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(path))
            sock.settimeout(DEADLINE)
            assert sock.recv(512) == b""  # hung up, no greeting
        assert not holder.agent_connected
    finally:
        holder.stop()


@pytest.mark.parametrize("gated", [False, True])
def test_a_sidecar_holds_its_pods_fds_only_where_the_webhook_says_the_pod_is_gated(
    tmp_path: Path, gated: bool
) -> None:
    """The webhook's sidecar (`--listen`) runs the `gate-holder` thread and serves its
    socket only with `VRAM_ENFORCER_ALLOCATION_GATE=on`, which the webhook sets on a pod
    with a container under the gate's profile: in any other pod (the gate off, the
    default; a pod admitted before the gate) no thread wakes and no socket is opened."""
    listen = tmp_path / "sidecar.sock"
    env = {
        "POD_NAME": "p",
        "POD_NAMESPACE": "ns",
        "POD_UID": "u",
        "VRAM_ENFORCER_LIMITS": '{"t": 1}',
        "VRAM_ENFORCER_LISTEN": str(listen),
    }
    if gated:
        env["VRAM_ENFORCER_ALLOCATION_GATE"] = "on"
    holder = sidecar_mode._holder(configured(["sidecar"], env), SidecarTelemetry())
    try:
        threads = [t.name for t in threading.enumerate()]
        assert (holder is not None) == gated
        assert ("gate-holder" in threads) == gated
        assert (tmp_path / "gate-holder.sock").exists() == gated
    finally:
        if holder is not None:
            holder.stop()


def test_a_message_that_is_not_one_listener_fd_with_its_claim_is_dropped_with_its_fds() -> None:
    """Neither end takes an fd it would poll and answer unless it is a seccomp listener."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b, open(os.devnull) as null:
        pass_fd(a, Held(null.fileno(), CID, 1))
        assert take_fd(b) == "its fd is no seccomp listener"
        a.sendmsg([b"{}"])
        assert take_fd(b) == "the message brought 0 fds, not 1"
        hand_over(a, [])
        assert take_fd(b) == "the message brought 0 fds, not 1"
        assert not is_listener_fd(null.fileno())
        a.close()
        assert take_fd(b) is None


SIDECAR_CID = "5e" * 32


def _pod(workload: str) -> Pod:
    """The running pod of the sidecar SIDECAR_CID and one workload container."""
    status = {
        "phase": "Running",
        "initContainerStatuses": [
            {"name": "vram-enforcer", "containerID": f"containerd://{SIDECAR_CID}"}
        ],
        "containerStatuses": [{"name": "trainer", "containerID": f"containerd://{workload}"}],
    }
    spec = {
        "initContainers": [{"name": "vram-enforcer", "restartPolicy": "Always"}],
        "containers": [{"name": "trainer"}],
    }
    meta = {"uid": UID, "name": "p", "namespace": "ml"}
    return cast(Pod, {"metadata": meta, "spec": spec, "status": status})


def _served_pod(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]]
) -> tuple[Node, Child]:
    """The agent's gate, and a pod's sidecar it can dial: the holder (and a usage socket)
    in the pod's own mount and PID namespaces, its first process in the cgroup of the
    sidecar container SIDECAR_CID."""
    node = Node(tmp_path)
    assert node.gate.start() is None
    argv = [sys.executable, str(HERE / "gate_sidecar.py"), GATE_HOLDER_SOCKET, SIDECAR_SOCKET]
    sidecar = _start(spawned, [*POD_NAMESPACES, *argv])
    pid = wait_for(lambda: children(sidecar.proc.pid), what="the pod's first process")[0]
    (container.parent / SIDECAR_CID).mkdir()
    (container.parent / SIDECAR_CID / "cgroup.procs").write_text(str(pid))
    sidecar.until({"held": 0, "agent": False})
    return node, sidecar


@pytest.mark.usefixtures("proven")
@pytest.mark.parametrize("workload", [CID, "77" * 32])
def test_the_agent_reaches_a_sidecars_holder_in_its_filesystem_and_hands_it_only_its_pods_fds(
    tmp_path: Path, container: Path, spawned: list[subprocess.Popen[bytes]], workload: str
) -> None:
    """The agent's dial (`dial_sidecar`): the sidecar's usage socket, then its holder's, in
    the sidecar container's own filesystem (a pod's mount and PID namespaces), the listener
    proven to be that container's first process; the holder gets a copy of the fd of a
    container of its own pod, and none of another pod's (`workload` names no container of
    the stand-in's: the fd served is then another pod's)."""
    node, sidecar = _served_pod(tmp_path, container, spawned)
    process = Standin([OVER], container)
    try:
        process.hand_over(node.socket, CID)
        wait_for(lambda: node.gate.gated() == {CID: 1}, what="the handoff")
        link = dial_sidecar(ProcFs(), node.gate, lambda: {UID: _pod(workload)}, SIDECAR_CID)
        assert isinstance(link, socket.socket), link
        link.close()
        # Handed before the dial returned (a copy only of its own pod's container's fd).
        sidecar.until({"agent": True, "held": 1 if workload == CID else 0})
        # Dialled again (its usage link lost, say): it hands back the copy the agent
        # serves already, which the agent drops rather than serve twice.
        again = dial_sidecar(ProcFs(), node.gate, lambda: {UID: _pod(workload)}, SIDECAR_CID)
        assert isinstance(again, socket.socket), again
        again.close()
        assert node.gate.gated() == {CID: 1}
    finally:
        node.gate.stop()
        _reap(process.spawned.pid)


@pytest.mark.usefixtures("proven")
def test_a_holder_the_agent_lost_is_dialled_again_by_itself_and_given_the_fds_it_missed(
    tmp_path: Path,
    container: Path,
    spawned: list[subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent cannot hand a pod's holder a new process's fd (its sidecar stopped, its
    connection gone): it gives that connection up, and the holder reads the pod's fds. The
    agent dials the holder again by itself (`gate-redial`), with the usage link still up
    and never dialled again: the holder hands its copies back, and is given the fd it
    missed; the dial is counted and said."""
    node, sidecar = _served_pod(tmp_path, container, spawned)
    first, second = Standin([OVER], container), Standin([OVER], container)
    try:
        first.hand_over(node.socket, CID)
        wait_for(lambda: node.gate.gated() == {CID: 1}, what="the handoff")
        link = dial_sidecar(ProcFs(), node.gate, lambda: {UID: _pod(CID)}, SIDECAR_CID)
        assert isinstance(link, socket.socket), link
        sidecar.until({"agent": True, "held": 1})
        # The sidecar stopped (it cannot hang up first), the agent's end of the connection
        # broken: handing it the next process's fd fails, and the agent gives it up.
        os.killpg(sidecar.proc.pid, signal.SIGSTOP)
        (lost,) = node.gate._holders
        lost.sock.shutdown(socket.SHUT_WR)
        with caplog.at_level(logging.INFO, logger="enforcer.modes.node_gate"):
            second.hand_over(node.socket, CID)
            wait_for(lambda: node.gate.holders() == 0, DEADLINE, "the holder given up")
            os.killpg(sidecar.proc.pid, signal.SIGCONT)
            sidecar.until({"agent": True, "held": 2})  # dialled again, given the fd it missed
            redials = functools.partial(node.metric, "allocation_gate_redials_total")
            wait_for(lambda: redials(result="held") == 1, DEADLINE, "the dial counted")
        assert node.gate.holders() == 1 and node.gate.gated() == {CID: 2}
        said = [r.getMessage() for r in caplog.records]
        assert any("lost a pod's holder" in m for m in said), said
        assert any(f"dialling the holder of sidecar {SIDECAR_CID[:12]} again" in m for m in said)
        assert any("dialled again and held" in m for m in said), said
        link.close()
    finally:
        node.gate.stop()
        _reap(first.spawned.pid)
        _reap(second.spawned.pid)


def test_a_lost_holders_dials_back_off_are_counted_and_end_once_its_pod_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder the agent lost whose sidecar cannot be reached: each dial counted as
    failed, spaced out, the first failure said; once its pod is no longer served, its
    thread ends (no more dials)."""
    monkeypatch.setattr(node_gate, "REDIAL_FIRST", 0.05)
    monkeypatch.setattr(node_gate, "REDIAL_MOST", 0.2)
    node = Node(tmp_path)
    served = threading.Event()
    served.set()
    dials: list[float] = []

    def dial() -> str:
        dials.append(time.monotonic())
        return "no process of the sidecar's container was found"

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hand_over(theirs, [])
    redial = node_gate.Redial(SIDECAR_CID, dial, served.is_set)
    try:
        with caplog.at_level(logging.INFO, logger="enforcer.modes.node_gate"):
            assert node.gate.hold(ours, lambda cid: True, time.monotonic(), redial)
            ours.shutdown(socket.SHUT_WR)  # its next renewal cannot be sent: given up
            failed = functools.partial(node.metric, "allocation_gate_redials_total")
            wait_for(lambda: failed(result="failed") == 3, DEADLINE, "three failed dials")
            served.clear()
            wait_for(lambda: not _threads("gate-redial"), DEADLINE, "the dials to end")
        assert len(dials) >= 3 and failed(result="held") == 0
        assert all(b - a >= 0.05 for a, b in itertools.pairwise(dials)), dials  # spaced out
        said = [r.getMessage() for r in caplog.records]
        assert sum("cannot dial the holder" in m for m in said) == 1, said
        assert any("no longer served" in m for m in said), said
    finally:
        node.gate.stop()
        theirs.close()


def test_a_holder_whose_fds_could_not_be_taken_is_dialled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that does not greet the agent in time (a sidecar slow under load): its
    connection is closed, and it is dialled again until it hands its fds over."""
    monkeypatch.setattr(node_gate, "REDIAL_FIRST", 0.05)
    node = Node(tmp_path)
    slow, silent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ready, greeting = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hand_over(greeting, [])
    answers: list[Dialled] = [ready]
    redial = node_gate.Redial(SIDECAR_CID, answers.pop, lambda: True)
    try:
        assert not node.gate.hold(slow, lambda cid: True, time.monotonic(), redial)
        wait_for(lambda: node.gate.holders() == 1, DEADLINE, "the holder dialled again")
        # Counted by the redial's thread once `hold` has returned: a moment after.
        redials = functools.partial(node.metric, "allocation_gate_redials_total")
        wait_for(lambda: redials(result="held") == 1, DEADLINE, "the redial counted")
        assert not answers
    finally:
        node.gate.stop()
        for sock in (silent, greeting):
            sock.close()


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("pod", [{CID, "0e" * 32}, {CID}])
def test_a_holders_claim_bounds_only_the_calls_of_its_pods_container_by_the_callers_cgroup(
    tmp_path: Path, container: Path, pod: set[str]
) -> None:
    """A holder hands the agent an fd it says serves container OTHER (whose ceiling would
    refuse the call), but the calling process is in CID: whether or not OTHER is of the
    holder's pod, the call goes on (never judged against OTHER's ceiling), and the fd is
    served. Without the check of each caller's cgroup, OTHER's ceiling refuses it."""
    other = "0e" * 32
    node = Node(tmp_path)
    node.tenants[other] = GIB
    process = Standin([OVER, OVER], container)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert process.spawned.listener is not None
        hand_over(theirs, [Held(process.spawned.listener, other, process.spawned.pid)])
        os.close(process.spawned.listener)
        with _acking(theirs):
            node.gate.hold(ours, pod.__contains__, time.monotonic())
            assert len(node.gate.gated()) == 1
            node.gate.saw({other: {"GPU-a": 0}, CID: {"GPU-a": 0}}, 0.0)
            for line in process.run():
                assert (line["ret"], line["status"]) == (-1, UNTOUCHED), line
    finally:
        node.gate.stop()
        theirs.close()
        _reap(process.spawned.pid)


def test_the_fds_a_holder_claims_for_containers_not_of_its_pod_share_one_budget(
    tmp_path: Path, container: Path
) -> None:
    """A claim for a container not of the holder's pod cannot be checked, and each such fd
    was a container of its own to the agent, with a budget of calls of its own: a holder
    (a sidecar taken over) that handed many could flood the agent at as many budgets. They
    share one (served, unbounded, as before): with a burst of 1, one of the two processes'
    calls is read, and the other waits for its turn (100 s on)."""
    node = Node(tmp_path, budget=Budget(rate=0.01, burst=1))
    first, second = Standin([OVER], container), Standin([OVER], container)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        claims = [(first, "0e" * 32), (second, "0f" * 32)]
        hand_over(theirs, [Held(p.spawned.listener or -1, c, p.spawned.pid) for p, c in claims])
        for p, _ in claims:
            os.close(p.spawned.listener or -1)
        with _acking(theirs):
            node.gate.hold(ours, {CID}.__contains__, time.monotonic())
            ((key, served),) = node.gate.gated().items()
            assert key.startswith("unproven:") and served == 2, node.gate.gated()
            assert first.spawned.go() == 0 and second.spawned.go() == 0
            allowed = {"outcome": "allowed"}
            wait_for(
                lambda: node.metric("allocation_gate_calls_total", **allowed) == 1,
                what="one call read",
            )
            time.sleep(0.5)  # the other, with a budget of its own, would be read by now
            assert node.metric("allocation_gate_calls_total", **allowed) == 1
    finally:
        node.gate.stop()
        theirs.close()
        _reap(first.spawned.pid)
        _reap(second.spawned.pid)


def test_the_connection_of_a_holder_that_hung_up_is_closed_on_the_next_pass(
    tmp_path: Path,
) -> None:
    """A sidecar that ended, or took the agent's newer connection, leaves nothing behind
    in the agent."""
    node = Node(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hand_over(theirs, [])
    node.gate.hold(ours, lambda cid: True, time.monotonic())
    node.gate.saw(None, 0.0)
    assert node.gate.holders() == 1
    theirs.close()
    node.gate.saw(None, 0.0)
    assert node.gate.holders() == 0
    assert ours.fileno() == -1  # closed


def test_the_calls_a_holder_let_on_while_the_agent_was_away_are_counted_by_the_agent(
    tmp_path: Path,
) -> None:
    """What a holder let go on unjudged (the agent restarted, stopped or stuck), told in
    its greeting and in each acknowledgement, and counted once by the agent."""
    node = Node(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        hand_over(theirs, [], 3)
        node.gate.hold(ours, lambda cid: True, time.monotonic())
        assert node.metric("allocation_gate_let_on_total") == 3
        theirs.settimeout(DEADLINE)
        number = beat(theirs.recv(512), "renew")
        assert number is not None
        acknowledge(theirs, number, 2)
        wait_for(lambda: node.metric("allocation_gate_let_on_total") == 5, what="the count")
    finally:
        node.gate.stop()
        theirs.close()


def test_two_copies_of_one_listener_answer_a_call_once_and_the_second_never_waits() -> None:
    """Where kcmp is refused (containerd's RuntimeDefault, the sidecar's) the holder may
    keep two copies of one listener, both readable for one call: the first lets it go on,
    the second finds nothing and returns at once, never waiting in RECV for the next call
    (which would hold up every other fd of the pod)."""
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    os.set_inheritable(out_w, True)
    os.set_inheritable(go_r, True)
    argv = [sys.executable, STANDIN, f"out={out_w}", OVER, f"wait={go_r}", OVER]
    spawned = gate_child.spawn(sys.executable, argv, program())
    os.close(out_w)
    os.close(go_r)
    assert spawned.listener is not None, spawned.why_not
    first, second = spawned.listener, os.dup(spawned.listener)
    lines, found = Lines(out_r), list[bool]()
    late = threading.Thread(target=lambda: found.append(let_go_on(second)))
    try:
        assert spawned.go() == 0
        select.select([first], [], [], DEADLINE)
        assert let_go_on(first)
        assert lines.next()["errno"] == errno.ENOTTY
        late.start()
        late.join(DEADLINE)  # a bound: at once, where it does not wait
        assert found == [False]
    finally:
        os.write(go_w, b"g")  # the next call, which a waiting RECV would take
        if late.ident is not None:
            late.join()
        _reap(spawned.pid)
        for fd in (first, second, out_r, go_w):
            os.close(fd)


def test_copies_of_one_open_file_are_told_apart_from_other_files_without_kcmp() -> None:
    """`same_file`, which both ends use so as not to hold or serve one listener twice."""
    r, w = os.pipe()
    other, other_w = os.pipe()
    copy = os.dup(r)
    try:
        assert same_file(r, copy) and same_file(copy, r)
        assert not same_file(r, other) and not same_file(r, w)
        assert os.get_blocking(r) and os.get_blocking(copy)  # each flag put back
    finally:
        for fd in (r, w, other, other_w, copy):
            os.close(fd)


def _reap(pid: int) -> None:
    """The stand-in killed and waited for, if it still runs."""
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class _NoBugs:
    def inc(self, amount: float = 1) -> None:
        raise AssertionError("a bug in the holder")


def test_the_agent_stops_reading_a_holders_fds_before_its_lease_ends_and_at_once_when_it_closes() -> (
    None
):
    """Review 2 of issue 45, finding 2: two readers of one fd may leave one waiting in RECV
    for the fd's next call. The agent stops `READ_MARGIN` before its lease ends (a reader
    held past its look still never reads as the holder starts to), and at once when it
    closes the connection itself (`_lost`, `stop`: the holder reads as soon as it sees the
    end), where it read on until the lease ran out."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        holder = node_gate._Holder(ours, lambda cid: True, time.monotonic() + LEASE)
        assert holder.lets_read()
        holder.leased_until = time.monotonic() + node_gate.READ_MARGIN / 2
        assert not holder.lets_read()
        holder.leased_until = time.monotonic() + LEASE
        holder.close()
        assert not holder.lets_read()
    finally:
        theirs.close()


def test_a_holder_that_trickles_its_handover_is_dropped_at_the_handovers_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 2 of issue 45, finding 6 (the sibling of runc's trickled message): each read
    had its own timeout, so a holder paced a message at a time (its sidecar stopped and
    continued) held the dial's thread for up to 4096 of them. The whole handover has one
    deadline now, and what came is closed."""
    monkeypatch.setattr(gate_holder, "HANDOVER_WITHIN", 0.35)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(1.0)  # as the agent's `hold` sets it: each read alone is in time
    pipes = [os.pipe() for _ in range(10)]
    done = threading.Event()

    def trickle() -> None:
        theirs.sendmsg([json.dumps({"fds": len(pipes), "let_on": 0}).encode()])
        for r, _ in pipes:
            if done.wait(0.1):
                return
            gate_holder.pass_fd(theirs, Held(r, CID, 1))

    sender = threading.Thread(target=trickle)
    before = len(os.listdir("/proc/self/fd"))
    sender.start()
    try:
        with pytest.raises(ValueError, match=r"handed over \d of 10 fds in 0.35 s"):
            gate_holder.take_over(ours)
    finally:
        done.set()
        sender.join()
    assert ours.gettimeout() == 1.0  # as it was, for the renewals after
    assert len(os.listdir("/proc/self/fd")) == before  # nothing that came is left open
    for r, w in pipes:
        os.close(r)
        os.close(w)
    ours.close()
    theirs.close()
