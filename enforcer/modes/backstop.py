"""The node agent enforces a pod itself while the pod's sidecar is silent.

A root workload can stop or kill its own sidecar: they share a PID namespace. The agent,
which sees every GPU process of its node with its container (by the process's cgroup),
then runs the sidecar's own tick for that pod from its sampler's pass: the same pipeline
and policy, with the action, grace period and warning threshold that the webhook wrote
into the sidecar's environment (the sidecar's defaults on a pod of a namespace that has not
opted in, where the webhook wrote none); the same units, held as the sidecar holds them
(`owed.owed`, `attribution.pod_units`: with DRA from the claims the agent last read for the
pod's replies, never read here, since the sampler does not wait on the API): a container
that may borrow to its ceiling while the agent lends, and to its request on a GPU only
where this pass's lending asks it to give back there (`reclaim.asked`), its largest process
there stopped as its sidecar would, a `VRAMReclaimed`; so a sidecar that hangs up costs its
borrowers nothing while their GPU has room. The same proof before each signal (a pidfd,
the process's start time, and its cgroup naming the container's ID in the pod's current
status); and Events on the pod.
Where the kernel refuses a signal all the same (EPERM: a security module, or an agent
without CAP_KILL; not a user-namespaced pod, whose namespace is a child of the agent's), the
pod is made to leave through the API instead, once while it is held, with its policy's grace
period: evicted, or, once its PodDisruptionBudgets have refused that for
`--eviction-timeout`, deleted, as the kubelet's node-pressure eviction stops a pod it cannot
hold to its memory (`core.eviction`).
A pod in a dry run is decided for as ever and never signalled nor evicted: what would have
been done is reported (`VRAMWouldEnforce`), as its sidecar would report it.
It hands the pod back as soon as the sidecar is heard again (`SidecarWatch` says when), and
follows the victims it signalled to their end all the same: their SIGKILL comes at the
deadline, after the same proof, whoever holds the pod by then (held again, a pod takes up
its own pipeline where it left it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import replace
from typing import TYPE_CHECKING

from enforcer.core.attribution import PodProcesses, pod_units
from enforcer.core.declaration import Undeclared, portion_basis, unreadable
from enforcer.core.dra import claim_names
from enforcer.core.eviction import cause, grace_seconds, to_evict
from enforcer.core.lending import Lending
from enforcer.core.model import (
    Action,
    ProcessKey,
    ProcessTotal,
    Sample,
    SignalResult,
    SourceDown,
    UnitUsage,
    format_bytes,
)
from enforcer.core.owed import Owed, node_claims, pod_owed
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod import ContainerRef, containers_by_id, pod_reference
from enforcer.core.policy import Enforcement, PolicyConfig
from enforcer.core.reclaim import Gpu, Reclaim, asked
from enforcer.core.settings.sidecar import pod_policy
from enforcer.core.units import Unit, of_sole_container
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Membership, Signaller, Terminator
from enforcer.edge.telemetry import SidecarTelemetry
from enforcer.modes.left_out import LeftOut
from enforcer.modes.node_view import NodeView
from enforcer.modes.pipeline import LogReporter, Pipeline, Report, Reporter, WholeUnit

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)

Evict = Callable[[ObjectReference, str, int], None]
"""Evict the pod (and container) named, for the reason given, with a grace period (s);
never blocks."""


class Backstop:
    """Called on every sampler pass: a pipeline per pod whose sidecar is silent."""

    def __init__(
        self,
        node: NodeView,
        silent: Callable[[], frozenset[str]],
        recorder: EventRecorder,
        telemetry: AgentTelemetry,
        procfs: ProcFs,
        evict: Evict | None = None,
    ) -> None:
        """`evict`: what evicts a pod whose signal the kernel refused (None: nothing does,
        and the refusals are only reported). Until the node's namespaces that opted in are
        listed, no pod is held."""
        self._pods = node.pods
        self._opted_in = node.opted_in
        self._evict = evict
        self._claims = node.claims  # DRA: the pod's claims and the node's slices, as last read
        self._unheld: set[str] = set()  # silent pods said to be beyond the agent's hold
        self._silent = silent
        self._declares = node.declares
        self._recorder = recorder
        self._telemetry = telemetry
        self._procfs = procfs
        self._held: dict[str, _Held] = {}  # pod UID -> its pipeline, while its sidecar is silent
        # Pod UID -> what the agent did in it, served with its sidecar's counts while the pod
        # is on the node (`pod_metrics`); swapped whole, read by the scrape.
        self.counts: Mapping[str, SidecarTelemetry] = {}
        # Pipelines of pods handed back (or gone) whose victims have not exited yet.
        self._releasing: dict[str, _Held] = {}
        self._guard = LoopGuard("backstop", telemetry.unexpected.labels("backstop"), log)
        self._left_out = LeftOut(
            log, "backstop", "holding it", "the agent does not enforce its limits while this lasts"
        )

    def __call__(
        self,
        sample: Sample,
        containers: Callable[[], Mapping[ProcessKey, str]],
        lending: Lending | None,
    ) -> None:
        """`lending`: this pass's, as the sidecars are told it (None: the agent does not
        lend, and a container that may borrow is held to its request)."""
        self._guard.run(lambda: self._pass(sample, containers, lending))

    def _pass(
        self,
        sample: Sample,
        containers: Callable[[], Mapping[ProcessKey, str]],
        lending: Lending | None,
    ) -> None:
        trusted = self._opted_in()
        if trusted is None:
            return  # which pods' declarations can be read is not known yet: nobody is held
        silent, pods = self._silent(), self._pods() or {}
        for uid in [uid for uid in self._held if uid not in silent or uid not in pods]:
            # Its sidecar is back, or the pod is gone. The victims already signalled are
            # followed to their end, SIGKILL included: a tenant that continues its sidecar
            # before the grace period ends must not cut the escalation short.
            self._releasing[uid] = self._held.pop(uid)
        self._unheld &= silent
        if self.counts.keys() - pods.keys():
            self.counts = {uid: c for uid, c in self.counts.items() if uid in pods}
        container_of = containers() if silent else {}
        left_out = {
            uid
            for uid in silent & pods.keys()
            if not self._guard.run(
                functools.partial(self._keep, pods, uid, sample, trusted, container_of, lending)
            )
        }
        self._left_out.say(pods, left_out)
        for uid, held in list(self._releasing.items()):
            if not held.follow_victims():
                del self._releasing[uid]
        self._telemetry.held_by_agent.set(len(self._held))

    def _keep(
        self,
        pods: Mapping[str, Pod],
        uid: str,
        sample: Sample,
        trusted: frozenset[str],
        container_of: Mapping[ProcessKey, str],
        lending: Lending | None,
    ) -> None:
        """One silent pod's step, guarded on its own: a bug its data trips leaves the
        node's other silent pods held."""
        held = self._held.get(uid) or self._releasing.pop(uid, None)
        held = held or self._hold(pods, uid, sample, trusted)
        if held is not None:
            self._held[uid] = held
            held.tick(pods[uid], sample, container_of, lending)

    def _hold(
        self, pods: Mapping[str, Pod], uid: str, sample: Sample, trusted: frozenset[str]
    ) -> _Held | None:
        """The pod's pipeline, or None for a pod that is owed nothing the agent can hold it
        to (yet: claims not read, or not mapped to a GPU, are looked at again). Its policy
        is the sidecar's defaults where its sidecar's environment is not read (its
        namespace has not opted in: a `warn` there is its author's)."""
        pod = pods[uid]
        policy = pod_policy(pod, self._declares.sidecar, trusted)
        reads = self._claims if claim_names(pod) else None  # DRA, and the pod claims
        claims = None
        if reads is not None:  # with who uses each claim on the node: cut to its part
            last = {u: reads.last(p) for u, p in pods.items() if claim_names(p)}
            known = {u: objects for u, objects in last.items() if objects is not None}
            claims = node_claims(pods.values(), known, reads.settings).get(uid)
        basis = portion_basis(sample.devices)
        read = pod_owed(pod, self._declares, opted_in=trusted, basis=basis, claims=claims)
        owed = read.owed
        if not owed.units:
            if reads is not None:  # what the pod's claims give it is not known, or no GPU
                why = "; ".join(owed.problems) if claims else "its claims have not been read yet"
                self._cannot_hold(pod, why or "its claims give no GPU")
            elif isinstance(read.declared, Undeclared):
                self._cannot_hold(pod, unreadable(read.declared))
            return None
        log.warning(
            "pod %s: its sidecar is silent; the agent enforces its limits itself (%s)",
            _named(pod),
            _said(owed),
        )
        counts = self.counts.get(uid) or SidecarTelemetry()
        self.counts = {**self.counts, uid: counts}
        return _Held(
            pod,
            owed,
            policy,
            self._declares.sidecar,
            self._recorder,
            self._procfs,
            counts,
            self._evict,
        )

    def _cannot_hold(self, pod: Pod, why: str) -> None:
        """Said once while the pod's sidecar stays silent, not on every pass."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if uid not in self._unheld:
            self._unheld.add(uid)
            log.warning(
                "pod %s: its sidecar is silent, and the agent cannot hold it: %s", _named(pod), why
            )


def _said(owed: Owed) -> str:
    """What each unit is owed, as the log says it: a container's request (and the ceiling
    it may borrow up to while the agent lends); with DRA, each allocation on its GPU."""
    if owed.claimed:
        return ", ".join(
            f"{o.unit.described()}: {format_bytes(o.request)}"
            + (f" up to {format_bytes(o.ceiling)}" if o.borrows else "")
            for o in owed.units
        )
    return ", ".join(
        f"{o.unit.containers[0]} {format_bytes(o.request * o.gpus)}"
        + (f" up to {format_bytes(o.ceiling * o.gpus)}" if o.borrows else "")
        + (f", one share on each of {o.gpus} GPUs" if o.gpus > 1 else "")
        for o in sorted(owed.units, key=lambda o: o.unit.containers)
    )


def _named(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


class _Held:
    """One silent pod's tick, with its own victims and their escalation."""

    def __init__(
        self,
        pod: Pod,
        owed: Owed,
        policy: PolicyConfig,
        sidecar: str,
        recorder: EventRecorder,
        procfs: ProcFs,
        telemetry: SidecarTelemetry,
        evict: Evict | None = None,
    ) -> None:
        meta = pod.get("metadata") or {}
        self._source = _Given()
        want_init = policy.action is Action.RESTART
        self._attributor = SilentPodAttributor(procfs, owed, sidecar, want_init)
        self._terminator = _Refusals(Signaller(procfs, protected=frozenset({1})))
        about = (
            str(meta.get("namespace") or ""),
            str(meta.get("name") or ""),
            str(meta.get("uid") or ""),
        )
        self._about = about
        self._evict = evict
        self._grace = grace_seconds(policy)  # the policy's, not the pod's own
        self._evicted = False  # once while the pod is held, not on every pass
        self._asked: Mapping[str, Reclaim] = {}  # this pass's reclaims, by container ID
        reporters: list[Reporter] = [LogReporter(), _PodEvents(recorder, about, self._attributor)]
        self._pipeline = Pipeline(
            self._source,
            self._attributor,
            policy,
            self._terminator,
            reporters,
            telemetry,
            requests=lambda: self._attributor.requests,
            reclaimer=self._reclaims,
        )

    def tick(
        self,
        pod: Pod,
        sample: Sample,
        container_of: Mapping[ProcessKey, str],
        lending: Lending | None,
    ) -> None:
        self._source.sample_now = sample
        self._asked = lending.reclaims if lending is not None else {}
        self._attributor.update(pod, container_of, lending is not None)
        self._pipeline.tick()
        if self._evict is None or self._evicted:
            return
        unit = to_evict(self._terminator.denied, self._pipeline.last_units)
        if unit is not None:
            self._evicted = True
            about = pod_reference(*self._about, self._attributor.ref(unit.name))
            self._evict(about, cause(unit, self._attributor.label(unit.name)), self._grace)

    def _reclaims(self, gpus: tuple[Gpu, ...], /) -> dict[str, Reclaim]:
        """What this pass's lending asks of the pod's units, as its sidecar would take it."""
        return asked(gpus, self._asked, self._attributor.container)

    def follow_victims(self) -> bool:
        """Once the pod is handed back: escalate, or forget, the victims already signalled,
        deciding nothing new; whether any is left to follow."""
        self._pipeline.follow_victims()
        return bool(self._terminator.busy())


