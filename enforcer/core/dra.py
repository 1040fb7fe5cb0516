"""What DRA allocated to each container, per GPU: a pod, its ResourceClaims and the
node's ResourceSlices in (the API server's JSON), limits per GPU out (pure).

With consumable capacity (KEP-5075) the scheduler records, per allocated device,
`consumedCapacity.memory`: that is the limit on that GPU, for the containers that use the
claim. The device is named by (driver, pool, device); the ResourceSlice that published
it gives its UUID attribute, which is how NVML names the GPU. Whichever driver made the
allocation: its name and the attribute are settings (NVIDIA's are the defaults).

Anything that cannot be proven (a claim not read or not allocated yet, a device no slice
of this node lists, a consumedCapacity missing or malformed) is a problem, worded for
`kubectl describe`, and leaves its containers unresolved: they are enforced on no GPU,
since a GPU that is theirs but unknown would otherwise count as one they were not given.

Pods may share a claim (`status.reservedFor` lists them), but the scheduler placed its
allocation once: each pod is held to its part of it (`_divided`), so that what the pods
use together never exceeds what was placed, whoever enforces each pod.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from enforcer.core.model import format_bytes
from enforcer.core.parsing import ConfigError, parse_quantity
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map, json_maps
from enforcer.core.units import Unit, of_sole_container

T = TypeVar("T")

NVIDIA_DRIVER = "gpu.nvidia.com"

# (namespace, ResourceClaim name) -> the UIDs of the pods known to use it (`claim_users`).
ClaimUsers = Mapping[tuple[str, str], frozenset[str]]


@dataclass(frozen=True, slots=True)
class DraObjects:
    """What `allocations` needs besides the pod: read from the API by the agent, and sent
    to each sidecar with its pod."""

    claims: dict[str, dict[str, Any]] = field(default_factory=dict)  # by ResourceClaim name
    slices: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class DraSettings:
    """Which allocations are GPUs, and how a device names its GPU and its memory."""

    drivers: frozenset[str] = frozenset({NVIDIA_DRIVER})
    uuid_attribute: str = "uuid"
    capacity: str = "memory"


@dataclass(frozen=True, slots=True)
class ClaimShare:
    """GPU memory that a claim's allocation gives to some containers of the pod."""

    gpu: str  # the GPU's UUID, as NVML names it
    limit_bytes: int
    containers: frozenset[str]
    claim: str  # the ResourceClaim's name
    result: int  # its index in the claim's status.allocation.devices.results
    device: str  # driver/pool/device, as the allocation names it


@dataclass(frozen=True, slots=True)
class GpuUnit:
    """Containers held together to one limit on one GPU: those that share an allocation."""

    gpu: str
    containers: tuple[str, ...]  # sorted
    limit_bytes: int
    shares: tuple[ClaimShare, ...]

    @property
    def name(self) -> str:
        return str(Unit(self.containers, self.gpu))


@dataclass(frozen=True, slots=True)
class Allocations:
    """What the pod's claims give its containers on each GPU.

    `unresolved` containers are enforced on no GPU (see `problems`, which also says why a
    pod is held below a claim that it shares); the containers that use no GPU claim at all
    are in none of the units.
    """

    units: tuple[GpuUnit, ...] = ()
    problems: tuple[str, ...] = ()
    unresolved: frozenset[str] = field(default_factory=frozenset)

    def unit_for(self, container: str, gpu: str) -> GpuUnit | None:
        for unit in self.units:
            if unit.gpu == gpu and container in unit.containers:
                return unit
        return None

    @property
    def claiming(self) -> frozenset[str]:
        """Containers that hold a GPU allocation, resolved or not."""
        return frozenset(c for u in self.units for c in u.containers) | self.unresolved


def with_ceilings(
    found: Allocations, ceilings: Mapping[str, int]
) -> tuple[Allocations, dict[str, int]]:
    """The allocations with each unit that may borrow raised to its ceiling, and those
    units' requests (unit name -> what they were allocated). A unit borrows where it is one
    container's, that container's only GPU allocation (the webhook's DRA mode gives each
    declaring container one claim, on one GPU), and its ceiling (`ceilings`, by container)
    lies above what it was allocated. A container with allocations on several GPUs, or one
    that containers share, borrows nowhere: which GPU its ceiling is for would be a guess."""
    gpus_of = Counter(c for u in found.units for c in u.containers)
    units: list[GpuUnit] = []
    requests: dict[str, int] = {}
    for unit in found.units:
        ceiling = of_sole_container(unit.name, ceilings)
        if ceiling is not None and ceiling > unit.limit_bytes and gpus_of[unit.containers[0]] == 1:
            requests[unit.name] = unit.limit_bytes
            units.append(replace(unit, limit_bytes=ceiling))
        else:
            units.append(unit)
    return replace(found, units=tuple(units)), requests


