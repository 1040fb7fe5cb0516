"""An AdmissionReview in, an AdmissionReview out (pure): which pods are ours, the checks
and denials, and the mutation, put together from `sidecar`, `claims` and `patch`."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from enforcer.core import kai, shapes
from enforcer.core.admission import isolation, undeclared
from enforcer.core.admission.claims import claim_template, claim_vram, claimed_limits, template_size
from enforcer.core.admission.common import (
    CEILING,
    INJECT,
    INJECTED,
    METRICS_PORT_ANNOTATION,
    SHM_SIZE,
    AdmissionSettings,
    Denied,
    as_list,
    as_map,
    containers,
    containers_at,
    deny_sidecar_name,
)
from enforcer.core.admission.ephemeral import EPHEMERAL, mutate_ephemeral
from enforcer.core.admission.gate import gate_containers, holder_env
from enforcer.core.admission.patch import Patch
from enforcer.core.admission.sidecar import (
    NO_TOKEN_VOLUME,
    SHM_VOLUME,
    SOCKET_VOLUME,
    action_env,
    add_shm,
    add_sidecar,
    check_sidecar_env,
    shm_size_limit,
    sidecar_variables,
    toolkit_env,
    workload_env,
)
from enforcer.core.declaration import (
    CEILINGS_ENV,
    ENFORCED,
    GPUS_ENV,
    PORTIONS_ENV,
    SIDECAR,
    Declaration,
    Undeclarable,
    declared_limits,
    encode_portions,
)
from enforcer.core.owed import owed
from enforcer.core.parsing import (
    ConfigError,
    kubernetes_version,
    parse_percent,
)
from enforcer.core.payloads import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionReview,
    PatchOperation,
    PodSpec,
)
from enforcer.core.settings import sidecar as declared
from enforcer.core.tenancy import (
    REPORT_ONLY,
    Bounds,
    check_action,
    check_borrowing,
    check_ceilings,
    check_grace_period,
    in_namespace,
)

API_VERSION = "admission.k8s.io/v1"


ACTION = "vram-enforcer.io/action"
# Annotation -> the sidecar variable it sets, and how it is checked (the action: `_action`).
_SETTINGS = {
    "vram-enforcer.io/grace-period": declared.GRACE_PERIOD.variable,
    "vram-enforcer.io/warn-at": declared.WARN_AT.variable,
}


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """The AdmissionReview to answer with, and how it ended (the metric's `result`)."""

    review: AdmissionReview
    result: str  # patched, skipped, denied, invalid


def review(doc: object, settings: AdmissionSettings) -> Outcome:
    """Answer one AdmissionReview (the decoded request body). Raises BadReview without uid."""
    request = _request(doc)
    uid = request["uid"]
    envelope = as_map(doc)
    if envelope.get("apiVersion") != API_VERSION or envelope.get("kind") != "AdmissionReview":
        problem = f"expected apiVersion {API_VERSION}, kind AdmissionReview"
        return Outcome(_deny(uid, f"unsupported review: {problem}", 400), "invalid")
    kind = as_map(request.get("kind"))
    what = (request.get("operation"), request.get("subResource") or None)
    if (kind.get("group"), kind.get("kind")) != ("", "Pod") or what not in _REVIEWED:
        return Outcome(_allow(uid, []), "skipped")
    pod = request.get("object")
    if not isinstance(pod, dict):
        return Outcome(_deny(uid, "request.object is not a Pod object", 400), "invalid")
    stored = request.get("oldObject")
    if what == _EPHEMERAL and not isinstance(stored, dict):
        return Outcome(_deny(uid, "request.oldObject is not a Pod object", 400), "invalid")
    namespace = request.get("namespace")
    said: list[str] = []
    try:
        if what == _EPHEMERAL:
            ops = mutate_ephemeral(pod, as_map(stored))
        else:
            ops = mutate(pod, settings, namespace if isinstance(namespace, str) else "", said)
    except Denied as exc:
        return Outcome(_deny(uid, str(exc), 403), "denied")
    warnings = [*_warnings(pod), *said] if ops and what == _CREATE else []
    return Outcome(_allow(uid, ops, warnings), "patched" if ops else "skipped")


# What the webhook reviews: pods created, and ephemeral containers added to a pod.
_CREATE = ("CREATE", None)
_EPHEMERAL = ("UPDATE", EPHEMERAL)
_REVIEWED = (_CREATE, _EPHEMERAL)


def _warnings(pod: Mapping[str, object]) -> list[str]:
    """What the user is told of an injected pod (kubectl prints "Warning: ..."): the
    annotations of earlier releases that no longer do anything."""
    if METRICS_PORT_ANNOTATION not in as_map(as_map(pod.get("metadata")).get("annotations")):
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
    meta, spec = as_map(pod.get("metadata")), as_map(pod.get("spec"))
    namespace = meta.get("namespace")
    if settings.dra_class is None or not isinstance(namespace, str) or not namespace:
        return []
    sizes = {
        size
        for rc in as_list(spec.get("resourceClaims"))
        if (size := template_size(str(as_map(rc).get("resourceClaimTemplateName") or "")))
        is not None
    }
    return [claim_template(namespace, size, settings) for size in sorted(sizes) if size > 0]


def _request(doc: object) -> AdmissionRequest:
    """The request of an AdmissionReview, once it is known to have a uid to answer to."""
    request = as_map(doc).get("request")
    uid = as_map(request).get("uid")
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
    pod: Mapping[str, object],
    settings: AdmissionSettings,
    namespace: str = "",
    said: list[str] | None = None,
) -> list[PatchOperation]:
    """The JSON patch that makes `pod` enforced; [] when it is not ours to touch. What the
    user is told of it (kubectl's "Warning: ..."), if anything, is appended to `said`.

    In DRA mode (`settings.dra_class`), a declaration becomes a claim (see `claim_vram`),
    and a pod with claims made by hand is enforced too: the sidecar takes its limits from
    the claims (`--limits-from dra`).

    Nothing the pod says makes it "already enforced": not an annotation, not a container
    named like the sidecar. Every part of the mutation is asserted again, in place, on every
    pass, so a reinvocation over our own output changes nothing, and a pod that forged any
    part of it (the sidecar, its volumes, `shareProcessNamespace: false`) gets ours back.
    """
    annotations = as_map(as_map(pod.get("metadata")).get("annotations"))
    raw_spec = as_map(pod.get("spec"))
    limits, by_kai = _declares(raw_spec, annotations, settings)
    claims_by_hand = settings.dra_class is not None and bool(
        as_list(raw_spec.get("resourceClaims"))
    )
    bounds = settings.tenancy.bounds(namespace)
    defaults = (
        {}  # KAI's annotations declare the pod's share; or the pod is left alone
        if by_kai or _may_opt_out(annotations, bounds)
        else undeclared.defaults(raw_spec, limits, bounds, settings, namespace)
    )
    if not limits and not defaults and not claims_by_hand and not by_kai:
        deny_sidecar_name(raw_spec, "declares no VRAM")
        return []
    if _opts_out(raw_spec, annotations, bounds, namespace):
        return []
    try:
        checked = shapes.check(pod)  # from here on, every field read has its JSON type
    except shapes.ShapeError as exc:
        raise Denied(str(exc)) from None
    spec = checked.get("spec") or {}
    _check_pod(spec, annotations, settings)
    if settings.dra_class is not None:
        limits = {**claimed_limits(spec), **limits}  # our claims, from an earlier pass
    limits = undeclared.with_defaults(spec, limits, defaults)
    action = _action(annotations, bounds, namespace)
    sidecar_env = _sidecar_settings(annotations, bounds, namespace, action)
    if by_kai:
        declared = _kai(annotations, spec, bounds, namespace)
    else:
        declared = Declaration(limits, _ceilings(annotations, limits, bounds, namespace))
    declared = _reporting(declared, annotations, action, namespace, said)
    limits, ceilings = dict(declared.requests), dict(declared.ceilings)
    if declared.portions:
        sidecar_env[PORTIONS_ENV] = encode_portions(declared.portions)
    if declared.gpus:
        sidecar_env[GPUS_ENV] = json.dumps(declared.gpus, separators=(",", ":"))
    if ceilings:
        sidecar_env[CEILINGS_ENV] = json.dumps(ceilings, separators=(",", ":"))
    shm = str(annotations.get(SHM_SIZE, settings.shm_default))
    shm_limit = None if shm == "off" else shm_size_limit(shm, spec)
    patch = Patch(checked)
    patch.set(("spec", "shareProcessNamespace"), True)
    isolation.drop_kill_beside_the_sidecar(patch)
    _declaring_containers(patch, limits, ceilings, defaults, settings)
    sidecar_env.update(_refusing(patch, declared, action, settings, said))
    env = sidecar_variables(spec, limits, sidecar_env, settings)
    check_sidecar_env(env)
    if shm != "off":
        add_shm(patch, shm_limit)
    add_sidecar(patch, env, settings)
    runtime_class = settings.runtime_class if settings.gpu_exposure == "env" else None
    if runtime_class and patch.get(("spec", "runtimeClassName")) is None:
        patch.set(("spec", "runtimeClassName"), runtime_class)
    patch.set(("metadata", "annotations", INJECTED), "true")
    patch.set(("metadata", "labels", ENFORCED), "true")
    return patch.ops


