"""Connecting to the sidecars of the node, each on the socket in its own filesystem.

A sidecar listens on `SIDECAR_SOCKET` in an emptyDir that no other container mounts (the
pod needs no hostPath). The agent, with the host's PIDs and CAP_SYS_PTRACE, reaches it
through `/proc/<pid>/root` of the sidecar container's init, its first process (the one
whose parent is not in the container, and the oldest of those: a `kubectl exec` into it
started later), found by the container's ID from the pod's status: so the agent chooses
whom it talks to. Nothing is sent here, and a connection is handed on only once the kernel
names that very init as the process listening on it (`peers.prove_listener`): a process
exec'd into the sidecar's container (`pods/exec`) or started by it shares its cgroup and
its filesystem, and could replace the socket. The server then attests the listener's
container again (`UsageServer.adopt`), so a pid reused meanwhile, or a link planted in the
sidecar's filesystem, can lead only to a socket of another container, or of the host, and
that is refused unread.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from dataclasses import dataclass

from enforcer.core.model import ProcessKey
from enforcer.core.protocol import SIDECAR_SOCKET
from enforcer.edge.peers import PeerError, prove_listener
from enforcer.edge.procfs import ProcFs


@dataclass(frozen=True, slots=True)
class Refused:
    """A socket was found, but the sidecar's own process does not listen on it: closed
    unread. Unlike a sidecar that cannot be reached yet, this is someone's doing."""

    why: str

    def __str__(self) -> str:
        return self.why


def dial(host_proc: ProcFs, container_id: str, init: ProcessKey) -> socket.socket | Refused | str:
    """A connection to the sidecar socket in the filesystem of `init`, the container's first
    process, on which that process listens; or why not."""
    path = f"{host_proc.root}/{init.pid}/root{SIDECAR_SOCKET}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        sock.connect(path)  # a Unix socket connects at once, or fails (EAGAIN: backlog full)
    except BlockingIOError:
        sock.close()
        return f"{path} has connections waiting: the sidecar does not accept them (stopped?)"
    except OSError as exc:
        sock.close()
        return f"cannot connect to {path}: {exc.strerror or exc}"
    try:
        prove_listener(sock, host_proc, init, container_id)
    except PeerError as exc:
        sock.close()
        return Refused(f"{path}: {exc}; closed unread")
    return sock


def dial_sidecars(
    host_proc: ProcFs, ids: Collection[str]
) -> dict[str, socket.socket | Refused | str]:
    """For each sidecar container ID: a connection to its socket, or why there is none."""
    return {
        cid: init if isinstance(init, str) else dial(host_proc, cid, init)
        for cid, init in host_proc.container_inits(ids).items()
    }
