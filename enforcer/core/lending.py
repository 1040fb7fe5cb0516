"""The node agent's reclaims: on each GPU of the node, which containers borrow above their
requests, and which must give it back (pure).

The agent alone sees every pod of its node and every GPU process with its container (by
the process's cgroup), so the decision for a GPU is made here, once per NVML pass. Each
unit of a pod is owed what `owed.owed` says (the one answer its sidecar, the backstop and
the hard limits read too): a request (what the scheduler counted), a ceiling (written by
the webhook into its sidecar's environment at admission, which nobody can change since;
the request when there is none), and its pod's priority. A container spread over N GPUs
is a tenant of each GPU its shares fall on (`Owing.placed`, on every pass), owed one share
there. `reclaim.plan` then decides per GPU; the victim's sidecar, which may signal in its
pod, carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from enforcer.core.attribution import attribute
from enforcer.core.declaration import unreadable
from enforcer.core.dra import finished
from enforcer.core.model import ProcessKey, ProcessTotal, Sample, UnitUsage
from enforcer.core.owed import Owing, PodOwed, holdings
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map
from enforcer.core.reclaim import Gpu, Reclaim, reclaims, views
from enforcer.core.units import Unit

# How a container of another namespace is named in a reclaim's reason: a tenant learns
# that a neighbour needed the memory, not who its neighbours are.
ELSEWHERE = "a container of another namespace"


@dataclass(frozen=True, slots=True)
class Tenant:
    """One container that declares VRAM, as the agent knows it from its pod; with DRA, one
    allocation on one GPU, of the containers that use it; a container spread over GPUs, and
    on each pass its share on each GPU it is placed on."""

    unit: str  # namespace/pod/container; DRA: namespace/pod/<dra unit>, `c@GPU-...`
    namespace: str
    request: int
    ceiling: int
    priority: int
    ids: frozenset[str] = frozenset()  # the IDs its containers run as now
    # The GPU its request is on, owed there before any use (DRA's allocation, or the GPU the
    # kubelet gave the container); None: wherever NVML shows it using one.
    gpu: str | None = None
    # Whether what its containers hold on another GPU is not its own (DRA: the sidecar holds
    # it to 0 there). Else (the kubelet's word: a container may still reach another GPU, by
    # NVIDIA_VISIBLE_DEVICES), one seen on another GPU is counted as NVML shows it.
    confined: bool = False
    # Above 1: the GPUs a container's request and ceiling are spread over, each of them one
    # share's; placed on every pass where the container runs (`Owing.placed`).
    gpus: int = 1

    @property
    def owing(self) -> Owing:
        """What it is owed, as `owed.owed` said it."""
        return Owing(Unit.of(self.unit), self.request, self.ceiling, self.gpus)


@dataclass(frozen=True, slots=True)
class Tenants:
    """The node's tenants, indexed once per change of its pods rather than on every pass."""

    all: tuple[Tenant, ...] = ()
    by_unit: Mapping[str, Tenant] = field(default_factory=dict)
    whole: Mapping[str, Tenant] = field(default_factory=dict)  # container ID -> over all GPUs
    spread: Mapping[str, Tenant] = field(default_factory=dict)  # container ID -> over N GPUs
    placed: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (ID, GPU) -> unit
    on_gpus: tuple[Tenant, ...] = ()  # those whose request is on a GPU known in advance
    unconfined: Mapping[str, Tenant] = field(default_factory=dict)  # container ID -> of those
    borrowing: bool = False  # whether any may borrow above its request
    requests: Mapping[str, int] = field(default_factory=dict)  # unit -> its request
    priorities: Mapping[str, int] = field(default_factory=dict)  # unit -> its pod's priority
    # Pod (namespace/name) -> what of its declaration could not be read (`unreadable`).
    unread: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, found: Iterable[Tenant], unread: Mapping[str, str] | None = None) -> Tenants:
        listed = tuple(found)
        on_gpus = tuple(t for t in listed if t.gpu is not None)
        return cls(
            listed,
            {t.unit: t for t in listed},
            {cid: t for t in listed if t.gpu is None and t.gpus == 1 for cid in t.ids},
            {cid: t for t in listed if t.gpu is None and t.gpus > 1 for cid in t.ids},
            {(cid, t.gpu): t.unit for t in on_gpus if t.gpu is not None for cid in t.ids},
            on_gpus,
            {cid: t for t in on_gpus if not t.confined for cid in t.ids},
            any(t.ceiling > t.request for t in listed),
            {t.unit: t.request for t in listed},
            {t.unit: t.priority for t in listed},
            unread or {},
        )

    def owner(self, unit: str) -> Tenant | None:
        """The tenant a unit of a GPU's view is: one of `all`, or the spread container whose
        share on one GPU it is."""
        return self.by_unit.get(unit) or self.by_unit.get(str(Unit.of(unit).on_all_gpus))


