"""The agent's reclaims, on every NVML pass: who borrows above a request on each GPU of the
node, and which borrowers' sidecars are asked to give memory back (`core/lending.py`
decides; the socket server tells each victim's own pod, with its sample).

The pods are the agent's one watch of its node. What each declares is read again only
when the watch says they changed (an event of its own), or the namespaces that opted in
did (whose pods' sidecar environment is read); a pass where no container may borrow costs
nothing more, and one where some may, one fold of the sample. Until both are listed,
nobody is asked anything.

A pass that fails (a bug, in any pod's data or in the lender) kills nobody: for up to
`LENDING_HOLD` after the last pass that did not, the agent still says that it lends, and
asks nothing new (each sidecar holds its borrowers to their ceilings, as it did); only once
the passes have failed that long is lending withdrawn, so that no neighbour's request goes
unmet for longer while nothing can decide (each sidecar then holds its borrowers to their
requests, as with an agent that never lent). Each is said once in the log, each failed
pass counted (`vram_enforcer_unexpected_errors_total{loop="lending"}`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping

from enforcer.core import messages
from enforcer.core.declaration import portion_basis
from enforcer.core.dra import DraObjects, claim_names
from enforcer.core.lending import Lending, Tenants, decide, tenants
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.owed import Claims, PodOwed, node_claims, pod_owed
from enforcer.core.payloads import Pod
from enforcer.core.pod_resources import Assignments, assigned_gpus
from enforcer.core.units import Unit
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry
from enforcer.modes.left_out import LeftOut
from enforcer.modes.node_view import NodeView

log = logging.getLogger(__name__)

# How long the lender's passes may fail before it withdraws lending: a transient fault (a
# pod's data that trips a bug until the pod changes) costs no borrower anything, and a
# neighbour whose request the borrowers' memory blocks waits at most this long for it.
LENDING_HOLD = 30.0  # s


class Lender:
    def __init__(
        self,
        node: NodeView,
        changed: threading.Event,
        watermark: int,
        telemetry: AgentTelemetry,
        assigned: tuple[Callable[[], Assignments | None], tuple[str, ...]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reserve_bytes: int = 0,
    ) -> None:
        """`changed`: set by the pod watch on every change of the node's pods. The pods'
        claims (DRA) are taken as last read (`ClaimReads.last`), never read here: the
        sampler does not wait on the API. `assigned`: the devices the kubelet gave each
        container, as last read, and the resources that are GPUs. `clock`: what the hold
        after a failed pass is timed on (monotonic). `reserve_bytes`: `--reserve`, lent to
        nobody, as it is advertised to nobody."""
        self._pods = node.pods
        self._opted_in = node.opted_in
        self._trusted: frozenset[str] | None = None  # as the tenants were made with
        self._claims = node.claims
        self._assigned = assigned
        self._assignments: Assignments | None = None  # as the tenants were made with
        # DRA pods: UID -> (the pod, its objects as last read, or None before a read)
        self._read: dict[str, tuple[Pod, DraObjects | None]] = {}
        self._changed = changed
        self._declares = node.declares
        self._watermark = watermark
        self._reserve = reserve_bytes
        self._telemetry = telemetry
        self._tenants: Tenants | None = None  # None: the pods are not known yet
        self._basis: int | None = None  # one GPU's memory, for portions (KAI's gpu-fraction)
        self._told: frozenset[tuple[str, str]] = frozenset()  # (container ID, GPU) asked
        self._unread: Mapping[str, str] = {}  # pod -> what of it could not be read, as said
        self._left_out = LeftOut(
            log,
            "lending",
            "reading what it is owed",
            "it is left out of lending, its memory counted as no one's request, until it "
            "reads again",
        )
        self._guard = LoopGuard("lending", telemetry.unexpected.labels("lending"), log)
        self._clock = clock
        self._good = clock()  # the last pass that did not fail (before any, the start)
        self._failing = ""  # "held", "withdrawn": as said in the log ("" while passes succeed)

    @property
    def tenants(self) -> Tenants | None:
        """The node's tenants as last made (None before the pods are known), for the pods'
        metrics: each container's request and ceiling."""
        return self._tenants

    def __call__(
        self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]
    ) -> Lending | None:
        """This pass's decision (nobody is asked anything before the pods are known). When
        the pass fails (a bug, reported and counted): nothing new is asked, and the agent
        still lends until the passes have failed for LENDING_HOLD; then None, no lending, so
        that borrowers are held to their requests until a pass succeeds. The tenants are
        made again on the next pass. `containers` (each GPU process's container ID) is
        asked for only when some container may borrow."""
        found: list[Lending] = []
        if self._guard.run(lambda: found.append(self._decide(sample, containers))):
            if self._failing:
                log.info("the lender's passes succeed again: reclaims are decided again")
            self._good, self._failing = self._clock(), ""
            return found[0]
        self._tenants = None
        self._telemetry.node.lending = ()
        return self._held()

    def _held(self) -> Lending | None:
        """After a failed pass: lending kept, with nothing asked, within LENDING_HOLD of the
        last pass that did not fail; else withdrawn. Each said once."""
        if self._clock() - self._good < LENDING_HOLD:
            if not self._failing:
                self._failing = "held"
                log.warning(
                    "a pass of the lender failed (a bug, counted in vram_enforcer_unexpected_"
                    'errors_total{loop="lending"}): containers keep borrowing up to their '
                    "ceilings and nothing new is asked back, for at most %.0f s while its "
                    "passes fail",
                    LENDING_HOLD,
                )
            return Lending()
        if self._failing != "withdrawn":
            self._failing = "withdrawn"
            log.error(
                "the lender's passes have failed for %.0f s: lending is withdrawn, and "
                "containers that may borrow are held to their requests until a pass succeeds",
                LENDING_HOLD,
            )
        return None

    def _decide(
        self, sample: Sample, containers: Callable[[], Mapping[ProcessKey, str]]
    ) -> Lending:
        basis = portion_basis(sample.devices)
        stale = self._changed.is_set() or self._tenants is None or basis != self._basis
        assignments = self._assigned[0]() if self._assigned is not None else None
        trusted = self._opted_in()
        stale = stale or trusted != self._trusted
        if stale or self._claims_read_again() or assignments is not self._assignments:
            self._changed.clear()  # before the read: a change during it is seen next pass
            pods = self._pods()
            if pods is None or trusted is None:
                # Not listed yet: nobody is asked (a pod whose declaration is not known yet
                # is never reclaimed from), and the next pass reads them again.
                self._tenants = None
                return Lending()
            claims = self._claims_of(pods)
            gpus = {}
            if self._assigned is not None and assignments is not None:
                gpus = assigned_gpus(assignments, self._assigned[1], sample.devices)
            read, left_out = [], set()
            for uid, pod in pods.items():
                owed = self._owed_of(pod, trusted, basis, claims.get(uid))
                if owed is None:
                    left_out.add(uid)
                else:
                    read.append((pod, owed))
            self._left_out.say(pods, left_out)
            self._tenants = tenants(read, gpus)
            self._basis, self._assignments, self._trusted = basis, assignments, trusted
            for who, problem in self._tenants.unread.items():
                if self._unread.get(who) != problem:  # once, not on every change of the pods
                    log.warning("pod %s %s", who, problem)
            self._unread = self._tenants.unread
        found = self._tenants
        if found is None or not found.borrowing:
            self._telemetry.node.lending = ()
            return Lending()  # nobody may borrow: nothing is lent, nothing to decide
        lending = decide(sample, containers(), found, self._watermark, self._reserve)
        self._telemetry.node.lending = lending.gpus
        asked = frozenset((cid, r.gpu) for cid, r in lending.reclaims.items())
        for cid, reclaim in lending.reclaims.items():
            if (cid, reclaim.gpu) not in self._told:
                who = f"container {Unit.of(reclaim.victim.unit).on_all_gpus}"
                log.info("%s", messages.reclaim(reclaim, who))
        self._told = asked
        return lending

    def _owed_of(
        self, pod: Pod, opted_in: frozenset[str], basis: int | None, claims: Claims | None
    ) -> PodOwed | None:
        """What the pod is owed (`owed.pod_owed`, total over any data); None should reading
        it raise all the same (a bug that one pod's data trips, counted as the loop's): that
        pod alone is left out of the pass, which lends and reclaims for the node's others."""
        return self._guard.result(
            functools.partial(
                pod_owed, pod, self._declares, opted_in=opted_in, basis=basis, claims=claims
            )
        )

    def _claims_of(self, pods: Mapping[str, Pod]) -> dict[str, Claims]:
        """DRA: each pod's claims as last read (a pod whose claims have not been read yet is
        owed nothing until they are: the next read makes the tenants again), with who uses
        each on the node, so that a claim that pods share is owed once."""
        if self._claims is None:
            return {}
        last = self._claims.last
        self._read = {uid: (pod, last(pod)) for uid, pod in pods.items() if claim_names(pod)}
        reads = {uid: objects for uid, (_, objects) in self._read.items() if objects is not None}
        return node_claims(pods.values(), reads, self._claims.settings)

    def _claims_read_again(self) -> bool:
        """Whether a DRA pod's claims were read since its tenants were made."""
        if self._claims is None:
            return False
        last = self._claims.last
        return any(last(pod) is not objects for pod, objects in self._read.values())
