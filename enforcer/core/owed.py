"""What a pod's containers are owed on its GPUs (pure): one answer for the sidecar, the
agent's backstop, its lender and its hard limiter, so that no two of them can disagree
about a pod.

`owed()` takes what a pod declares and, with DRA, what its claims were allocated, and says
what each of its units is owed (`Owing`): its request (what it always gets) and its ceiling
(how far it may borrow above, while its GPU has room). A unit is a container over any of
its GPUs; a container's share on each of N GPUs (KAI's `gpu-fraction-num-devices`); or, with
DRA, the containers of an allocation on one GPU. Where a share falls is decided by where the
container runs (`Owing.placed`): on the N GPUs where it holds most, never N shares on one.
Every input is required: a portion of a GPU counts only against a known GPU size (`basis`),
and a claim that pods share comes already cut to this pod's part (`dra.allocations` takes
who uses it). What a consumer holds a unit to (its ceiling while the agent lends, else its
request) is the consumer's to say; what it is owed is said here alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from enforcer.core.declaration import Declaration, Declares, Undeclared, dra_ceilings, of_pod
from enforcer.core.dra import (
    Allocations,
    ClaimUsers,
    DraObjects,
    DraSettings,
    allocations,
    claim_users,
    with_ceilings,
)
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id, json_map
from enforcer.core.settings.sidecar import pod_policy
from enforcer.core.units import Unit


@dataclass(frozen=True, slots=True)
class Owing:
    """What one unit is owed, in bytes: its request, and its ceiling (the request where it
    may not borrow). With `gpus` above 1, a container's share on each of that many GPUs."""

    unit: Unit  # its containers; its GPU where that is known (DRA), else wherever it runs
    request: int
    ceiling: int
    gpus: int = 1

    @property
    def borrows(self) -> bool:
        """Whether it may hold more than its request (up to its ceiling)."""
        return self.ceiling > self.request

    def placed(self, held: Mapping[str, int]) -> tuple[Owing, ...]:
        """Where it is owed, given what its container holds on each GPU now (`held`, as
        `holdings` counts it): a unit that is owed on one GPU, or over any, as it is; a share
        spread over N GPUs on each of the N GPUs where its container holds most (the first
        by UUID among equals), each its own unit (`trainer@GPU-…`). On any other GPU it is
        owed nothing; holding on none, it is owed nowhere yet."""
        if self.gpus == 1:
            return (self,)
        ranked = sorted(held.items(), key=lambda g: (-g[1], g[0]))[: self.gpus]
        on = self.unit.containers, self.unit.pod
        return tuple(
            Owing(Unit(on[0], gpu, on[1]), self.request, self.ceiling) for gpu, _ in ranked
        )


@dataclass(frozen=True, slots=True)
class Owed:
    """What a pod's units are owed (`owed`), and which of its containers are owed nothing
    anywhere it has no unit."""

    units: tuple[Owing, ...] = ()
    # Containers whose portion of a GPU is not counted yet (no GPU's memory is known): they
    # are not checked at all, never held to 0.
    uncounted: frozenset[str] = frozenset()
    # DRA: the units are what the pod's claims give on each GPU; a container is owed
    # nothing on a GPU no unit gives it, and nothing can be said of `unresolved` ones (their
    # GPUs are not proven: they are enforced on none). `claiming`: every container that holds
    # a GPU allocation, resolved or not; `problems`: why any is not, or is held below a
    # claim it shares.
    claimed: bool = False
    unresolved: frozenset[str] = frozenset()
    claiming: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()

    @property
    def borrowing(self) -> bool:
        """Whether any of its units may borrow above its request."""
        return any(o.borrows for o in self.units)

    def total(self, lending: bool) -> int:
        """What its units may hold together: their ceilings while the agent lends, else
        their requests (a spread share counted on each of its GPUs)."""
        return sum((o.ceiling if lending else o.request) * o.gpus for o in self.units)