class _Refusals(Terminator):
    """The terminator, noting each unit whose victim the kernel refused a signal."""

    def __init__(self, signaller: Signaller) -> None:
        super().__init__(signaller)
        self.denied: set[str] = set()

    def start(self, enforcement: Enforcement, is_member: Membership, now: float) -> SignalResult:
        result = super().start(enforcement, is_member, now)
        if result is SignalResult.DENIED:
            self.denied.add(enforcement.unit.name)
        return result


class _Given:
    """The sampler's sample of this pass, as the pipeline's source."""

    def __init__(self) -> None:
        self.sample_now: Sample | SourceDown = SourceDown("no pass yet")

    def sample(self) -> Sample | SourceDown:
        return self.sample_now

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        return None


class SilentPodAttributor:
    """A silent pod's containers, each process by the container ID in its cgroup, as the
    agent reads it for every GPU process of the node; only IDs in the pod's own current
    status count, and the sidecar's container is never one of its units. Its units, and
    what each is held to, are its sidecar's (`attribution.pod_units` over what the pod is
    owed): a container that declares nothing held to 0; a unit that may borrow held to its
    ceiling while the agent lends (`lends`), else to its request."""

    def __init__(
        self,
        procfs: ProcFs,
        owed: Owed,
        sidecar: str,
        want_init: bool,
    ) -> None:
        self._procfs = procfs
        self._finder = InitFinder(procfs)
        self._owed = owed
        self._sidecar = sidecar
        self._want_init = want_init  # `restart`: each container's init, when one is over
        self._tick_inits: dict[str, ProcessTotal] | None = None  # this tick's, when looked for
        self._ids: dict[str, str] = {}  # container name -> its container ID now
        self._refs: dict[str, ContainerRef] = {}
        self._container_of: Mapping[ProcessKey, str] = {}
        self._lends = False
        # Unit -> its request, for those that may borrow above it (as of the last tick).
        self.requests: dict[str, int] = {}

    def update(self, pod: Pod, container_of: Mapping[ProcessKey, str], lends: bool) -> None:
        """This pass's pod, each GPU process's container ID, and whether the agent lends."""
        by_id = {cid: r for cid, r in containers_by_id(pod).items() if r.name != self._sidecar}
        self._ids = {ref.name: cid for cid, ref in by_id.items()}
        self._refs = {ref.name: ref for ref in by_id.values()}
        self._container_of = container_of
        self._lends = lends

    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]:
        name_of = {cid: name for name, cid in self._ids.items()}
        unit_of = {k: name_of[c] for k, c in self._container_of.items() if c in name_of}
        seen = PodProcesses(dict.fromkeys(unit_of, ""), unit_of, tuple(self._refs.values()))
        found = pod_units(sample, seen, self._owed, False, self._lends)
        units, self.requests = found.units, found.requests
        self._tick_inits = None
        if self._want_init and any(u.used_bytes > u.limit_bytes for u in units):
            inits = self._tick_inits = self._inits()  # only when one is over
            units = tuple(replace(u, init_process=of_sole_container(u.name, inits)) for u in units)
        return units

    def container(self, container_id: str) -> str | None:
        """The pod's container that runs as `container_id` now; None for none of its own."""
        return next((name for name, cid in self._ids.items() if cid == container_id), None)

    def _inits(self) -> dict[str, ProcessTotal]:
        """Each container's init, as the host sees it: a process of the container whose
        parent is not (the runtime's shim). A `kubectl exec` into it is one too, and always
        younger: the oldest is the init; two of the same clock tick prove none. Named by its
        `comm`, not its command line: this runs on the sampler's thread (`ProcFs.comm`)."""
        found = self._finder(set(self._ids.values()))
        return {
            name: ProcessTotal(key, 0, (), self._procfs.comm(key.pid) or "")
            for name, cid in self._ids.items()
            if isinstance(key := found.get(cid), ProcessKey)
        }

    def membership(self, unit: str) -> Membership:
        ids = {self._ids[n] for n in Unit.of(unit).containers if n in self._ids}

        def member(pid: int) -> bool:
            return self._procfs.container_id(pid) in ids

        return member

    def label(self, unit: str) -> str:
        held = "held by the node agent while the pod's sidecar is silent"
        return f"{Unit.of(unit).described()} ({held})"

    def whole(self, unit: UnitUsage) -> WholeUnit:
        """`restart`: the container's init, whose end makes the kubelet restart the
        container; else (a unit that containers share, or an init not proven) each of its
        GPU processes."""
        init = None
        if self._want_init:  # this tick's, looked for when the unit was found over
            inits = self._tick_inits if self._tick_inits is not None else self._inits()
            init = of_sole_container(unit.name, inits)
        if init is not None:
            return WholeUnit((init,), restart=True)
        return WholeUnit(unit.processes)

    def ref(self, unit: str) -> ContainerRef | None:
        return of_sole_container(unit, self._refs)


