"""The sidecar's link to the node agent: one connection that brings the usage (and with it
the reclaims), the sidecar's own pod, and takes its reports and counts to the agent.

The connection is the sidecar's to the agent's socket, or, with `--listen`, the agent's to
a socket in the sidecar's own filesystem (`SidecarSocket`); either way the conversation is
the same. What waits to go out is kept apart from the connection (`Outbox`): it outlives a
lost connection, and goes on the next one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from enforcer.core.model import Sample, SourceDown
from enforcer.core.protocol import (
    MAX_REQUEST_BYTES,
    Challenge,
    EventRequest,
    PodReply,
    ProtocolError,
    Usage,
    decode_reply,
    encode_event,
    encode_report,
    encode_request,
)
from enforcer.core.reclaim import Reclaim
from enforcer.core.sidecar_report import SidecarReport
from enforcer.edge.backoff import Backoff
from enforcer.edge.listening import listen, peer_credentials

log = logging.getLogger(__name__)

EVENT_BACKLOG = 64  # reports kept for the agent while it cannot take them; then the oldest go
EVENT_MESSAGE_CHARS = 2048  # a message too long for a request is cut to half of this, ...

# The sidecar's socket: its owner, and others may write (connect). The agent connects as the
# host's root, which in a user-namespaced pod (`hostUsers: false`) is none of the pod's
# users, and has no CAP_DAC_OVERRIDE: with 0600 it was refused (EACCES), and every such pod
# was held by the agent from its start. Who else could connect is bounded elsewhere: the
# directory is an emptyDir only the sidecar mounts, the sidecar is not dumpable (another
# container reaches /proc/<pid>/root only with CAP_SYS_PTRACE), and a caller inside the
# pod's PID namespace is refused at accept (`SidecarSocket.accept`).
SOCKET_MODE = 0o602


class Outbox:
    """What the sidecar has for the agent, as lines of the protocol: reports to post as
    Events, up to EVENT_BACKLOG of them (then the oldest go), and this pod's latest counts,
    which go once to each connection. It sends nothing itself: `flush` is given the send."""

    def __init__(self) -> None:
        self._events: collections.deque[bytes] = collections.deque(maxlen=EVENT_BACKLOG)
        # This pod's latest counts, and whether this connection has had them: only the
        # latest waits, and each new connection gets it.
        self._report: bytes | None = None
        self._report_sent = False

    def event(self, event: EventRequest) -> None:
        line, keep = encode_event(event), EVENT_MESSAGE_CHARS
        while len(line) > MAX_REQUEST_BYTES:  # a request is at most 4096 bytes, escapes too
            keep //= 2
            line = encode_event(replace(event, message=event.message[:keep] + "…"))
        self._events.append(line)

    def report(self, report: SidecarReport) -> None:
        self._report, self._report_sent = encode_report(report), False

    def reconnected(self) -> None:
        """A new connection: it has not had the counts yet."""
        self._report_sent = False

    def flush(self, send: Callable[[bytes], bool]) -> None:
        """Send what waits, in order, until `send` says a line did not go."""
        while self._events and send(self._events[0]):
            self._events.popleft()
        if self._report is not None and not self._report_sent:
            self._report_sent = send(self._report)


class SidecarSocket:
    """The socket the sidecar listens on (`--listen`), in its own filesystem: the agent
    connects to it through /proc/<pid>/root (the pod needs no hostPath). Only a process
    outside this PID namespace may connect: one inside it is of this pod, a workload that
    could feed the sidecar made-up usage, and is refused."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Raises SocketInUse or OSError: the sidecar cannot start without it.
        self._sock = listen(Path(path), SOCKET_MODE, 4, "sidecar", "--listen")

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> socket.socket | None:
        """The agent's connection, if it has connected; a caller from this pod is refused."""
        for _ in range(8):  # a few refused callers do not keep the agent waiting a tick
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            pid, _uid = peer_credentials(sock)
            if pid == 0:  # outside this PID namespace: the agent (see the class)
                return sock
            sock.close()
            log.warning(
                "refused a connection to %s from pid %d of this pod: only the node agent may "
                "connect to the sidecar",
                self.path,
                pid,
            )
        return None

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class AgentLink:
    """The sidecar's connection to the node agent, subscribed: each sample arrives once it
    is taken. It is the sidecar's `UsageSource`.

    Never blocks a tick: the socket is read without waiting, the newest complete reply
    wins, and a lost agent is reconnected on a backoff schedule while every tick reports
    the source down. `fileno()` lets a loop wake up as soon as a sample arrives.

    With `pod`, the subscription also brings the caller's own pod (and its DRA objects)
    each time the agent's watch sees it change: `pod_reply` is the latest, kept while the
    agent is away, so that enforcement goes on with what was last known. `send_event`
    gives the agent a report to post as an Event on that pod; reports made while the agent
    cannot take them (away, or not yet sure who we are) wait in the `Outbox`, and go once
    it answers again.

    With `listen`, the sidecar does not connect: it listens on that socket
    (`SidecarSocket`), and the agent connects to it. The conversation is then the same. A
    newer connection of the agent's is tried beside the live one, which it replaces only
    once the agent has answered on it (`_take_newer`).

    One class, not a source and a sender: the usage, the pod and the reports share one
    connection, and whether the agent answers on it (it knows who we are) decides both
    what is read and when a report may go.
    """

    def __init__(
        self,
        path: str,
        stale_after: float,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        pod: bool = False,
        listen: str | None = None,
    ) -> None:
        self._path = path
        self._listener = None if listen is None else SidecarSocket(listen)
        self._stale_after = stale_after
        self._wants_pod = pod
        self.pod_reply: PodReply | None = None  # None until the agent has sent one
        self.pod_replies = 0  # how many have arrived: a new one is news to the caller
        # What the agent asks this pod's containers to give back, by container ID: from the
        # latest sample, and nothing while the agent is away.
        self.reclaims: dict[str, Reclaim] = {}
        # Whether the agent decides reclaims at all (one of an earlier release does not),
        # and for DRA allocations too: as its latest reply said, kept while it is away.
        self.lending = False
        self.lending_dra = False
        self._outbox = Outbox()
        self._answering = False  # the agent has answered on this connection: it knows us
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._sock: socket.socket | None = None
        self._buffer = b""
        # A newer connection of the agent's, not yet answered on, and what it sent so far.
        self._candidate: socket.socket | None = None
        self._candidate_buffer = b""
        self._answered = ""  # the last challenge answered
        # When the latest sample arrived, on `clock` (monotonic): its own `sampled_at` is the
        # agent's wall clock, and a step of either clock would make a frozen sample look fresh.
        self._received = 0.0
        self._latest: Sample | SourceDown = SourceDown(
            "waiting for the first sample from the node agent"
            if listen is None
            else f"waiting for the node agent to connect to {listen} (is an agent of this "
            "release running on this node?)"
        )

    def fileno(self) -> int | None:
        if self._sock is not None:
            return self._sock.fileno()
        return None if self._listener is None else self._listener.fileno()

    def sample(self) -> Sample | SourceDown:
        if self._listener is not None and self._sock is not None:
            self._take_newer(self._listener)
        if self._sock is None and not self._connect():
            return self._latest
        self._drain()
        latest = self._latest
        if isinstance(latest, Sample):
            age = self._clock() - self._received
            if age > self._stale_after:
                return SourceDown(f"the node agent's last sample arrived {age:.1f}s ago")
        return latest

    def _connect(self) -> bool:
        now = self._clock()
        if self._listener is not None and self._candidate is not None:
            # The live link is gone: the newer connection, subscribed already, is the link.
            self._sock, self._buffer = self._candidate, self._candidate_buffer
            self._candidate, self._candidate_buffer, self._answering = None, b"", False
            self._outbox.reconnected()
            return True
        if self._listener is not None:
            accepted = self._listener.accept()
            return accepted is not None and self._subscribe(accepted, now)
        if not self._backoff.ready(now):
            return False
        return self._subscribe(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), now)

    def _subscribe(self, sock: socket.socket, now: float) -> bool:
        where = self._path if self._listener is None else self._listener.path
        try:
            sock.settimeout(1.0)
            if self._listener is None:
                sock.connect(self._path)
            sock.sendall(encode_request("subscribe", pod=self._wants_pod))
            select.select([sock], [], [], 1.0)  # the agent answers a subscription at once
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self._backoff.failed(now)
            self._latest = SourceDown(
                f"cannot reach the node agent at {where}: {exc.strerror or exc}"
            )
            return False
        self._backoff.succeeded()
        self._sock, self._buffer, self._answering = sock, b"", False
        self._outbox.reconnected()
        return True

    def _take_newer(self, listener: SidecarSocket) -> None:
        """While connected, a newer connection of the agent's (it connects again when it
        no longer counts the old one) is subscribed beside the live one, and replaces it
        only once the agent answers on it (a sample, or this pod): a connection that
        delivers nothing, say one the agent made to a socket it then found was not the one
        it meant and closed unread, never costs the pod its live link (the agent would take
        the hang-up for a killed sidecar). Callers of this pod are refused at once, not
        left waiting."""
        accepted = listener.accept()
        if accepted is not None:
            self._drop_candidate()
            try:
                accepted.setblocking(False)
                accepted.send(encode_request("subscribe", pod=self._wants_pod))  # fits
            except OSError:
                accepted.close()
                return
            self._candidate, self._candidate_buffer = accepted, b""
        if self._candidate is not None:
            self._try_candidate(self._candidate)

    def _try_candidate(self, candidate: socket.socket) -> None:
        """Read the newer connection; once it answers, it is the link."""
        while True:
            try:
                chunk = candidate.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._drop_candidate()  # closed before it answered: the live link stays
                return
            self._candidate_buffer += chunk
        *lines, rest = self._candidate_buffer.split(b"\n")
        for i, line in enumerate(lines):
            try:
                reply = decode_reply(line)
            except ProtocolError:
                self._drop_candidate()
                return
            if isinstance(reply, Challenge):
                try:
                    self._answer(reply, candidate)
                except OSError:
                    self._drop_candidate()
                    return
            elif isinstance(reply, (Usage, PodReply)):  # the agent, answering: take it
                self._hang_up()
                self._sock, self._candidate = candidate, None
                self._buffer = b"\n".join([*lines[i:], rest])
                self._answering = False
                self._outbox.reconnected()
                return
        self._candidate_buffer = rest

    def _drop_candidate(self) -> None:
        if self._candidate is not None:
            self._candidate.close()
            self._candidate, self._candidate_buffer = None, b""

    def send_event(self, event: EventRequest) -> None:
        """Hand a report to the agent, never waiting: the Event is the agent's to post."""
        self._outbox.event(event)
        self._outbox.flush(self._send)

    def send_report(self, report: SidecarReport) -> None:
        """Hand the agent this pod's counts, never waiting: it serves them as the pod's
        metrics. While it is away only the latest waits, and goes to it once it answers."""
        self._outbox.report(report)
        self._outbox.flush(self._send)

    def _send(self, line: bytes) -> bool:
        """Whether the line went to an agent that answers (it knows who we are)."""
        if self._sock is None or not self._answering:
            return False
        try:
            sent = self._sock.send(line)
        except (BlockingIOError, InterruptedError):
            return False  # the socket's buffer is full: the next tick tries again
        except OSError as exc:
            self._lost(f"the connection to the node agent failed: {exc.strerror or exc}")
            return False
        if sent < len(line):  # rare: finish this one, blocking briefly
            try:
                self._sock.settimeout(1.0)
                self._sock.sendall(line[sent:])
                self._sock.setblocking(False)
            except OSError as exc:
                self._lost(f"the connection to the node agent failed: {exc.strerror or exc}")
                return False
        return True

    def _drain(self) -> None:
        assert self._sock is not None  # noqa: S101 - only called when connected
        while True:
            try:
                chunk = self._sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._lost(f"the connection to the node agent failed: {exc.strerror or exc}")
                return
            if not chunk:
                self._lost("the node agent closed the connection")
                return
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        try:
            for line in lines:  # usually one: a sample per wake-up
                reply = decode_reply(line)
                if isinstance(reply, Challenge):
                    self._answer(reply, self._sock)
                elif isinstance(reply, PodReply):
                    self.pod_reply = reply
                    self.pod_replies += 1
                    self._answering = True
                elif isinstance(reply, Usage):
                    self._latest, self._received = reply.sample, self._clock()
                    self.reclaims, self.lending = reply.reclaims, reply.lending
                    self.lending_dra = reply.lending_dra
                    self._answering = True
                else:
                    self._latest, self._received = reply, self._clock()
                    self._answering = True
        except (ProtocolError, OSError) as exc:
            self._lost(str(exc))
            return
        self._outbox.flush(self._send)

    def _answer(self, challenge: Challenge, sock: socket.socket) -> None:
        """A node whose kernel cannot name its callers asks them to prove who they are."""
        if challenge.nonce != self._answered:
            sock.sendall(encode_request("subscribe", challenge.nonce, self._wants_pod))
            self._answered = challenge.nonce

    def _lost(self, reason: str) -> None:
        self._hang_up()
        self.reclaims = {}
        self._backoff.failed(self._clock())
        self._latest = SourceDown(reason)

    def _hang_up(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._hang_up()
        self._drop_candidate()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
