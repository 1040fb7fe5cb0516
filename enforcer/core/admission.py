"""The webhook's decision (pure): an AdmissionReview in, an AdmissionReview out.

A pod that declares VRAM gets the sidecar (with a socket of its own that the agent connects
to), a shared PID namespace, its limits in the environment and, by default, a real
`/dev/shm`. The patch is built as the pod is changed, one operation at each path that
changes (`_Patch`). Everything a user can get wrong is denied with a message that names
the container, the field, the value and the fix.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from enforcer.core import kai, shapes
from enforcer.core.declaration import (
    CEILINGS_ENV,
    ENFORCED,
    GPUS_ENV,
    LIMITS_FROM_ENV,
    PORTIONS_ENV,
    SIDECAR,
    Declaration,
    Undeclarable,
    declared_limits,
    encode_portions,
)
from enforcer.core.dra import NVIDIA_DRIVER
from enforcer.core.parsing import (
    ConfigError,
    kubernetes_version,
    parse_bytes,
    parse_percent,
)
from enforcer.core.payloads import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionReview,
    Container,
    EnvVar,
    PatchOperation,
    PodSpec,
    VolumeMount,
)
from enforcer.core.protocol import SIDECAR_SOCKET, SIDECAR_SOCKET_DIR
from enforcer.core.settings import resolve
from enforcer.core.settings.sidecar import DECLARED as SIDECAR_SETTINGS
from enforcer.core.settings.sidecar import sidecar_settings
from enforcer.core.tenancy import (
    Bounds,
    Tenancy,
    check_action,
    check_borrowing,
    check_ceilings,
    check_grace_period,
    in_namespace,
)

API_VERSION = "admission.k8s.io/v1"
INJECT = "vram-enforcer.io/inject"
INJECTED = "vram-enforcer.io/injected"
SHM_SIZE = "vram-enforcer.io/shm-size"
METRICS_PORT_ANNOTATION = "vram-enforcer.io/metrics-port"
CEILING = "vram-enforcer.io/vram-ceiling"
SOCKET_VOLUME = "vram-enforcer-socket"
SHM_VOLUME = "vram-enforcer-shm"
NO_TOKEN_VOLUME = "vram-enforcer-no-token"  # noqa: S105 - a volume name, not a secret
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # noqa: S105 - a path
SHM_DIR = "/dev/shm"  # noqa: S108 - the mount point we provide, not a file we write
# Annotation -> the sidecar variable it sets, and how it is checked.
_SETTINGS = {
    "vram-enforcer.io/action": "VRAM_ENFORCER_ACTION",
    "vram-enforcer.io/grace-period": "VRAM_ENFORCER_GRACE_PERIOD",
    "vram-enforcer.io/warn-at": "VRAM_ENFORCER_WARN_AT",
}
# Set on declaring containers unless the user set them: frameworks that grab all of a GPU
# at start-up would otherwise be over their limit before they allocate anything.
FRAMEWORK_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
# Read by the NVIDIA container toolkit's `apply-cuda-memory-limits` CDI hook, in MiB: it
# sets them as the container cgroup's soft and hard limit on each of the container's GPUs.
TOOLKIT_ENV = ("NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT")
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What the mutation depends on (the webhook's flags, validated)."""

    sidecar_image: str
    sidecar_mode: str  # native or container ("auto" is resolved at start-up)
    resource_name: str
    resource_unit: int
    framework_env: bool = True
    shm_default: str = "auto"  # auto, off, or a quantity
    gpu_exposure: str = "none"  # none or env
    toolkit_limits: bool = False  # also set TOOLKIT_ENV for the toolkit's CDI hook
    runtime_class: str | None = None
    sidecar_cpu: str = "10m"
    sidecar_memory: str = "48Mi"
    # DRA: the DeviceClass that a declaration becomes a claim on (None: per-node counting by
    # the extended resource), and the device capacity that is GPU memory.
    dra_class: str | None = None
    dra_capacity: str = "memory"
    # ...and how the sidecars tell a GPU allocation (passed on to them in DRA mode).
    dra_drivers: tuple[str, ...] = (NVIDIA_DRIVER,)
    dra_uuid_attribute: str = "uuid"
    # What a pod's annotations may loosen, cluster-wide and per namespace.
    tenancy: Tenancy = dataclasses.field(default_factory=Tenancy)
    # Whether KAI Scheduler's annotations (gpu-memory, gpu-fraction, ...) declare VRAM too.
    kai_annotations: bool = False


