"""Every TCP port we serve (the metrics endpoints with /healthz, the webhook's HTTPS), on one
thread where a connection that waits costs no thread of its own.

Whoever reaches a port chooses what it sends and how slowly. A thread per connection, each
read with a timeout, let a request that dripped a byte every 4 s hold its thread for ever:
eight pods held the 32 threads of the agent's metrics port, the kubelet's liveness probe
waited, and the agents were restarted (issue 42, item 6). Here:
- a request, head and body, has `request_within` seconds from its first byte (from accept
  on a new connection, the TLS handshake included), however it drips; then 408 and close;
- an answer has `answer_within` from the request's last byte until the peer has taken it;
- a kept-alive connection waits `idle_within` for its next request (0: one per connection);
- when the server holds `connections` (or the newcomer's address `per_peer`), the
  connection that has waited longest on its peer, of the peer holding the most, makes way
  (`core/fairness.py`): an address that holds fewer, like the kubelet's, always gets in;
- answers are made on this thread: a cheap one at once, a costly one (`Later`) at most one
  per pass of the loop, shared by every request waiting for the same one, so that a probe
  waits for one at most;
- bytes of bodies being read, and of answers not yet taken, are bounded: past the first a
  body waits its turn, past the second the answers that have waited longest are dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol

from prometheus_client import Counter

from enforcer.core.fairness import making_way
from enforcer.core.http_exchange import (
    Answer,
    BadHead,
    Head,
    Later,
    Limits,
    Request,
    answer_head,
    head_end,
    parse_head,
)
from enforcer.edge.guard import LoopGuard
from enforcer.edge.http_connection import (
    READABLE,
    READING,
    Conn,
    Holdings,
    Phase,
    Wait,
    longest_waiting,
)

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024  # a request line and its fields (Go's clients send well under 1 KiB)
ACCEPT_BATCH = 64  # accepted per pass: a flood of connects cannot keep the loop from the rest
ACCEPT_PAUSE = 1.0  # out of file descriptors: stop accepting this long, rather than spin
# After a connection's last answer its write side is shut, and what the peer still sends is
# read and dropped this long (and this much) before closing: closing on unread input resets
# the connection, and the peer would lose the answer.
LINGER = 1.0
LINGER_BYTES = 4 * 1024 * 1024

# Why the server closed a connection: vram_enforcer_http_connections_closed_total{reason}.
DEADLINE = "deadline"  # its request was not whole within its bound (408), or its handshake
UNREAD = "unread"  # its answer was not taken within its bound
MADE_WAY = "made-way"  # for a newcomer, its peer holding the most connections
TLS = "tls"  # its TLS handshake failed
REASONS = (DEADLINE, UNREAD, MADE_WAY, TLS)

Handler = Callable[[Request], Answer | Later]
# The server's own answers (408, 411, 413, 503, 500, ...), in the handler's format: the head
# they answer (None when it could not be read), the status and why.
Refusal = Callable[[Head | None, HTTPStatus, str], Answer]


class Counts(Protocol):
    """Where a server counts: each mode's telemetry has both."""

    @property
    def http_closed(self) -> Counter: ...  # labelled by server and reason

    @property
    def unexpected(self) -> Counter: ...  # labelled by loop


