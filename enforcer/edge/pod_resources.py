"""The kubelet's pod-resources API, read by the agent: which devices each container of the
node was given (`core/pod_resources.py` decodes the reply).

Read over gRPC on the kubelet's local socket, once per change of the node's pods (the pod
watch wakes this thread; a device is given when the kubelet admits a pod, before its
containers start), at most once per `MIN_GAP`, and at least every `REFRESH_EVERY`. The
last good reply is kept: a read that fails (a kubelet restarting, a socket not mounted) is
said once and tried again, and the reclaims meanwhile use what was last read. Never read
in the sampler's pass.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from enforcer.core.pod_resources import Assignments, WireError, decode_list
from enforcer.edge import logs
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry

log = logging.getLogger(__name__)

LIST = "/v1.PodResourcesLister/List"
DEADLINE = 5.0  # one List on a local socket; a kubelet that does not answer in it is stuck
REFRESH_EVERY = 30.0  # read again at least this often: a pod watch event can be missed
STOP_CHECK = 1.0  # seconds: how soon `stop` is seen (the agent's shutdown waits for it)
# Seconds between two reads: a burst of pod changes (a tenant patching its own pods in a
# loop) costs the kubelet one List a second at most, whatever the node's pods do.
MIN_GAP = 1.0


class PodResourcesError(Exception):
    """The kubelet did not answer, or not with the reply it should."""


def list_once(socket: Path, deadline: float = DEADLINE) -> Assignments:
    """One `List` on the kubelet's socket: each container's devices, by resource."""
    import grpc  # noqa: PLC0415 - only what reads the kubelet loads gRPC

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        listed = channel.unary_unary(
            LIST, request_serializer=lambda _: b"", response_deserializer=decode_list
        )
        try:
            found: Assignments = listed(None, timeout=deadline)
        except (grpc.RpcError, WireError) as exc:
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise PodResourcesError(details or str(exc)) from None
        return found


class PodResources(threading.Thread):
    """`last`: what the kubelet said each container was given, as last read well; None
    before the first good read."""

    def __init__(self, socket: Path, changed: threading.Event, telemetry: AgentTelemetry) -> None:
        super().__init__(name="pod-resources", daemon=True)
        self._socket = socket
        self._changed = changed
        self.stop = threading.Event()
        self._outage = logs.Outage(log)
        self._guard = LoopGuard("pod-resources", telemetry.unexpected.labels("pod-resources"), log)
        self.last: Assignments | None = None

    def run(self) -> None:
        due = 0.0
        while not self.stop.is_set():
            if self._changed.is_set() or time.monotonic() >= due:
                self._changed.clear()  # before the read: a change during it is read again
                self._guard.run(self._read)
                due = time.monotonic() + REFRESH_EVERY
                self.stop.wait(MIN_GAP)  # a change meanwhile is read right after it
            self._changed.wait(STOP_CHECK)

    def _read(self) -> None:
        what = f"cannot read the kubelet's pod resources at {self._socket}"
        try:
            found = list_once(self._socket)
        except PodResourcesError as exc:
            self._outage.failed(what, exc)
            return
        self._outage.ended(f"the kubelet's pod resources at {self._socket} are read again")
        if found != self.last:  # a new object only for news: the lender rebuilds on one
            self.last = found
