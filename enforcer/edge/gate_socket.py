"""The socket a gating seccomp profile names as its `listenerPath`: runc dials it once per
container process it starts under the profile (the container's init, and each `kubectl
exec`), and sends that process's seccomp listener fd (SCM_RIGHTS) with the OCI
`ContainerProcessState` as JSON, in one message, then hangs up.

Only root may hand us an fd (`SO_PEERCRED`): runc runs as root, and a fd from anyone else
would let them choose which calls we answer. The state's annotations are runc's word, a
hint only: who the process is comes from its cgroup, read by whoever takes the handoff.
A bad message is logged and dropped (its fds closed), and the next connection is served.
"""

from __future__ import annotations

import array
import contextlib
import functools
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from enforcer.edge.guard import ErrorCounter, LoopGuard

log = logging.getLogger(__name__)

MAX_STATE = 1 << 20  # bytes of state JSON taken from one connection (annotations included)
READ_TIMEOUT = 5.0  # s one connection may take to send its message


@dataclass(frozen=True, slots=True)
class Handoff:
    """One process's listener fd (the taker's to close) and what runc said of it: its pid
    (the host's: runc runs there), its container's id, the profile's `listenerMetadata`."""

    fd: int
    pid: int
    container_id: str
    metadata: str
    annotations: dict[str, str] = field(default_factory=dict)


def parse_state(raw: bytes, fd: int) -> Handoff | str:
    """runc's `ContainerProcessState` JSON with the fd it came with, or why it is not one."""
    try:
        found = json.loads(raw)
    except ValueError as exc:
        return f"the state is not JSON ({exc})"
    state = found.get("state") if isinstance(found, dict) else None
    if not isinstance(state, dict):
        return "the message has no `state` object"
    pid, cid = found.get("pid"), state.get("id")
    if not isinstance(pid, int) or pid <= 0:
        return f"the message's `pid` is {pid!r}, not a process id"
    if not isinstance(cid, str) or not cid:
        return f"the state's `id` is {cid!r}, not a container id"
    fds = found.get("fds")
    if fds != ["seccompFd"]:
        return f'the message\'s `fds` is {fds!r}, not ["seccompFd"]'
    annotations = state.get("annotations") or {}
    if not isinstance(annotations, dict):
        annotations = {}
    metadata = found.get("metadata")
    return Handoff(
        fd=fd,
        pid=pid,
        container_id=cid,
        metadata=metadata if isinstance(metadata, str) else "",
        annotations={str(k): str(v) for k, v in annotations.items()},
    )


def receive(conn: socket.socket) -> Handoff | str:
    """Read one runc message from `conn`: the fd and the state, or why not (any fd that came
    is closed then). The whole message within `READ_TIMEOUT`: a client that sends a byte at
    a time never holds the one thread that takes runc's handoffs for longer."""
    fds = array.array("i")
    deadline = time.monotonic() + READ_TIMEOUT
    chunks: list[bytes] = []
    total = 0
    try:
        conn.settimeout(READ_TIMEOUT)
        data, ancdata, _flags, _addr = conn.recvmsg(MAX_STATE, socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        chunks.append(data)
        total = len(data)
        while data and total <= MAX_STATE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            data = conn.recv(MAX_STATE)
            chunks.append(data)
            total += len(data)
    except OSError as exc:  # TimeoutError among them
        why = f"not sent within {READ_TIMEOUT:.0f} s" if isinstance(exc, TimeoutError) else exc
        for fd in fds:
            os.close(fd)
        return f"the message could not be read: {why}"
    why = ""
    if len(fds) != 1:
        why = f"{len(fds)} fds came with the message, not one"
    elif total > MAX_STATE:
        why = f"the state is over {MAX_STATE} bytes"
    if why:
        for fd in fds:
            os.close(fd)
        return why
    found = parse_state(b"".join(chunks), fds[0])
    if isinstance(found, str):
        os.close(fds[0])
    return found


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[4:8], "little")


class GateSocket:
    """Serves `path` (0600, root's) on a thread of its own; `take(handoff)` gets each good
    message, and owns its fd from then on."""

    def __init__(self, path: Path, take: Callable[[Handoff], None], errors: ErrorCounter) -> None:
        self._path = path
        self._take = take
        self._guard = LoopGuard("allocation gate socket", errors, log)
        self._server: socket.socket | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self._path.lstat().st_mode):
                self._path.unlink()  # ours, from before a restart: nobody serves it
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        server.bind(str(self._path))
        os.chmod(self._path, 0o600)
        server.listen(64)
        server.settimeout(0.2)
        self._server = server
        self._thread = threading.Thread(
            target=self._serve, args=(server,), name="gate-socket", daemon=True
        )
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self._server is not None:
            self._server.close()

    def _serve(self, server: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                self._guard.run(functools.partial(self._one, conn))

    def _one(self, conn: socket.socket) -> None:
        uid = _peer_uid(conn)
        if uid != 0:
            log.warning("the allocation gate's socket refused a connection of uid %d", uid)
            return
        found = receive(conn)
        if isinstance(found, str):
            log.warning("the allocation gate's socket dropped a message from runc: %s", found)
            return
        self._take(found)