def _declaring_containers(
    patch: Patch,
    limits: Mapping[str, int],
    ceilings: Mapping[str, int],
    defaults: Mapping[str, int],
    settings: AdmissionSettings,
) -> None:
    """Each declaring container: the declaration it is given by default (in DRA mode, the
    claim made from it is the declaration), its environment, and in DRA mode its claim."""
    for where, c in containers_at(patch.get(("spec",))):
        name = c["name"]
        if name in defaults and settings.dra_class is None:
            quantity = undeclared.declared_quantity(defaults[name], settings)
            patch.set((*where, "resources", "limits", settings.resource_name), quantity)
        if name in limits:
            workload_env(patch, where, limits[name], ceilings.get(name), settings)
            if settings.dra_class is not None:
                claim_vram(patch, where, limits[name], settings)


def _refusing(
    patch: Patch,
    declared: Declaration,
    action: str,
    settings: AdmissionSettings,
    said: list[str] | None,
) -> dict[str, str]:
    """What makes the node refuse a container's allocations past its limit, where the
    flags ask for it: the toolkit hook's limit, the allocation gate's profile. Refusing is
    enforcing: a pod only reported on gets neither. Returned: the sidecar's variables for
    it (`holder_env`: a gated pod's sidecar holds its fds)."""
    enforced = action not in REPORT_ONLY
    _toolkit_limits(patch, declared, settings.toolkit_limits and enforced)
    gate_containers(patch, set(declared.requests), said, settings.allocation_gate and enforced)
    return holder_env(patch.get(("spec",)))


