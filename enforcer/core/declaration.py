"""What a pod declares: each container's VRAM request, and the ceiling it may borrow up to
(pure). One reading for the webhook, the agent's hard limits and reclaims, and the sidecar.

A container declares in `resources.limits[<resource>]` (what the scheduler counts), or, in
a KAI Scheduler cluster, by KAI's annotations (`enforcer.core.kai`). Annotations can be
patched once the pod exists, so the webhook reads them at admission only and writes what
they declare into the sidecar's environment, which nobody can change since; the agent reads
them there, on pods of the namespaces that opted in alone (elsewhere the webhook wrote
nothing, and a container named like the sidecar is anybody's). A KAI `gpu-fraction` is a
portion of a GPU's memory: it becomes bytes only where the node's GPUs are known
(`portion_basis`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation

from enforcer.core import shapes
from enforcer.core.model import Device, MiB
from enforcer.core.parsing import ConfigError, json_object, parse_limits, parse_quantity, shown
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map, json_maps

# What the webhook writes into every pod it injects, and the agent reads: the sidecar's
# container name, and the label that marks the pod as enforced.
SIDECAR = "vram-enforcer"
ENFORCED = "vram-enforcer.io/enforced"

# The sidecar's variables that carry the declaration, as the webhook wrote it at admission.
LIMITS_ENV = "VRAM_ENFORCER_LIMITS"  # container -> request (its limit, when no ceiling), bytes
CEILINGS_ENV = "VRAM_ENFORCER_CEILINGS"  # container -> ceiling above its request, bytes
PORTIONS_ENV = "VRAM_ENFORCER_PORTIONS"  # container -> portions of a GPU's memory (KAI)
LIMITS_FROM_ENV = "VRAM_ENFORCER_LIMITS_FROM"  # "dra": the limits are the pod's claims
GPUS_ENV = "VRAM_ENFORCER_GPUS"  # container -> GPUs its request is spread over, one share each

# The sidecar's variables that declare: on a pod of a namespace that has not opted in, the
# webhook never wrote them, and none is read (`of_pod`).
_DECLARING = (LIMITS_ENV, CEILINGS_ENV, PORTIONS_ENV, LIMITS_FROM_ENV)

# The label of the namespaces whose pods the webhook mutates (the chart's namespaceSelector,
# which leaves out the chart's own namespace by name, whatever its labels).
OPT_IN = ("vram-enforcer.io/inject", "enabled")

PORTIONS_FORM = '{"trainer": {"request": "0.5", "ceiling": "0.8"}} (portions of one GPU)'
GPUS_FORM = '{"trainer": 2} (GPUs, each holding one equal share of the container\'s request)'

# A portion as the webhook writes one (`kai`): a share of a GPU below 1, with at most
# PORTION_DIGITS digits after the point (more than a float prints for a share worth
# counting), times a number of GPUs of at most GPUS_DIGITS digits: so the product is exact
# in decimal's 28 digits. Rounded, a share could become 0 (`1e-999999999`) or reach its
# limit. A reader refuses anything else before counting it: `1E+999999` would overflow.
PORTION_DIGITS = 20
GPUS_DIGITS = 4
_MAX_GPUS = 10**GPUS_DIGITS
_MAX_PORTION = Decimal(_MAX_GPUS)
_PORTION_TEXT = 40  # characters: what the webhook writes takes at most about 26


class Undeclarable(ValueError):
    """A declaration that the API server's own validation would not have let through."""


@dataclass(frozen=True, slots=True)
class Portion:
    """A container's share of a GPU's memory, in GPUs' worth (KAI's `gpu-fraction` times its
    `gpu-fraction-num-devices`), and the ceiling it may borrow up to, if any."""

    request: Decimal
    ceiling: Decimal | None = None

    def in_bytes(self, basis: int, gpus: int = 1) -> tuple[int, int | None]:
        """(request, ceiling) in bytes against `basis`, one GPU's memory; rounded down to
        whole MiB, as KAI counts a share (`int64(portion * memory in MiB)`), never above it.
        Spread over `gpus` GPUs, each GPU's share is rounded, as KAI gives it on each."""
        mib = basis // MiB

        def counted(portion: Decimal) -> int:
            return int(portion / gpus * mib) * MiB * gpus  # exact: the webhook's product

        return counted(self.request), None if self.ceiling is None else counted(self.ceiling)


