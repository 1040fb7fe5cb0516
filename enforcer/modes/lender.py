"""The agent's reclaims, on every NVML pass: who borrows above a request on each GPU of the
node, and which borrowers' sidecars are asked to give memory back (`core/lending.py`
decides; the socket server tells each victim's own pod, with its sample).

The pods are the agent's one watch of its node. What each declares is read again only
when the watch says they changed (an event of its own); a pass where no container may
borrow costs nothing more, and one where some may, one fold of the sample.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from enforcer.core import messages
from enforcer.core.declaration import portion_basis
from enforcer.core.lending import Lending, Tenant, decide, tenants
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.payloads import Pod
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry

log = logging.getLogger(__name__)


class Lender:
    def __init__(
        self,
        pods: Callable[[], Mapping[str, Pod] | None],
        changed: threading.Event,
        resource: tuple[str, int],
        sidecar: str,
        watermark: int,
        telemetry: AgentTelemetry,
    ) -> None:
        """`changed`: set by the pod watch on every change of the node's pods."""
        self._pods = pods
        self._changed = changed
        self._resource = resource
        self._sidecar = sidecar
        self._watermark = watermark
        self._telemetry = telemetry
        self._tenants: dict[str, Tenant] | None = None  # None: the pods are not known yet
        self._basis: int | None = None  # one GPU's memory, for portions (KAI's gpu-fraction)
        self._told: frozenset[tuple[str, str]] = frozenset()  # (container ID, GPU) asked
        self._guard = LoopGuard("lending", telemetry.unexpected.labels("lending"), log)

    def __call__(
        self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]
    ) -> Lending | None:
        """This pass's decision; None before the pods are known, or on a bug (reported,
        counted): then nobody is asked for anything. `containers` (each GPU process's
        container ID) is asked for only when some container may borrow."""
        found: list[Lending | None] = []
        self._guard.run(lambda: found.append(self._decide(sample, containers)))
        return found[0] if found else None

    def _decide(
        self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]
    ) -> Lending | None:
        basis = portion_basis(sample.devices)
        if self._changed.is_set() or self._tenants is None or basis != self._basis:
            self._changed.clear()  # before the read: a change during it is seen next pass
            pods = self._pods()
            if pods is None:
                return None
            name, unit = self._resource
            self._tenants = tenants(pods.values(), name, unit, self._sidecar, basis)
            self._basis = basis
        if not any(t.ceiling > t.request for t in self._tenants.values()):
            self._telemetry.node.lending = ()
            return Lending()  # nobody may borrow: nothing is lent, nothing to decide
        lending = decide(sample, containers(), self._tenants, self._watermark)
        self._telemetry.node.lending = lending.gpus
        asked = frozenset((cid, r.gpu) for cid, r in lending.reclaims.items())
        for cid, reclaim in lending.reclaims.items():
            if (cid, reclaim.gpu) not in self._told:
                log.info("%s", messages.reclaim(reclaim, f"container {reclaim.victim.unit}"))
        self._told = asked
        return lending
