"""What a pod is owed on its GPUs (pure): its declaration in bytes, each container's request
and ceiling; or, with DRA, what its claims were allocated on each GPU, raised to the
ceilings the webhook wrote. One reading for the hard limits, the lender and the backstop,
so that the three never disagree about a pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from enforcer.core.declaration import Declaration, Declares, Undeclared, dra_ceilings, of_pod
from enforcer.core.dra import (
    Allocations,
    ClaimUsers,
    DraObjects,
    DraSettings,
    allocations,
    with_ceilings,
)
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id
from enforcer.core.units import Unit


@dataclass(frozen=True, slots=True)
class PodVram:
    """What a pod declares, and which container ID each of its containers runs as now."""

    uid: str
    namespace: str
    name: str
    limits: Mapping[str, int]  # container name -> bytes, declaring containers only
    ids: Mapping[str, str]  # container name -> container ID, from the pod's status
    # DRA: container name -> GPU -> bytes, what its claims were allocated (then `limits`
    # holds each container's sum over GPUs); empty for a declaring pod.
    gpu_limits: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    # Container name -> its request, where it may borrow above it up to `limits` (its
    # ceiling): the driver's soft limit, "guaranteed before allocations may fail".
    requests: Mapping[str, int] = field(default_factory=dict)
    # Container name -> the GPUs its limit and request are spread over, an equal share of
    # each held on every GPU (KAI's gpu-fraction-num-devices); absent: 1, the whole on each.
    gpus: Mapping[str, int] = field(default_factory=dict)

    def on_each_gpu(self, name: str) -> tuple[int, int]:
        """(limit, request: the limit where it may not borrow) of a declaring container on
        any one GPU."""
        count, limit = self.gpus.get(name, 1), self.limits[name]
        return limit // count, self.requests.get(name, limit) // count

    @property
    def total(self) -> int:
        """The pod's cap on any one GPU: the sum of its containers' limits there (an upper
        bound on what they may hold together, init containers included)."""
        return sum(self.on_each_gpu(name)[0] for name in self.limits)

    @property
    def requested(self) -> int:
        """The pod's soft limit on any one GPU: its containers' requests there, where any
        may borrow; else 0."""
        if not self.requests:
            return 0
        return sum(self.on_each_gpu(name)[1] for name in self.limits)

    @property
    def gpu_totals(self) -> dict[str, int]:
        """DRA: the pod's cap on each GPU, the sum of what its claims were allocated there
        (a claim that containers share counts once)."""
        return dict(self._gpu_totals)

    _gpu_totals: Mapping[str, int] = field(default_factory=dict)


def pod_vram_from_claims(
    pod: Pod, found: Allocations, ceilings: Mapping[str, int] | None = None
) -> PodVram | None:
    """DRA: the pod's GPU allocations as hard limits, or None when it has none. Containers
    whose GPUs are not proven get none (the sidecar says why). A container that may borrow
    above its claim (`ceilings`, by container; `dra.with_ceilings`) gets its ceiling as the
    hard limit on its claim's GPU, and its allocation as the soft one."""
    meta = pod.get("metadata") or {}
    uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
    if not (isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str)):
        return None
    if not found.units:
        return None
    found, allocated = with_ceilings(found, ceilings or {})
    requests = {Unit.of(u).containers[0]: size for u, size in allocated.items()}
    per_container: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for unit in found.units:
        totals[unit.gpu] = totals.get(unit.gpu, 0) + unit.limit_bytes
        for container in unit.containers:
            per_container.setdefault(container, {})[unit.gpu] = unit.limit_bytes
    ids = {ref.name: cid for cid, ref in containers_by_id(pod).items()}
    sums = {c: sum(g.values()) for c, g in per_container.items()}
    return PodVram(uid, namespace, name, sums, ids, per_container, requests, _gpu_totals=totals)


def pod_vram(
    pod: Pod, declared: Declaration | Undeclared, basis: int | None = None
) -> PodVram | None:
    """The pod's declared VRAM, as `declaration.of_pod` read it, or None when it declares
    none in bytes (nothing, nothing readable, or only claims: `pod_vram_from_claims`). A
    container's limit is its ceiling where it may borrow, and its declaration its request;
    a portion of a GPU counts against `basis`, one GPU's memory, and not at all without
    one."""
    meta = pod.get("metadata") or {}
    uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
    if not (isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str)):
        return None
    if isinstance(declared, Undeclared):
        return None
    limits, borrow = declared.in_bytes(basis)
    if not limits:
        return None
    ids = {ref.name: cid for cid, ref in containers_by_id(pod).items()}
    gpus = dict(declared.gpus)
    if not borrow:
        return PodVram(uid, namespace, name, limits, ids, gpus=gpus)
    return PodVram(uid, namespace, name, {**limits, **borrow}, ids, requests=limits, gpus=gpus)


@dataclass(frozen=True, slots=True)
class Owed:
    """A pod as the agent's loops read it: what it declares (or why nothing can be read),
    and what that makes it owed."""

    declared: Declaration | Undeclared
    # In bytes per container: its declaration, or (DRA) its claims' allocations; None when
    # it is owed nothing that can be counted (yet: claims not read, a portion of an unknown GPU).
    vram: PodVram | None
    # DRA, where the pod declares no bytes: its claims' units, containers that share an
    # allocation held together (None: no claims read).
    allocations: Allocations | None = None


def owed(
    pod: Pod,
    declares: Declares,
    *,
    opted_in: AbstractSet[str],
    basis: int | None,
    claims: tuple[DraObjects, DraSettings] | None = None,
    users: ClaimUsers | None = None,
) -> Owed:
    """What `pod` is owed: its declaration (`declaration.of_pod`, its sidecar's environment
    read only in a namespace of `opted_in`), in bytes against `basis` (one GPU's memory, for
    portions); or, where it declares no bytes and its claims were read (`claims`: the pod's
    claims and the node's slices, with the DRA settings), what they were allocated, a claim
    that pods share (`users`, `dra.claim_users`) cut to this pod's part."""
    declared = of_pod(pod, declares, opted_in=opted_in)
    vram = pod_vram(pod, declared, basis)
    if vram is not None or claims is None:
        return Owed(declared, vram)
    objects, settings = claims
    found = allocations(pod, objects.claims, objects.slices, settings, users)
    return Owed(declared, pod_vram_from_claims(pod, found, dra_ceilings(declared)), found)