@dataclass(frozen=True, slots=True)
class Declaration:
    """Container name -> what it declares, in bytes or in portions of a GPU."""

    requests: Mapping[str, int] = field(default_factory=dict)  # bytes, declared
    ceilings: Mapping[str, int] = field(default_factory=dict)  # above the request only
    portions: Mapping[str, Portion] = field(default_factory=dict)
    claims: bool = False  # DRA: the pod's claims are its limits, the ceilings above them
    unread: str = ""  # the sidecar's ceilings that could not be read, and why: none count
    # Container -> the number of GPUs its request and ceiling are spread over, one equal
    # share held on each (KAI's gpu-fraction-num-devices); absent: a sum over any GPUs.
    gpus: Mapping[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.requests or self.portions)

    def held_to_requests(self) -> Declaration:
        """The declaration without its ceilings (in bytes or portions): what a pod that is
        only reported on (`PolicyConfig.reports_only`) is owed, since nothing it borrowed
        could be taken back."""
        portions = {name: Portion(p.request) for name, p in self.portions.items()}
        return replace(self, ceilings={}, portions=portions)

    def in_bytes(self, basis: int | None) -> tuple[dict[str, int], dict[str, int]]:
        """(requests, ceilings above them) in bytes. Portions count only with a `basis`:
        without one they are left out, unknown, never taken as 0."""
        limits, ceilings = dict(self.requests), dict(self.ceilings)
        if basis is not None:
            for name, portion in self.portions.items():
                request, ceiling = portion.in_bytes(basis, self.gpus.get(name, 1))
                limits[name] = request
                if ceiling is not None and ceiling > request:
                    ceilings[name] = ceiling
        return limits, ceilings


@dataclass(frozen=True, slots=True)
class Undeclared:
    """A pod that declares nothing because what it carries cannot be read: resources the API
    server would have refused, or a sidecar's environment the webhook never wrote."""

    reason: str


def unreadable(declared: Declaration | Undeclared) -> str:
    """What the agent says once of a pod it could not read whole ("" for one it could)."""
    if isinstance(declared, Undeclared):
        return f"declares nothing: {declared.reason}"
    return f"borrows nothing: {declared.unread}" if declared.unread else ""


# KAI Scheduler counts a fraction against one GPU memory per node, `MemoryOfEveryGpuOnNode`:
# GPU feature discovery's `nvidia.com/gpu.memory` label (MiB, from NVML), floored to a
# multiple of 100 MiB "so there will not be 2 jobs that get same bytes".
KAI_MEMORY_STEP = 100 * MiB


def portion_basis(devices: Sequence[Device]) -> int | None:
    """The memory of one GPU, for portions, as KAI counts it: that of the node's smallest
    whole GPU, in whole MiB, floored to a multiple of 100 MiB. KAI assumes one GPU model
    per node (its count is one value per node); the smallest, so that on a node that mixes
    models a share never counts for more than it could be on any GPU here. None when NVML
    knows no whole GPU's memory (MIG only, or none yet)."""
    in_mig_mode = {d.parent_uuid for d in devices if d.parent_uuid}
    sizes = [
        d.total_bytes
        for d in devices
        if d.parent_uuid is None and d.uuid not in in_mig_mode and d.total_bytes
    ]
    return min(sizes) // KAI_MEMORY_STEP * KAI_MEMORY_STEP if sizes else None


@dataclass(frozen=True, slots=True)
class Declares:
    """Where the pods of a cluster declare VRAM: the extended resource (its name, and the
    bytes of one unit of it), and the container the webhook injects, whose environment
    carries what the webhook read at admission."""

    resource: str
    unit: int = 1
    sidecar: str = SIDECAR