# A Pod as the API server sends it nests about 12 levels deep; a body nested far deeper is
# no Pod, and walking it (copying, diffing, printing) would recurse past Python's limit.
MAX_DEPTH = 64


class BadReview(ValueError):
    """The body is not an AdmissionReview with a request uid: answered with HTTP 400."""


def decode(body: bytes) -> object:
    """The request body as JSON, or BadReview saying why it cannot be one: not UTF-8, not
    JSON, a number past Python's digit limit, or nested deeper than MAX_DEPTH."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise BadReview(f"the body nests deeper than {MAX_DEPTH} levels; no Pod does") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit number
        raise BadReview(f"the body is not JSON: {str(exc)[:200]}") from None
    if _nests_deeper(doc, MAX_DEPTH):
        raise BadReview(f"the body nests deeper than {MAX_DEPTH} levels; no Pod does")
    return doc


def _nests_deeper(doc: object, limit: int) -> bool:
    """Whether `doc` has a list or map more than `limit` levels down (without recursing)."""
    level = [doc]
    for _ in range(limit + 1):
        level = [
            child
            for item in level
            if isinstance(item, (dict, list))
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return False
    return True


class Denied(Exception):
    """The pod cannot be admitted; the message tells the user what to change."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The AdmissionReview to answer with, and how it ended (the metric's `result`)."""

    review: AdmissionReview
    result: str  # patched, skipped, denied, invalid


def review(doc: object, settings: AdmissionSettings) -> Outcome:
    """Answer one AdmissionReview (the decoded request body). Raises BadReview without uid."""
    request = _request(doc)
    uid = request["uid"]
    envelope = _map(doc)
    if envelope.get("apiVersion") != API_VERSION or envelope.get("kind") != "AdmissionReview":
        problem = f"expected apiVersion {API_VERSION}, kind AdmissionReview"
        return Outcome(_deny(uid, f"unsupported review: {problem}", 400), "invalid")
    kind = _map(request.get("kind"))
    if (
        request.get("operation") != "CREATE"
        or (kind.get("group"), kind.get("kind")) != ("", "Pod")
        or request.get("subResource")
    ):
        return Outcome(_allow(uid, []), "skipped")
    pod = request.get("object")
    if not isinstance(pod, dict):
        return Outcome(_deny(uid, "request.object is not a Pod object", 400), "invalid")
    namespace = request.get("namespace")
    try:
        ops = mutate(pod, settings, namespace if isinstance(namespace, str) else "")
    except Denied as exc:
        return Outcome(_deny(uid, str(exc), 403), "denied")
    return Outcome(_allow(uid, ops, _warnings(pod) if ops else []), "patched" if ops else "skipped")


def _warnings(pod: Mapping[str, object]) -> list[str]:
    """What the user is told of an injected pod (kubectl prints "Warning: ..."): the
    annotations of earlier releases that no longer do anything."""
    if METRICS_PORT_ANNOTATION not in _map(_map(pod.get("metadata")).get("annotations")):
        return []
    return [
        f"metadata.annotations[{METRICS_PORT_ANNOTATION!r}] is ignored: since 0.2.0 the "
        "sidecar serves no metrics and takes no port; the node agent serves every enforced "
        "pod's (docs/operations.md#metrics). Remove the annotation"
    ]


def templates_named(
    pod: Mapping[str, object], settings: AdmissionSettings
) -> list[dict[str, object]]:
    """DRA mode: the ResourceClaimTemplates of ours (`vram-enforcer-<size>`) that a stored pod's
    claims name, as they should be made in its namespace."""
    meta, spec = _map(pod.get("metadata")), _map(pod.get("spec"))
    namespace = meta.get("namespace")
    if settings.dra_class is None or not isinstance(namespace, str) or not namespace:
        return []
    sizes = {
        size
        for rc in _list(spec.get("resourceClaims"))
        if (size := template_size(str(_map(rc).get("resourceClaimTemplateName") or ""))) is not None
    }
    return [claim_template(namespace, size, settings) for size in sorted(sizes) if size > 0]


def _request(doc: object) -> AdmissionRequest:
    """The request of an AdmissionReview, once it is known to have a uid to answer to."""
    request = _map(doc).get("request")
    uid = _map(request).get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("not an AdmissionReview: request.uid is missing")
    return cast(AdmissionRequest, request)