class HttpServer:
    """HTTP/1.1 on `listener` (`http_connection.listen_tcp`), on a thread named `name`;
    over TLS when given `tls`, the context for each new connection (read at accept: a
    rotated certificate is used for new connections, and those in flight finish on theirs)."""

    def __init__(
        self,
        listener: socket.socket,
        limits: Limits,
        handle: Handler,
        refuse: Refusal,
        counts: Counts,
        name: str,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self._listener = listener
        self._limits = limits
        self._handle = handle
        self._refuse = refuse
        self._closed = counts.http_closed
        self._name = name
        self._tls = tls
        for reason in REASONS:
            self._closed.labels(name, reason)
        self._guard = LoopGuard(name, counts.unexpected.labels(name), log)
        self._epoll = select.epoll()
        self._conns: dict[int, Conn] = {}
        self._by_peer: dict[str, set[Conn]] = {}
        self._laters: deque[Conn] = deque()
        self._ready: deque[Conn] = deque()  # kept alive with a next request already read
        self._budget: deque[Conn] = deque()  # waiting for room among the bodies in flight
        self._bodies = 0
        self._answers = 0  # bytes of answers not yet taken
        self._due = math.inf  # the earliest deadline, or later
        self._accepting_at: float | None = None  # paused (out of fds) until then
        self._serving: Conn | None = None  # the connection being served, for the guard
        self._draining = False
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> None:
        self.thread.start()

    def drain(self, within: float = 30.0) -> None:
        """Stop accepting; close the connections that wait for a request, answer those in
        flight (each answer closes its connection), then stop. Every one of them ends within
        its deadline, so `within` is only a backstop."""
        self._draining = True
        self._wake()
        self.thread.join(timeout=within)
        self.close()

    def close(self) -> None:
        """Stop at once: every connection closed unanswered."""
        self._stopping = True
        self._wake()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._listener.close()
        if self._wake_r >= 0:
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a wake-up already pending, or closed
            os.write(self._wake_w, b"x")

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            due = min(self._due, self._accepting_at or math.inf)
            if self._laters or self._ready:
                timeout = 0.0
            else:
                timeout = -1.0 if due == math.inf else max(0.0, due - now)
            ready = self._epoll.poll(timeout)
            if self._stopping:
                return
            # A bug in serving one connection closes that connection; the loop goes on.
            if not self._guard.run(functools.partial(self._dispatch, ready)) and self._serving:
                self._close(self._serving)
            self._serving = None
            for step in (self._expire, self._make_later, self._resume, self._pipelined):
                self._guard.run(step)
            if self._draining and not self._conns:
                return

    def _dispatch(self, ready: list[tuple[int, int]]) -> None:
        for fd, events in ready:
            self._serving = None
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                if self._draining:
                    self._stop_accepting()
            elif fd == self._listener.fileno():
                self._accept()
            elif (conn := self._conns.get(fd)) is not None:
                self._serving = conn
                self._step(conn, events)
        self._serving = None
        if self._accepting_at is not None and time.monotonic() >= self._accepting_at:
            self._accepting_at = None
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)

    def _stop_accepting(self) -> None:
        if self._listener.fileno() < 0:
            return
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(self._listener.fileno())
        self._listener.close()
        self._accepting_at = None
        for conn in list(self._conns.values()):
            waiting = conn.phase in (Phase.HANDSHAKE, Phase.IDLE)
            if waiting or (conn.phase is Phase.HEAD and not conn.inbox):
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, or of memory: pause, don't spin
                log.warning("%s: cannot accept (%s); pausing for a second", self._name, exc)
                self._epoll.unregister(self._listener.fileno())
                self._accepting_at = time.monotonic() + ACCEPT_PAUSE
                return
            peer = str(address[0])
            holdings = Holdings(self._by_peer)
            loser = making_way(holdings, len(self._conns), peer, self._limits.bounds)
            if loser is not None:
                if loser not in self._by_peer:
                    sock.close()  # nobody to make way: a bound of 0
                    continue
                self._close(longest_waiting(self._by_peer[loser]), MADE_WAY)
            self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: str) -> None:
        now = time.monotonic()
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            # Headers and body leave in one write, and nothing waits for Nagle and the
            # peer's delayed ACK (40 ms a review, measured).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        phase = Phase.HEAD
        if self._tls is not None:
            phase = Phase.HANDSHAKE
            try:
                sock = self._tls().wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            except (ssl.SSLError, OSError):
                sock.close()
                self._closed.labels(self._name, TLS).inc()
                return
        conn = Conn(sock, peer, phase, now)
        self._conns[sock.fileno()] = conn
        self._by_peer.setdefault(peer, set()).add(conn)
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        self._set(conn, phase, self._limits.request_within, now)
        self._step(conn, select.EPOLLIN)  # what came with the connection is read at once

    def _set(self, conn: Conn, phase: Phase, within: float, now: float | None = None) -> None:
        conn.phase = phase
        conn.since = time.monotonic() if now is None else now
        conn.deadline = conn.since + within
        self._due = min(self._due, conn.deadline)

    def _want(self, conn: Conn, wait: Wait | None) -> None:
        """Wake for the connection when it can go on (None: for nothing but a reset)."""
        with contextlib.suppress(OSError, ValueError):
            self._epoll.modify(conn.sock.fileno(), 0 if wait is None else wait.events)

    def _step(self, conn: Conn, events: int) -> None:
        phase = conn.phase
        if phase in (Phase.BUDGET, Phase.LATER):  # it waits on us, reading nothing
            if events & (select.EPOLLHUP | select.EPOLLERR):
                self._close(conn)  # the peer reset it
        elif phase is Phase.HANDSHAKE:
            self._handshake(conn)
        elif phase is Phase.WRITE:
            self._write(conn)
        elif phase is Phase.LINGER:
            if not conn.drop_input(LINGER_BYTES):
                self._close(conn)
        else:
            self._read(conn)

    def _handshake(self, conn: Conn) -> None:
        done = conn.handshake()
        if isinstance(done, Wait):
            self._want(conn, done)
        elif not done:
            log.debug("%s: a TLS handshake with %s failed", self._name, conn.peer)
            self._close(conn, TLS)
        else:
            conn.phase = Phase.HEAD  # its request's deadline runs on from accept
            self._want(conn, READABLE)
            self._read(conn)

    def _read(self, conn: Conn) -> None:
        """Read what has come, and take it as far as it goes."""
        while conn.phase in READING and not conn.closed:
            while len(conn.inbox) <= (conn.length if conn.phase is Phase.BODY else MAX_HEAD):
                chunk = conn.receive()
                if chunk is None and conn.inbox:
                    conn.hung_up = True  # what it sent before is answered, if whole
                    break
                if chunk is None:
                    self._close(conn)  # the peer is gone, or done
                    return
                if isinstance(chunk, Wait):
                    self._want(conn, chunk)
                    break
                if conn.phase is Phase.IDLE:  # a next request's first byte: its deadline
                    self._set(conn, Phase.HEAD, self._limits.request_within)
                if not conn.inbox and conn.phase is Phase.HEAD:
                    conn.started = time.monotonic()
                conn.inbox += chunk
            self._progress(conn)
            if conn.hung_up and conn.phase in READING:
                self._close(conn)  # nothing whole to answer
                return
            if not conn.pending():
                return

    def _progress(self, conn: Conn) -> None:
        """Take what the inbox holds as far as it goes: a head, then its body."""
        if conn.phase is Phase.HEAD:
            end = head_end(conn.inbox)
            if (end[0] if end else len(conn.inbox)) > MAX_HEAD:
                why = f"the head is over {MAX_HEAD} bytes"
                self._refusal(conn, None, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, why)
                return
            if end is None:
                return
            raw, conn.inbox = conn.inbox[: end[0]], conn.inbox[sum(end) :]
            if not self._begin(conn, raw):
                return
        if conn.phase is Phase.BODY and len(conn.inbox) >= conn.length:
            body, conn.inbox = conn.inbox[: conn.length], conn.inbox[conn.length :]
            self._dispatch_request(conn, body)

    def _begin(self, conn: Conn, raw: bytes) -> bool:
        """Read a head; False when it was refused, or its body waits for its turn."""
        try:
            head = parse_head(raw)
            length = head.body_length()
        except BadHead as exc:
            self._refusal(conn, None, exc.status, str(exc))
            return False
        conn.head, conn.length = head, length
        if length > self._limits.max_body:
            problem = f"the body is {length} bytes; at most {self._limits.max_body} are accepted"
            self._refusal(conn, head, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, problem)
            return False
        if length and not self._reserve(conn):
            conn.phase = Phase.BUDGET  # its request's deadline runs on
            self._want(conn, None)
            self._budget.append(conn)
            return False
        self._body(conn)
        return True

    def _body(self, conn: Conn) -> None:
        conn.phase = Phase.BODY
        assert conn.head is not None  # noqa: S101 - a body follows a head
        if conn.length and conn.head.expects_continue and len(conn.inbox) < conn.length:
            with contextlib.suppress(OSError, ssl.SSLError):  # if it cannot go now, the
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")  # client sends anyway
        self._want(conn, READABLE)

    # -- bodies in flight -----------------------------------------------------------------

    def _room(self, conn: Conn) -> int | None:
        """What the body takes of the bodies in flight, if it fits now. A body as large as
        all of them still gets its turn, alone."""
        need = min(conn.length, self._limits.bodies_in_flight)
        fits = not self._bodies or self._bodies + need <= self._limits.bodies_in_flight
        return need if fits else None

    def _reserve(self, conn: Conn) -> bool:
        need = None if self._budget else self._room(conn)  # first come, first served
        if need is None:
            return False
        self._bodies += need
        conn.reserved = need
        return True

    def _release(self, conn: Conn) -> None:
        self._bodies -= conn.reserved
        conn.reserved = 0

    def _resume(self) -> None:
        """Let the waiting bodies in, in turn, while there is room."""
        while self._budget:
            conn = self._budget[0]
            if conn.closed or conn.phase is not Phase.BUDGET:
                self._budget.popleft()
                continue
            need = self._room(conn)
            if need is None:
                return
            self._budget.popleft()
            self._bodies += need
            conn.reserved = need
            self._body(conn)
            self._read(conn)

    # -- answers --------------------------------------------------------------------------

    def _dispatch_request(self, conn: Conn, body: bytes) -> None:
        head = conn.head
        assert head is not None  # noqa: S101 - a request has a head
        request = Request(head.method, head.target, head.headers, body, conn.peer, conn.started)
        self._set(conn, Phase.LATER, self._limits.answer_within)
        self._want(conn, None)
        answer = self._made(lambda: self._handle(request), head)
        if isinstance(answer, Later):
            conn.later = answer
            self._laters.append(conn)
        else:
            self._answer(conn, answer)

    def _made(self, make: Callable[[], Answer | Later], head: Head) -> Answer | Later:
        """What `make` answers; a bug in it is a 500 (logged once, counted), never a
        dropped connection."""
        made = self._guard.result(make)
        if made is None:
            return self._refuse(
                head, HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the log"
            )
        return made

    def _make_later(self) -> None:
        """One costly answer per pass, for every request waiting for the same one."""
        while self._laters:
            conn = self._laters.popleft()
            if conn.closed or conn.later is None or conn.head is None:
                continue
            later, head = conn.later, conn.head
            answer = self._made(later.make, head)
            assert isinstance(answer, Answer)  # noqa: S101 - make() gives an Answer
            batch = [conn]
            if later.key is not None:
                batch += [c for c in self._laters if c.later and c.later.key == later.key]
                self._laters = deque(c for c in self._laters if c not in batch)
            for each in batch:
                if not each.closed:
                    self._answer(each, answer)
            return

    def _refusal(
        self, conn: Conn, head: Head | None, status: HTTPStatus, why: str, within: float = 0.0
    ) -> None:
        """The server's own answer, after which the connection ends (its input not read),
        taken within `within` (0: an answer's bound)."""
        made = self._refuse(head, status, why)
        self._set(conn, conn.phase, within or self._limits.answer_within)
        closing = Answer(made.status, made.body, made.content_type, made.fields, close=True)
        self._answer(conn, closing)

    def _answer(self, conn: Conn, answer: Answer) -> None:
        head = conn.head
        self._release(conn)
        conn.later = None
        last = (
            answer.close
            or conn.hung_up
            or self._draining
            or head is None
            or not head.keep_alive
            or self._limits.idle_within <= 0
        )
        body = b"" if head is not None and head.method == "HEAD" else answer.body
        fields = (("Content-Type", answer.content_type), *answer.fields)
        conn.outbox = answer_head(answer.status, fields, len(answer.body), last) + body
        conn.sent = 0
        conn.last = last
        conn.phase = Phase.WRITE  # within the answer's deadline, set with its request
        self._answers += len(conn.outbox)
        self._write(conn)
        self._shed(conn)

    def _shed(self, made: Conn) -> None:
        """Past the bytes of answers in flight, the connections whose answers have waited
        longest to be taken are closed, until the one just made fits."""
        if self._answers <= self._limits.answers_in_flight:
            return
        writing = [c for c in self._conns.values() if c.phase is Phase.WRITE and c is not made]
        for conn in sorted(writing, key=lambda c: c.since):
            if self._answers <= self._limits.answers_in_flight:
                return
            self._close(conn, UNREAD)

    def _write(self, conn: Conn) -> None:
        unsent = conn.unsent
        sent = conn.send()
        self._answers -= unsent - conn.unsent
        if isinstance(sent, Wait):
            self._want(conn, sent)
            return
        if not sent:
            self._close(conn)
            return
        conn.outbox, conn.sent, conn.head = b"", 0, None
        if conn.last:
            conn.shut_write()
            self._set(conn, Phase.LINGER, LINGER)
            self._want(conn, READABLE)
            self._step(conn, 0)
            return
        self._set(conn, Phase.IDLE, self._limits.idle_within)
        self._want(conn, READABLE)
        if conn.inbox:  # a pipelined request came with the last one
            self._set(conn, Phase.HEAD, self._limits.request_within)
            conn.started = conn.since
        if conn.inbox or conn.pending():
            self._ready.append(conn)

    def _pipelined(self) -> None:
        """A next request that came with the last one, taken here (one per connection and
        pass) rather than from inside the last one's answer."""
        for _ in range(len(self._ready)):
            conn = self._ready.popleft()
            if not conn.closed and conn.phase in (Phase.IDLE, Phase.HEAD):
                self._read(conn)

    # -- deadlines ------------------------------------------------------------------------

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        due = math.inf
        for conn in list(self._conns.values()):
            if conn.deadline <= now:
                self._overdue(conn)
            if not conn.closed:
                due = min(due, conn.deadline)
        self._due = due

    def _overdue(self, conn: Conn) -> None:
        phase = conn.phase
        if phase in (Phase.HEAD, Phase.BODY):
            self._closing(conn, DEADLINE)
            why = f"the request did not arrive whole within {self._limits.request_within:g}s"
            self._refusal(conn, conn.head, HTTPStatus.REQUEST_TIMEOUT, why, LINGER)
        elif phase is Phase.BUDGET:
            self._closing(conn, DEADLINE)
            why = "too many large requests at once; retry"
            self._refusal(conn, conn.head, HTTPStatus.SERVICE_UNAVAILABLE, why, LINGER)
        elif phase is Phase.LATER:  # ours to be late with, not the peer's
            why = "the answer was not ready in time; retry"
            self._refusal(conn, conn.head, HTTPStatus.SERVICE_UNAVAILABLE, why, LINGER)
        elif phase is Phase.WRITE:
            self._close(conn, UNREAD)
        else:  # the handshake, an idle connection, a lingering one
            self._close(conn, DEADLINE if phase is Phase.HANDSHAKE else None)

    def _closing(self, conn: Conn, reason: str) -> None:
        """Counted once, when decided: a connection answered 408 closes after its answer."""
        if conn.reason is None:
            conn.reason = reason
            self._closed.labels(self._name, reason).inc()

    def _close(self, conn: Conn, reason: str | None = None) -> None:
        if conn.closed:
            return
        conn.closed = True
        if reason is not None:
            self._closing(conn, reason)
        self._release(conn)
        self._answers -= conn.unsent
        conn.outbox = b""
        fd = conn.sock.fileno()
        self._conns.pop(fd, None)
        peers = self._by_peer.get(conn.peer)
        if peers is not None:
            peers.discard(conn)
            if not peers:
                del self._by_peer[conn.peer]
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        conn.close()
