"""Who is on the other end of a Unix socket: the peer's process, and its PID namespace.

The agent answers each caller only about processes in the caller's own PID namespace (or
below it). The peer is identified by the kernel, not by anything it sends: SO_PEERPIDFD
(Linux >= 6.5) hands us a pidfd for the very process that connected; on older kernels we
fall back to SO_PEERCRED's pid. Its namespace is read through the host's `/proc`, and the
pidfd is checked afterwards: if the peer exited meanwhile, its pid may name another process
now, and the answer is refused.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass

from enforcer.procfs import ProcFs
from enforcer.sources import PidView, PidViewError

# Not in Python's socket module before 3.13; the value is fixed in the kernel ABI.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerError(Exception):
    """The peer could not be identified; it gets an error, never someone else's data."""


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int  # in the reader's (the agent's) PID namespace
    uid: int
    view: PidView


def attest(sock: socket.socket, host_proc: ProcFs) -> Peer:
    pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    if pid <= 0:
        raise PeerError("the kernel reports no process for this connection")
    pidfd = _peer_pidfd(sock, pid)
    try:
        try:
            view = PidView.of_process(host_proc, pid)
        except PidViewError as exc:
            raise PeerError(f"cannot read the caller's PID namespace: {exc}") from None
        if select.select([pidfd], [], [], 0)[0]:
            raise PeerError("the caller exited while it was being identified")
        return Peer(pid, uid, view)
    finally:
        os.close(pidfd)


def _peer_pidfd(sock: socket.socket, pid: int) -> int:
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        pass  # kernel older than 6.5: open by pid, racing an exit we then detect
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise PeerError("the caller exited before it could be identified") from None