def _allow(
    uid: str, ops: list[PatchOperation], warnings: list[str] | None = None
) -> AdmissionReview:
    response: AdmissionResponse = {"uid": uid, "allowed": True}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _deny(uid: str, message: str, code: int) -> AdmissionReview:
    response: AdmissionResponse = {
        "uid": uid,
        "allowed": False,
        "status": {"code": code, "message": message},
    }
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def mutate(
    pod: Mapping[str, object], settings: AdmissionSettings, namespace: str = ""
) -> list[PatchOperation]:
    """The JSON patch that makes `pod` enforced; [] when it is not ours to touch.

    In DRA mode (`settings.dra_class`), a declaration becomes a claim (see `_claim_vram`),
    and a pod with claims made by hand is enforced too: the sidecar takes its limits from
    the claims (`--limits-from dra`).

    Nothing the pod says makes it "already enforced": not an annotation, not a container
    named like the sidecar. Every part of the mutation is asserted again, in place, on every
    pass, so a reinvocation over our own output changes nothing, and a pod that forged any
    part of it (the sidecar, its volumes, `shareProcessNamespace: false`) gets ours back.
    """
    annotations = _map(_map(pod.get("metadata")).get("annotations"))
    raw_spec = _map(pod.get("spec"))
    limits, by_kai = _declares(raw_spec, annotations, settings)
    claims_by_hand = settings.dra_class is not None and bool(_list(raw_spec.get("resourceClaims")))
    if not limits and not claims_by_hand and not by_kai:
        _check_undeclared(raw_spec)
        return []
    bounds = settings.tenancy.bounds(namespace)
    if str(annotations.get(INJECT, "")).lower() == "false":
        if bounds.allow_opt_out:
            return []
        raise Denied(
            f"metadata.annotations[{INJECT!r}]: 'false' is not allowed "
            f"{in_namespace(namespace)}: a pod that declares VRAM is held to it. Remove the "
            "annotation (the operator lets pods opt out with the webhook's --allow-opt-out or "
            "--namespace-bounds)"
        )
    try:
        checked = shapes.check(pod)  # from here on, every field read has its JSON type
    except shapes.ShapeError as exc:
        raise Denied(str(exc)) from None
    spec = checked.get("spec") or {}
    _check_pod(spec, settings)
    if settings.dra_class is not None:
        limits = {**_claimed_limits(spec), **limits}  # our claims, from an earlier pass
    sidecar_env = _sidecar_settings(annotations, bounds, namespace)
    if by_kai:
        declared = _kai(annotations, spec, bounds, namespace)
    else:
        declared = Declaration(limits, _ceilings(annotations, limits, bounds, namespace))
    limits, ceilings = dict(declared.limits), dict(declared.ceilings)
    if declared.portions:
        sidecar_env[PORTIONS_ENV] = encode_portions(declared.portions)
    if declared.gpus:
        sidecar_env[GPUS_ENV] = json.dumps(declared.gpus, separators=(",", ":"))
    if ceilings:
        sidecar_env[CEILINGS_ENV] = json.dumps(ceilings, separators=(",", ":"))
    shm = str(annotations.get(SHM_SIZE, settings.shm_default))
    shm_limit = None if shm == "off" else _shm_limit(shm, spec)
    env = _sidecar_env(spec, limits, sidecar_env, settings)
    _check_sidecar_env(env)
    patch = _Patch(checked)
    patch.set(("spec", "shareProcessNamespace"), True)
    for where, c in _containers_at(spec):
        if c["name"] in limits:
            _workload_env(patch, where, limits[c["name"]], ceilings.get(c["name"]), settings)
            if settings.dra_class is not None:
                _claim_vram(patch, where, limits[c["name"]], settings)
    if shm != "off":
        _add_shm(patch, shm_limit)
    _add_sidecar(patch, env, settings)
    runtime_class = settings.runtime_class if settings.gpu_exposure == "env" else None
    if runtime_class and patch.get(("spec", "runtimeClassName")) is None:
        patch.set(("spec", "runtimeClassName"), runtime_class)
    patch.set(("metadata", "annotations", INJECTED), "true")
    patch.set(("metadata", "labels", ENFORCED), "true")
    return patch.ops


Path = tuple[str | int, ...]  # map keys and list indexes, from the pod down


