"""The agent's pod replies: each sidecar's own pod, from the agent's one watch of its node.

Sidecars used to read their pod (and, with DRA, its claims and the node's slices) from the
API, each on its own timer. The agent already watches the node's pods; on every change
this thread reads the DRA objects of the pods that claim GPUs (once per change of a pod,
shared with the hard limiter; again 5 s after a failed read, and every 5 minutes), builds
the directory of replies by container ID (`pod_directory.directory`, pure; a pod's reply
is encoded again only when that pod, its DRA objects or the watch's health changed) and
hands it to the socket, which pushes each pod to the sidecars whose replies changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from enforcer.core.declaration import ENFORCED, OPT_IN, SIDECAR, injected, marked
from enforcer.core.dra import claim_names
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import Directory, DraRead, directory
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry

if TYPE_CHECKING:  # the kubernetes client, loaded only by an agent that uses the API
    from enforcer.edge.claims import ClaimCache
    from enforcer.edge.node_pods import NodePods

log = logging.getLogger(__name__)

STOP_CHECK = 1.0  # seconds


class PodPublisher(threading.Thread):
    """Keeps the socket's pod directory equal to the node's pods, woken by the pod watch."""

    def __init__(
        self,
        pods: NodePods,
        publish: Callable[[Directory], None],
        claims: ClaimCache | None,
        changed: threading.Event,
        telemetry: AgentTelemetry,
        *,
        opted_in: Callable[[], frozenset[str] | None],
    ) -> None:
        """`changed`: set by the watches of the pods and of the namespaces that opted in
        (`opted_in`: only their pods the webhook injected are served)."""
        super().__init__(name="pod-publisher", daemon=True)
        self._pods = pods
        self._opted_in = opted_in
        # Pods said to carry the webhook's marks outside the namespaces that opted in.
        self._said: frozenset[str] = frozenset()
        self._publish = publish
        self._claims = claims
        self._changed = changed
        self._last: Directory | None = None
        self.stop = threading.Event()
        self._guard = LoopGuard("pod-publisher", telemetry.unexpected.labels("pod-publisher"), log)

    def run(self) -> None:
        while not self.stop.is_set():
            due = self._claims.next_read() if self._claims is not None else None
            # A change, or a pod's claims due to be read again; at least once a second, to
            # see `stop` (the agent's shutdown waits for this thread).
            woken = self._changed.wait(STOP_CHECK if due is None else min(due, STOP_CHECK))
            if self.stop.is_set():
                return
            if woken or (due is not None and due <= STOP_CHECK):
                self._changed.clear()
                self._guard.run(self.publish_once)

    def publish_once(self) -> None:
        pods, opted_in = self._pods.snapshot(), self._opted_in()
        if pods is None or opted_in is None:
            return  # not listed yet: callers are told so
        dra: dict[str, DraRead] = {}
        if self._claims is not None:
            self._claims.retain(pods)
            for uid, pod in pods.items():
                if claim_names(pod):
                    dra[uid] = self._claims.read(pod)
        problem = self._pods.error or None
        if problem is not None:
            problem = f"the agent's view of this node's pods may be out of date: {problem}"
        self._last = directory(pods.values(), dra, problem, self._last, opted_in=opted_in)
        self._publish(self._last)
        self._say_unserved(pods, opted_in)

    def _say_unserved(self, pods: Mapping[str, Pod], opted_in: frozenset[str]) -> None:
        """Once per pod: one that carries the webhook's marks in a namespace that does not
        opt in (now) is neither served nor held, so nothing enforces it by sampling. Its
        namespace's label was taken away, or the pod was made to look injected."""
        unserved = frozenset(
            uid for uid, pod in pods.items() if marked(pod) and not injected(pod, opted_in)
        )
        for uid in unserved - self._said:
            meta = pods[uid].get("metadata") or {}
            log.warning(
                "pod %s/%s carries the marks of a pod that vram-enforcer's webhook injected "
                "(the %s label, a container named %s), but its namespace is not labelled "
                "%s=%s: its sidecar is not served and the pod is not enforced by sampling (its "
                "namespace's label was taken away, or the pod was made to look injected). "
                "Recreate it in a namespace that opted in",
                meta.get("namespace"),
                meta.get("name"),
                ENFORCED,
                SIDECAR,
                *OPT_IN,
            )
        self._said = unserved
