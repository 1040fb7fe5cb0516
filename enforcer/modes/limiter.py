"""The node agent's hard limits: each pod bound to this node, and each of its declaring
containers, held by the driver to its limit on every GPU (NVIDIA R615+ per-cgroup limits).

One pass, on every pod change and every --cgroup-scan: the pods from the watch, the
kubelet's cgroups from a scan, `hard_limits.plan()` for what to set, clear or forget, and
the chosen tier for the doing (`edge/tiers.tier_for`: read before the first write, Set with
soft 0, read back). The pod's total goes on the pod's cgroup, which the kubelet creates
before any container; a container's limit on the cgroup named by its current container ID,
so a restart (a new ID, a new cgroup) moves it. Only limits this agent set (or adopted as
its own) are cleared; someone else's are left as they are, and said. Each running
declaring container is proven on its own cgroup, and the pod told which tier holds each.

Where the driver cannot (an older driver, MIG, no root, no cgroup v2), each pod is told
once, and the sidecar's sampling enforces alone. A pod in a dry run gets none: the
driver's refusal of an allocation would enforce what a dry run only reports. NVML failing
mid-way keeps what is in place and tries again on the next pass.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from enforcer.core import messages
from enforcer.core.declaration import container_env, env_trusted, portion_basis, unreadable
from enforcer.core.dra import DraObjects, claim_names
from enforcer.core.hard_limits import (
    TOOLKIT,
    Holding,
    Key,
    Target,
    fractioned,
    mig_gpus,
    owner,
    per_gpu,
    plan,
    pod_limits,
    targets,
)
from enforcer.core.model import Device, LimitOutcome, LimitResult, format_bytes
from enforcer.core.owed import Claims, PodOwed, node_claims, pod_owed
from enforcer.core.payloads import Pod
from enforcer.core.pod import pod_reference
from enforcer.core.reasons import Reason
from enforcer.core.settings.sidecar import pod_policy
from enforcer.core.sidecar_presence import running_containers
from enforcer.core.tier_choice import Choice, TierName
from enforcer.core.tiers import Holds, Tier, Want
from enforcer.core.units import POD_UNIT
from enforcer.edge import cgroupfs
from enforcer.edge.charge_proof import ChargeProof
from enforcer.edge.driver_tier import without_dmem
from enforcer.edge.guard import LoopGuard
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.tiers import tier_for
from enforcer.modes.left_out import LeftOut
from enforcer.modes.node_view import NodeView

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder
    from enforcer.edge.latest import Latest

log = logging.getLogger(__name__)


class Sampled(Protocol):
    """The sampler's last pass, as the hard limiter reads it (each value swapped whole)."""

    @property
    def devices(self) -> Latest[Sequence[Device]]: ...

    @property
    def container_usage(self) -> Latest[Mapping[str, Mapping[str, int]]]:
        """Container ID -> GPU -> what NVML lists for its processes."""
        ...


