"""The agent's watch over the sidecars of its node: it connects to each, and says when one
is gone.

It looks only at the pods the webhook injected (`declaration.injected`: of a namespace
that opted in, labelled enforced, with the sidecar): a pod anywhere else that carries the
label and a container of the sidecar's name is its author's, and is neither dialled nor
watched.

Once a second this thread asks for a connection to each running sidecar that has none
(through the socket in the sidecar's own filesystem: `sidecar_dialer`), on the schedule of
`sidecar_presence.to_dial`. The dials run on threads of their own, each with a deadline
(`sidecar_dialer.Dialer`): one that hangs in the kernel costs this thread nothing, and its
pod is said unheard like any sidecar that cannot be reached. A connection is handed to the
agent's server, which attests the listener's container again before it serves it. A
socket that is not the sidecar's own to be connected to (a link or a mount in its place,
another process listening on it) is refused: a warning, said once, and
`vram_enforcer_agent_requests_total{result="refused"}`. Each check that completes is
dated (`last_check`): the agent's `/healthz` fails when none has for a minute.

A root workload can stop or kill its own sidecar (they share a PID namespace). This thread
also says which of the node's enforced pods are unguarded (`sidecar_presence.update`, pure)
while a container that their sidecar enforces runs, in any phase (a regular init container
runs while its pod is Pending), from what it sees of each sidecar: whether it reads its
subscription, whether it hung up (the server tells at once, and the thread looks then), and
its process's state in the host's /proc. A pod whose sidecar is stopped or has ended is
unguarded at once, one whose sidecar runs but is not heard after 10 s. It gets a
`VRAMSidecarSilent` Warning, the log says so, and `vram_enforcer_pods_unguarded` counts it,
until its sidecar is back (a Normal Event of the same reason); meanwhile the agent's
backstop holds it.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from enforcer.core import messages
from enforcer.core.model import ProcessKey
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map, pod_reference
from enforcer.core.reasons import Reason
from enforcer.core.sidecar_presence import (
    Attempt,
    Presence,
    Sidecar,
    guarded,
    halt,
    reachable,
    refusing,
    sidecar_id,
    to_dial,
    update,
)
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sidecar_dialer import Dialled, Refused

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)

HANDED_FOR = 5.0  # seconds a connection handed to the server has to be subscribed on


class Connections(Protocol):
    """The agent's usage socket, as the sidecar watch reads it (the `UsageServer`)."""

    @property
    def connected(self) -> frozenset[str]:
        """The container IDs with a subscription being read."""
        ...

    @property
    def peers(self) -> Mapping[str, int]:
        """Container ID -> the pid at the other end of its proven connection."""
        ...

    def adopt(self, container_id: str, sock: socket.socket) -> None:
        """Take a connection the agent made to a sidecar."""


class Dials(Protocol):
    """The dials to sidecars, each on a thread of its own (`sidecar_dialer.Dialer`)."""

    @property
    def in_flight(self) -> frozenset[str]:
        """The container IDs with a dial that has not ended."""
        ...

    def start(self, due: Mapping[str, str]) -> None:
        """Dial these sidecar container IDs (-> the namespace of their pod)."""

    def collect(self) -> Mapping[str, Dialled]:
        """The dials that ended (or passed their deadline) since the last call."""
        ...


class SidecarNews:
    """What the socket server learns of the sidecars between the watch's checks, told on
    its loop's thread (it must not wait) and taken by the watch, which it wakes: the
    sidecars that hung up their last connection (a killed one does: its pod is held at
    once, not at the next check), and those whose signals the kernel refused (EPERM), as
    their reports say, with when each last was (it decides but cannot act: its pod is the
    agent's to hold, `sidecar_presence.refusing`). Made before both, as each needs the
    other: the watch reads the server's connections, and the server tells the watch (its
    `ServerHooks`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.watched: frozenset[str] = frozenset()  # the watch's sidecars: no other is told
        self.woken = threading.Event()
        self._clock = clock
        self._hung_up: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._refused_at: dict[str, float] = {}

    def hung_up(self, container_id: str) -> None:
        """A caller hung up its last connection."""
        if container_id in self.watched:
            self._hung_up.append(container_id)
            self.woken.set()

    def refused(self, container_id: str) -> None:
        """A sidecar's report says the kernel refused one of its signals."""
        with self._lock:
            self._refused_at[container_id] = self._clock()
        self.woken.set()

    def hang_ups(self) -> set[str]:
        """Those that hung up since the last time."""
        found = set()
        while self._hung_up:
            found.add(self._hung_up.popleft())
        return found

    def refusals(self, ids: frozenset[str]) -> dict[str, float]:
        """When each of these sidecars last had a signal refused; the others are forgotten."""
        with self._lock:
            self._refused_at = {cid: at for cid, at in self._refused_at.items() if cid in ids}
            return dict(self._refused_at)


