"""One connection of `http_server.HttpServer`: where it stands, what it holds, and its
socket's non-blocking reads and writes, TLS or not, each saying what it waits for; and of a
peer's connections, the one that makes way for a newcomer (`core/fairness.py`)."""

from __future__ import annotations

import contextlib
import enum
import fcntl
import math
import select
import socket
import ssl
import struct
import termios
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from enforcer.core.fairness import Holding
from enforcer.core.http_exchange import Head, Later

BACKLOG = 1024  # the kernel's queue of connections not yet accepted (capped by somaxconn)
CHUNK = 256 * 1024
# What the kernel holds for each connection (it doubles it), fixed rather than autotuned (to 4
# and 6 MiB), so that a peer that sends and does not read, on every connection it may hold,
# costs a known amount. 16 KiB in still moves a 3 MiB body in 30 ms on loopback; what goes
# out is the server's to choose (`listen_tcp`).
RECEIVE_BUFFER = 16 * 1024


def listen_tcp(address: str, port: int, send_buffer: int) -> socket.socket:
    """A listening socket on `address` (IPv4 or IPv6) and `port` (0: a free one), whose
    connections have `send_buffer` bytes of the kernel's for what they send."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Set on the listener, before listen(): accepted sockets inherit them, with a window
        # scale that fits.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Phase(enum.Enum):
    HANDSHAKE = "handshake"  # TLS, before the first request
    HEAD = "head"  # a request's head is being read
    BUDGET = "budget"  # its body waits for room among the bodies in flight
    BODY = "body"  # its body is being read
    LATER = "later"  # its answer waits for its turn to be made
    WRITE = "write"  # its answer is being taken
    IDLE = "idle"  # kept alive, between requests
    LINGER = "linger"  # its last answer sent; what comes is dropped, then it closes


READING = (Phase.HEAD, Phase.BODY, Phase.IDLE)


@dataclass(frozen=True, slots=True)
class Wait:
    """The socket cannot go on until it can be read (or written): the epoll events."""

    events: int


READABLE, WRITABLE = Wait(select.EPOLLIN), Wait(select.EPOLLOUT)


class Conn:
    __slots__ = (
        "closed",
        "deadline",
        "dropped",
        "head",
        "hung_up",
        "inbox",
        "last",
        "later",
        "length",
        "outbox",
        "peer",
        "phase",
        "reason",
        "reserved",
        "sent",
        "since",
        "sock",
        "started",
    )

    def __init__(self, sock: socket.socket, peer: str, phase: Phase, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.phase = phase
        self.since = now  # when it began to wait in this phase
        self.deadline = math.inf
        self.started = now  # when its request's first byte came
        self.inbox = b""
        self.head: Head | None = None
        self.length = 0  # its request's body
        self.reserved = 0  # bytes of the bodies in flight that it holds
        self.later: Later | None = None
        self.outbox = b""
        self.sent = 0  # of the outbox
        self.dropped = 0  # lingering, what came and was dropped
        self.last = False  # its answer is the connection's last
        self.hung_up = False  # the peer closed its side after its request: answered, then closed
        self.reason: str | None = None  # why the server closes it, counted once
        self.closed = False

    def handshake(self) -> Wait | bool:
        """The TLS handshake, as far as it goes: True once done, False if it failed."""
        assert isinstance(self.sock, ssl.SSLSocket)  # noqa: S101 - only TLS shakes hands
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            return READABLE
        except ssl.SSLWantWriteError:
            return WRITABLE
        except (ssl.SSLError, OSError):
            return False
        return True

    def receive(self) -> bytes | Wait | None:
        """What has come (None: the peer is gone, reset or done; or it speaks no TLS)."""
        try:
            return self.sock.recv(CHUNK) or None
        except (BlockingIOError, ssl.SSLWantReadError):
            return READABLE
        except ssl.SSLWantWriteError:
            return WRITABLE
        except (ssl.SSLError, OSError):
            return None

    def pending(self) -> bool:
        """TLS holds decrypted bytes, which epoll cannot see."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    @property
    def unsent(self) -> int:
        return len(self.outbox) - self.sent

    def send(self) -> Wait | bool:
        """The outbox, as far as it goes: True once all of it is taken, False if the peer
        is gone."""
        while self.sent < len(self.outbox):
            try:
                self.sent += self.sock.send(memoryview(self.outbox)[self.sent : self.sent + CHUNK])
            except (BlockingIOError, ssl.SSLWantWriteError):
                return WRITABLE
            except ssl.SSLWantReadError:
                return READABLE
            except (ssl.SSLError, OSError):
                return False
        return True

    def shut_write(self) -> None:
        """The peer reads our last answer, then the end (no TLS close_notify)."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_WR)

    def close(self) -> None:
        """Closed, with a reset if the kernel still holds some of what we sent (a peer that
        did not take it): its buffers are freed at once, not kept for an orphan's retries."""
        with contextlib.suppress(OSError):
            held = fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            if struct.unpack("i", held)[0] > 1:  # more than our FIN
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def drop_input(self, limit: int) -> bool:
        """Lingering: read what comes and drop it, TLS not decoded. False once the peer has
        closed or `limit` bytes have come."""
        while True:
            try:
                chunk = socket.socket.recv(self.sock, CHUNK)
            except BlockingIOError:
                return True
            except OSError:
                return False
            self.dropped += len(chunk)
            if not chunk or self.dropped > limit:
                return False


def longest_waiting(conns: set[Conn]) -> Conn:
    """The one that has waited longest on its peer; one whose answer is yet to be made
    (waiting on us) only after those."""
    return min(conns, key=lambda c: (c.phase is Phase.LATER, c.since))


class Holdings(Mapping[str, Holding]):
    """Each peer's holding, worked out only for the peers `making_way` looks at."""

    def __init__(self, by_peer: dict[str, set[Conn]]) -> None:
        self._by_peer = by_peer

    def __getitem__(self, peer: str) -> Holding:
        conns = self._by_peer[peer]
        return Holding(len(conns), longest_waiting(conns).since)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_peer)

    def __len__(self) -> int:
        return len(self._by_peer)