class HardLimiter(threading.Thread):
    """Keeps the driver's per-cgroup limits equal to what this node's pods declare."""

    def __init__(
        self,
        nvml: Nvml,
        node: NodeView,
        sampled: Sampled,
        recorder: EventRecorder,
        telemetry: AgentTelemetry,
        *,
        cgroups: tuple[Path, float],
        changed: threading.Event,
        tier: Latest[Choice | None] | None = None,
    ) -> None:
        """`cgroups`: the host's cgroupfs, and how often its pods' cgroups are scanned;
        `tier`: the node's choice of tier (`tier_watch`), where the agent probes it."""
        super().__init__(name="hard-limiter", daemon=True)
        cgroup_root, scan_every = cgroups
        self._nvml = nvml
        self._pods = node.pods
        self._opted_in = node.opted_in
        self._node_labels = node.labels
        self._sampled = sampled
        self._recorder = recorder
        self._telemetry = telemetry
        self._root = cgroupfs.v2_at(cgroup_root)  # a hybrid host's v2 is below `unified`
        self._scanner = cgroupfs.PodScanner(self._root)
        self._declares = node.declares
        self._claims = node.claims  # DRA: reads a pod's claims and this node's slices
        self._scan_every = scan_every
        self._changed = changed
        self._tier = tier
        self.stop = threading.Event()
        self._guard = LoopGuard("hard-limiter", telemetry.unexpected.labels("hard-limiter"), log)
        # The limits this agent set and that are still in place, with whom they are for.
        self._applied: dict[Key, tuple[Target, int]] = {}
        # Limits someone else set where we would set ours, never written or cleared by us:
        # with whom they are on, the hard limit the driver holds, and who set it.
        self._foreign: dict[Key, tuple[Target, int, str]] = {}
        # Values NVML rejected, or that did not read back, with why: not tried again until
        # the value or the cgroup changes.
        self._rejected: dict[tuple[str, str, int], str] = {}
        # Cgroups the driver cannot hold (no dmem files; or NOT_SUPPORTED where it holds
        # others on that GPU), with why and the first cgroup from the root that does not
        # enable dmem below it: a fact about that cgroup, never the GPU's, and not asked
        # again until that cgroup is gone or the first such cgroup changes.
        self._refused: dict[str, tuple[str, Path | None]] = {}
        self._final: dict[str, LimitOutcome] = {}  # GPU -> why it never gets a limit
        self._told: set[str] = set()  # pods whose Event has gone out
        self._proof = ChargeProof(nvml)  # whether the driver charges each leaf's processes
        # Container cgroup -> its target and the tier that holds it, once known.
        self._holdings: dict[str, tuple[Target, Holding]] = {}
        # uid -> (version, parsed, what of its declaration could not be read, as said)
        self._parsed: dict[str, tuple[str, PodOwed | None, str]] = {}
        self._logged = ""
        self._left_out = LeftOut(
            log,
            "hard-limiter",
            "reading what it is owed",
            "its limits stay as they were until it reads again",
        )

    def run(self) -> None:
        while not self.stop.is_set():
            self._changed.wait(self._scan_every)
            self._changed.clear()
            if not self.stop.is_set():
                self._guard.run(self._pass)

    def _pass(self) -> None:
        pods, devices, trusted = self._pods(), self._sampled.devices.get(), self._opted_in()
        if pods is None or not devices or trusted is None:
            return  # no pod or namespace list or no NVML pass yet: never act on a guess
        declared = self._declared(pods, portion_basis(devices), trusted)
        live = {p.uid for p in declared}
        self._told &= live
        declared = self._not_fractioned(declared, pods)
        usable = [d for d in devices if d.uuid not in self._final]
        choice = self._choice(devices, usable)
        if not choice.refuses:
            why = choice.why
            self._say_once(why)
            for p in declared:
                self._tell(p, Reason.SAMPLING_ONLY, messages.sampling_only(why))
            return
        usable = [d for d in usable if d.uuid in choice.gpus]
        found = self._scanner.scan()
        pod_dirs, existing = found.pods, found.paths()
        self._rejected = {r: why for r, why in self._rejected.items() if r[0] in existing}
        self._refused = {
            cgroup: (why, at)
            for cgroup, (why, at) in self._refused.items()
            if cgroup in existing and cgroupfs.first_without("dmem", Path(cgroup), self._root) == at
        }
        wanted = targets(declared, pod_dirs, found.containers)
        for key in [key for key in self._foreign if key[0] not in wanted]:
            self._drop_foreign(key)  # its pod, or its cgroup, is gone: never cleared by us
        limits = {key: limit for key, (_, limit) in self._applied.items()}
        todo = plan(
            wanted,
            usable,
            limits,
            existing,
            set(self._rejected),
            set(self._foreign),
            set(self._refused),
        )
        for key in todo.forget:
            self._drop(key)
        for key in todo.clear:
            self._clear(key)
        self._hold(tier_for(choice, self._nvml), todo.set, pods)
        for gone in [cg for cg in self._holdings if cg not in wanted]:
            leaf, held = self._holdings.pop(gone)
            self._telemetry.container_tier.remove(*_labels(leaf), held.tier)
        self._proof.keep(existing)
        for p in declared:
            if p.uid in pod_dirs:
                leaves = [t for t in wanted.values() if t.uid == p.uid and t.container]
                self._announce(p, pod_dirs[p.uid], usable, leaves)
            elif running_containers(pods[p.uid]):
                why = f"the pod's cgroup is not below {self._root} (is --cgroup-root the host's?)"
                self._tell(p, Reason.SAMPLING_ONLY, messages.sampling_only(why))

    def _not_fractioned(self, declared: list[PodOwed], pods: Mapping[str, Pod]) -> list[PodOwed]:
        """The pods whose limits are ours to hold: gpu-fractioning holds the others itself
        (`hard_limits.fractioned`), each said once."""
        labels = self._node_labels()
        mine = []
        for p in declared:
            annotations = (pods[p.uid].get("metadata") or {}).get("annotations") or {}
            if fractioned(annotations, labels):
                self._tell(p, Reason.FOREIGN_LIMIT, messages.held_by_fractioning())
            else:
                mine.append(p)
        return mine

    def _declared(
        self, pods: Mapping[str, Pod], basis: int | None, trusted: frozenset[str]
    ) -> list[PodOwed]:
        """What each pod declares (or, with DRA, was allocated), parsed again only when the
        pod has changed (or the GPUs that its portions of one count against, or the pods
        that share its claims: each pod's cgroup gets its part of a shared claim, never the
        whole; or whether its namespace opted in: `trusted`, `declaration.of_pod`). A pod
        whose claims cannot be read now is read again next pass. What of a pod's
        declaration cannot be read is said once, not on every read."""
        reads: dict[str, DraObjects | str] = {}
        claims: dict[str, Claims] = {}
        if self._claims is not None:
            reads = {uid: self._claims.now(pod) for uid, pod in pods.items() if claim_names(pod)}
            read = {uid: o for uid, o in reads.items() if isinstance(o, DraObjects)}
            claims = node_claims(pods.values(), read, self._claims.settings)
        parsed: dict[str, tuple[str, PodOwed | None, str]] = {}
        left_out: set[str] = set()
        for uid, pod in pods.items():
            step = functools.partial(
                self._read, uid, pod, reads.get(uid), claims.get(uid), basis, trusted
            )
            found = self._guard.result(step)
            if found is None:  # a bug its data trips (counted): the others are limited
                left_out.add(uid)
                found = self._parsed.get(uid) or ("", None, "")  # not its version: read again
            parsed[uid] = found
        self._parsed = parsed
        self._left_out.say(pods, left_out)
        return [v for _, v, _ in parsed.values() if v is not None]

    def _read(
        self,
        uid: str,
        pod: Pod,
        objects: DraObjects | str | None,
        mine: Claims | None,
        basis: int | None,
        trusted: frozenset[str],
    ) -> tuple[str, PodOwed | None, str]:
        """One pod's (version, what it is owed or None, what of it cannot be read)."""
        meta = pod.get("metadata") or {}
        resource_version = str(meta.get("resourceVersion") or "")
        users = mine.users if mine is not None else {}
        sharing = sorted(
            (name, sorted(users.get((str(meta.get("namespace")), name), ())))
            for name in claim_names(pod).values()
            if name
        )
        opted = env_trusted(pod, trusted)
        version = f"{resource_version}@{basis}@{sharing}@{opted}" if resource_version else ""
        known = self._parsed.get(uid)
        if known and version and known[0] == version:
            return known
        if pod_policy(pod, self._declares.sidecar, trusted).reports_only:
            # The driver would refuse its allocations past the limit: enforcement, which
            # `warn` and a dry run only report. Limits set before are cleared.
            log.info(
                "pod %s/%s: only reported on (warn or a dry run): no hard limit",
                meta.get("namespace"),
                meta.get("name"),
            )
            return (version, None, "")
        read_now = pod_owed(pod, self._declares, opted_in=trusted, basis=basis, claims=mine)
        problem = unreadable(read_now.declared)
        if problem and problem != (known[2] if known else ""):
            log.warning("pod %s/%s %s", meta.get("namespace"), meta.get("name"), problem)
        if not read_now.owed.units and isinstance(objects, str):
            self._say_once(f"the claims of pod {uid} cannot be read ({objects})")
            # Keep its limits meanwhile; its old version makes us read again.
            return (known[0], known[1], problem) if known else ("", None, problem)
        return (version, read_now if read_now.owed.units else None, problem)

    def _choice(self, devices: Sequence[Device], usable: Sequence[Device]) -> Choice:
        """The tier that holds this node's pods, from `_node_reason`: on the GPUs the node's
        choice (`tier_watch`) gives it, once made, that the driver has not refused since."""
        why = self._node_reason(devices, usable)
        if why:
            return Choice(TierName.SAMPLING, (), why)
        node = self._tier.get() if self._tier is not None else None
        gpus = tuple(g for g in per_gpu(1, usable) if node is None or g in node.gpus)
        if not gpus and node is not None:
            return Choice(TierName.SAMPLING, (), node.why)
        return Choice(TierName.DRIVER, gpus, node.why if node is not None else "")

    def _node_reason(self, devices: Sequence[Device], usable: Sequence[Device]) -> str:
        """Why no pod on this node can get a hard limit; "" while some can: the node's
        tier (`tier_choice`, as doctor and exec choose), then what the driver answered."""
        choice = self._tier.get() if self._tier is not None else None
        if choice is not None and not choice.refuses:
            return choice.why
        if not cgroupfs.exists(self._root):
            return f"no cgroup v2 hierarchy at {self._root} (--cgroup-root)"
        if per_gpu(1, usable):
            return ""
        reasons = [
            f"{gpu}: {messages.no_hard_limit(o, self._nvml.driver_version, '')}"
            for gpu, o in self._final.items()
        ]
        if mig_gpus(devices):
            reasons.append(messages.mig_without_hard_limit(mig_gpus(devices)))
        return "; ".join(dict.fromkeys(reasons)) or "NVML reports no GPU memory to limit"

    def _hold(
        self, tier: Tier, changes: Sequence[tuple[Target, str, int]], pods: Mapping[str, Pod]
    ) -> None:
        """Make the tier hold each target to its limit on the GPU, and keep what came of it.
        A (cgroup, GPU) we have not written to is read first (`DriverTier`): no limit there
        is ours to set, our own value (a restarted agent's) is adopted, anything else is
        someone else's and left as it is; so is any limit on a container that NVIDIA's hook
        sets (given its variable), whatever its value: the hook's and ours never both act."""
        owners = [self._owner(t, pods) for t, _, _ in changes]
        wants = [
            Want(
                t.cgroup,
                gpu,
                limit,
                (t.cgroup, gpu) not in self._applied,
                self._pods_limit(t, gpu),
                adopt=owned_by != TOOLKIT,
            )
            for (t, gpu, limit), owned_by in zip(changes, owners, strict=True)
        ]
        held_by = zip(changes, owners, tier.hold(wants), strict=True)
        for (target, gpu, limit), owned_by, held in held_by:
            if held.wrote and held.outcome is not None:
                self._telemetry.hard_limit_calls.labels("set", held.outcome.result.value).inc()
            if held.holds in (Holds.SET, Holds.ADOPTED):
                self._took(target, gpu, limit, held.holds)
            elif held.holds is Holds.FOREIGN:
                self._found_foreign(target, gpu, held.hard_bytes, owned_by)
            elif held.outcome is not None:
                self._failed(target, gpu, limit, held.outcome)

    def _pods_limit(self, target: Target, gpu: str) -> int | None:
        """For a container's cgroup, the limit we hold its pod's cgroup to on the GPU: what
        a cgroup without dmem files reads as its own (NVIDIA's MPS v3 page)."""
        if not target.container:
            return None
        return next(
            (
                b
                for (_, g), (t, b) in self._applied.items()
                if g == gpu and t.uid == target.uid and not t.container
            ),
            None,
        )

    def _took(self, target: Target, gpu: str, limit: int, how: Holds) -> None:
        self._applied[(target.cgroup, gpu)] = (target, limit)
        self._telemetry.hard_limits.labels(*_labels(target), gpu).set(limit)
        log.info(
            "hard limit of %s on %s for %s (%s): %s",
            format_bytes(limit),
            gpu,
            _name(target),
            how,
            target.cgroup,
        )

    def _failed(self, target: Target, gpu: str, limit: int, outcome: LimitOutcome) -> None:
        elsewhere = any(g == gpu for _, g in self._applied)  # the driver holds another there
        if outcome.result is LimitResult.NO_DMEM or (
            outcome.result is LimitResult.UNSUPPORTED and elsewhere
        ):
            if outcome.result is LimitResult.UNSUPPORTED:  # S4: "Not Supported": no dmem files
                elsewhere_too = f"NOT_SUPPORTED here, while it holds other cgroups on {gpu}"
                outcome = LimitOutcome(LimitResult.NO_DMEM, elsewhere_too)
            outcome, at = without_dmem(outcome, target.cgroup, self._root)
            why = messages.no_hard_limit(outcome, "", target.cgroup)
            self._refused[target.cgroup] = (why, at)
            self._not_held(target, gpu, why)
        elif outcome.final:
            self._final[gpu] = outcome  # said once, as this node's reason
        elif outcome.result in (LimitResult.REJECTED, LimitResult.NOT_APPLIED):
            why = messages.no_hard_limit(outcome, "", target.cgroup)
            self._rejected[(target.cgroup, gpu, limit)] = why
            self._not_held(target, gpu, why)
        else:  # the cgroup went away meanwhile, or NVML failed: the next pass tries again
            log.debug("%s", messages.no_hard_limit(outcome, "", target.cgroup))

    def _not_held(self, target: Target, gpu: str, why: str) -> None:
        """Said once: in the log, and for a container's cgroup in a Warning on its pod (the
        pod's own is its tier's Event, `_announce`)."""
        log.warning("%s: %s", _name(target), why)
        if target.container:
            about = pod_reference(target.namespace, target.pod, target.uid)
            text = f"container {target.container} on {gpu}: {messages.sampling_only(why)}"
            self._recorder.record(about, str(Reason.SAMPLING_ONLY), text, warning=True, once=True)

    def _owner(self, target: Target, pods: Mapping[str, Pod]) -> str:
        """Who would set a limit on the target's cgroup but us (`hard_limits.owner`)."""
        pod = pods.get(target.uid)
        return owner(set(container_env(pod, target.container)) if pod else set())

    def _found_foreign(self, target: Target, gpu: str, hard: int, owned_by: str) -> None:
        """A limit we did not set: kept as it is, said once on the pod and in the series.
        Within what the target is owed there, the driver holds it; above, sampling does."""
        self._foreign[(target.cgroup, gpu)] = (target, hard, owned_by)
        self._telemetry.foreign_limits.labels(*_labels(target), gpu, owned_by).set(hard)
        owed = target.limits_on(self._sampled.devices.get()).get(gpu, 0)
        text = messages.foreign_limit(_whose(target), gpu, hard, owed, owned_by)
        above = hard > owed
        (log.warning if above else log.info)("%s: %s", _name(target), text)
        about = pod_reference(target.namespace, target.pod, target.uid)
        self._recorder.record(about, str(Reason.FOREIGN_LIMIT), text, warning=above, once=True)

    def _drop_foreign(self, key: Key) -> None:
        target, _, owned_by = self._foreign.pop(key)
        self._telemetry.foreign_limits.remove(*_labels(target), key[1], owned_by)

    def _clear(self, key: Key) -> None:
        outcome = self._nvml.clear_memory_limit(key[1], key[0])
        self._telemetry.hard_limit_calls.labels("clear", outcome.result.value).inc()
        if outcome.result in (LimitResult.SET, LimitResult.NO_CGROUP):
            log.info("hard limit on %s for %s cleared", key[1], key[0])
            self._drop(key)
        else:
            log.warning(
                "clearing the hard limit on %s for %s: %s",
                key[1],
                key[0],
                messages.no_hard_limit(outcome, "", key[0]),
            )

    def _drop(self, key: Key) -> None:
        target, _ = self._applied.pop(key)
        self._telemetry.hard_limits.remove(*_labels(target), key[1])

    def _announce(
        self, pod: PodOwed, pod_dir: str, usable: Sequence[Device], leaves: Sequence[Target]
    ) -> None:
        """The pod's one Event, once the tier that holds each of its running declaring
        containers is known (`_holding`): which, per container."""
        for leaf in leaves:
            if leaf.cgroup not in self._holdings:
                holding = self._holding(pod, leaf, usable)
                if holding is not None:
                    self._holdings[leaf.cgroup] = (leaf, holding)
                    self._telemetry.container_tier.labels(*_labels(leaf), holding.tier).set(1)
        holdings = [
            self._holdings[leaf.cgroup][1] for leaf in leaves if leaf.cgroup in self._holdings
        ]
        if pod.uid in self._told or not leaves or len(holdings) < len(leaves):
            return
        owed = pod_limits(pod, usable)
        held = self._held_on(pod_dir, owed)
        failed = self._failures(pod_dir)
        if set(held) != set(owed) and not failed:
            return  # the pod's own limit is still to come
        driver = any(h.tier is TierName.DRIVER for h in holdings)
        text = messages.pod_tiers(held if set(held) == set(owed) else None, failed, holdings)
        self._tell(pod, Reason.HARD_LIMIT if driver else Reason.SAMPLING_ONLY, text)

    def _holding(self, pod: PodOwed, leaf: Target, usable: Sequence[Device]) -> Holding | None:
        """Which tier holds the container of `leaf`, or None while that is not known: a
        limit on its leaf (ours, or someone else's within what it is owed) on every GPU it
        is owed, once the driver shows it charges the container's own processes (NVML's
        listing of them, by container ID) to it; sampling where the leaf has none, one
        above what it is owed, or one the driver charges nothing to."""
        owed = leaf.limits_on(usable)
        whose = f"container {leaf.container}'s processes"
        foreign = {g: (b, o) for (cg, g), (_, b, o) in self._foreign.items() if cg == leaf.cgroup}
        for gpu, (b, owned_by) in foreign.items():
            if b > owed.get(gpu, 0):
                text = messages.foreign_limit("it", gpu, b, owed.get(gpu, 0), owned_by)
                return Holding(leaf.container, TierName.SAMPLING, text)
        failed = self._failures(leaf.cgroup)
        if failed:
            return Holding(leaf.container, TierName.SAMPLING, failed)
        held = self._held_on(leaf.cgroup, owed)
        if set(held) != set(owed):
            return None
        usage = self._sampled.container_usage.get().get(pod.ids.get(leaf.container, ""), {})
        proof = self._proof.read(leaf.cgroup, {gpu: usage.get(gpu, 0) for gpu in held})
        if proof is None:
            return None
        if not proof.binds:
            why = messages.not_charged(proof.gpu, proof.listed_bytes, whose)
            log.warning("%s: %s", _name(leaf), why)
            return Holding(leaf.container, TierName.SAMPLING, why)
        owners = ", ".join(sorted({o for _, o in foreign.values()}))
        said = (proof.gpu, proof.charged_bytes, proof.listed_bytes)
        return Holding(leaf.container, TierName.DRIVER, messages.held_by_driver(held, owners, said))

    def _held_on(self, cgroup: str, owed: Mapping[str, int]) -> dict[str, int]:
        """The limits that hold `cgroup` on each GPU: ours, and someone else's within what
        it is owed there."""
        held = {gpu: b for (cg, gpu), (_, b) in self._applied.items() if cg == cgroup}
        for (cg, gpu), (_, b, _) in self._foreign.items():
            if cg == cgroup and b <= owed.get(gpu, 0):
                held[gpu] = b
        return held

    def _failures(self, cgroup: str) -> str:
        """Why the driver holds `cgroup` to none of ours on some GPU ("" where nothing
        failed): a value it rejected or did not read back, or no dmem files."""
        why = [f"{gpu}: {w}" for (cg, gpu, _), w in self._rejected.items() if cg == cgroup]
        if cgroup in self._refused:
            why.append(self._refused[cgroup][0])
        return "; ".join(why)

    def _tell(self, pod: PodOwed, reason: Reason, message: str) -> None:
        if pod.uid in self._told:
            return
        self._told.add(pod.uid)
        about = pod_reference(pod.namespace, pod.name, pod.uid)
        # A lasting fact: a restarted agent finds it said already, and does not repeat it.
        self._recorder.record(about, str(reason), message, warning=False, once=True)

    def _say_once(self, why: str) -> None:
        if why != self._logged:
            log.warning("%s", messages.sampling_only(why))
            self._logged = why


def _name(target: Target) -> str:
    pod = f"pod {target.namespace}/{target.pod}"
    return f"{pod}, container {target.container}" if target.container else pod


def _whose(target: Target) -> str:
    return f"container {target.container}" if target.container else "the pod"


def _labels(target: Target) -> tuple[str, str, str]:
    return (
        target.namespace,
        target.pod,
        target.container or POD_UNIT,
    )  # a pod's own limit, as the sidecar names it