class SidecarWatch(threading.Thread):
    def __init__(
        self,
        pods: Callable[[], Mapping[str, Pod] | None],
        server: Connections,
        news: SidecarNews,
        recorder: EventRecorder,
        telemetry: AgentTelemetry,
        reach: tuple[Dials, SidecarProcesses],
        *,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pods`: the node's pods that the webhook injected (`declaration.injected_pods`;
        None before they are listed); `reach`: how the host shows the sidecars, their
        sockets (to connect) and their processes (`SidecarProcesses`)."""
        super().__init__(name="sidecar-watch", daemon=True)
        self._pods = pods
        self._server = server
        self._news = news
        self._recorder = recorder
        self._telemetry = telemetry
        self._every = every
        self._clock = clock
        self._presence = Presence()
        self._dials, self._processes = reach
        self._tried: dict[str, Attempt] = {}
        self._failed: dict[str, str] = {}  # why each sidecar could not be reached, last time
        self._closed: set[str] = set()  # sidecars that hung up, with no connection since
        # Sidecars whose connection was handed to the server, and when: not dialled again
        # while it takes them on (the sidecar accepts, then subscribes).
        self._handed: dict[str, float] = {}
        self.stop = threading.Event()
        self._guard = LoopGuard("sidecar-watch", telemetry.unexpected.labels("sidecar-watch"), log)
        self.last_check = clock()  # when a check last completed, on `clock`

    @property
    def silent(self) -> frozenset[str]:
        """The UIDs of the pods that are unguarded (`sidecar_presence.update`)."""
        return self._presence.silent

    def run(self) -> None:
        while not self.stop.is_set():
            self._news.woken.wait(self._every)
            self._news.woken.clear()
            if not self.stop.is_set() and self._guard.run(self.check):
                self.last_check = self._clock()

    def check(self) -> None:
        pods = self._pods()
        if pods is None:
            return  # not listed yet
        # Before the peers are read: one that connects again counts.
        self._closed |= self._news.hang_ups()
        connected, peers, now = self._server.connected, self._server.peers, self._clock()
        self._connect(pods, connected, now)
        self._news.watched = watched = frozenset(
            cid for pod in pods.values() if guarded(pod) and (cid := sidecar_id(pod))
        )
        self._closed = {cid for cid in self._closed if cid in watched and cid not in peers}
        states = self._processes.states({c: pid for c, pid in peers.items() if c in watched})
        refused = self._news.refusals(watched)
        seen = {
            c: Sidecar(
                c in connected, c in self._closed, states.get(c), refusing(refused.get(c), now)
            )
            for c in watched
        }
        change = update(self._presence, pods, seen, now)
        self._presence = change.presence
        for uid in change.went_silent:
            cid = reachable(pods[uid])
            why = self._failed.get(cid) if cid is not None else None
            unheard = now - change.presence.missing_since[uid]
            own = sidecar_id(pods[uid])
            how = halt(seen[own]) if own is not None and own in seen else None
            self._tell(pods[uid], messages.sidecar_silent(unheard, why, how), warning=True)
        for uid in change.came_back:
            self._tell(pods[uid], messages.sidecar_back(), warning=False)
        self._telemetry.unguarded.set(len(change.presence.silent))

    def _connect(self, pods: Mapping[str, Pod], connected: frozenset[str], now: float) -> None:
        self._handed = {c: at for c, at in self._handed.items() if now - at < HANDED_FOR}
        namespaces = {
            cid: str(json_map(pod.get("metadata")).get("namespace"))
            for pod in pods.values()
            if (cid := reachable(pod)) and cid not in connected and cid not in self._handed
        }
        due, self._tried = to_dial(namespaces, self._tried, now)
        self._failed = {cid: why for cid, why in self._failed.items() if cid in namespaces}
        if due:  # one still being dialled is not dialled twice (`Dials.start`)
            self._dials.start({cid: namespaces[cid] for cid in due})
        for cid, found in self._dials.collect().items():
            if isinstance(found, socket.socket):
                if cid not in namespaces:  # connected meanwhile, or no longer ours to serve
                    found.close()
                    continue
                self._failed.pop(cid, None)
                self._server.adopt(cid, found)
                self._handed[cid] = now
                continue
            refused = isinstance(found, Refused)
            if refused:
                self._telemetry.requests.labels("refused").inc()
            if self._failed.get(cid) != str(found):  # said once, not every attempt
                log.log(
                    logging.WARNING if refused else logging.INFO,
                    "sidecar container %s: %s; trying again",
                    cid[:12],
                    found,
                )
            self._failed[cid] = str(found)

    def _tell(self, pod: Pod, text: str, warning: bool) -> None:
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        log.log(
            logging.WARNING if warning else logging.INFO, "pod %s/%s: %s", namespace, name, text
        )
        about = pod_reference(namespace, name, str(meta.get("uid") or ""))
        self._recorder.record(about, str(Reason.SIDECAR_SILENT), text, warning)


class SidecarProcesses:
    """The state of each sidecar's process, read from the host's /proc. The process is the
    one at the other end of the sidecar's connection (`UsageServer.peers`: the kernel named
    it), known by (pid, start time) from the first look, which pins it with a pidfd and
    proves that its cgroup names the sidecar's container. A state is told only when the
    start time read with it is that one: a pid reused since names someone else."""

    def __init__(self, host_proc: ProcFs) -> None:
        self._procfs = host_proc
        self._known: dict[str, ProcessKey] = {}

    def states(self, peers: Mapping[str, int]) -> dict[str, str]:
        """By container ID, the state letter of each sidecar process that is proven, of
        those in `peers` (its pid, by container ID)."""
        known = {cid: key for cid, key in self._known.items() if peers.get(cid) == key.pid}
        found = {}
        for cid, pid in peers.items():
            st = self._procfs.stat(pid)
            key = known.get(cid) or self._identify(cid, pid)
            if st is not None and key is not None and st.start_time == key.start_time:
                known[cid] = key
                found[cid] = st.state
        self._known = known
        return found

    def _identify(self, container_id: str, pid: int) -> ProcessKey | None:
        pinned = Pinned.open(pid)
        if not isinstance(pinned, Pinned):
            return None
        with pinned:
            st = self._procfs.stat(pid)
            if st is None or self._procfs.container_id(pid) != container_id or pinned.exited():
                return None  # last: the reads above were of the pinned process
            return ProcessKey(pid, st.start_time)