def claim_names(pod: Pod) -> dict[str, str | None]:
    """The pod's claims (spec.resourceClaims[].name) -> the ResourceClaim's name; None while
    a claim from a template has not been made yet (status.resourceClaimStatuses)."""
    made = {
        s.get("name"): s.get("resourceClaimName")
        for s in json_maps(json_map(pod.get("status")).get("resourceClaimStatuses"))
    }
    names: dict[str, str | None] = {}
    for entry in json_maps(json_map(pod.get("spec")).get("resourceClaims")):
        name = entry.get("name")
        if not isinstance(name, str):
            continue
        direct = entry.get("resourceClaimName")
        made_name = made.get(name)
        chosen = direct if isinstance(direct, str) else made_name
        names[name] = chosen if isinstance(chosen, str) and chosen else None
    return names


def container_claims(pod: Pod) -> dict[str, list[tuple[str, str | None]]]:
    """Container -> the (pod claim, request or None for all of it) that it uses."""
    spec = json_map(pod.get("spec"))
    used: dict[str, list[tuple[str, str | None]]] = {}
    for section in ("initContainers", "containers"):
        for container in json_maps(spec.get(section)):
            name = container.get("name")
            if not isinstance(name, str):
                continue
            for ref in json_maps(json_map(container.get("resources")).get("claims")):
                claim, request = ref.get("name"), ref.get("request")
                if isinstance(claim, str):
                    used.setdefault(name, []).append(
                        (claim, request if isinstance(request, str) and request else None)
                    )
    return used


def device_uuids(
    slices: Iterable[Mapping[str, Any]], settings: DraSettings
) -> dict[tuple[str, str, str], str]:
    """(driver, pool, device) -> GPU UUID, from the newest generation of each pool."""
    pools: list[tuple[str, str, int, list[Mapping[str, Any]]]] = []
    for s in slices:
        spec = json_map(s.get("spec"))
        driver, pool = spec.get("driver"), json_map(spec.get("pool"))
        name, generation = pool.get("name"), pool.get("generation")
        if driver in settings.drivers and isinstance(name, str) and isinstance(generation, int):
            pools.append((driver, name, generation, json_maps(spec.get("devices"))))
    newest: dict[tuple[str, str], int] = {}
    for driver, name, generation, _ in pools:
        newest[(driver, name)] = max(newest.get((driver, name), generation), generation)
    found: dict[tuple[str, str, str], str] = {}
    for driver, name, generation, devices in pools:
        if generation != newest[(driver, name)]:
            continue  # the driver is replacing this slice
        for device in devices:
            uuid = _attribute(json_map(device.get("attributes")), driver, settings.uuid_attribute)
            if isinstance(uuid, str) and uuid and isinstance(device.get("name"), str):
                found[(driver, name, device["name"])] = uuid
    return found


def shareable_gpus(slices: Iterable[Mapping[str, Any]], settings: DraSettings) -> list[str]:
    """The GPUs (driver/pool/device) that DRA can place by memory and that the sidecar can
    name: published by a configured driver, shared (`allowMultipleAllocations`), with the
    memory capacity and the UUID attribute."""
    named = device_uuids(slices, settings)
    found = []
    for s in slices:
        spec = json_map(s.get("spec"))
        driver, pool = str(spec.get("driver")), str(json_map(spec.get("pool")).get("name"))
        for device in json_maps(spec.get("devices")):
            key = (driver, pool, str(device.get("name")))
            capacity = json_map(device.get("capacity"))
            shared = device.get("allowMultipleAllocations") is True
            if key in named and shared and settings.capacity in capacity:
                found.append("/".join(key))
    return sorted(set(found))


def _attribute(attributes: Mapping[str, Any], driver: str, name: str) -> object:
    """An attribute's value; a name without a domain is in the driver's own."""
    value = json_map(attributes.get(name) or attributes.get(f"{driver}/{name}"))
    return value.get("string")


