"""The node agent's reclaims: on each GPU of the node, which containers borrow above their
requests, and which must give it back (pure).

The agent alone sees every pod of its node and every GPU process with its container (by
the process's cgroup), so the decision for a GPU is made here, once per NVML pass. Each
container that declares VRAM has a request (its declared limit: what the scheduler
counted), a ceiling (written by the webhook into its sidecar's environment at admission,
which nobody can change since; the request when there is none) and its pod's priority.
`reclaim.plan` then decides per GPU; the victim's sidecar, which may signal in its pod,
carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from enforcer.core.attribution import attribute
from enforcer.core.declaration import Declares, dra_ceilings, unreadable
from enforcer.core.dra import Allocations, finished, with_ceilings
from enforcer.core.model import ProcessKey, ProcessTotal, Sample, UnitUsage
from enforcer.core.owed import owed
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id, json_map
from enforcer.core.reclaim import Gpu, Reclaim, reclaims, views
from enforcer.core.units import Unit

# How a container of another namespace is named in a reclaim's reason: a tenant learns
# that a neighbour needed the memory, not who its neighbours are.
ELSEWHERE = "a container of another namespace"


@dataclass(frozen=True, slots=True)
class Tenant:
    """One container that declares VRAM, as the agent knows it from its pod; with DRA, one
    allocation on one GPU, of the containers that use it."""

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


@dataclass(frozen=True, slots=True)
class Tenants:
    """The node's tenants, indexed once per change of its pods rather than on every pass."""

    all: tuple[Tenant, ...] = ()
    by_unit: Mapping[str, Tenant] = field(default_factory=dict)
    whole: Mapping[str, Tenant] = field(default_factory=dict)  # container ID -> over all GPUs
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
            {cid: t for t in listed if t.gpu is None for cid in t.ids},
            {(cid, t.gpu): t.unit for t in on_gpus if t.gpu is not None for cid in t.ids},
            on_gpus,
            {cid: t for t in on_gpus if not t.confined for cid in t.ids},
            any(t.ceiling > t.request for t in listed),
            {t.unit: t.request for t in listed},
            {t.unit: t.priority for t in listed},
            unread or {},
        )


def tenants(
    pods: Iterable[Pod],
    declares: Declares,
    basis: int | None,
    allocated: Mapping[str, Allocations] | None = None,
    assigned: Mapping[tuple[str, str, str], str] | None = None,
    *,
    opted_in: AbstractSet[str],
) -> Tenants:
    """Every running container of the pods that declares VRAM (a container not started yet
    has no ID, and no process to charge), and with DRA (`allocated`, by pod UID: what the
    pod's claims give it, as last read; a claim that pods share cut to each one's part by
    `dra.allocations`, so that it is owed once) every allocation of a pod that has not
    finished, its containers started or not: its GPU is known, and it is owed there. So is a
    declaring container the kubelet gave one GPU (`assigned`: (namespace, pod, container)
    -> GPU, `pod_resources.assigned_gpus`), from before it starts. `basis`: one GPU's
    memory, for portions of one (`declaration.portion_basis`). `opted_in`: the namespaces
    whose pods' sidecar environment is read (`declaration.of_pod`). A pod whose declaration
    cannot be read whole is left out, or borrows nothing, and said in `unread`."""
    found: list[Tenant] = []
    unread: dict[str, str] = {}
    for pod in pods:
        priority = json_map(pod.get("spec")).get("priority")
        rank = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        pod_owed = owed(pod, declares, opted_in=opted_in, basis=basis)
        meta = json_map(pod.get("metadata"))
        if problem := unreadable(pod_owed.declared):
            unread[f"{meta.get('namespace')}/{meta.get('name')}"] = problem
        # As the hard limits read it: a container's limit is its ceiling, its declaration
        # its request (`requests` lists those of a pod where one may borrow).
        vram = pod_owed.vram
        if vram is not None:
            for name, ceiling in vram.limits.items():
                cid = vram.ids.get(name)
                gpu = (assigned or {}).get((vram.namespace, vram.name, name))
                if cid is not None or gpu is not None:
                    request = vram.requests.get(name, ceiling)
                    unit_name = str(Unit((name,), pod=f"{vram.namespace}/{vram.name}"))
                    ids = frozenset({cid} if cid is not None else ())
                    found.append(
                        Tenant(unit_name, vram.namespace, request, ceiling, rank, ids, gpu)
                    )
            continue
        uid = str(meta.get("uid") or "")
        # A pod that has finished is owed nothing: its claims are being released.
        if allocated and uid in allocated and not finished(pod):
            found.extend(_claim_tenants(pod, allocated[uid], dra_ceilings(pod_owed.declared), rank))
    return Tenants.of(found, unread)


