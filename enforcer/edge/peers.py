"""Who is on the other end of a Unix socket: the peer's process, its PID namespace, and
the container it runs in (the ID in its cgroup, which names its pod: `pod_directory`).

The agent answers each caller only about processes in the caller's own PID namespace (or
below it). The peer is identified by the kernel, not by anything it sends.

- With SO_PEERPIDFD (Linux >= 6.5) the kernel hands us a pidfd for the very process that
  connected. Its namespace is read through the host's `/proc`, and the pidfd is checked
  afterwards: if the peer exited meanwhile, the reads may be of someone else, and the
  connection is refused.
- Older kernels give only SO_PEERCRED's pid, taken at connect time. If the caller exited
  before we pinned that pid, the pid may name another process by now, maybe in another
  pod. So the pinned process must prove that it is the caller: the agent sends a random
  challenge, and the request that echoes it must arrive with SCM_CREDENTIALS (stamped by
  the kernel when it was sent) naming the pinned pid. It was sent after we pinned, and the
  pinned process still holds its pid when we check; so the process that sent it is the
  one we pinned, and it holds the connection.

For a connection the agent made (to a sidecar's socket), the kernel names the process
that listens: the one that called listen(). `prove_listener` holds it to the sidecar's own
process, the first of its container.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass

from enforcer.core.model import ProcessKey
from enforcer.core.protocol import Challenge
from enforcer.edge.listening import UCRED, peer_credentials
from enforcer.edge.pid_view import PidView, PidViewError
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs

# Not in Python's socket module before 3.13; the value is fixed in the kernel ABI.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
CREDENTIALS_SPACE = socket.CMSG_SPACE(UCRED.size)


class PeerError(Exception):
    """The peer could not be identified; it gets an error, never someone else's data."""


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int  # in the reader's (the agent's) PID namespace
    uid: int
    view: PidView
    container_id: str | None = None  # from its cgroup, read while it was pinned


class Unproven:
    """A caller pinned by its pid alone, until it answers the challenge (see the module)."""

    def __init__(
        self, pid: int, uid: int, process: Pinned, view: PidView, container_id: str | None
    ) -> None:
        self.pid, self.uid, self.view, self.container_id = pid, uid, view, container_id
        self._process = process
        self.challenge = Challenge(
            secrets.token_hex(16),
            "this node's kernel cannot name the process behind a connection (no SO_PEERPIDFD, "
            "Linux < 6.5): send the request again with this challenge to be identified",
        )

    def prove(self, answer: str | None, senders: set[int]) -> Peer:
        """The caller, once the request that carries `answer` was sent by the pinned process
        alone (`senders`: the pids in its SCM_CREDENTIALS). Raises PeerError otherwise."""
        if answer != self.challenge.nonce:
            raise PeerError("the answer to the challenge is wrong")
        if senders != {self.pid}:
            raise PeerError(
                "the challenge was answered by another process than the one that connected"
            )
        if self._process.exited():
            raise PeerError("the caller exited while it was being identified")
        return Peer(self.pid, self.uid, self.view, self.container_id)

    def close(self) -> None:
        self._process.close()


def attest(sock: socket.socket, host_proc: ProcFs, peer_pidfd: bool = True) -> Peer | Unproven:
    """Identify the caller: a `Peer` at once, or, without SO_PEERPIDFD (or with
    `peer_pidfd` False), an `Unproven` caller that still has to answer its challenge."""
    pid, uid = peer_credentials(sock)
    if pid <= 0:
        raise PeerError("the kernel reports no process for this connection")
    process = _peer_pidfd(sock, pid) if peer_pidfd else None
    proven = process is not None
    if process is None:
        opened = Pinned.open(pid)
        if not isinstance(opened, Pinned):
            raise PeerError("the caller exited before it could be identified")
        process = opened
    try:
        view = PidView.of_process(host_proc, pid)
    except PidViewError as exc:
        process.close()
        raise PeerError(f"cannot read the caller's PID namespace: {exc}") from None
    cid = host_proc.container_id(pid)
    if process.exited():
        process.close()
        raise PeerError("the caller exited while it was being identified")
    if proven:
        process.close()
        return Peer(pid, uid, view, cid)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # stamp what it sends next
    return Unproven(pid, uid, process, view, cid)


def prove_listener(
    sock: socket.socket, host_proc: ProcFs, init: ProcessKey, container_id: str
) -> None:
    """Raise PeerError unless the process listening on the far end of `sock`, a connection
    the agent made, is `init`: the first process of container `container_id`, which runs
    the container's command (the sidecar). Any other process of that container (one exec'd
    into it, a child) passes a check of the container ID, and may have replaced the socket.

    With SO_PEERPIDFD the pidfd is the listener itself. Without it (Linux < 6.5) the pid is
    the one the listener had, which `init` may have taken since, had the listener exited;
    the challenge that the agent's server makes on this connection, which only the process
    holding it can answer, with the kernel's stamp of its pid, proves that one too."""
    pid, _ = peer_credentials(sock)
    if pid != init.pid:
        raise PeerError(
            f"the process listening on it (pid {pid}) is not the container's first process "
            f"(pid {init.pid}): another process of the container (exec'd into it?) took the "
            "sidecar's socket"
        )
    process = _peer_pidfd(sock, pid) or Pinned.open(pid)
    if not isinstance(process, Pinned):
        raise PeerError("the process listening on it exited before it could be identified")
    with process:
        st = host_proc.stat(pid)
        if (
            st is None
            or st.start_time != init.start_time
            or host_proc.container_id(pid) != container_id
            or process.exited()
        ):
            raise PeerError(
                f"the container's first process (pid {init.pid}) exited, or left the "
                "container, while the process listening on its socket was being identified"
            )


def _peer_pidfd(sock: socket.socket, pid: int) -> Pinned | None:
    try:
        return Pinned(pid, int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)))
    except OSError:
        return None  # kernel older than 6.5


def sender(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sending process's pid from a message's SCM_CREDENTIALS (0 when the kernel did not
    stamp it), None without credentials."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            return int(UCRED.unpack(data[: UCRED.size])[0])
    return None