def owed(
    declared: Declaration | Undeclared, claimed: Allocations | None, basis: int | None
) -> Owed:
    """What each unit of a pod is owed. `declared`: what it declares (`declaration.of_pod`,
    or the sidecar's own environment, `declaration.of_sidecar`); in bytes its requests and
    the ceilings above them, a portion of a GPU counted against `basis` (one GPU's memory,
    `declaration.portion_basis`; None: not known, and the portion is not counted, never
    taken as 0), a request spread over N GPUs one share on each. Where it declares no bytes:
    `claimed`, what its claims give it on each GPU (`dra.allocations`, None where they are
    not read), each allocation raised to the ceiling the webhook wrote above it where it is
    one container's only one (`dra.with_ceilings`)."""
    if isinstance(declared, Declaration) and not declared.claims:
        requests, ceilings = declared.in_bytes(basis)
        portions = declared.portions
        uncounted = frozenset(portions).difference(requests) if portions else frozenset()
        if requests or claimed is None:
            units = tuple(
                _declared(name, request, ceilings.get(name, request), declared.gpus.get(name, 1))
                for name, request in requests.items()
            )
            return Owed(units, uncounted)
    if claimed is None:
        return Owed()
    raised, requests = with_ceilings(claimed, dra_ceilings(declared))
    units = tuple(
        Owing(Unit(u.containers, u.gpu), requests.get(u.name, u.limit_bytes), u.limit_bytes)
        for u in raised.units
    )
    return Owed(
        units,
        claimed=True,
        unresolved=claimed.unresolved,
        claiming=claimed.claiming,
        problems=claimed.problems,
    )


def _declared(name: str, request: int, ceiling: int, gpus: int) -> Owing:
    """A declaring container's unit: over any GPUs, or one share on each of `gpus`."""
    return Owing(Unit((name,)), request // gpus, ceiling // gpus, gpus)


def holdings(sample: Sample, container_of: Mapping[ProcessKey, str]) -> dict[str, dict[str, int]]:
    """Container -> GPU -> the bytes its processes hold there, as `Owing.placed` weighs
    them: a GPU where it has a process counts, its unknown usage as 0."""
    found: dict[str, dict[str, int]] = {}
    for usage in sample.processes:
        container = container_of.get(usage.key)
        if container is not None:
            on = found.setdefault(container, {})
            on[usage.device_uuid] = on.get(usage.device_uuid, 0) + (usage.used_bytes or 0)
    return found


# --- the agent's reading of its node's pods ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Claims:
    """DRA: a pod's claims and its node's slices as read, which allocations are GPUs, and
    who uses each claim (`dra.claim_users`): so that a claim pods share is always cut to
    this pod's part, whichever of the agent's loops reads it."""

    objects: DraObjects
    settings: DraSettings
    users: ClaimUsers


def node_claims(
    pods: Iterable[Pod], reads: Mapping[str, DraObjects], settings: DraSettings
) -> dict[str, Claims]:
    """Pod UID -> its claims as read (`reads`, each pod's last read), with every pod of the
    node that uses each claim (the reads joined with the node's pods)."""
    users = claim_users(pods, reads.values())
    return {uid: Claims(objects, settings, users) for uid, objects in reads.items()}


@dataclass(frozen=True, slots=True)
class PodOwed:
    """A pod as the agent's loops read it: who it is, what it declares (or why nothing can
    be read), and what that makes each of its units owed."""

    uid: str
    namespace: str
    name: str
    ids: Mapping[str, str]  # container name -> the container ID it runs as now
    declared: Declaration | Undeclared
    owed: Owed = field(default_factory=Owed)


def pod_owed(
    pod: Pod,
    declares: Declares,
    *,
    opted_in: AbstractSet[str],
    basis: int | None,
    claims: Claims | None,
) -> PodOwed:
    """What the agent owes `pod`: its declaration (`declaration.of_pod`, its sidecar's
    environment read only in a namespace of `opted_in`), and with its claims (`claims`: as
    read, with their users; None where the pod claims nothing, or nothing is read) what
    they give it, through `owed`. A pod whose policy only reports (`pod_policy`, read as
    the declaration is) is owed its requests alone: it borrows nothing, since what it
    borrowed could not be taken back while its neighbours go without their requests."""
    declared = of_pod(pod, declares, opted_in=opted_in)
    if (
        isinstance(declared, Declaration)
        and pod_policy(pod, declares.sidecar, opted_in).reports_only
    ):
        declared = declared.held_to_requests()
    claimed = None
    if claims is not None:
        objects = claims.objects
        claimed = allocations(pod, objects.claims, objects.slices, claims.settings, claims.users)
    meta = json_map(pod.get("metadata"))
    ids = {ref.name: cid for cid, ref in containers_by_id(pod).items()}
    return PodOwed(
        str(meta.get("uid") or ""),
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        ids,
        declared,
        owed(declared, claimed, basis),
    )
