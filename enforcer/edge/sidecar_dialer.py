"""Connecting to a sidecar on the socket in its own filesystem.

A sidecar listens on `SIDECAR_SOCKET` in an emptyDir that no other container mounts (the
pod needs no hostPath). The agent, with the host's PIDs and CAP_SYS_PTRACE, reaches it
through the root of the sidecar container's init, its first process (the one whose parent
is not in the container, and the oldest of those: a `kubectl exec` into it started later),
found by the container's ID from the pod's status: so the agent chooses whom it talks to.
Only pods the webhook injected are dialled (`sidecar_presence`).

The socket's path is in a filesystem its container can change, so it is never resolved the
ordinary way: `tenant_fs.open_in` walks it from the init's root (held by a pidfd) without
following any link and without entering a mount that might never answer, and the agent
connects through the descriptor it found (`/proc/self/fd/N`). A link planted there (to
another pod's socket, through `/proc/<pid>/root`) is refused before anything is connected
to, so no other sidecar ever sees a connection meant for this one. Nothing is sent here,
and a connection is handed on only once the kernel names that very init as the process
listening on it (`peers.prove_listener`): a process exec'd into the sidecar's container
(`pods/exec`) or started by it shares its cgroup and its filesystem, and could replace the
socket. The server then attests the listener's container again (`UsageServer.adopt`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from enforcer.core.model import ProcessKey
from enforcer.core.protocol import SIDECAR_SOCKET
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.peers import PeerError, prove_listener
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs
from enforcer.edge.tenant_fs import Planted, open_in

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refused:
    """A socket was found, but it is not the sidecar's own to be connected to (a link, a
    mount, another process listening): nothing sent. Unlike a sidecar that cannot be
    reached yet, this is someone's doing."""

    why: str

    def __str__(self) -> str:
        return self.why


Dialled = socket.socket | Refused | str
"""A connection to a sidecar, or why there is none."""


def dial(
    host_proc: ProcFs,
    container_id: str,
    init: ProcessKey,
    path: str = SIDECAR_SOCKET,
    kind: int = socket.SOCK_STREAM,
) -> socket.socket | Refused | str:
    """A connection to the sidecar's socket at `path` (its usage link's, or the allocation
    gate's holder's, of `kind`) in the filesystem of `init`, the container's first process,
    on which that process listens; or why not."""
    pinned = Pinned.open(init.pid)
    if not isinstance(pinned, Pinned):
        return f"the sidecar's first process (pid {init.pid}) has exited"
    with pinned:
        st = host_proc.stat(init.pid)
        if (
            st is None
            or st.start_time != init.start_time
            or host_proc.container_id(init.pid) != container_id
        ):
            return f"the sidecar's first process (pid {init.pid}) has exited"
        found = open_in(host_proc, pinned, path, stat.S_IFSOCK)
    where = f"{path} of the sidecar (pid {init.pid})"
    if isinstance(found, Planted):
        return Refused(f"{where}: {found}; not connected to")
    if isinstance(found, str):
        return f"cannot reach {where}: {found}"
    try:
        # A socket that cannot be made (EMFILE) must not leak the walk's descriptor.
        sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK)
    except OSError as exc:
        os.close(found)
        return f"cannot connect to {where}: {exc.strerror or exc}"
    try:
        # Through the descriptor: the walk above is what decided which socket this is. A
        # Unix socket connects at once, or fails (EAGAIN: its backlog is full).
        sock.connect(f"/proc/self/fd/{found}")
    except BlockingIOError:
        sock.close()
        return f"{where} has connections waiting: the sidecar does not accept them (stopped?)"
    except OSError as exc:
        sock.close()
        return f"cannot connect to {where}: {exc.strerror or exc}"
    finally:
        with contextlib.suppress(OSError):
            os.close(found)
    try:
        prove_listener(sock, host_proc, init, container_id)
    except PeerError as exc:
        sock.close()
        return Refused(f"{where}: {exc}; closed unread")
    return sock