def tenants(
    read: Iterable[tuple[Pod, PodOwed]], assigned: Mapping[tuple[str, str, str], str]
) -> Tenants:
    """The node's tenants, from each pod and what it is owed (`owed.pod_owed`; with DRA its
    claims as last read, a claim that pods share cut to each one's part, so that it is owed
    once): each unit of a running container of a pod that declares VRAM (a container not
    started yet has no ID, and no process to charge), and with DRA every allocation of a pod
    that has not finished, its containers started or not: its GPU is known, and it is owed
    there. So is a declaring container the kubelet gave one GPU (`assigned`: (namespace,
    pod, container) -> GPU, `pod_resources.assigned_gpus`), from before it starts. A pod
    whose declaration cannot be read whole is left out, or borrows nothing, and said in
    `unread`."""
    found: list[Tenant] = []
    unread: dict[str, str] = {}
    for pod, p in read:
        priority = json_map(pod.get("spec")).get("priority")
        rank = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        where = f"{p.namespace}/{p.name}"
        if problem := unreadable(p.declared):
            unread[where] = problem
        if p.owed.claimed and finished(pod):
            continue  # a pod that has finished is owed nothing: its claims are being released
        for o in p.owed.units:
            ids = frozenset(p.ids[c] for c in o.unit.containers if c in p.ids)
            unit = str(Unit(o.unit.containers, o.unit.gpu, where))
            if p.owed.claimed:
                found.append(
                    Tenant(unit, p.namespace, o.request, o.ceiling, rank, ids, o.unit.gpu, True)
                )
                continue
            gpu = assigned.get((p.namespace, p.name, o.unit.containers[0]))
            if ids or (gpu is not None and o.gpus == 1):
                found.append(
                    Tenant(
                        unit,
                        p.namespace,
                        o.request,
                        o.ceiling,
                        rank,
                        ids,
                        gpu if o.gpus == 1 else None,
                        gpus=o.gpus,
                    )
                )
    return Tenants.of(found, unread)


@dataclass(frozen=True, slots=True)
class Lending:
    """One pass's decision: each GPU's view, and what each victim container (by ID) is to
    give back, with its reason as its own namespace may read it."""

    gpus: tuple[Gpu, ...] = ()
    reclaims: Mapping[str, Reclaim] = field(default_factory=dict)
    # The victims' processes: where their sidecars are (the PID namespaces to tell).
    victims: Mapping[str, frozenset[ProcessKey]] = field(default_factory=dict)


def decide(
    sample: Sample,
    containers: Mapping[ProcessKey, str],
    found: Tenants,
    watermark: int,
    reserve_bytes: int = 0,
) -> Lending:
    """`containers`: each GPU process's container ID, as its cgroup says. Only containers
    with a ceiling above their request borrow; every declaring container may be owed its
    request, and all else on a GPU (other pods, the driver) may grow into the watermark.
    Nothing is lent of the driver's reserved memory or of `reserve_bytes` (`--reserve`)."""
    if not found.borrowing:
        return Lending()  # nobody may borrow: nothing is ever lent, nothing to decide
    shares = _shares(sample, containers, found)
    units = _usage(sample, containers, found, shares)
    requests, priorities = found.requests, found.priorities
    if shares:
        requests = {**requests, **{t.unit: t.request for t in shares}}
        priorities = {**priorities, **{t.unit: t.priority for t in shares}}
    gpus = views(
        sample.devices, units, requests, priorities=priorities, reserve_bytes=reserve_bytes
    )
    asked: dict[str, Reclaim] = {}
    victims: dict[str, frozenset[ProcessKey]] = {}
    for unit_name, reclaim in reclaims(gpus, watermark).items():
        tenant = found.owner(unit_name)
        if tenant is None:
            continue  # every unit of a view is a tenant's: never reached
        for cid in sorted(tenant.ids):
            asked.setdefault(cid, _as_seen_from(reclaim, tenant.namespace, found))
            victims[cid] = frozenset(k for k, c in containers.items() if c == cid)
    return Lending(gpus, asked, victims)


