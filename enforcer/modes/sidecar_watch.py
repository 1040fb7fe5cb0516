"""The agent's watch over the sidecars of its node: a pod whose sidecar is gone is said.

A root workload can stop or kill its own sidecar (they share a PID namespace). Once a
second this thread compares the node's running enforced pods with the sidecars connected
to the agent's socket (`sidecar_presence.update`, pure); a pod without one for 10 s gets
a `VRAMSidecarSilent` Warning, the log says so, and `vram_enforcer_pods_unguarded`
counts it, until its sidecar is back (a Normal Event of the same reason).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.payloads import Pod
from enforcer.core.pod import pod_reference
from enforcer.core.policy import Reason
from enforcer.core.sidecar_presence import SILENT_AFTER, Presence, update
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
        self.stop = threading.Event()
        self._guard = LoopGuard("sidecar-watch", telemetry.unexpected.labels("sidecar-watch"), log)

    def run(self) -> None:
        while not self.stop.wait(self._every):
            self._guard.run(self.check)

    def check(self) -> None:
        pods = self._pods()
        if pods is None:
            return  # not listed yet
        change = update(self._presence, pods, self._connected(), self._clock())
        self._presence = change.presence
        for uid in change.went_silent:
            self._tell(pods[uid], messages.sidecar_silent(SILENT_AFTER), warning=True)
        for uid in change.came_back:
            self._tell(pods[uid], messages.sidecar_back(), warning=False)
        self._telemetry.unguarded.set(len(change.presence.silent))

    def _tell(self, pod: Pod, text: str, warning: bool) -> None:
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        log.log(
            logging.WARNING if warning else logging.INFO, "pod %s/%s: %s", namespace, name, text
        )
        about = pod_reference(namespace, name, str(meta.get("uid") or ""))
        self._recorder.record(about, str(Reason.SIDECAR_SILENT), text, warning)
