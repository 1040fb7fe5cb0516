"""Connecting to the sidecars of the node, each on the socket in its own filesystem.

A sidecar listens on `SIDECAR_SOCKET` in an emptyDir that no other container mounts (the
pod needs no hostPath). The agent, with the host's PIDs and CAP_SYS_PTRACE, reaches it
through `/proc/<pid>/root` of a process whose cgroup names the sidecar's container (the ID
from the pod's status): so the agent chooses whom it talks to. Nothing is sent here: the
server attests the process that listens on the socket before it says a word
(`UsageServer.adopt`), so a pid reused meanwhile, or a link planted in the sidecar's
filesystem, can lead only to a socket of another container, or of the host, and that is
refused unread.
"""

from __future__ import annotations

import socket
from collections.abc import Collection

from enforcer.core.protocol import SIDECAR_SOCKET
from enforcer.edge.procfs import ProcFs


def processes_of(host_proc: ProcFs, ids: Collection[str]) -> dict[str, int]:
    """A process of each of these containers (by ID) that runs now, from one pass over the
    host's processes."""
    found: dict[str, int] = {}
    for pid in host_proc.pids():
        cid = host_proc.container_id(pid)
        if cid is not None and cid in ids and cid not in found:
            found[cid] = pid
            if len(found) == len(ids):
                break
    return found


def dial(host_proc: ProcFs, pid: int) -> socket.socket | str:
    """A connection to the sidecar socket in the filesystem of `pid`, or why not."""
    path = f"{host_proc.root}/{pid}/root{SIDECAR_SOCKET}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        sock.connect(path)  # a Unix socket connects at once, or fails (EAGAIN: backlog full)
    except BlockingIOError:
        sock.close()
        return f"{path} has connections waiting: the sidecar does not accept them (stopped?)"
    except OSError as exc:
        sock.close()
        return f"cannot connect to {path}: {exc.strerror or exc}"
    return sock


def dial_sidecars(host_proc: ProcFs, ids: Collection[str]) -> dict[str, socket.socket | str]:
    """For each sidecar container ID: a connection to its socket, or why there is none."""
    pids = processes_of(host_proc, ids)
    return {
        cid: dial(host_proc, pids[cid]) if cid in pids else "no process of it runs on this node"
        for cid in ids
    }