def _shares(
    sample: Sample, containers: Mapping[ProcessKey, str], found: Tenants
) -> tuple[Tenant, ...]:
    """Each spread container's share on each GPU it is placed on in this sample (the N where
    it holds most: `Owing.placed`), as a tenant of that GPU alone: what it holds on any
    other is no one's request, as its sidecar holds it to 0 there."""
    if not found.spread:
        return ()
    held = holdings(sample, {k: c for k, c in containers.items() if c in found.spread})
    return tuple(
        replace(t, unit=str(share.unit), gpu=share.unit.gpu, confined=True, gpus=1)
        for cid, t in found.spread.items()
        for share in t.owing.placed(held.get(cid, {}))
    )


def _usage(
    sample: Sample,
    containers: Mapping[ProcessKey, str],
    found: Tenants,
    shares: tuple[Tenant, ...],
) -> list[UnitUsage]:
    """Each tenant's usage: a container's over all GPUs, against its ceiling; one whose
    request is on a known GPU (a DRA allocation, a GPU the kubelet gave, a spread
    container's share: `shares`), on that GPU alone (what its containers hold elsewhere is
    no one's request: `views` counts it as unrequested there). A container the kubelet gave
    one GPU that this sample shows on another is counted as NVML shows it, over all GPUs:
    owed its request where it was given it, it would otherwise hold memory elsewhere that
    no reclaim could take back."""
    strayed = {
        t.unit
        for p in (sample.processes if found.unconfined else ())
        if (t := found.unconfined.get(containers.get(p.key, ""))) is not None
        and p.used_bytes
        and p.device_uuid != t.gpu
    }
    whole = {**found.whole, **{c: t for c, t in found.unconfined.items() if t.unit in strayed}}
    placed, on_gpus = found.placed, found.on_gpus
    if shares:
        placed = {**placed, **{(cid, t.gpu or ""): t.unit for t in shares for cid in t.ids}}
        on_gpus = (*on_gpus, *shares)
    unit_of = {key: whole[cid].unit for key, cid in containers.items() if cid in whole}
    units = list(attribute(sample, unit_of, {t.unit: t.ceiling for t in whole.values()}))
    held: dict[str, dict[ProcessKey, int]] = {}
    for p in sample.processes if placed else ():
        unit_name = placed.get((containers.get(p.key, ""), p.device_uuid))
        if unit_name is not None and unit_name not in strayed and p.used_bytes:
            on_gpu = held.setdefault(unit_name, {})
            on_gpu[p.key] = on_gpu.get(p.key, 0) + p.used_bytes
    for t in (t for t in on_gpus if t.unit not in strayed):
        processes = tuple(
            ProcessTotal(key, used, ((t.gpu or "", used),))
            for key, used in held.get(t.unit, {}).items()
        )
        units.append(UnitUsage(t.unit, t.ceiling, processes, device_uuid=t.gpu))
    return units


def _as_seen_from(reclaim: Reclaim, namespace: str, found: Tenants) -> Reclaim:
    """The reclaim with the containers owed memory named only when they are of the
    victim's own namespace."""
    owed = tuple(
        dict.fromkeys(
            str(Unit.of(unit).on_all_gpus)
            if (owner := found.owner(unit)) is not None and owner.namespace == namespace
            else ELSEWHERE
            for unit in reclaim.owed_to
        )
    )
    return replace(reclaim, owed_to=owed)