class _Patch:
    """The pod as mutated, and the JSON patch (RFC 6902) that makes it so, built together:
    each change is made to a working copy and recorded as one operation at the path it
    changes. (A diff of the whole pod after, `jsonpatch.make_patch`, took about 1 s of CPU
    for a pod of 3 MiB, 5 s in issue 35's report: a few such creates starved admission.)
    Only the maps and lists on a changed path are copied; the rest is the pod as sent,
    shared and never written. A change to what is already there records nothing, so a
    pass over our own output yields no patch."""

    def __init__(self, pod: Mapping[str, object]) -> None:
        self.ops: list[PatchOperation] = []
        self._doc: dict[str, Any] = dict(pod)
        self._copies = {id(self._doc): self._doc}  # held, so that no id is reused

    def get(self, path: Path) -> Any:
        """What `path` holds now (None: nothing), to read: it changes only through here."""
        doc: Any = self._doc
        for key in path:
            if isinstance(doc, dict):
                doc = doc.get(key)
            elif isinstance(doc, list) and isinstance(key, int) and key < len(doc):
                doc = doc[key]
            else:
                return None
        return doc

    def set(self, path: Path, value: object) -> None:
        """Add or replace a map's member (the maps above it made where absent or null), or
        replace a list's item."""
        for depth, key in enumerate(path[:-1]):
            holder = self.get(path[:depth])
            if isinstance(holder, dict) and holder.get(key) is None:
                for above in reversed(path[depth + 1 :]):
                    value = {above: value}
                path = path[: depth + 1]
                break
        parent, key = self._parent(path), path[-1]
        present = not isinstance(parent, dict) or key in parent
        if present and _same(parent[key], value):
            return
        parent[key] = value
        self._record("replace" if present else "add", path, value)

    def insert(self, path: Path, value: object) -> None:
        """Insert into a list at the index that ends `path` (its length: at the end)."""
        self._parent(path).insert(path[-1], value)
        self._record("add", path, value)

    def append(self, path: Path, value: object) -> None:
        """Add to the end of the list that the map member at `path` holds (or is made of)."""
        items = self.get(path)
        if items is None:
            self.set(path, [value])
        else:
            self.insert((*path, len(items)), value)

    def remove(self, path: Path) -> None:
        del self._parent(path)[path[-1]]
        self.ops.append({"op": "remove", "path": _pointer(path)})

    def _parent(self, path: Path) -> Any:
        """The map or list that holds `path`'s last key, each one down to it copied once."""
        doc: Any = self._doc
        for key in path[:-1]:
            child = doc[key]
            if id(child) not in self._copies:
                child = copy.copy(child)
                self._copies[id(child)] = doc[key] = child
            doc = child
        return doc

    def _record(self, op: str, path: Path, value: object) -> None:
        # `value` is never written after: a later change below it copies it first.
        self.ops.append({"op": op, "path": _pointer(path), "value": value})


def _pointer(path: Path) -> str:
    """A JSON pointer (RFC 6901): `~` and `/` in a key (an annotation's) escaped."""
    return "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in path)


def _same(a: object, b: object) -> bool:
    """Equal as JSON (in Python, `True == 1`)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def claim_template_name(limit: int) -> str:
    """The ResourceClaimTemplate a declaration of `limit` bytes becomes a claim from, one per
    size and namespace: `vram-enforcer-16gi`."""
    return f"vram-enforcer-{format_quantity(limit).lower()}"


def claim_template(namespace: str, limit: int, settings: AdmissionSettings) -> dict[str, object]:
    """That template: one request of `limit` bytes of the DeviceClass's memory capacity."""
    assert settings.dra_class is not None  # noqa: S101 - only asked in DRA mode
    exactly = {
        "deviceClassName": settings.dra_class,
        "capacity": {"requests": {settings.dra_capacity: format_quantity(limit)}},
    }
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": claim_template_name(limit), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "vram-enforcer"}},
        "spec": {"spec": {"devices": {"requests": [{"name": "vram", "exactly": exactly}]}}},
    }  # fmt: skip


def _claim_vram(patch: _Patch, where: Path, limit: int, settings: AdmissionSettings) -> None:
    """DRA mode: the container's VRAM becomes a claim from the template of its size, which
    the scheduler places on one GPU with that much room; the extended resource goes.

    A declaration of 0 asks for no GPU: it becomes no claim (a claim of 0 bytes would still
    be given a share of a GPU), and stays as it is (0 of a resource fits any node), so that
    the sidecar holds the container to 0 on every GPU.

    When extended resource names can carry capacity requests (KEP-6406, provisional), the
    scheduler will make this claim itself, and this step can be dropped."""
    if limit == 0:
        return
    claim = f"vram-{patch.get(where)['name']}"
    resources = (*where, "resources")
    for part in ("limits", "requests"):
        listed = patch.get((*resources, part))
        if isinstance(listed, dict) and settings.resource_name in listed:
            alone = len(listed) == 1  # the part goes with it
            patch.remove(
                (*resources, part) if alone else (*resources, part, settings.resource_name)
            )
    if claim in _claim_names(patch.get(("spec",))):
        return  # claimed on an earlier pass
    patch.append((*resources, "claims"), {"name": claim})
    patch.append(
        ("spec", "resourceClaims"),
        {"name": claim, "resourceClaimTemplateName": claim_template_name(limit)},
    )