def allocations(
    pod: Pod,
    claims: Mapping[str, Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]],
    settings: DraSettings,
    users: ClaimUsers,
) -> Allocations:
    """The pod's GPU allocations, from its claims as read (`claims`, by ResourceClaim name)
    and the ResourceSlices of its node, each cut to the pod's part of its claim: `users`
    (`claim_users`: the node's view in the agent, the pod's own read in its sidecar) adds the
    pods that the claim's own read may miss."""
    uuids = device_uuids(slices, settings)
    names = claim_names(pod)
    shares: list[ClaimShare] = []
    problems: list[str] = []
    unresolved: set[str] = set()
    for container, refs in container_claims(pod).items():
        for pod_claim, request in refs:
            found, problem = _shares_of(
                container, pod_claim, request, names, claims, uuids, settings
            )
            if problem is not None:
                problems.append(problem)
                unresolved.add(container)
            shares.extend(found)
    resolved = [s for s in shares if not (s.containers & unresolved)]
    parts, notes = _divided(pod, resolved, claims, users)
    said = tuple(dict.fromkeys([*problems, *notes]))
    return Allocations(_group(parts), said, frozenset(unresolved))


def finished(pod: Pod) -> bool:
    """Whether the pod has finished: it uses its claims no more (they are being released)."""
    return json_map(pod.get("status")).get("phase") in ("Succeeded", "Failed")


def reserved_pods(claim: Mapping[str, Any]) -> frozenset[str] | None:
    """The UIDs of the pods that the claim is reserved for (status.reservedFor); None when
    it is reserved for anything else (a workload), which does not name the pods that use
    it."""
    found: set[str] = set()
    for ref in json_maps(json_map(claim.get("status")).get("reservedFor")):
        if ref.get("resource") != "pods" or ref.get("apiGroup") not in (None, ""):
            return None
        found.add(str(ref.get("uid") or ""))
    return frozenset(found)


def claim_users(
    pods: Iterable[Pod], reads: Iterable[DraObjects]
) -> dict[tuple[str, str], frozenset[str]]:
    """(namespace, ResourceClaim name) -> the pods known to use it: those that any read of
    it (`reads`, each pod's last) lists in status.reservedFor, and those of `pods` (the
    node's) that name it and have not finished. Reads of different ages are joined: a pod
    that one of them misses still counts, so its part is never handed out twice."""
    found: dict[tuple[str, str], set[str]] = {}
    for claim in (c for read in reads for c in read.claims.values()):
        meta = json_map(claim.get("metadata"))
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        found.setdefault(key, set()).update(reserved_pods(claim) or ())
    for pod in pods:
        if finished(pod):
            continue
        meta = json_map(pod.get("metadata"))
        namespace, uid = str(meta.get("namespace") or ""), str(meta.get("uid") or "")
        for name in claim_names(pod).values():
            if name is not None:
                found.setdefault((namespace, name), set()).add(uid)
    return {key: frozenset(uids) for key, uids in found.items()}


def _divided(
    pod: Pod, shares: list[ClaimShare], claims: Mapping[str, Mapping[str, Any]], users: ClaimUsers
) -> tuple[list[ClaimShare], list[str]]:
    """Each share cut to the pod's part of its claim, and why, for the pod's owner. The
    scheduler placed a claim's allocation once, however many pods use it: n pods get 1/n
    each (rounded down: the parts never add up to more), enforceable by each pod's own
    sidecar and cgroup. A claim reserved for something that names no pods gives 0: how
    many pods share it is unknown."""
    meta = json_map(pod.get("metadata"))
    namespace, uid = str(meta.get("namespace") or ""), str(meta.get("uid") or "")
    parts: list[ClaimShare] = []
    notes: list[str] = []
    for s in shares:
        reserved = reserved_pods(claims.get(s.claim) or {})  # read: _shares_of found it
        if reserved is None:
            notes.append(
                f"ResourceClaim {s.claim!r} is reserved for something other than pods "
                "(status.reservedFor), which does not say how many pods share its allocation: "
                f"this pod is held to 0 of it on GPU {s.gpu}"
            )
            parts.append(replace(s, limit_bytes=0))
            continue
        n = len(reserved | users.get((namespace, s.claim), frozenset()) | {uid})
        part = s.limit_bytes // n
        if n > 1:
            notes.append(
                f"ResourceClaim {s.claim!r} is used by {n} pods (status.reservedFor, and this "
                "node's pods): the scheduler placed its allocation once, so each pod is held "
                f"to 1/{n} of it, {format_bytes(part)} of {format_bytes(s.limit_bytes)} on "
                f"GPU {s.gpu}"
            )
        parts.append(replace(s, limit_bytes=part))
    return parts, notes