def of_pod(pod: Pod, declares: Declares, *, opted_in: AbstractSet[str]) -> Declaration | Undeclared:
    """What the pod declares, as the agent reads every pod of its node: its containers'
    `resources.limits`, with the ceilings the webhook gave its sidecar; or, for a pod that
    declares no resource, what the webhook wrote into its sidecar's environment from
    KAI's annotations; or, in DRA mode, the ceilings above its claims. Total, since a
    tenant may write anything there (one pod's garbage must not stop the agent's passes for
    the node): what cannot be read is the pod's alone. Its ceilings unread, it borrows
    nothing; its declaration unread, it declares nothing (`Undeclared`, saying why).

    The sidecar's environment is read only on a pod of a namespace in `opted_in` (those
    labelled OPT_IN, the agent's own left out): anywhere else the webhook never wrote it,
    and a container named like the sidecar is its author's. There, what the resources
    declare counts (the scheduler counted it) and borrows nothing, and a pod that declares
    through the environment alone declares nothing; either said, as an unread ceiling is."""
    env = sidecar_env(pod, declares.sidecar)
    distrusted = "" if env_trusted(pod, opted_in) else _distrusted(pod, env)
    if distrusted:
        env = {}
    try:
        limits = declared_limits(json_map(pod.get("spec")), declares.resource, declares.unit)
    except Undeclarable as exc:
        return Undeclared(str(exc))
    if limits:  # what the scheduler counted: unreadable ceilings take only the borrowing away
        ceilings, unread = _ceilings(env)
        return Declaration(limits, _above(ceilings, limits), unread=unread or distrusted)
    if distrusted:
        return Undeclared(distrusted)
    if env.get(LIMITS_FROM_ENV) == "dra":
        ceilings, unread = _ceilings(env)
        return replace(of_sidecar({}, ceilings, {}, {}, claims=True), unread=unread)
    if LIMITS_ENV not in env:
        return Declaration()
    try:
        limits = parse_limits(env[LIMITS_ENV], LIMITS_ENV)
        ceilings = parse_limits(env.get(CEILINGS_ENV, "{}"), CEILINGS_ENV)
        portions = parse_portions(env.get(PORTIONS_ENV, "{}"), PORTIONS_ENV)
        gpus = spread_over(
            parse_gpus(env.get(GPUS_ENV, "{}"), GPUS_ENV), {*limits, *portions}, GPUS_ENV
        )
    except ConfigError as exc:
        return Undeclared(str(exc))
    return of_sidecar(limits, ceilings, portions, gpus, claims=False)


def of_sidecar(
    limits: Mapping[str, int],
    ceilings: Mapping[str, int],
    portions: Mapping[str, Portion],
    gpus: Mapping[str, int],
    *,
    claims: bool,
) -> Declaration:
    """What the sidecar's variables declare, once parsed: read so by the sidecar from its
    own settings and by the agent from the pod's spec (`of_pod`), so that the two cannot
    differ. In DRA mode (`claims`) what the containers declared became claims, and the
    limits are what each claim was allocated on its GPU (`dra.allocations`), not these sums:
    only the ceilings above the claims count."""
    if claims:
        return Declaration(ceilings=dict(ceilings), claims=True)
    return Declaration(dict(limits), _above(ceilings, limits), dict(portions), gpus=dict(gpus))


def env_trusted(pod: Pod, opted_in: AbstractSet[str]) -> bool:
    """Whether the pod's sidecar environment is the webhook's to have written: the pod is of
    a namespace in `opted_in`."""
    return json_map(pod.get("metadata")).get("namespace") in opted_in


def injected(pod: Pod, opted_in: AbstractSet[str]) -> bool:
    """Whether the webhook injected the pod, the only pods the agent dials, serves and holds:
    of a namespace in `opted_in` (where the webhook mutates every pod, and admits no
    container under the sidecar's name but its own), labelled enforced, with the sidecar
    among its containers. A label or a container name alone proves nothing: a pod of a
    namespace the webhook does not mutate may carry both."""
    return env_trusted(pod, opted_in) and marked(pod)


def marked(pod: Pod) -> bool:
    """Whether the pod carries the webhook's marks, the enforced label and the sidecar among
    its containers, whatever its namespace (`injected` says whether they count)."""
    if json_map(json_map(pod.get("metadata")).get("labels")).get(ENFORCED) != "true":
        return False
    spec = json_map(pod.get("spec"))
    return any(
        c.get("name") == SIDECAR
        for spec_field in ("initContainers", "containers")
        for c in json_maps(spec.get(spec_field))
    )


