"""The sidecar's own pod, read from the API (`--api-access direct`), in the background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kubernetes import client

from enforcer.core.payloads import Pod
from enforcer.core.sidecar_report import POD_WATCHER_LOOP
from enforcer.edge import logs
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.kube import POD, KubeError, call

log = logging.getLogger(__name__)

# Read again this often even unasked: container states change without a new container ID
# (the tick asks at once for an ID it does not know).
REREAD_EVERY = 30.0
# At most one read a second, however often the tick asks: a container that crash-loops must
# not make the sidecar a load on the API server.
MIN_GAP = 1.0
READ_DEADLINE = 10.0  # one read, retries included: it runs in this thread, never in a tick


class PodWatcher(threading.Thread):
    """The sidecar's own pod, fetched in the background and refreshed on demand.

    Attribution needs the pod's container IDs; a container that restarts gets a new one.
    Asking for a refresh never blocks: the tick goes on with what is known, and a process
    of an unknown container is simply not attributed until the refresh lands.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        period: float = REREAD_EVERY,
        min_gap: float = MIN_GAP,
        on_read: Callable[[Pod], None] | None = None,
        *,
        unexpected: ErrorCounter,
    ) -> None:
        super().__init__(name="pod-watcher", daemon=True)
        self._guard = LoopGuard(POD_WATCHER_LOOP, unexpected, log)
        self._on_read = on_read  # more to read once the pod is (its ResourceClaims)
        self._api = api
        self._namespace = namespace
        self._pod = name
        self._period = period
        self._min_gap = min_gap
        self._wanted = threading.Event()
        self.stop = threading.Event()
        self.pod: Pod | None = None
        self._outage = logs.Outage(log)
        self._wanted.set()

    @property
    def error(self) -> str | None:
        """Why the last read failed; None once a read succeeds."""
        return self._outage.error

    def refresh(self) -> None:
        self._wanted.set()

    def run(self) -> None:
        while not self.stop.is_set():
            self._wanted.wait(self._period)  # also re-read now and then: container states
            self._wanted.clear()
            if self.stop.is_set():
                return
            self._guard.run(self._read)
            self.stop.wait(self._min_gap)

    def _read(self) -> None:
        """One read of the pod (and what `on_read` reads after it); a bug in it is counted
        and logged by the guard, and the next read goes on."""
        try:
            pod = call(
                self._api,
                "GET",
                POD,
                "pods",
                deadline=READ_DEADLINE,
                params={"namespace": self._namespace, "name": self._pod},
            )
        except KubeError as exc:
            what = "cannot read this pod from the API; attribution uses what is known"
            self._outage.failed(what, exc)
            self._wanted.set()  # keep trying, at the pace of min_gap
            return
        self.pod = pod
        self._outage.ended("reading this pod from the API again")
        if self._on_read is not None:
            self._on_read(pod)
