"""Each NVML pass, the node's GPU memory that no declaration accounts for
(`core/unaccounted.py`): left for its series, and each container of a pod the webhook did
not inject that holds some (or an injected pod's sidecar container that does) said once,
in the log and on its pod (`VRAMUndeclared`), while the pod lives; each process in no pod
said once in the log, with its pid, once it has stayed so for `SAY_AFTER` passes.

The Events are bounded: one per container while its pod is on the node (a restarted agent
updates the Event it finds, through the recorder's `once`), each for a container that
holds GPU memory (a CUDA context each: NVML's list bounds them), at most `PER_PASS` a pass
(the rest wait for the next), and none about a pod of the agent's own namespace (the
operator's, which the webhook never mutates; as none of the agent's Events are): that is
said in the log alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import pod_reference
from enforcer.core.reasons import Reason
from enforcer.core.unaccounted import InNoPod, PodIndex, pod_index, unaccounted
from enforcer.modes.node_view import NodeView

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder
    from enforcer.edge.metrics import NodeCollector

log = logging.getLogger(__name__)

PER_PASS = 5  # VRAMUndeclared Events one pass may post; the others wait for the next
# Passes a process stays in no pod before it is said in the log: a new pod's container
# may hold memory before the pod watch hears of its ID.
SAY_AFTER = 5


class UnaccountedStep:
    """Called on each sampler pass with its sample and each process's container ID."""

    def __init__(
        self, node: NodeView, shown: NodeCollector, recorder: EventRecorder, own_namespace: str
    ) -> None:
        self._node = node
        self._shown = shown
        self._recorder = recorder
        self._own = own_namespace
        self._said: set[tuple[str, str]] = set()  # (pod UID, container), while the pod lives
        self._in_no_pod: dict[ProcessKey, int] = {}  # passes in no pod in a row (said: above)
        self._indexed: tuple[Mapping[str, Pod], frozenset[str], PodIndex] | None = None

    def __call__(self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]) -> None:
        pods, opted_in = self._node.pods(), self._node.opted_in()
        if pods is None or opted_in is None:  # nothing is known to be unaccounted yet
            self._shown.unaccounted = None
            return
        found = unaccounted(sample, containers(), self._index(pods, opted_in))
        self._shown.unaccounted = found
        self._say_in_no_pod(found.in_no_pod)
        self._said = {said for said in self._said if said[0] in pods}
        due = [c for c in found.undeclared if (c.uid, c.container.name) not in self._said]
        for c in due[:PER_PASS]:
            text = messages.undeclared(c)
            log.warning("pod %s/%s: %s", c.namespace, c.pod, text)
            if c.namespace != self._own:
                about = pod_reference(c.namespace, c.pod, c.uid, c.container)
                self._recorder.record(about, str(Reason.UNDECLARED), text, True, once=True)
            self._said.add((c.uid, c.container.name))

    def _index(self, pods: Mapping[str, Pod], opted_in: frozenset[str]) -> PodIndex:
        """The pods' index, made again only when a pod or the namespaces changed: the watch
        replaces a pod's object on each change, and the pods indexed are kept (a copy of
        the mapping, holding each object), so an object found again is the same pod."""
        last = self._indexed
        if (
            last is None
            or last[1] != opted_in
            or len(last[0]) != len(pods)
            or any(last[0].get(uid) is not pod for uid, pod in pods.items())
        ):
            index = pod_index(pods, opted_in, self._node.declares)
            last = self._indexed = (dict(pods), opted_in, index)
        return last[2]

    def _say_in_no_pod(self, outside: Sequence[InNoPod]) -> None:
        """Each process in no pod said once in the log, after SAY_AFTER passes in a row."""
        held: dict[ProcessKey, list[InNoPod]] = {}
        for each in outside:
            held.setdefault(each.usage.key, []).append(each)
        passes = {key: min(self._in_no_pod.get(key, 0) + 1, SAY_AFTER + 1) for key in held}
        for key, seen in passes.items():
            if seen == SAY_AFTER:
                log.warning("%s", messages.in_no_pod(key.pid, held[key]))
        self._in_no_pod = passes