def _claim_names(spec: Mapping[str, object]) -> set[str]:
    return {str(_map(rc).get("name")) for rc in _list(spec.get("resourceClaims"))}


_TEMPLATE_SIZE = re.compile(r"vram-enforcer-([0-9]+)([kmgtpe]i)?")


def template_size(name: str) -> int | None:
    """The bytes a template of ours claims, from its name (`vram-enforcer-16gi`); None for
    a name that is not one of ours."""
    size = _TEMPLATE_SIZE.fullmatch(name)
    if size is None:
        return None
    quantity = size[1] + (size[2] or "").capitalize()  # the name is lowercase: 16gi
    try:
        return parse_bytes(quantity, field="resourceClaimTemplateName")
    except ConfigError:
        return None  # past what Kubernetes holds: not a template of ours


def _claimed_limits(spec: PodSpec) -> dict[str, int]:
    """DRA mode, on a later pass: each container's limit from the claim an earlier pass made
    (`vram-<container>` from the template `vram-enforcer-<size>`), since the declaration it
    came from is gone. Written by hand, that claim is a declaration like any other."""
    templates = {
        str(rc.get("name")): str(rc.get("resourceClaimTemplateName") or "")
        for rc in map(_map, _list(spec.get("resourceClaims")))
    }
    found = {}
    for c in _containers(spec):
        claim = f"vram-{c['name']}"
        claims = {_map(rc).get("name") for rc in _list(_map(c.get("resources")).get("claims"))}
        size = template_size(templates.get(claim, ""))
        if claim in claims and size is not None:
            found[c["name"]] = size
    return found


def _check_pod(spec: PodSpec, settings: AdmissionSettings) -> None:
    """Deny what the mutation cannot make right. A container named like the sidecar that
    runs our image, and our volumes beside it, are an earlier pass's (or a forgery of it):
    they are replaced with ours in place. Anything else under our names is the user's."""
    if spec.get("hostPID") is True:
        raise Denied(
            "spec.hostPID: true cannot be combined with the shared process namespace that VRAM "
            "enforcement needs; remove hostPID"
        )
    images = [c.get("image") for c in _containers(spec) if c["name"] == SIDECAR]
    if any(image != settings.sidecar_image for image in images):
        raise Denied(f"a container is already named {SIDECAR!r}, the name of the enforcer's "
                     "sidecar; rename it")  # fmt: skip
    if len(images) > 1:  # never an earlier pass's, and each would be one more operation
        raise Denied(
            f"spec: {len(images)} containers are named {SIDECAR!r}, the name of the enforcer's "
            "sidecar; a pod's container names are unique: remove them"
        )
    volumes = {str(v.get("name")) for v in spec.get("volumes") or ()}
    taken = volumes & {SOCKET_VOLUME, SHM_VOLUME, NO_TOKEN_VOLUME}
    if taken and not images:
        raise Denied(f"spec.volumes: {sorted(taken)[0]!r} is reserved for the enforcer; rename it")


def _sidecar_settings(
    annotations: Mapping[str, object], bounds: Bounds, namespace: str
) -> dict[str, str]:
    """The sidecar's variables from the pod's annotations, each checked as the sidecar will,
    and against what the operator lets this namespace loosen."""
    env: dict[str, str] = {}
    for key, var in _SETTINGS.items():
        if key not in annotations:
            continue
        value = str(annotations[key])
        field = f"metadata.annotations[{key!r}]"
        try:
            if var == "VRAM_ENFORCER_ACTION":
                check_action(value, bounds, field, namespace)
            elif var == "VRAM_ENFORCER_GRACE_PERIOD":
                check_grace_period(value, bounds, field, namespace)
            else:
                parse_percent(value, field=field)
        except ConfigError as exc:
            raise Denied(str(exc)) from None
        env[var] = value
    return env