def _shares_of(
    container: str,
    pod_claim: str,
    request: str | None,
    names: Mapping[str, str | None],
    claims: Mapping[str, Mapping[str, Any]],
    uuids: Mapping[tuple[str, str, str], str],
    settings: DraSettings,
) -> tuple[list[ClaimShare], str | None]:
    """The GPU shares one container reference gives, or the problem that stops it."""
    name = names.get(pod_claim)
    if name is None:
        return [], (
            f"container {container!r} uses claim {pod_claim!r}, whose ResourceClaim has not "
            "been made yet (status.resourceClaimStatuses): not enforced on any GPU until it is"
        )
    claim = claims.get(name)
    if claim is None:
        return [], (
            f"ResourceClaim {name!r} (claim {pod_claim!r} of container {container!r}) could not "
            "be read: not enforced on any GPU until it is (the sidecar needs get on "
            "resourceclaims)"
        )
    results = json_maps(
        json_map(json_map(json_map(claim.get("status")).get("allocation")).get("devices")).get(
            "results"
        )
    )
    if not results:
        return [], (
            f"ResourceClaim {name!r} of container {container!r} has no allocation "
            "(status.allocation.devices.results): not enforced on any GPU until it has one"
        )
    shares: list[ClaimShare] = []
    for index, result in enumerate(results):
        made_for = str(result.get("request", ""))  # "<request>/<subrequest>" for firstAvailable
        if request is not None and made_for != request and not made_for.startswith(f"{request}/"):
            continue  # another request of the claim, not used by this container
        driver = result.get("driver")
        if driver not in settings.drivers:
            continue  # not a GPU (a NIC, ...): nothing of ours
        where = f"{driver}/{result.get('pool')}/{result.get('device')}"
        field = f"ResourceClaim {name!r}: status.allocation.devices.results[{index}]"
        uuid = uuids.get((str(driver), str(result.get("pool")), str(result.get("device"))))
        if uuid is None:
            return [], (
                f"{field} names device {where}, which no ResourceSlice of this node lists with "
                f"a {settings.uuid_attribute!r} attribute, so it cannot be matched to an NVML "
                f"GPU: container {container!r} is not enforced on any GPU (check the DRA "
                "driver's ResourceSlices, and --dra-uuid-attribute)"
            )
        consumed = json_map(result.get("consumedCapacity")).get(settings.capacity)
        try:
            limit = _bytes(consumed, f"{field}.consumedCapacity.{settings.capacity}")
        except ConfigError as exc:
            return [], f"{exc}: container {container!r} is not enforced on any GPU"
        shares.append(ClaimShare(uuid, limit, frozenset({container}), name, index, where))
    return shares, None


def _bytes(value: object, field: str) -> int:
    if value is None:
        raise ConfigError(
            field,
            None,
            (
                "is missing: the device was not allocated by consumable capacity (is it published "
                "with allowMultipleAllocations and a memory capacity, and is the "
                "DRAConsumableCapacity feature on?)"
            ),
        )
    if not isinstance(value, str):
        raise ConfigError(field, value, "is not a quantity (a string such as 16Gi)")
    amount = parse_quantity(value, field)
    if amount < 0 or amount != amount.to_integral_value():
        raise ConfigError(field, value, "is not a whole number of bytes")
    return int(amount)


def _group(shares: list[ClaimShare]) -> tuple[GpuUnit, ...]:
    """One unit per GPU and set of containers that share an allocation there: the same
    claim result (a claim used by two containers) counts once, against all of them."""
    by_key: dict[tuple[str, int], ClaimShare] = {}
    for s in shares:
        seen = by_key.get((s.claim, s.result))
        by_key[(s.claim, s.result)] = (
            s if seen is None else replace(s, containers=seen.containers | s.containers)
        )
    units: list[tuple[str, set[str], list[ClaimShare]]] = []
    for s in by_key.values():
        joined = [u for u in units if u[0] == s.gpu and u[1] & s.containers]
        merged_containers, merged = set(s.containers), [s]
        for u in joined:
            units.remove(u)
            merged_containers |= u[1]
            merged.extend(u[2])
        units.append((s.gpu, merged_containers, merged))
    return tuple(
        sorted(
            (
                GpuUnit(gpu, tuple(sorted(cs)), sum(s.limit_bytes for s in ss), tuple(ss))
                for gpu, cs, ss in units
            ),
            key=lambda u: (u.gpu, u.containers),
        )
    )