def _claim_tenants(
    pod: Pod, found: Allocations, ceilings: Mapping[str, int], rank: int
) -> list[Tenant]:
    """A DRA pod's allocations, each raised to its container's ceiling where it may borrow
    (`dra.with_ceilings`, from the ceilings the webhook wrote into the sidecar's env)."""
    meta = json_map(pod.get("metadata"))
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    raised, requests = with_ceilings(found, ceilings)
    ids = {ref.name: cid for cid, ref in containers_by_id(pod).items()}
    return [
        Tenant(
            str(Unit(u.containers, u.gpu, f"{namespace}/{name}")),
            namespace,
            requests.get(u.name, u.limit_bytes),
            u.limit_bytes,
            rank,
            frozenset(ids[c] for c in u.containers if c in ids),
            u.gpu,
            confined=True,
        )
        for u in raised.units
    ]


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
) -> Lending:
    """`containers`: each GPU process's container ID, as its cgroup says. Only containers
    with a ceiling above their request borrow; every declaring container may be owed its
    request, and all else on a GPU (other pods, the driver) may grow into the watermark."""
    if not found.borrowing:
        return Lending()  # nobody may borrow: nothing is ever lent, nothing to decide
    units = _usage(sample, containers, found)
    gpus = views(sample.devices, units, found.requests, priorities=found.priorities)
    asked: dict[str, Reclaim] = {}
    victims: dict[str, frozenset[ProcessKey]] = {}
    for unit_name, reclaim in reclaims(gpus, watermark).items():
        tenant = found.by_unit[unit_name]
        for cid in sorted(tenant.ids):
            asked.setdefault(cid, _as_seen_from(reclaim, tenant.namespace, found))
            victims[cid] = frozenset(k for k, c in containers.items() if c == cid)
    return Lending(gpus, asked, victims)


def _usage(sample: Sample, containers: Mapping[ProcessKey, str], found: Tenants) -> list[UnitUsage]:
    """Each tenant's usage: a container's over all GPUs, against its ceiling; one whose
    request is on a known GPU (a DRA allocation, a GPU the kubelet gave), on that GPU alone
    (what its containers hold elsewhere is no one's request: `views` counts it as
    unrequested there). A container the kubelet gave one GPU that this sample shows on
    another is counted as NVML shows it, over all GPUs: owed its request where it was
    given it, it would otherwise hold memory elsewhere that no reclaim could take back."""
    strayed = {
        t.unit
        for p in (sample.processes if found.unconfined else ())
        if (t := found.unconfined.get(containers.get(p.key, ""))) is not None
        and p.used_bytes
        and p.device_uuid != t.gpu
    }
    whole = {**found.whole, **{c: t for c, t in found.unconfined.items() if t.unit in strayed}}
    placed = found.placed
    unit_of = {key: whole[cid].unit for key, cid in containers.items() if cid in whole}
    units = list(attribute(sample, unit_of, {t.unit: t.ceiling for t in whole.values()}))
    held: dict[str, dict[ProcessKey, int]] = {}
    for p in sample.processes if placed else ():
        unit_name = placed.get((containers.get(p.key, ""), p.device_uuid))
        if unit_name is not None and unit_name not in strayed and p.used_bytes:
            on_gpu = held.setdefault(unit_name, {})
            on_gpu[p.key] = on_gpu.get(p.key, 0) + p.used_bytes
    for t in (t for t in found.on_gpus if t.unit not in strayed):
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
            if found.by_unit[unit].namespace == namespace
            else ELSEWHERE
            for unit in reclaim.owed_to
        )
    )
    return replace(reclaim, owed_to=owed)