def _ceilings(
    annotations: Mapping[str, object],
    limits: Mapping[str, int],
    bounds: Bounds,
    namespace: str,
) -> dict[str, int]:
    """Container name -> the ceiling it may borrow up to above its request (its declared
    limit; with DRA, its claim's size, and the ceiling is on that claim's GPU); {} without
    the annotation. Fixed here, in the sidecar's environment, which no
    one can change once the pod exists: the annotation itself can be patched later."""
    if CEILING not in annotations:
        return {}
    field = f"metadata.annotations[{CEILING!r}]"
    try:
        return check_ceilings(str(annotations[CEILING]), limits, bounds, field, namespace)
    except ConfigError as exc:
        raise Denied(str(exc)) from None


def _declares(
    spec: Mapping[str, object], annotations: Mapping[str, object], settings: AdmissionSettings
) -> tuple[dict[str, int], bool]:
    """The containers' declared limits, and whether KAI Scheduler's annotations declare a
    GPU share instead (where the webhook reads them)."""
    try:
        limits = declared_limits(spec, settings.resource_name, settings.resource_unit)
    except Undeclarable as exc:
        raise Denied(str(exc)) from None
    by_kai = settings.kai_annotations and kai.declares(annotations)
    if limits and by_kai:
        raise Denied(
            f"spec: container {next(iter(limits))!r} declares {settings.resource_name} in its "
            "resources.limits, and KAI Scheduler's annotations declare a GPU share too; "
            "declare VRAM one way: remove one"
        )
    return limits, by_kai


def _kai(
    annotations: Mapping[str, object], spec: PodSpec, bounds: Bounds, namespace: str
) -> Declaration:
    """What KAI Scheduler's annotations declare, with its limits above requests within
    what the operator lets this namespace borrow."""
    if CEILING in annotations:
        raise Denied(
            f"metadata.annotations[{CEILING!r}]: this pod declares its GPU share with KAI "
            "Scheduler's annotations; give its limit with KAI's (gpu-memory.limit, "
            "gpu-fraction.limit) and remove this one"
        )

    def borrowing(ceiling: int | None, request: int, key: str, value: object) -> None:
        where = f"metadata.annotations[{key!r}]"
        check_borrowing(ceiling, request, bounds, where, value, namespace)

    names = [c["name"] for c in spec.get("containers") or () if c["name"] != SIDECAR]
    inits = [c["name"] for c in spec.get("initContainers") or () if c["name"] != SIDECAR]
    try:
        return kai.declaration(annotations, names, inits, borrowing)
    except ConfigError as exc:
        raise Denied(str(exc)) from None


def _check_undeclared(spec: Mapping[str, object]) -> None:
    """A pod that declares no VRAM carries no container under the sidecar's name: the node
    agent trusts what the sidecar's environment declares, as the webhook wrote it."""
    for spec_field in shapes.CONTAINER_FIELDS:
        if any(_map(c).get("name") == SIDECAR for c in _list(spec.get(spec_field))):
            raise Denied(
                f"spec.{spec_field}: a container is named {SIDECAR!r}, the name of the "
                "enforcer's sidecar, in a pod that declares no VRAM; rename it"
            )


def _shm_limit(value: str, spec: PodSpec) -> int | None:
    """The /dev/shm sizeLimit in bytes (None: no limit) for `auto` or a quantity."""
    if value == "auto":
        # The largest container memory limit: tmpfs pages count against the container's
        # memory, so more than that could never be used anyway.
        known = [
            m
            for c in spec.get("containers") or ()
            if c["name"] != SIDECAR and (m := _memory_limit(c)) is not None
        ]
        return max(known) if known else None
    try:
        return parse_bytes(value, field=f"metadata.annotations[{SHM_SIZE!r}]")
    except ConfigError as exc:
        raise Denied(f"{exc}; or use auto or off") from None


def _memory_limit(c: Container) -> int | None:
    memory = ((c.get("resources") or {}).get("limits") or {}).get("memory")
    if memory is None:
        return None
    try:
        return parse_bytes(str(memory), field="memory")
    except ConfigError:
        return None  # the API server's own validation will say so