SAMPLER_MOST = 4096
"""Of a container's cgroups, at most this many directories and processes are read on the
sampler's thread (some 15 µs a process: 60 ms for 4,000, once per container); a larger
one is looked at on a thread of its own."""
RESCAN_AFTER = 5.0  # s: a look off the sampler's thread that named no init, again no sooner


class InitFinder:
    """Containers' inits (`ProcFs.container_inits`) for the sampler's thread, which must
    not wait on a scan of the whole node. Each from its own cgroup, at once, where the
    host's cgroupfs shows it within SAMPLER_MOST; else (no cgroupfs mounted, a container
    larger than that) on a thread of its own, which reads its cgroup whole or, failing
    that, every process, and answers on a later call: meanwhile its unit has no init, and
    `restart` signals nothing. An init found is kept while its start time reads the same:
    a container's init never changes (its end is the container's, and a container
    restarted has a new ID), and a process exec'd into it later is younger."""

    def __init__(self, procfs: ProcFs) -> None:
        self._procfs = procfs
        self._lock = threading.Lock()
        self._found: dict[str, ProcessKey | str] = {}  # inits found; why not, off the thread
        self._looking = False
        self._looked_at = float("-inf")

    def __call__(self, ids: Set[str]) -> dict[str, ProcessKey | str]:
        with self._lock:
            self._found = {cid: v for cid, v in self._found.items() if cid in ids}
            before, looking = dict(self._found), self._looking
        found: dict[str, ProcessKey | str] = {
            cid: key
            for cid, key in before.items()
            if isinstance(key, ProcessKey) and self._procfs.start_time(key.pid) == key.start_time
        }
        found |= self._procfs.cgroup_inits(ids - found.keys(), SAMPLER_MOST)
        due = ids - found.keys()
        for cid in due:
            why = before.get(cid)
            found[cid] = why if isinstance(why, str) else "being looked for, off the sampler"
        again = time.monotonic() - self._looked_at >= RESCAN_AFTER
        with self._lock:
            self._found.update((c, k) for c, k in found.items() if isinstance(k, ProcessKey))
            if due and not looking and (again or not due <= before.keys()):
                self._looking = True
                threading.Thread(
                    target=self._look, args=(due,), name="init-finder", daemon=True
                ).start()
        return found

    def _look(self, ids: set[str]) -> None:
        try:
            found = self._procfs.container_inits(ids)
            with self._lock:
                self._found.update(found)
        finally:
            with self._lock:
                self._looking = False
                self._looked_at = time.monotonic()


class _PodEvents:
    """The pipeline's reports as Events on the pod, posted by the agent's recorder."""

    def __init__(
        self, recorder: EventRecorder, about: tuple[str, str, str], attributor: SilentPodAttributor
    ) -> None:
        self._recorder = recorder
        self._about = about
        self._attributor = attributor

    def report(self, report: Report) -> None:
        if report.quiet:
            return
        ref = self._attributor.ref(report.unit) if report.unit else None
        about = pod_reference(*self._about, ref)
        self._recorder.record(about, str(report.reason), report.message, not report.normal)