def injected_pods(
    pods: Mapping[str, Pod] | None, opted_in: AbstractSet[str] | None
) -> dict[str, Pod] | None:
    """Those of `pods` (by UID) that the webhook injected; None while either the pods or the
    namespaces that opted in are not listed yet."""
    if pods is None or opted_in is None:
        return None
    return {uid: pod for uid, pod in pods.items() if injected(pod, opted_in)}


def opts_in(namespace: Mapping[str, object]) -> bool:
    """Whether a Namespace, as the API sends it, carries the label OPT_IN."""
    labels = json_map(json_map(namespace.get("metadata")).get("labels"))
    return labels.get(OPT_IN[0]) == OPT_IN[1]


def _distrusted(pod: Pod, env: Mapping[str, str]) -> str:
    """Why the declaring variables that the pod's sidecar carries are not read ("" when it
    carries none: there is nothing to say)."""
    carried = [name for name in _DECLARING if name in env]
    if not carried:
        return ""
    namespace = json_map(pod.get("metadata")).get("namespace")
    return (
        f"namespace {shown(namespace)} is not labelled {OPT_IN[0]}={OPT_IN[1]} (or is the "
        f"agent's own), so the webhook never wrote its sidecar's environment: "
        f"{', '.join(carried)} not read"
    )


def dra_ceilings(declared: Declaration | Undeclared) -> Mapping[str, int]:
    """DRA mode: container name -> the ceiling the webhook gave it above its claim ({} for
    a pod not in DRA mode). Each applies on its claim's GPU (`dra.with_ceilings`)."""
    return declared.ceilings if isinstance(declared, Declaration) and declared.claims else {}


def _ceilings(env: Mapping[str, str]) -> tuple[dict[str, int], str]:
    """The ceilings the webhook gave the sidecar, or none and why they cannot be read."""
    try:
        return parse_limits(env.get(CEILINGS_ENV, "{}"), CEILINGS_ENV), ""
    except ConfigError as exc:
        return {}, str(exc)


def _above(ceilings: Mapping[str, int], limits: Mapping[str, int]) -> dict[str, int]:
    """The ceilings of declaring containers that lie above their request: the others
    borrow nothing."""
    return {n: c for n, c in ceilings.items() if c > limits.get(n, c)}


def sidecar_env(pod: Pod, sidecar: str) -> dict[str, str]:
    """The literal variables of the pod's sidecar, read from its spec: fixed at admission,
    unlike the pod's annotations."""
    return container_env(pod, sidecar)


def container_env(pod: Pod, container: str) -> dict[str, str]:
    """The literal variables a container of the pod (init containers included) is given in
    its spec."""
    spec = json_map(pod.get("spec"))
    found: dict[str, str] = {}
    for spec_field in ("initContainers", "containers"):
        for c in json_maps(spec.get(spec_field)):
            if c.get("name") == container:
                for e in json_maps(c.get("env")):
                    name, value = e.get("name"), e.get("value")
                    if isinstance(name, str) and isinstance(value, str):
                        found[name] = value
    return found


def declared_limits(spec: Mapping[str, object], resource: str, unit: int) -> dict[str, int]:
    """Container name -> limit in bytes, for each container that declares the resource.

    Read before the pod's shape is checked (a pod that declares nothing is not ours to
    judge), so every field is taken as it comes: a map or list of the wrong type counts as
    absent.
    """
    limits: dict[str, int] = {}
    for spec_field in shapes.CONTAINER_FIELDS:
        for item in json_maps(spec.get(spec_field)):
            name = item.get("name")
            resources = json_map(item.get("resources"))
            limit = json_map(resources.get("limits")).get(resource)
            request = json_map(resources.get("requests")).get(resource)
            if not isinstance(name, str) or (limit is None and request is None):
                continue
            where = f"spec.{spec_field}[{name!r}].resources"
            if limit is None:
                raise Undeclarable(
                    f"{where}.requests[{resource!r}] is set but limits is not; "
                    f"extended resources are declared in limits (requests default to them): "
                    f"set limits[{resource!r}]: {shown(request)}"
                )
            units = _units(limit, f"{where}.limits[{resource!r}]", unit)
            request_field = f"{where}.requests[{resource!r}]"
            if request is not None and _units(request, request_field, unit) != units:
                raise Undeclarable(
                    f"{where}: requests[{resource!r}] {shown(request)} differs from limits "
                    f"{shown(limit)}; VRAM cannot be overcommitted: make them equal, or drop the "
                    "request"
                )
            limits[name] = int(units) * unit
    return limits