def _workload_env(
    patch: _Patch, where: Path, limit: int, ceiling: int | None, settings: AdmissionSettings
) -> None:
    """What the workload is told: the most it may use (its ceiling, when it may borrow)
    and what it is guaranteed."""
    env = (*where, "env")
    names = {e.get("name") for e in patch.get(env) or ()}
    most = limit if ceiling is None else ceiling
    ours = {"VRAM_LIMIT_BYTES": str(most)}
    if ceiling is not None:
        ours["VRAM_REQUEST_BYTES"] = str(limit)
    if settings.toolkit_limits:  # whole MiB, rounded down: never above what is declared
        request_mib, limit_mib = TOOLKIT_ENV
        ours.update({request_mib: str(limit // MiB), limit_mib: str(most // MiB)})
    for name, value in ours.items():
        _put(patch, env, {"name": name, "value": value})
    extra = {**(FRAMEWORK_ENV if settings.framework_env else {})}
    if settings.gpu_exposure == "env" and not _requests_gpus(patch.get(where)):
        extra.update(GPU_ENV)  # a container given GPUs by the device plugin keeps those
    for k, v in extra.items():
        if k not in names:
            patch.append(env, {"name": k, "value": v})


def _requests_gpus(c: Container) -> bool:
    resources = c.get("resources") or {}
    return any(
        key.startswith("nvidia.com/")
        for part in (resources.get("limits") or {}, resources.get("requests") or {})
        for key in part
    )


def _add_shm(patch: _Patch, size: int | None) -> None:
    spec: PodSpec = patch.get(("spec",))
    missing = [
        where
        for where, c in _containers_at(spec)
        if where[1] == "containers"
        and c["name"] != SIDECAR
        and not any(
            str(m.get("mountPath", "")).rstrip("/") == SHM_DIR for m in c.get("volumeMounts") or ()
        )
    ]
    ours = any(v.get("name") == SHM_VOLUME for v in spec.get("volumes") or ())
    if not missing and not ours:
        return
    empty_dir = {"medium": "Memory"}
    if size is not None:
        empty_dir["sizeLimit"] = format_quantity(size)
    _put(patch, ("spec", "volumes"), {"name": SHM_VOLUME, "emptyDir": empty_dir})
    for where in missing:
        patch.append((*where, "volumeMounts"), {"name": SHM_VOLUME, "mountPath": SHM_DIR})


def _sidecar_env(spec: PodSpec, limits: Mapping[str, int], settings_env: Mapping[str, str],
                 settings: AdmissionSettings) -> list[EnvVar]:  # fmt: skip
    return [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("NODE_NAME", "spec.nodeName"),
        {"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps(dict(limits), separators=(",", ":"))},
        {
            "name": "VRAM_ENFORCER_CONTAINERS",
            "value": ",".join(c["name"] for c in _containers(spec) if c["name"] != SIDECAR),
        },
        *[EnvVar(name=k, value=v) for k, v in {**settings_env, **_dra_env(settings)}.items()],
        {"name": "VRAM_ENFORCER_LISTEN", "value": SIDECAR_SOCKET},
        {"name": "VRAM_ENFORCER_SIDECAR_MODE", "value": settings.sidecar_mode},
    ]


def _dra_env(settings: AdmissionSettings) -> dict[str, str]:
    """DRA mode: the sidecar takes its limits from the pod's claims, and tells an
    allocation of a GPU as the webhook's settings say."""
    if settings.dra_class is None:
        return {}
    return {
        LIMITS_FROM_ENV: "dra",
        "VRAM_ENFORCER_DRA_DRIVERS": ",".join(settings.dra_drivers),
        "VRAM_ENFORCER_DRA_UUID_ATTRIBUTE": settings.dra_uuid_attribute,
        "VRAM_ENFORCER_DRA_CAPACITY": settings.dra_capacity,
    }


def _check_sidecar_env(env: list[EnvVar]) -> None:
    """Read the sidecar's environment with the sidecar's own settings parser (the agent
    reads it with the same parsers, `declaration.of_pod`), so that the two cannot disagree:
    a value it refuses would leave the pod never started (a native sidecar) or unenforced.
    The Downward API's values stand in as their field paths."""
    environ = {
        e["name"]: e["value"] if "value" in e else e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in env
    }
    try:
        sidecar_settings(resolve(SIDECAR_SETTINGS, {}, environ))
    except ConfigError as exc:
        raise Denied(
            "the sidecar would refuse its settings as this pod's metadata.annotations and spec "
            f"make them: {exc}; change the value it comes from"
        ) from None


def _add_sidecar(patch: _Patch, env: list[EnvVar], settings: AdmissionSettings) -> None:
    # The sidecar's own socket, which the agent connects to through /proc/<pid>/root: an
    # emptyDir (which every Pod Security level allows) that no other container mounts. (A
    # pod copied from one that 0.1.0 injected may carry the hostPath of the agent's socket
    # under this name: it is replaced.)
    # No API token: the sidecar never calls the API (the agent brings its pod and posts its
    # Events). ServiceAccount admission mounts the pod's token into every container that
    # has nothing mounted at its path, so an empty one is: and since it then finds nothing
    # to add after this webhook, the API server does not call the webhook a second time.
    mounts: list[VolumeMount] = [
        {"name": SOCKET_VOLUME, "mountPath": SIDECAR_SOCKET_DIR},
        {"name": NO_TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    for volume, size in ((SOCKET_VOLUME, "1Mi"), (NO_TOKEN_VOLUME, "1Ki")):
        empty_dir = {"medium": "Memory", "sizeLimit": size}
        _put(patch, ("spec", "volumes"), {"name": volume, "emptyDir": empty_dir})
    sidecar: Container = {
        "name": SIDECAR,
        "image": settings.sidecar_image,
        "command": ["vram-enforcer", "sidecar"],
        "env": env,
        "resources": {
            "requests": {"cpu": settings.sidecar_cpu, "memory": settings.sidecar_memory},
            "limits": {"memory": settings.sidecar_memory},
        },
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["KILL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Started once its socket is there, which it makes after closing itself to the
        # workload (not dumpable): a native sidecar's workload starts only then, so it
        # never finds the sidecar open to ptrace in its first second, nor unenforced.
        "startupProbe": {
            "exec": {"command": ["python", "-c", _LISTENING]},
            "periodSeconds": 1,
            "timeoutSeconds": 5,
            "failureThreshold": 120,
        },
    }
    # An earlier pass's sidecar (or a forgery of it) is replaced in place, and leaves the
    # list it does not belong in. A native sidecar goes first: it starts before the workload.
    if settings.sidecar_mode == "native":
        sidecar["restartPolicy"] = "Always"
        _drop_sidecar(patch, "containers")
        _put(patch, ("spec", "initContainers"), sidecar, at=0)
    else:
        _drop_sidecar(patch, "initContainers")
        _put(patch, ("spec", "containers"), sidecar)


_LISTENING = f"import os, sys; sys.exit(not os.path.exists({SIDECAR_SOCKET!r}))"


def _drop_sidecar(patch: _Patch, field: str) -> None:
    listed = patch.get(("spec",)).get(field) or []
    for i in reversed(range(len(listed))):
        if listed[i]["name"] == SIDECAR:
            patch.remove(("spec", field, i))


def _put(patch: _Patch, path: Path, item: Mapping[str, Any], at: int | None = None) -> None:
    """Replace the entry of the list at `path` with `item`'s name in place, or add it at
    `at` (None: at the end). In place, so that a pass over our own output leaves the order
    others gave it; but an entry that must be at `at` (the native sidecar, first of the init
    containers) is moved there: a pod that declared its own `vram-enforcer` third would
    otherwise run two init containers before the sidecar exists."""
    items = patch.get(path) or ()
    for i, existing in enumerate(items):
        if existing.get("name") == item["name"]:
            if at is None or i == at:
                patch.set((*path, i), item)
            else:
                patch.remove((*path, i))
                patch.insert((*path, at), item)
            return
    if at is None or not items:
        patch.append(path, item)
    else:
        patch.insert((*path, at), item)


def _field_env(name: str, path: str) -> EnvVar:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def format_quantity(n: int) -> str:
    """Bytes as the shortest exact binary quantity: 8589934592 -> 8Gi."""
    for suffix, shift in _SUFFIXES:
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def sidecar_mode_for(git_version: str) -> str:
    """native from Kubernetes 1.29 (sidecar containers on by default), else container."""
    version = kubernetes_version(git_version)
    if version is None:
        raise ValueError(f"cannot read a Kubernetes version from {git_version!r}")
    return "native" if version >= (1, 29) else "container"


def _containers(spec: PodSpec) -> Iterator[Container]:
    """Init containers, then containers: every one that the sidecar may have to enforce."""
    for _, c in _containers_at(spec):
        yield c


def _containers_at(spec: PodSpec) -> Iterator[tuple[Path, Container]]:
    """Each container with its path in the pod: `("spec", "containers", 0)`."""
    for i, c in enumerate(spec.get("initContainers") or ()):
        yield ("spec", "initContainers", i), c
    for i, c in enumerate(spec.get("containers") or ()):
        yield ("spec", "containers", i), c


def _map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []
