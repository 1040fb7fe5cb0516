"""A Unix socket to listen on (a stale one left by an earlier process is replaced, a live
one or a file that is not a socket never is), and who connected to it."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from pathlib import Path


class SocketInUse(Exception):
    """Another process is listening on the socket path, or the path is not a socket."""


def prepare_path(path: Path, whose: str, option: str, kind: int = socket.SOCK_STREAM) -> None:
    """Create the directory; replace a stale socket, but never a live one or a non-socket.
    `whose` names the process that would be listening, `option` the setting of the path,
    `kind` the socket's type (a probe of another type is refused, live or not)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(
            f"{path} exists and is not a socket; remove it or choose another {option}"
        )
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        path.unlink(missing_ok=True)  # nobody listens: left over from an earlier process
        return
    finally:
        probe.close()
    raise SocketInUse(f"another {whose} is already listening on {path}")


def listen(
    path: Path, mode: int, backlog: int, whose: str, option: str, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A non-blocking listener of `kind` at `path`, with the file's permissions set to
    `mode`."""
    prepare_path(path, whose, option, kind)
    listener = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK)
    try:
        listener.bind(str(path))
        os.chmod(path, mode)
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (SO_PEERCRED, SCM_CREDENTIALS)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process on the other end, as this process's namespaces see
    it (SO_PEERCRED: the connecting process, or for a connection we made, the listening
    one). The pid is 0 when that process lives outside this PID namespace: the kernel
    reports no pid it could not name."""
    pid, uid, _gid = UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    )
    return int(pid), int(uid)
