"""The agent's usage socket: the latest NVML sample, as each caller's namespace sees it.

One NVML pass per interval is shared by every caller. When the sampler publishes a
sample, it is indexed once by PID namespace (each process under every namespace on its
chain, with the pid that namespace knows it by) and its JSON is pre-encoded, so a request
costs a dictionary lookup and a write. Bad input gets an error line; a line longer than
the limit, a reader that stops reading and a silent connection are disconnected; a caller
that sends more than LINES_PER_SECOND lines is not read until the next second (its lines
wait in the kernel, costing the loop nothing); none of it can stall the other callers, who
share one epoll loop.

An agent that serves pods serves only the sidecars of the pods the webhook injected
(`pod_directory`), and the node's own processes (in no container, in the host's PID
namespace); any other caller is told why not, once, and each request of it is counted as
`refused`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from enforcer.core.lending import Lending
from enforcer.core.model import Sample, SourceDown
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import Directory
from enforcer.core.protocol import (
    MAX_REQUEST_BYTES,
    EventRequest,
    PodReply,
    ProtocolError,
    Request,
    encode_challenge,
    encode_error,
    encode_pod,
    parse_request,
)
from enforcer.core.sidecar_report import SidecarReport
from enforcer.edge.guard import LoopGuard
from enforcer.edge.listening import listen
from enforcer.edge.peers import CREDENTIALS_SPACE, PeerError, Unproven, attest, sender
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_replies import Published

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 30.0  # a connection that is not subscribed and asks nothing for this long
WRITE_TIMEOUT = 5.0  # a reader that leaves replies unread this long is disconnected
MAX_CONNECTIONS = 2048
# Per caller, by PID namespace: a pod's sidecar needs one, `doctor` one more. Without it, one
# process holding MAX_CONNECTIONS locked every other pod of the node out of its usage, and
# won the race to reconnect after an agent restart. (Not the host's namespace: no pod's.)
PER_NAMESPACE = 8
ACCEPT_PAUSE = 1.0  # out of file descriptors: stop accepting this long, rather than spin
ACCEPT_BATCH = 64  # connections accepted per wake-up of the loop; the rest wait their turn
# What the kernel holds for a reader: a sidecar that stops reading (a workload stopped it)
# blocks its connection within a few seconds, not after minutes of samples.
SEND_BUFFER = 32 * 1024
_WRITE_BUFFER = 64 * 1024  # past this, stop reading a client's requests until it reads
# Lines read from one connection in a second (the sweep's). A sidecar sends a subscription,
# its Events (at most EVENT_BACKLOG after a reconnection) and its counts every few seconds;
# a taken-over one sent 44,000 a second, each parsed on this loop's thread.
LINES_PER_SECOND = 64


@dataclass(slots=True)
class ServerMetrics:
    requests: Counter
    connections: Gauge
    unexpected: Counter  # labelled by loop


@dataclass(frozen=True, slots=True)
class ServerHooks:
    """What the server does with its callers, for an agent that serves pods (nothing, by
    default). `events` posts a caller's report as an Event on its pod; `reports` keeps a
    caller's counts as its pod's (the pod, the caller's container ID, the report); `hung_up`
    is told the container ID of a caller that hung up its last connection (a sidecar does
    when its process ends, SIGKILL included), on the loop's thread: it must not wait.
    `no_pods`: what a caller that asks for its pod is told while there are no pods.
    `sidecars_only`: an agent that serves pods serves only their sidecars (see the module);
    one that does not tells each caller about its own processes alone, whoever it is."""

    events: Callable[[Pod, EventRequest], None] | None = None
    reports: Callable[[Pod, str, SidecarReport], None] | None = None
    hung_up: Callable[[str], None] | None = None
    no_pods: str = "this agent does not serve pods (it has no API access)"
    sidecars_only: bool = False


def _discard_pending(sock: socket.socket, limit: int = 1 << 20) -> None:
    """Read away what the peer already sent: closing a Unix socket with unread input resets
    the connection, and the peer would lose the error line we just sent it."""
    with contextlib.suppress(OSError):
        while limit > 0 and (chunk := sock.recv(min(limit, 65536))):
            limit -= len(chunk)


@functools.lru_cache(maxsize=64)
def _parse(line: bytes) -> Request:
    """Clients send the same few lines over and over; parse each distinct one once."""
    return parse_request(line)


class _Connection:
    """One caller: its attested view, unparsed input and unsent output.

    Without SO_PEERPIDFD, a caller stays `unproven` until it answers its challenge; until
    then it gets nothing but the challenge, and the pids the kernel stamped on what it
    sent are collected in `senders`.
    """

    __slots__ = (
        "blocked_since",
        "container_id",
        "inbox",
        "last_request",
        "lines",
        "outbox",
        "paused",
        "pid",
        "pod_sent",
        "refusal",
        "refused",
        "senders",
        "sock",
        "subscribed",
        "unproven",
        "view",
        "wants_pod",
    )

    def __init__(
        self,
        sock: socket.socket,
        view: PidView,
        unproven: Unproven | None,
        container_id: str | None = None,
        pid: int = 0,
    ) -> None:
        self.sock = sock
        self.view = view
        self.container_id = container_id  # the caller's, from its cgroup: names its pod
        self.pid = pid  # the caller's (the listener's, on a connection the agent made), host's
        self.wants_pod = False
        self.pod_sent = b""  # the pod reply it was last sent: pushed again only when changed
        self.unproven = unproven
        self.senders: set[int] = set()
        self.refused = False
        self.inbox = b""
        self.outbox = b""
        self.last_request = time.monotonic()
        self.blocked_since: float | None = None
        self.subscribed = False
        self.lines = 0  # read in this second
        self.paused = False  # past LINES_PER_SECOND: not read until the next second
        # Why the caller is not served, as of the latest directory (None: it is served).
        self.refusal: str | None = None


class UsageServer:
    """A small epoll loop in its own thread.

    Hand-rolled rather than asyncio on purpose: at 110 pods asking ten times a second,
    asyncio's per-event overhead (~37 us per request, measured) was most of the agent's
    CPU; this loop spends ~10 us, most of it in the two syscalls.
    """

    def __init__(
        self,
        path: Path,
        host_proc: ProcFs,
        metrics: ServerMetrics,
        stale_after: float,
        hooks: ServerHooks | None = None,
        peer_pidfd: bool = True,
    ) -> None:
        self.host_proc = host_proc
        self._hooks = hooks or ServerHooks()
        self._peer_pidfd = peer_pidfd  # False: identify callers as on kernels < 6.5
        self._path = path
        self._metrics = metrics
        self._stale_after = stale_after
        self._published = Published.of(SourceDown("the agent has not sampled NVML yet"))
        # By container ID, each pod's reply and the pod (pod_directory); None: this agent
        # serves no pods.
        self._pods: Directory | None = None
        self._listener: socket.socket | None = None
        self._epoll = select.epoll()
        self._connections: dict[int, _Connection] = {}
        self._per_namespace: collections.Counter[tuple[int, int]] = collections.Counter()
        self._accepting_at: float | None = None  # paused (out of fds) until then
        # Connections the agent made to sidecars (`adopt`), waiting for the loop to attest
        # them: (the sidecar's container ID, the socket).
        self._dialed: collections.deque[tuple[str, socket.socket]] = collections.deque()
        # The container IDs with a subscription that is being read, as of the last sweep (a
        # second at most) or subscription: whose sidecars are there (`sidecar_presence`).
        # Swapped whole.
        self.connected: frozenset[str] = frozenset()
        # The pid of the process at the other end of each container's latest proven
        # connection, by container ID: a sidecar's own process. Swapped whole.
        self.peers: Mapping[str, int] = {}
        self._counters: dict[str, Counter] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name="usage-socket", daemon=True)
        self._stopping = False
        self._guard = LoopGuard("usage-socket", metrics.unexpected.labels("usage-socket"), log)
        self._serving: _Connection | None = None  # the caller being served, for the guard

    def publish(self, sample: Sample | SourceDown, lending: Lending | None = None) -> None:
        """Called by the sampler thread: swap in the sample, with the reclaims decided on
        it (None: this agent decides none), and wake the loop to push it to subscribers.
        One reference, no lock needed."""
        self._published = Published.of(sample, lending)
        self._wake(b"p")

    def publish_pods(self, directory: Directory) -> None:
        """Called by the agent's pod publisher: swap in the node's pods (by container ID,
        `pod_directory.directory`) and wake the loop to push what changed."""
        self._pods = directory
        self._wake(b"o")

    def adopt(self, container_id: str, sock: socket.socket) -> None:
        """Called by the thread that connected to a sidecar's own socket (`sidecar_dialer`):
        the loop serves it as a caller once the process listening on it is proven to be in
        that container, and closes it unread otherwise."""
        self._dialed.append((container_id, sock))
        if not self._wake(b"d"):
            sock.close()  # the server closed: nobody will read it

    def _wake(self, why: bytes) -> bool:
        """Wake the loop; whether the server is still open. Its feeders (the sampler, the
        pod publisher, dials) may outlive it by a moment at shutdown: a write to the closed
        pipe's number, which the process may have given to any file since, is not made."""
        with self._wake_lock:
            if self._closed:
                return False
            with contextlib.suppress(BlockingIOError):  # a wake-up is already pending
                os.write(self._wake_w, why)
            return True

    def pod_reply(self, conn: _Connection) -> bytes:
        pods = self._pods
        if pods is None:
            return encode_pod(PodReply(None, self._hooks.no_pods))
        found = pods.replies.get(conn.container_id or "")
        if found is not None:
            return found
        return encode_pod(PodReply(None, pods.refusal(conn.container_id)))

    def _refusal(self, conn: _Connection) -> str | None:
        """Why this caller is not served, or None (see the module)."""
        if not self._hooks.sidecars_only or conn.unproven is not None:
            return None  # an unproven caller gets nothing but its challenge anyway
        if conn.container_id is None and conn.view.level == 0:
            return None  # the node's own: an administrator, `doctor` on the host
        if self._pods is None:
            return self._hooks.no_pods
        return self._pods.refusal(conn.container_id)

    def usage(self, conn: _Connection) -> bytes:
        """The caller's usage, or why it is not served."""
        if conn.refusal is not None:
            return encode_error(conn.refusal)
        return self.reply(conn.view)

    def reply(self, view: PidView) -> bytes:
        published = self._published
        if published.error is not None:
            return published.error
        age = time.monotonic() - published.published_at
        if age > self._stale_after:
            return encode_error(f"GPU usage is stale: the last NVML sample is {age:.1f}s old")
        return published.reply(view)

    def start(self) -> None:
        # Any pod may connect; each one learns only about its own processes.
        listener = listen(self._path, 0o666, 512, "agent", "--socket")
        self._listener = listener
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self.thread.start()
        log.info("serving GPU usage on %s", self._path)

    def close(self) -> None:
        """Stop accepting, end every conversation, remove the socket."""
        if self.thread.is_alive():
            self._stopping = True
            self._wake(b"x")
            self.thread.join(timeout=5)
        for conn in list(self._connections.values()):
            self._drop(conn)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
        self._epoll.close()
        with self._wake_lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)
        while self._dialed:  # dialed, and not served
            self._dialed.popleft()[1].close()

    def _run(self) -> None:
        next_sweep = time.monotonic() + 1.0
        while not self._stopping:
            ready = self._epoll.poll(1.0)
            # One guarded call per wake-up, not per event: this loop is the agent's hottest
            # path. Events left unhandled come back (level-triggered), and the caller being
            # served when the bug struck is hung up on.
            if not self._guard.run(functools.partial(self._dispatch, ready)) and self._serving:
                self._drop(self._serving)
            if (now := time.monotonic()) >= next_sweep:
                self._guard.run(functools.partial(self._sweep, now))
                next_sweep = now + 1.0

    def _dispatch(self, ready: list[tuple[int, int]]) -> None:
        assert self._listener is not None  # noqa: S101 - start() sets it before the thread runs
        for fd, events in ready:
            self._serving = None
            if fd == self._wake_r:
                woken = b""
                with contextlib.suppress(BlockingIOError):
                    woken = os.read(self._wake_r, 4096)
                if self._stopping:
                    return
                if b"p" in woken:
                    self._push()
                if b"o" in woken:
                    self._push_pods()
                if b"d" in woken:
                    self._adopt()
            if fd == self._listener.fileno():
                self._accept()
            elif (conn := self._connections.get(fd)) is not None:
                self._serving = conn
                if events & select.EPOLLOUT:
                    self._flush(conn)
                if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    self._read(conn)
        self._serving = None

    def _accept(self) -> None:
        """Up to ACCEPT_BATCH callers per wake-up: callers that connect as fast as they are
        refused would otherwise keep this loop accepting, and nothing else (no sample
        pushed, no request answered) would happen until they stopped."""
        assert self._listener is not None  # noqa: S101
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, or of memory: pause, don't spin
                self._pause_accepting(exc)
                return
            self._admit(sock)

    def _adopt(self) -> None:
        while self._dialed:
            container_id, sock = self._dialed.popleft()
            self._admit(sock, container_id)

    def _admit(self, sock: socket.socket, dialed: str | None = None) -> None:
        """Serve a caller once the kernel says who it is. `dialed`: the container ID of the
        sidecar whose socket the agent connected to; whoever listens there must be in it,
        or the socket is closed without a word (it may be anyone's)."""
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if len(self._connections) >= MAX_CONNECTIONS:
            self._refuse(sock, "too many connections; retry later", dialed)
            return
        try:
            peer = attest(sock, self.host_proc, self._peer_pidfd)
        except PeerError as exc:
            self._refuse(sock, str(exc), dialed)
            return
        unproven = peer if isinstance(peer, Unproven) else None
        if dialed is not None and peer.container_id != dialed:
            if unproven is not None:
                unproven.close()
            log.warning(
                "the socket found in the sidecar container %s is held by a process of "
                "%s: closed unread",
                dialed[:12],
                "container " + peer.container_id[:12] if peer.container_id else "no container",
            )
            self._refuse(sock, "", dialed)
            return
        namespace = (peer.view.ns_inode, peer.view.level)
        # The host's own namespace (level 0) is the node's, not a pod's: not capped.
        if peer.view.level > 0 and self._per_namespace[namespace] >= PER_NAMESPACE:
            if unproven is not None:
                unproven.close()
            self._refuse(
                sock,
                f"too many connections from this PID namespace (at most "
                f"{PER_NAMESPACE}); close one, or retry later",
                dialed,
            )
            return
        self._per_namespace[namespace] += 1
        conn = _Connection(sock, peer.view, unproven, peer.container_id, peer.pid)
        conn.refusal = self._refusal(conn)
        self._connections[sock.fileno()] = conn
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        self._metrics.connections.set(len(self._connections))
        if unproven is None and peer.container_id:
            self._peers_changed()
        if unproven is not None:
            conn.outbox = encode_challenge(unproven.challenge)
            self._flush(conn)

    def _refuse(self, sock: socket.socket, message: str, dialed: str | None = None) -> None:
        """Tell a caller why, and hang up; a socket the agent dialed is only hung up on."""
        self.count("refused")
        if dialed is None:
            with contextlib.suppress(OSError):
                sock.send(encode_error(message))
        sock.close()

    def _read(self, conn: _Connection) -> None:
        if conn.paused:  # not polled for input: woken by a hang-up or an error
            self._drop(conn, hung_up=True)
            return
        try:
            if conn.unproven is None:
                data = conn.sock.recv(65536)
            else:
                data, ancillary, _, _ = conn.sock.recvmsg(65536, CREDENTIALS_SPACE)
                # Unstamped data (pid 0) was sent before SO_PASSCRED, so before the challenge:
                # it cannot hold the answer, and says nothing about who sent the answer.
                if data and (pid := sender(ancillary)):
                    conn.senders.add(pid)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, hung_up=True)
            return
        conn.inbox += data
        self._take_lines(conn)

    def _take_lines(self, conn: _Connection) -> None:
        """Answer the complete lines read, up to LINES_PER_SECOND in this second; past that,
        stop reading the connection until the sweep's next second."""
        replies = []
        while conn.lines < LINES_PER_SECOND and (end := conn.inbox.find(b"\n")) >= 0:
            line, conn.inbox = conn.inbox[: end + 1], conn.inbox[end + 1 :]
            conn.lines += 1
            replies.append(self._answer(line, conn))
            if conn.refused:
                with contextlib.suppress(OSError):
                    conn.sock.send(replies[-1])
                _discard_pending(conn.sock)
                self._drop(conn)
                return
        if b"\n" in conn.inbox:  # past its lines for this second
            if not conn.paused:
                conn.paused = True
                self.count("limited")
                self._interest(conn)
        elif len(conn.inbox) > MAX_REQUEST_BYTES:  # the stream cannot resync: hang up
            self.count("error")
            with contextlib.suppress(OSError):
                conn.sock.send(
                    encode_error(f"request longer than {MAX_REQUEST_BYTES} bytes; closing")
                )
            _discard_pending(conn.sock)
            self._drop(conn)
            return
        if replies:
            conn.outbox += b"".join(replies)
            self._flush(conn)

    def _answer(self, line: bytes, conn: _Connection) -> bytes:
        conn.last_request = time.monotonic()
        try:
            request = _parse(line)
        except ProtocolError as exc:
            self.count("error")
            return encode_error(str(exc))
        if conn.unproven is not None:
            if request.challenge is None:
                return encode_challenge(conn.unproven.challenge)  # sent before it read it
            try:
                peer = conn.unproven.prove(request.challenge, conn.senders)
            except PeerError as exc:
                self.count("refused")
                conn.refused = True
                return encode_error(str(exc))
            conn.unproven.close()
            conn.unproven, conn.view, conn.container_id = None, peer.view, peer.container_id
            conn.refusal = self._refusal(conn)
            self._peers_changed()
        if request.op == "event":
            self._post(conn, request.event)
            return b""  # never answered: see EventRequest
        if request.op == "report":
            self._keep(conn, request.report)
            return b""  # never answered, as an event is not
        self.count("ok" if conn.refusal is None else "refused")
        if request.op == "subscribe":
            conn.subscribed = True
            self._connected_changed()
            if request.pod:
                conn.wants_pod = True
                conn.pod_sent = self.pod_reply(conn)
                return self.usage(conn) + conn.pod_sent
        return self.usage(conn)

    def _push(self) -> None:
        """Each new sample to every subscriber that is served; one still reading the last gets
        only the next. One that is not served was told why, once."""
        for conn in list(self._connections.values()):
            if conn.subscribed and not conn.outbox and conn.refusal is None:
                self.count("pushed")
                conn.outbox = self.usage(conn)
                self._flush(conn)

    def _post(self, conn: _Connection, event: EventRequest | str | None) -> None:
        """A caller's report, as an Event on the pod its cgroup proves it is in, and no
        other. Its rate per pod is the recorder's (client-go's spam filter)."""
        events = self._hooks.events
        pod = self._callers_pod(conn, event, events is not None)
        if pod is not None and isinstance(event, EventRequest) and events is not None:
            self.count("event")
            events(pod, event)

    def _keep(self, conn: _Connection, report: SidecarReport | str | None) -> None:
        """A caller's counts, kept for the pod its cgroup proves it is in, and no other."""
        reports = self._hooks.reports
        pod = self._callers_pod(conn, report, reports is not None)
        if pod is not None and isinstance(report, SidecarReport) and reports is not None:
            self.count("report")
            reports(pod, conn.container_id or "", report)

    def _callers_pod(self, conn: _Connection, given: object, taken: bool) -> Pod | None:
        """The pod whose sidecar the caller is proven to be, for a well-formed request (not
        what is wrong with it, a str) that this agent takes; else None, counted as an error
        or a refusal."""
        pods = self._pods
        pod = pods.pods.get(conn.container_id or "") if pods is not None else None
        if conn.refusal is not None or pod is None or not taken:
            self.count("refused")
            return None
        if isinstance(given, str) or given is None:
            self.count("error")
            return None
        return pod

    def _push_pods(self) -> None:
        """The node's pods changed: each caller is served, or not, as they say now (one
        that became served gets its usage, one that no longer is gets why); each
        subscriber that asked for its pod gets it again when it changed."""
        for conn in list(self._connections.values()):
            refusal = self._refusal(conn)
            changed, conn.refusal = refusal != conn.refusal, refusal
            if changed:
                self._peers_changed()
                self._connected_changed()
                if conn.subscribed:
                    conn.outbox += self.usage(conn)
            if conn.wants_pod and (reply := self.pod_reply(conn)) != conn.pod_sent:
                self.count("pod")
                conn.pod_sent = reply
                conn.outbox += reply
            if conn.outbox:
                self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        """Send what we can; a reader that falls behind is no longer read until it catches up."""
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn, hung_up=True)
            return
        conn.outbox = conn.outbox[sent:]
        if conn.outbox and conn.blocked_since is None:
            conn.blocked_since = time.monotonic()
            self._interest(conn)
        elif not conn.outbox and conn.blocked_since is not None:
            conn.blocked_since = None
            self._interest(conn)

    def _interest(self, conn: _Connection) -> None:
        """What the loop waits for on a connection: its replies to be taken while they wait
        (it is not read meanwhile), else its requests, unless it is past its lines."""
        if conn.blocked_since is not None:
            events = select.EPOLLOUT
        else:
            events = 0 if conn.paused else select.EPOLLIN
        self._epoll.modify(conn.sock.fileno(), events)

    def _pause_accepting(self, exc: OSError) -> None:
        """The listener stays readable while the kernel cannot give us the connection's fd:
        polled on, it would spin the loop. Leave it alone for ACCEPT_PAUSE."""
        assert self._listener is not None  # noqa: S101
        if self._accepting_at is None:
            log.warning(
                "cannot accept connections (%s); pausing for %gs", exc.strerror or exc, ACCEPT_PAUSE
            )
            self._epoll.unregister(self._listener.fileno())
        self._accepting_at = time.monotonic() + ACCEPT_PAUSE
        self.count("refused")

    def _resume_accepting(self, now: float) -> None:
        if self._accepting_at is not None and now >= self._accepting_at:
            assert self._listener is not None  # noqa: S101
            self._accepting_at = None
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)

    def _sweep(self, now: float) -> None:
        """Disconnect readers stuck for WRITE_TIMEOUT and connections idle for IDLE_TIMEOUT;
        accept again after a pause."""
        self._resume_accepting(now)
        for conn in list(self._connections.values()):
            stuck = conn.blocked_since is not None and now - conn.blocked_since > WRITE_TIMEOUT
            idle = not conn.subscribed and now - conn.last_request > IDLE_TIMEOUT
            if stuck or idle:
                self._drop(conn)
                continue
            conn.lines = 0  # a new second
            if conn.paused:
                conn.paused = False
                self._interest(conn)
                self._take_lines(conn)  # those read and waiting first
        self._connected_changed()

    def _connected_changed(self) -> None:
        """`connected`, as of now: on every sweep (a reader that stopped reading drops out
        within WRITE_TIMEOUT), and as soon as a caller subscribes or leaves."""
        self.connected = frozenset(
            conn.container_id
            for conn in self._connections.values()
            if conn.subscribed
            and conn.blocked_since is None
            and conn.container_id
            and conn.refusal is None
        )

    def _drop(self, conn: _Connection, hung_up: bool = False) -> None:
        """`hung_up`: the caller closed the connection (not the agent)."""
        proven = conn.unproven is None
        if conn.unproven is not None:
            conn.unproven.close()
            conn.unproven = None
        fd = conn.sock.fileno()
        if self._connections.pop(fd, None) is not None:
            namespace = (conn.view.ns_inode, conn.view.level)
            self._per_namespace[namespace] -= 1
            if not self._per_namespace[namespace]:
                del self._per_namespace[namespace]
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)
            if proven and conn.container_id:
                self._peers_changed()
                self._connected_changed()
                told = self._hooks.hung_up
                if hung_up and conn.container_id not in self.peers and told is not None:
                    told(conn.container_id)
        conn.sock.close()
        self._metrics.connections.set(len(self._connections))

    def _peers_changed(self) -> None:
        self.peers = {
            conn.container_id: conn.pid
            for conn in self._connections.values()
            if conn.container_id and conn.unproven is None and conn.refusal is None
        }

    def count(self, result: str) -> None:
        counter = self._counters.get(result)
        if counter is None:
            counter = self._counters[result] = self._metrics.requests.labels(result)
        counter.inc()