def dial_container(
    host_proc: ProcFs,
    container_id: str,
    path: str = SIDECAR_SOCKET,
    kind: int = socket.SOCK_STREAM,
) -> Dialled:
    """`dial`, to the first process of the container of this ID, found on the host."""
    init = host_proc.container_inits([container_id]).get(container_id)
    if init is None:
        return "no process of the sidecar's container was found"
    if isinstance(init, str):
        return init
    return dial(host_proc, container_id, init, path, kind)


DIAL_DEADLINE = 5.0  # seconds a dial may take before it is said to hang
MOST_IN_FLIGHT = 64  # dials at once that have not passed their deadline: the rest wait
MOST_HUNG_PER_NAMESPACE = 4  # a namespace with this many hung dials gets no new one
# Hung dials on the node past which only a namespace with none hung gets a new dial: one
# namespace's hung paths never stop the others' dials, and hung threads stay bounded by
# MOST_HUNG_PER_NAMESPACE times the namespaces that have any.
MOST_HUNG = 64


class Dialer:
    """Dials sidecars, each on a thread of its own with a deadline: a dial that hangs in the
    kernel (a filesystem that does not answer, which `tenant_fs` should never enter) costs
    the thread that asked nothing, and the pods of the same namespace at most a few of the
    threads; every other pod of the node is dialled as before. A container with a dial in
    flight is not dialled again until it ends; one past its deadline is said once, and its
    pod is left to the sidecar watch's rule for a sidecar not heard."""

    def __init__(
        self,
        dial: Callable[[str], Dialled],
        wake: Callable[[], None],
        unexpected: ErrorCounter,
        deadline: float = DIAL_DEADLINE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`dial`: one sidecar, by its container's ID (`dial_container`); `wake`: called
        from a dial's thread when it ends (the watch looks at once); `unexpected`: where a
        bug in a dial is counted."""
        self._guard = LoopGuard("sidecar-dial", unexpected, log)
        self._wake = wake
        self._dial = dial
        self._deadline = deadline
        self._clock = clock
        self._lock = threading.Lock()
        self._started: dict[str, tuple[float, str]] = {}  # container ID -> (when, namespace)
        self._done: dict[str, Dialled] = {}
        self._said_hung: set[str] = set()

    @property
    def in_flight(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._started)

    def start(self, due: Mapping[str, str]) -> None:
        """Dial each of these sidecar container IDs (-> their pod's namespace) that has no
        dial in flight, within the bounds above."""
        now = self._clock()
        with self._lock:
            hung = collections.Counter(
                ns for at, ns in self._started.values() if now - at >= self._deadline
            )
            live = len(self._started) - hung.total()
            for cid, namespace in due.items():
                if live >= MOST_IN_FLIGHT:
                    break
                if cid in self._started or hung[namespace] >= MOST_HUNG_PER_NAMESPACE:
                    continue
                if hung.total() >= MOST_HUNG and hung[namespace]:
                    continue
                self._started[cid] = (now, namespace)
                live += 1
                threading.Thread(
                    target=self._run, args=(cid,), name="sidecar-dial", daemon=True
                ).start()

    def _run(self, cid: str) -> None:
        found: list[Dialled] = []
        self._guard.run(lambda: found.append(self._dial(cid)))  # a bug: counted, said below
        result = found[0] if found else "the dial failed (a bug: see the agent's log)"
        with self._lock:
            self._started.pop(cid, None)
            self._said_hung.discard(cid)
            self._done[cid] = result
        self._wake()

    def collect(self) -> dict[str, Dialled]:
        """The dials that ended since the last call; and, once each, those past their
        deadline (as why they have no connection yet)."""
        now = self._clock()
        with self._lock:
            found, self._done = self._done, {}
            for cid, (at, _) in self._started.items():
                if now - at >= self._deadline and cid not in self._said_hung:
                    self._said_hung.add(cid)
                    found[cid] = (
                        f"the dial has not ended after {now - at:.0f}s: something in the "
                        "sidecar's filesystem does not answer"
                    )
        return found
