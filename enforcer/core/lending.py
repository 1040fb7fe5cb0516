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
from dataclasses import dataclass, field, replace

from enforcer.core.attribution import attribute
from enforcer.core.hard_limits import pod_vram
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map
from enforcer.core.reclaim import Gpu, Reclaim, reclaims, views

# How a container of another namespace is named in a reclaim's reason: a tenant learns
# that a neighbour needed the memory, not who its neighbours are.
ELSEWHERE = "a container of another namespace"


@dataclass(frozen=True, slots=True)
class Tenant:
    """One container that declares VRAM, as the agent knows it from its pod."""

    unit: str  # namespace/pod/container
    namespace: str
    request: int
    ceiling: int
    priority: int


def tenants(
    pods: Iterable[Pod], resource: str, unit: int, sidecar: str, basis: int | None
) -> dict[str, Tenant]:
    """Container ID -> tenant, for every running container of the pods that declares VRAM
    (a container not started yet has no ID, and no process to charge). `basis`: one GPU's
    memory, for portions of one (`declaration.portion_basis`)."""
    found: dict[str, Tenant] = {}
    for pod in pods:
        # As the hard limits read it: a container's limit is its ceiling, its declaration
        # its request (`requests` lists those of a pod where one may borrow).
        vram = pod_vram(pod, resource, unit, sidecar, basis)
        if vram is None:
            continue
        priority = json_map(pod.get("spec")).get("priority")
        rank = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        for name, ceiling in vram.limits.items():
            cid = vram.ids.get(name)
            if cid is not None:
                request = vram.requests.get(name, ceiling)
                unit_name = f"{vram.namespace}/{vram.name}/{name}"
                found[cid] = Tenant(unit_name, vram.namespace, request, ceiling, rank)
    return found


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
    found: Mapping[str, Tenant],
    watermark: int,
) -> Lending:
    """`containers`: each GPU process's container ID, as its cgroup says. Only containers
    with a ceiling above their request borrow; every declaring container may be owed its
    request, and all else on a GPU (other pods, the driver) may grow into the watermark."""
    if not any(t.ceiling > t.request for t in found.values()):
        return Lending()  # nobody may borrow: nothing is ever lent, nothing to decide
    unit_of = {key: found[cid].unit for key, cid in containers.items() if cid in found}
    by_unit = {t.unit: (cid, t) for cid, t in found.items()}
    units = attribute(sample, unit_of, {t.unit: t.ceiling for t in found.values()})
    requests = {t.unit: t.request for t in found.values()}
    priorities = {t.unit: t.priority for t in found.values()}
    gpus = views(sample.devices, units, requests, priorities=priorities)
    asked: dict[str, Reclaim] = {}
    victims: dict[str, frozenset[ProcessKey]] = {}
    for unit_name, reclaim in reclaims(gpus, watermark).items():
        cid, tenant = by_unit[unit_name]
        asked[cid] = _as_seen_from(reclaim, tenant.namespace, found)
        victims[cid] = frozenset(k for k, c in containers.items() if c == cid)
    return Lending(gpus, asked, victims)


def _as_seen_from(reclaim: Reclaim, namespace: str, found: Mapping[str, Tenant]) -> Reclaim:
    """The reclaim with the containers owed memory named only when they are of the
    victim's own namespace."""
    namespaces = {t.unit: t.namespace for t in found.values()}
    owed = tuple(dict.fromkeys(
        unit if namespaces.get(unit) == namespace else ELSEWHERE for unit in reclaim.owed_to
    ))  # fmt: skip
    return replace(reclaim, owed_to=owed)
