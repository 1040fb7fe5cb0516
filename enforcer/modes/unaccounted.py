"""Each NVML pass, the node's GPU memory that no declaration accounts for
(`core/unaccounted.py`): left for its series, and each container of a pod the webhook did
not inject that holds some said once, in the log and on its pod (`VRAMUndeclared`), while
the pod lives; each process in no pod said once in the log, with its pid, once it has
stayed so for `SAY_AFTER` passes.

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
from enforcer.core.pod import pod_reference
from enforcer.core.reasons import Reason
from enforcer.core.unaccounted import InNoPod, unaccounted
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

    def __call__(self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]) -> None:
        pods = self._node.pods()
        found = unaccounted(sample, containers(), pods, self._node.opted_in(), self._node.declares)
        self._shown.unaccounted = found
        if found is None or pods is None:
            return
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