def _units(value: object, where: str, unit: int) -> Decimal:
    try:
        units = parse_quantity(str(value), field=where)
    except ConfigError as exc:
        raise Undeclarable(str(exc)) from None
    named = "bytes" if unit == 1 else f"{unit}-byte units"
    if units < 0:
        raise Undeclarable(f"{where}: {shown(value)} is negative; declare 0 or more {named}")
    if units != units.to_integral_value():
        raise Undeclarable(
            f"{where}: {shown(value)} is not a whole number of {named}; use a whole number, "
            f"e.g. {max(1, int(units.to_integral_value()))}"
        )
    return units


def encode_portions(portions: Mapping[str, Portion]) -> str:
    """The sidecar's PORTIONS_ENV: exact decimals, as text."""
    doc = {
        name: {"request": str(p.request), **({"ceiling": str(p.ceiling)} if p.ceiling else {})}
        for name, p in portions.items()
    }
    return json.dumps(doc, separators=(",", ":"))


def parse_portions(text: str, where: str) -> dict[str, Portion]:
    """PORTIONS_ENV back: each request above 0, each ceiling above its request."""
    doc = json_object(text, where, PORTIONS_FORM)
    found: dict[str, Portion] = {}
    for name, given in doc.items():
        if not isinstance(given, dict) or not set(given) <= {"request", "ceiling"}:
            raise ConfigError(
                where, text, f"gives container {name!r} {shown(given)}; use {PORTIONS_FORM}"
            )
        request = _portion(given.get("request"), f"{where} {name!r} request")
        ceiling = given.get("ceiling")
        found[name] = Portion(request, None)
        if ceiling is not None:
            high = _portion(ceiling, f"{where} {name!r} ceiling")
            if high <= request:
                raise ConfigError(
                    where,
                    text,
                    f"gives container {name!r} a ceiling at or "
                    "below its request; a ceiling is above it",
                )
            found[name] = Portion(request, high)
    return found


def parse_gpus(text: str, where: str) -> dict[str, int]:
    """GPUS_ENV back: a whole number of GPUs from 2 up to GPUS_DIGITS digits (1 is what a
    container without an entry has)."""
    doc = json_object(text, where, GPUS_FORM)
    found: dict[str, int] = {}
    for name, count in doc.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count < _MAX_GPUS:
            raise ConfigError(
                where,
                text,
                f"gives container {name!r} {shown(count)} GPUs; use "
                f"a whole number from 2 to {_MAX_GPUS - 1}: {GPUS_FORM}",
            )
        found[name] = count
    return found


def spread_over(gpus: dict[str, int], declaring: AbstractSet[str], where: str) -> dict[str, int]:
    """`gpus`, when each names a container of `declaring`: only a request can be spread."""
    for name in gpus:
        if name not in declaring:
            raise ConfigError(
                where,
                json.dumps(gpus),
                f"names container {name!r}, which "
                "declares no request to spread; name a declaring "
                "container",
            )
    return gpus


def _portion(value: object, where: str) -> Decimal:
    """A portion within the bounds of what the webhook writes, so that counting it in bytes
    is exact enough and cannot overflow."""
    readable = isinstance(value, str) and value.isascii() and len(value) <= _PORTION_TEXT
    try:
        portion = Decimal(str(value) if readable else "NaN")
    except InvalidOperation:
        portion = Decimal("NaN")
    exponent = portion.as_tuple().exponent  # an int for any finite decimal
    if not (
        portion.is_finite()
        and 0 < portion < _MAX_PORTION
        and isinstance(exponent, int)
        and -exponent <= PORTION_DIGITS
    ):
        raise ConfigError(
            where,
            value,
            "is not a portion of a GPU; use a decimal above 0 and "
            f"below {_MAX_PORTION}, with at most {PORTION_DIGITS} digits after "
            'the point, as text, e.g. "0.5"',
        )
    return portion
