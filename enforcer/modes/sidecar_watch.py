"""The agent's watch over the sidecars of its node: it connects to each, and says when one
is gone.

Once a second this thread connects to each running sidecar that has no connection to the
agent (through the socket in the sidecar's own filesystem: `sidecar_dialer`), on the
schedule of `sidecar_presence.to_dial`, and hands the connection to the agent's server,
which proves who listens on it before it serves it.

A root workload can stop or kill its own sidecar (they share a PID namespace). This thread
also compares the node's running enforced pods with the sidecars connected
to the agent's socket (`sidecar_presence.update`, pure); a pod without one for 10 s gets
a `VRAMSidecarSilent` Warning, the log says so, and `vram_enforcer_pods_unguarded`
counts it, until its sidecar is back (a Normal Event of the same reason).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.payloads import Pod
from enforcer.core.pod import pod_reference
from enforcer.core.policy import Reason
from enforcer.core.sidecar_presence import (
    SILENT_AFTER,
    Attempt,
    Presence,
    reachable,
    to_dial,
    update,
)
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)


class SidecarWatch(threading.Thread):
    def __init__(
        self,
        pods: Callable[[], Mapping[str, Pod] | None],
        connected: Callable[[], frozenset[str]],
        recorder: EventRecorder,
        telemetry: AgentTelemetry,
        dial: Callable[[Collection[str]], Mapping[str, socket.socket | str]],
        adopt: Callable[[str, socket.socket], None],
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="sidecar-watch", daemon=True)
        self._pods = pods
        self._connected = connected
        self._recorder = recorder
        self._telemetry = telemetry
        self._every = every
        self._clock = clock
        self._presence = Presence()
        self._dial, self._adopt = dial, adopt
        self._tried: dict[str, Attempt] = {}
        self._failed: dict[str, str] = {}  # why each sidecar could not be reached, last time
        self.stop = threading.Event()
        self._guard = LoopGuard("sidecar-watch", telemetry.unexpected.labels("sidecar-watch"), log)

    @property
    def silent(self) -> frozenset[str]:
        """The UIDs of the pods whose sidecar has been silent for SILENT_AFTER."""
        return self._presence.silent

    def run(self) -> None:
        while not self.stop.wait(self._every):
            self._guard.run(self.check)

    def check(self) -> None:
        pods = self._pods()
        if pods is None:
            return  # not listed yet
        connected, now = self._connected(), self._clock()
        self._connect(pods, connected, now)
        change = update(self._presence, pods, connected, now)
        self._presence = change.presence
        for uid in change.went_silent:
            cid = reachable(pods[uid])
            why = self._failed.get(cid) if cid is not None else None
            self._tell(pods[uid], messages.sidecar_silent(SILENT_AFTER, why), warning=True)
        for uid in change.came_back:
            self._tell(pods[uid], messages.sidecar_back(), warning=False)
        self._telemetry.unguarded.set(len(change.presence.silent))

    def _connect(self, pods: Mapping[str, Pod], connected: frozenset[str], now: float) -> None:
        unconnected = {
            cid for pod in pods.values() if (cid := reachable(pod)) and cid not in connected
        }
        due, self._tried = to_dial(unconnected, self._tried, now)
        self._failed = {cid: why for cid, why in self._failed.items() if cid in unconnected}
        for cid, found in self._dial(due).items() if due else ():
            if isinstance(found, str):
                if self._failed.get(cid) != found:  # said once, not every attempt
                    log.info("sidecar container %s: %s; trying again", cid[:12], found)
                self._failed[cid] = found
            else:
                self._failed.pop(cid, None)
                self._adopt(cid, found)

    def _tell(self, pod: Pod, text: str, warning: bool) -> None:
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        log.log(
            logging.WARNING if warning else logging.INFO, "pod %s/%s: %s", namespace, name, text
        )
        about = pod_reference(namespace, name, str(meta.get("uid") or ""))
        self._recorder.record(about, str(Reason.SIDECAR_SILENT), text, warning)