def _toolkit_limits(patch: Patch, declared: Declaration, toolkit: bool) -> None:
    """The NVIDIA toolkit hook's variables on every container of the pod. With `toolkit`
    (`--toolkit-memory-limits`, and an action that enforces: the hook's limit refuses
    allocations, not for a pod only reported on), on each declaring container what it is
    owed on each of its GPUs (`owed`: its ceiling; one share of a share spread over N
    GPUs), since the hook sets one value on every GPU the container was given. On every
    other container, no hard limit of its own; on all of them soft 0 (`toolkit_env`): no
    container sets its own limit or reservation through the hook. The sidecar is ours,
    and `add_sidecar` writes all of it."""
    units = owed(declared, None, None).units if toolkit else ()
    per_gpu = {o.unit.containers[0]: o.ceiling for o in units}
    for where, c in containers_at(patch.get(("spec",))):
        if c["name"] != SIDECAR:
            toolkit_env(patch, where, per_gpu.get(c["name"]))


def _may_opt_out(annotations: Mapping[str, object], bounds: Bounds) -> bool:
    """Whether the pod opts out of injection (`inject: "false"`) where the operator lets it."""
    return bounds.allow_opt_out and _opting_out(annotations)


def _opting_out(annotations: Mapping[str, object]) -> bool:
    return str(annotations.get(INJECT, "")).lower() == "false"


def _opts_out(
    spec: Mapping[str, object], annotations: Mapping[str, object], bounds: Bounds, namespace: str
) -> bool:
    """Whether a declaring pod opts out of injection (`inject: "false"`), where the operator
    lets it; denied elsewhere. Admitted as it is, it may not carry the sidecar's name."""
    if not _opting_out(annotations):
        return False
    if not bounds.allow_opt_out:
        raise Denied(
            f"metadata.annotations[{INJECT!r}]: 'false' is not allowed "
            f"{in_namespace(namespace)}: a pod that declares VRAM is held to it. Remove the "
            "annotation (the operator lets pods opt out with the webhook's --allow-opt-out or "
            "--namespace-bounds)"
        )
    deny_sidecar_name(spec, f"opts out of it (metadata.annotations[{INJECT!r}]: 'false')")
    return True


