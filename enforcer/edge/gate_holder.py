"""The second holder of the allocation gate's listener fds: the pod's sidecar keeps a copy of
each of its containers' fds, so that the agent's exit (a restart, a rollout, a crash) does
not close the last copy, which fails every later gated call of those containers with ENOSYS
for the rest of their lives (`seccomp_notify_detach`, kernel/seccomp.c).

Who reads the fds is a lease the agent renews. The agent sends a renewal every `RENEW_EVERY`
seconds; the holder, on each, promises to read nothing for `LEASE` seconds from when it got
it, and acknowledges it; the agent reads and judges only until `LEASE` after it *sent* the
renewal last acknowledged (sent before it was got: its lease ends first, on the one
monotonic clock of the node). So when the agent stops answering (stopped, stuck, or dead:
the kernel hangs its connection up then) the holder lets every notified call go on unjudged
(fail open: sampling still holds the line) within `LEASE`, and stops as soon as a renewal
comes again, before it acknowledges it. One reader at a time: the holder's one thread either
answers, hands over or acknowledges, and the agent waits for the acknowledgement. A new
agent is handed a copy of each fd the holder holds, and is renewed from its connection.

The wire is a SOCK_SEQPACKET socket in the sidecar's own filesystem, reached by the agent as
the usage link's `SidecarSocket` is, and refused to callers inside the pod's PID namespace:
one message per fd, its claim as JSON (`{"container": ID, "pid": N}`) with the fd in
SCM_RIGHTS; a renewal `{"renew": N}` and its acknowledgement `{"ack": N, "let_on": K}`
bring no fd (K: the calls let go on here since the last count the agent was told, as in
the greeting `{"fds": N, "let_on": K}`).
Neither end takes anything but a seccomp listener fd, and the claim is a hint: who a
process is, the agent proves from its cgroup.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from enforcer.edge.agent_link import SOCKET_MODE  # the agent may not be root of the pod
from enforcer.edge.gate_listener import let_go_on
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.listening import listen, peer_credentials

log = logging.getLogger(__name__)

MAX_HANDED = 4096  # fds one holder may hand over: a pod's processes under the gate
MAX_CLAIM = 512  # bytes of one message's JSON: a container ID and a pid
NOTIFY_FD = "anon_inode:seccomp notify"  # what /proc/self/fd/N names a listener fd
LEASE = 2.0  # s one acknowledged renewal lets the agent judge, and keeps the holder off
HANDOVER_WITHIN = 5.0  # s a holder may take to hand the agent every fd it holds
RENEW_EVERY = LEASE / 4  # s between the agent's renewals: three may be late before it lapses
_FLIPPING = threading.Lock()  # one `same_file` at a time: each flips a flag and reads it back


@dataclass(frozen=True, slots=True)
class Held:
    """A listener fd (the taker's to close) and what its sender says it serves: a hint."""

    fd: int
    container_id: str
    pid: int


def pass_fd(sock: socket.socket, held: Held) -> None:
    """Send a copy of `held.fd` with its claim (one message; raises OSError)."""
    claim = json.dumps({"container": held.container_id, "pid": held.pid}).encode()
    sock.sendmsg([claim], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [held.fd]))])


def hand_over(sock: socket.socket, helds: list[Held], let_on: int = 0) -> None:
    """The holder's greeting to an agent that connects: how many fds follow (and how many
    calls it let go on that no agent was told of), then each."""
    sock.sendmsg([json.dumps({"fds": len(helds), "let_on": let_on}).encode()])
    for held in helds:
        pass_fd(sock, held)


def take_over(sock: socket.socket) -> tuple[list[Held], int]:
    """The agent's side of `hand_over`: the fds the holder held, and the calls it let go
    on that no agent was told of, all within `HANDOVER_WITHIN` (a holder paced a message
    at a time, its sidecar stopped and continued, never holds the dial's thread longer).
    Raises OSError, or ValueError for a greeting that is no count or a connection that
    ends early or late (the fds taken so far closed then)."""
    deadline, timeout = time.monotonic() + HANDOVER_WITHIN, sock.gettimeout()
    try:
        return _take_over(sock, deadline)
    finally:
        sock.settimeout(timeout)


def _take_over(sock: socket.socket, deadline: float) -> tuple[list[Held], int]:
    _until(sock, deadline)
    raw, _, _, _ = sock.recvmsg(MAX_CLAIM)
    try:
        count = json.loads(raw)["fds"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"the holder's greeting {raw[:80]!r} says no count of fds") from exc
    if not isinstance(count, int) or not 0 <= count <= MAX_HANDED:
        raise ValueError(f"the holder's greeting says {count!r} fds (0 to {MAX_HANDED})")
    taken: list[Held] = []
    for seen in range(count):
        late = False
        try:
            _until(sock, deadline)
            found = take_fd(sock)
        except TimeoutError:
            found, late = None, True
        except OSError:
            found = None
        if found is None:
            for held in taken:
                os.close(held.fd)
            if late:
                raise ValueError(
                    f"the holder handed over {seen} of {count} fds in {HANDOVER_WITHIN:g} s"
                )
            raise ValueError(f"the holder's connection ended after {seen} of {count} fds")
        if isinstance(found, str):
            log.warning("allocation gate: dropped a message of a holder: %s", found)
        else:
            taken.append(found)
    return taken, calls_let_on(raw)


def _until(sock: socket.socket, deadline: float) -> None:
    """The next read on `sock` ends by `deadline` (TimeoutError once it has passed)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    timeout = sock.gettimeout()
    sock.settimeout(left if timeout is None else min(left, timeout))


def renew(sock: socket.socket, number: int) -> None:
    """The agent's renewal of its lease (raises OSError)."""
    sock.sendmsg([json.dumps({"renew": number}).encode()])


def acknowledge(sock: socket.socket, number: int, let_on: int = 0) -> None:
    """The holder's word that it reads nothing for `LEASE` from now, with the calls it let
    go on since it last told an agent (raises OSError)."""
    sock.sendmsg([json.dumps({"ack": number, "let_on": let_on}).encode()])


def beat(raw: bytes, kind: str) -> int | None:
    """The number of a message without fd that is a renewal (`kind` "renew") or an
    acknowledgement ("ack"); None where it is not one."""
    return _count_in(raw, kind)


def calls_let_on(raw: bytes) -> int:
    """The calls a holder's greeting or acknowledgement says it let go on (0: none said)."""
    return _count_in(raw, "let_on") or 0


def _count_in(raw: bytes, key: str) -> int | None:
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    number = found.get(key) if isinstance(found, dict) else None
    ok = isinstance(number, int) and not isinstance(number, bool) and number >= 0
    return number if ok else None


def take_fd(sock: socket.socket) -> Held | str | None:
    """One message: the fd and its claim; why it is not one (every fd it brought closed);
    None once the other end has hung up (raises OSError)."""
    found = take(sock)
    return "the message brought 0 fds, not 1" if isinstance(found, bytes) else found


def take(sock: socket.socket) -> Held | bytes | str | None:
    """As `take_fd`, and the bytes of a message that brings no fd (a renewal or its
    acknowledgement: `beat`)."""
    fds = array.array("i")
    raw, ancillary, flags, _ = sock.recvmsg(MAX_CLAIM, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not raw and not fds:
        return None
    if not fds and not flags & socket.MSG_TRUNC:
        return raw
    found = _claim(raw, flags, list(fds))
    if isinstance(found, str):
        for fd in fds:
            os.close(fd)
    return found


def _claim(raw: bytes, flags: int, fds: list[int]) -> Held | str:
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return "the message was longer than one claim and one fd"
    if len(fds) != 1:
        return f"the message brought {len(fds)} fds, not 1"
    if not is_listener_fd(fds[0]):
        return "its fd is no seccomp listener"
    try:
        found = json.loads(raw)
    except ValueError as exc:
        return f"the claim is not JSON ({exc})"
    cid = found.get("container") if isinstance(found, dict) else None
    pid = found.get("pid") if isinstance(found, dict) else None
    if not isinstance(cid, str) or not isinstance(pid, int) or isinstance(pid, bool):
        return f"the claim {raw[:80]!r} names no container and pid"
    return Held(fds[0], cid, pid)


def is_listener_fd(fd: int) -> bool:
    """Whether `fd` is a seccomp listener: the only kind either end polls and answers."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == NOTIFY_FD
    except OSError:
        return False


def same_file(a: int, b: int) -> bool:
    """Whether two fds of this process are copies of one open file. Every listener fd is
    on the one anonymous inode (fstat cannot tell them apart), and kcmp(2), which could,
    is refused under containerd's RuntimeDefault (the agent's and the sidecar's): but a
    file's status flags are the open file's, so a flag flipped through `a` shows through
    `b` only where both are copies of one. O_NONBLOCK, which a listener's RECV ignores."""
    with _FLIPPING:
        flags_a, flags_b = fcntl.fcntl(a, fcntl.F_GETFL), fcntl.fcntl(b, fcntl.F_GETFL)
        if flags_a != flags_b:
            return False
        fcntl.fcntl(a, fcntl.F_SETFL, flags_a ^ os.O_NONBLOCK)
        try:
            return bool(fcntl.fcntl(b, fcntl.F_GETFL) != flags_b)
        finally:
            fcntl.fcntl(a, fcntl.F_SETFL, flags_a)


class Holder:
    """The sidecar's side (`start`, `stop`): listens on `path`, takes the fds an agent hands
    it, lets their calls go on while no agent holds the lease, and hands them to each agent
    that connects. An fd is closed once every task under its filter has exited."""

    def __init__(self, path: Path, errors: ErrorCounter) -> None:
        # Raises SocketInUse or OSError.
        self._sock = listen(path, SOCKET_MODE, 4, "gate holder", "path", socket.SOCK_SEQPACKET)
        self._path = path
        self._guard = LoopGuard("allocation gate holder", errors, log)
        self._held: dict[int, Held] = {}
        self._agent: socket.socket | None = None
        self._quiet_until = 0.0  # monotonic: the agent's lease, in which nothing is read
        self._was_reading = True  # for the lines that say when the agent is away, or back
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.let_on = 0  # calls let go on unjudged while no agent held the lease
        self._told = 0  # of those, how many an agent was told of

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gate-holder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop, closing every copy held (the agent's, if it runs, keep the calls served)."""
        self._stopping.set()
        os.write(self._wake_w, b"s")
        if self._thread is not None:
            self._thread.join()
        for held in self._held.values():
            os.close(held.fd)
        self._held.clear()
        self._hang_up()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(OSError):
            self._path.unlink()

    @property
    def agent_connected(self) -> bool:
        return self._agent is not None

    @property
    def reading(self) -> bool:
        """Whether the holder answers the calls now: no agent holds the lease."""
        return self._agent is None or time.monotonic() >= self._quiet_until

    def held(self) -> list[Held]:
        return list(self._held.values())

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self._guard.run(self._once):
                self._stopping.wait(1.0)  # a bug: said and counted, tried again after a breath

    def _once(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(self._sock, select.POLLIN)
        if self._agent is not None:
            poller.register(self._agent, select.POLLIN)
        reading = self._says_reading()
        # While an agent holds the lease, an fd is watched only for its end (POLLHUP),
        # and the wait ends when the lease does.
        watch, wait = select.POLLIN, 1000
        if not reading:
            watch, wait = 0, min(wait, int((self._quiet_until - time.monotonic()) * 1000) + 1)
        for fd in self._held:
            poller.register(fd, watch)
        found = poller.poll(wait)
        # The agent's messages first: a renewal stops the reading before an fd is read.
        if self._agent is not None and any(fd == self._agent.fileno() for fd, _ in found):
            self._from_agent(self._agent)
        for fd, events in found:
            if fd == self._sock.fileno():
                self._accept()
            elif fd in self._held:
                self._serve(fd, events)

    def _says_reading(self) -> bool:
        """Whether the holder reads now, said when that changes while an agent is
        connected (a connection that ends says so itself)."""
        reading = self.reading
        if reading and not self._was_reading and self._agent is not None:
            log.warning(
                "allocation gate: the node agent has not renewed its lease for %.0f s (it is "
                "stopped or stuck); this pod's %d gated processes' allocations go on "
                "unchecked until it answers again",
                LEASE,
                len(self._held),
            )
        self._was_reading = reading
        return reading

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, _uid = peer_credentials(sock)
        if pid != 0:  # inside this PID namespace: of this pod, not the agent
            sock.close()
            log.warning(
                "refused a connection to %s from pid %d of this pod: only the node agent may "
                "connect to it",
                self._path,
                pid,
            )
            return
        # The new agent reads the fds from now on: this loop stopped reading them when it
        # came here, and hands them over before it polls again.
        self._hang_up()
        sock.setblocking(True)
        sock.settimeout(1.0)
        try:
            hand_over(sock, list(self._held.values()), self.let_on - self._told)
            self._told = self.let_on
        except OSError as exc:
            sock.close()
            log.warning("allocation gate: cannot hand the fds to the node agent: %s", exc)
            return
        self._agent = sock
        self._quiet_until = time.monotonic() + LEASE  # its lease runs from before it dialled
        self._was_reading = False
        log.info("allocation gate: the node agent serves this pod's %d fds", len(self._held))

    def _from_agent(self, agent: socket.socket) -> None:
        try:
            found = take(agent)
        except OSError as exc:
            found = None
            log.warning("allocation gate: the node agent's connection failed: %s", exc)
        if isinstance(found, bytes):
            self._renewed(agent, found)
        elif found is None:
            self._hang_up()
            log.warning(
                "allocation gate: the node agent is gone; this pod's %d gated processes' "
                "allocations go on unchecked until it is back",
                len(self._held),
            )
        elif isinstance(found, str):
            log.warning("allocation gate: dropped a message of the node agent: %s", found)
        elif any(same_file(found.fd, fd) for fd in self._held):
            os.close(found.fd)  # a copy of one held already (the agent handed it again)
        else:
            self._held[found.fd] = found

    def _renewed(self, agent: socket.socket, raw: bytes) -> None:
        """A renewal: nothing read for `LEASE` from now (this thread reads nothing until
        it has said so), then acknowledged."""
        number = beat(raw, "renew")
        if number is None:
            log.warning("allocation gate: dropped a message of the node agent: %r", raw[:80])
            return
        self._quiet_until = time.monotonic() + LEASE
        if self._was_reading:
            log.warning(
                "allocation gate: the node agent answers again; it judges this pod's %d gated "
                "processes' allocations",
                len(self._held),
            )
            self._was_reading = False
        try:
            acknowledge(agent, number, self.let_on - self._told)
            self._told = self.let_on
        except OSError as exc:  # its lease then lapses, and the calls go on here
            log.warning("allocation gate: cannot acknowledge the node agent's renewal: %s", exc)

    def _serve(self, fd: int, events: int) -> None:
        if events & select.POLLIN and self.reading:
            if let_go_on(fd):
                self.let_on += 1
        elif events & (select.POLLHUP | select.POLLNVAL):  # every task under it has exited
            del self._held[fd]
            os.close(fd)

    def _hang_up(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