def _check_pod(
    spec: PodSpec, annotations: Mapping[str, object], settings: AdmissionSettings
) -> None:
    """Deny what the mutation cannot make right. A container named like the sidecar that
    runs our image, and our volumes beside it, are an earlier pass's (or a forgery of it):
    they are replaced with ours in place. Anything else under our names is the user's. Nor
    may the other containers reach into the sidecar, or out of its reach (`isolation`)."""
    if spec.get("hostPID") is True:
        raise Denied(
            "spec.hostPID: true cannot be combined with the shared process namespace that VRAM "
            "enforcement needs; remove hostPID"
        )
    images = [c.get("image") for c in containers(spec) if c["name"] == SIDECAR]
    if any(image != settings.sidecar_image for image in images):
        raise Denied(
            f"a container is already named {SIDECAR!r}, the name of the enforcer's "
            "sidecar; rename it"
        )
    if len(images) > 1:  # never an earlier pass's, and each would be one more operation
        raise Denied(
            f"spec: {len(images)} containers are named {SIDECAR!r}, the name of the enforcer's "
            "sidecar; a pod's container names are unique: remove them"
        )
    volumes = {str(v.get("name")) for v in spec.get("volumes") or ()}
    taken = volumes & {SOCKET_VOLUME, SHM_VOLUME, NO_TOKEN_VOLUME}
    if taken and not images:
        raise Denied(f"spec.volumes: {sorted(taken)[0]!r} is reserved for the enforcer; rename it")
    isolation.check_pod(spec, annotations)


def _sidecar_settings(
    annotations: Mapping[str, object], bounds: Bounds, namespace: str, action: str
) -> dict[str, str]:
    """The sidecar's variables from the pod's annotations, each checked as the sidecar will,
    and against what the operator lets this namespace loosen; and its action (`_action`),
    unless that is the sidecar's own default, given by no one."""
    env: dict[str, str] = {}
    if ACTION in annotations or action != declared.ACTION.default:
        env.update(action_env(action))
    for key, var in _SETTINGS.items():
        if key not in annotations:
            continue
        value = str(annotations[key])
        field = f"metadata.annotations[{key!r}]"
        try:
            if var == declared.GRACE_PERIOD.variable:
                check_grace_period(value, bounds, field, namespace)
            else:
                parse_percent(value, field=field)
        except ConfigError as exc:
            raise Denied(str(exc)) from None
        env[var] = value
    return env


def _action(annotations: Mapping[str, object], bounds: Bounds, namespace: str) -> str:
    """The pod's action: its annotation's, where the operator lets this namespace choose it
    (`Bounds.actions`, enforcing ones only by default: a pod may be stricter than a
    report-only default, not laxer), else the namespace's default."""
    if ACTION not in annotations:
        return bounds.default_action
    field = f"metadata.annotations[{ACTION!r}]"
    try:
        return check_action(str(annotations[ACTION]), bounds, field, namespace)
    except ConfigError as exc:
        raise Denied(str(exc)) from None


def _reporting(
    declared: Declaration,
    annotations: Mapping[str, object],
    action: str,
    namespace: str,
    said: list[str] | None,
) -> Declaration:
    """The declaration of a pod only reported on (`REPORT_ONLY`) borrows nothing: what it
    borrowed could not be taken back, and its neighbours would go without their requests.
    A ceiling the pod asks for beside a report-only action it chose is denied; beside its
    namespace's report-only default it is dropped, and the user told: denying it would stop
    a workload's replacement pods in a namespace switched to observe."""
    held = declared.held_to_requests()
    if action not in REPORT_ONLY or held == declared:
        return declared
    field = (
        f"metadata.annotations[{CEILING!r}]"
        if CEILING in annotations
        else "the limit in KAI Scheduler's annotations"
    )
    why = (
        "a pod that is only reported on borrows nothing above its request (what it borrowed "
        "could not be taken back while its neighbours go without theirs)"
    )
    if ACTION in annotations:
        raise Denied(
            f"{field}: a ceiling cannot go with metadata.annotations[{ACTION!r}]: "
            f"{annotations[ACTION]!r}: {why}. Remove the ceiling, or choose an enforcing action"
        )
    if said is not None:
        said.append(
            f"{field} is ignored: the default action {in_namespace(namespace)} is {action!r}, "
            f"and {why}; the pod is held to its request. Remove the ceiling, or choose an "
            f"enforcing action with metadata.annotations[{ACTION!r}]"
        )
    return held


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


def sidecar_mode_for(git_version: str) -> str:
    """native from Kubernetes 1.29 (sidecar containers on by default), else container."""
    version = kubernetes_version(git_version)
    if version is None:
        raise ValueError(f"cannot read a Kubernetes version from {git_version!r}")
    return "native" if version >= (1, 29) else "container"
