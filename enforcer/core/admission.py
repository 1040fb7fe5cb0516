"""The webhook's decision (pure): an AdmissionReview in, an AdmissionReview out.

A pod that declares VRAM gets the sidecar, a shared PID namespace, the agent's socket, its
limits in the environment and, by default, a real `/dev/shm`. The patch is the difference
between the pod as submitted and as mutated (`jsonpatch.make_patch`), so it applies to
exactly the object the API server holds. Everything a user can get wrong is denied with a
message that names the container, the field, the value and the fix.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import jsonpatch

from enforcer.core import shapes
from enforcer.core.parsing import (
    ConfigError,
    parse_action,
    parse_bytes,
    parse_duration,
    parse_percent,
    parse_quantity,
)
from enforcer.core.settings.sidecar import METRICS_PORT_DEFAULT, SIDECAR_ACTIONS

API_VERSION = "admission.k8s.io/v1"
INJECT = "vram-enforcer.io/inject"
INJECTED = "vram-enforcer.io/injected"
ENFORCED = "vram-enforcer.io/enforced"
SHM_SIZE = "vram-enforcer.io/shm-size"
METRICS_PORT_ANNOTATION = "vram-enforcer.io/metrics-port"
SIDECAR = "vram-enforcer"
SOCKET_VOLUME = "vram-enforcer-socket"
SHM_VOLUME = "vram-enforcer-shm"
TOKEN_VOLUME = "vram-enforcer-token"  # noqa: S105 - a volume name, not a secret
SOCKET_DIR = "/run/vram-enforcer"
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
    runtime_class: str | None = None
    sidecar_cpu: str = "10m"
    sidecar_memory: str = "96Mi"
    agent_socket: str = f"{SOCKET_DIR}/agent.sock"


class BadReview(ValueError):
    """The body is not an AdmissionReview with a request uid: answered with HTTP 400."""


class Denied(Exception):
    """The pod cannot be admitted; the message tells the user what to change."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The AdmissionReview to answer with, and how it ended (the metric's `result`)."""

    review: dict[str, Any]
    result: str  # patched, skipped, denied, invalid


def review(doc: object, settings: AdmissionSettings) -> Outcome:
    """Answer one AdmissionReview (the decoded request body). Raises BadReview without uid."""
    uid = _uid(doc)
    if not isinstance(doc, dict):  # pragma: no cover - _uid has checked it
        raise BadReview("not an AdmissionReview")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "AdmissionReview":
        problem = f"expected apiVersion {API_VERSION}, kind AdmissionReview"
        return Outcome(_deny(uid, f"unsupported review: {problem}", 400), "invalid")
    request = doc["request"]
    kind = request.get("kind") or {}
    if (
        request.get("operation") != "CREATE"
        or not isinstance(kind, dict)
        or (kind.get("group"), kind.get("kind")) != ("", "Pod")
        or request.get("subResource")
    ):
        return Outcome(_allow(uid, []), "skipped")
    pod = request.get("object")
    if not isinstance(pod, dict):
        return Outcome(_deny(uid, "request.object is not a Pod object", 400), "invalid")
    try:
        ops = mutate(pod, settings)
    except Denied as exc:
        return Outcome(_deny(uid, str(exc), 403), "denied")
    return Outcome(_allow(uid, ops), "patched" if ops else "skipped")


def _uid(doc: object) -> str:
    request = doc.get("request") if isinstance(doc, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    if not isinstance(uid, str) or not uid:
        raise BadReview("not an AdmissionReview: request.uid is missing")
    return uid


def _allow(uid: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _deny(uid: str, message: str, code: int) -> dict[str, Any]:
    response = {"uid": uid, "allowed": False, "status": {"code": code, "message": message}}
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def mutate(pod: Mapping[str, Any], settings: AdmissionSettings) -> list[dict[str, Any]]:
    """The JSON patch that makes `pod` enforced; [] when it is not ours to touch."""
    meta = _dict(pod.get("metadata"))
    annotations = _dict(meta.get("annotations"))
    if str(annotations.get(INJECT, "")).lower() == "false" or INJECTED in annotations:
        return []
    spec = _dict(pod.get("spec"))
    limits = declared_limits(spec, settings)
    if not limits:
        return []
    try:
        shapes.check(pod)
    except shapes.ShapeError as exc:
        raise Denied(str(exc)) from None
    _check_pod(spec, annotations)
    sidecar_env = _sidecar_settings(annotations)
    metrics_port = _metrics_port(annotations, spec)
    shm = str(annotations.get(SHM_SIZE, settings.shm_default))
    shm_limit = None if shm == "off" else _shm_limit(shm, spec)
    out: dict[str, Any] = copy.deepcopy(dict(pod))
    shapes.without_nulls(out)
    out_spec = out.setdefault("spec", {})
    out_meta = out.setdefault("metadata", {})
    out_spec["shareProcessNamespace"] = True
    for c in _containers(out_spec):
        if c.get("name") in limits:
            _workload_env(c, limits[c["name"]], settings)
    if shm != "off":
        _add_shm(out_spec, shm_limit)
    _add_sidecar(out_spec, limits, sidecar_env, metrics_port, settings)
    if settings.gpu_exposure == "env" and settings.runtime_class:
        out_spec.setdefault("runtimeClassName", settings.runtime_class)
    out_meta.setdefault("annotations", {})[INJECTED] = "true"
    out_meta.setdefault("labels", {})[ENFORCED] = "true"
    ops: list[dict[str, Any]] = jsonpatch.make_patch(dict(pod), out).patch
    return ops


def declared_limits(spec: Mapping[str, Any], settings: AdmissionSettings) -> dict[str, int]:
    """Container name -> limit in bytes, for each container that declares the resource."""
    limits: dict[str, int] = {}
    for field, c in _named_containers(spec):
        resources = _dict(c.get("resources"))
        limit = _dict(resources.get("limits")).get(settings.resource_name)
        request = _dict(resources.get("requests")).get(settings.resource_name)
        if limit is None and request is None:
            continue
        where = f"{field}[{c['name']!r}].resources"
        if limit is None:
            raise Denied(
                f"{where}.requests[{settings.resource_name!r}] is set but limits is not; "
                f"extended resources are declared in limits (requests default to them): "
                f"set limits[{settings.resource_name!r}]: {request!r}"
            )
        units = _units(limit, f"{where}.limits[{settings.resource_name!r}]", settings)
        request_field = f"{where}.requests[{settings.resource_name!r}]"
        if request is not None and _units(request, request_field, settings) != units:
            raise Denied(
                f"{where}: requests[{settings.resource_name!r}] {request!r} differs from "
                f"limits {limit!r}; VRAM cannot be overcommitted: make them equal, or drop "
                "the request"
            )
        limits[c["name"]] = int(units) * settings.resource_unit
    return limits


def _units(value: object, field: str, settings: AdmissionSettings) -> Decimal:
    try:
        units = parse_quantity(str(value), field=field)
    except ConfigError as exc:
        raise Denied(str(exc)) from None
    unit = "bytes" if settings.resource_unit == 1 else f"{settings.resource_unit}-byte units"
    if units < 0 or units != units.to_integral_value():
        raise Denied(
            f"{field}: {value!r} is not a whole number of {unit}; use a whole number, "
            f"e.g. {max(1, int(units.to_integral_value()))}"
        )
    return units


def _check_pod(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> None:
    if spec.get("hostPID") is True:
        raise Denied(
            "spec.hostPID: true cannot be combined with the shared process namespace that VRAM "
            f'enforcement needs; remove hostPID, or opt the pod out with {INJECT}: "false"'
        )
    names = {c.get("name") for _, c in _named_containers(spec)}
    volumes = {str(v.get("name")) for v in _list(spec.get("volumes")) if isinstance(v, dict)}
    if SIDECAR in names:
        raise Denied(
            f"a container is already named {SIDECAR!r}, the name of the enforcer's sidecar; "
            f'rename it, or opt the pod out with {INJECT}: "false"'
        )
    taken = volumes & {SOCKET_VOLUME, SHM_VOLUME, TOKEN_VOLUME}
    if taken:
        raise Denied(f"spec.volumes: {sorted(taken)[0]!r} is reserved for the enforcer; rename it")


def _sidecar_settings(annotations: Mapping[str, Any]) -> dict[str, str]:
    """The sidecar's variables from the pod's annotations, each checked as the sidecar will."""
    env: dict[str, str] = {}
    for key, var in _SETTINGS.items():
        if key not in annotations:
            continue
        value = str(annotations[key])
        field = f"metadata.annotations[{key!r}]"
        try:
            if var == "VRAM_ENFORCER_ACTION":
                parse_action(value, field=field, allowed=SIDECAR_ACTIONS)
            elif var == "VRAM_ENFORCER_GRACE_PERIOD":
                parse_duration(value, field=field)
            else:
                parse_percent(value, field=field)
        except ConfigError as exc:
            raise Denied(str(exc)) from None
        env[var] = value
    return env


def _metrics_port(annotations: Mapping[str, Any], spec: Mapping[str, Any]) -> int:
    """The sidecar's metrics port: the annotation's, else the first from 9477 up that no
    container declares. The containers share the pod's network namespace, so a port taken
    twice would keep the sidecar from serving metrics. Scrapers find it by its name."""
    declared = {
        port.get("containerPort"): f"{field}[{c['name']!r}].ports"
        for field, c in _named_containers(spec)
        for port in _list(c.get("ports"))
        if isinstance(port, dict) and port.get("protocol", "TCP") == "TCP"
    }
    if METRICS_PORT_ANNOTATION not in annotations:
        return next(p for p in range(METRICS_PORT_DEFAULT, 65536) if p not in declared)
    value = str(annotations[METRICS_PORT_ANNOTATION])
    field = f"metadata.annotations[{METRICS_PORT_ANNOTATION!r}]"
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise Denied(f"{field}: {value!r} is not a TCP port; use 1-65535")
    if int(value) in declared:
        raise Denied(
            f"{field}: port {value} is also declared in {declared[int(value)]}; the containers "
            "of a pod share one network namespace: choose another port for the sidecar"
        )
    return int(value)


def _shm_limit(value: str, spec: Mapping[str, Any]) -> int | None:
    """The /dev/shm sizeLimit in bytes (None: no limit) for `auto` or a quantity."""
    if value == "auto":
        # The largest container memory limit: tmpfs pages count against the container's
        # memory, so more than that could never be used anyway.
        known = [m for c in _list(spec.get("containers")) if (m := _memory_limit(c)) is not None]
        return max(known) if known else None
    try:
        return parse_bytes(value, field=f"metadata.annotations[{SHM_SIZE!r}]")
    except ConfigError as exc:
        raise Denied(f"{exc}; or use auto or off") from None


def _memory_limit(c: object) -> int | None:
    memory = _dict(_dict(_dict(c).get("resources")).get("limits")).get("memory")
    if memory is None:
        return None
    try:
        return parse_bytes(str(memory), field="memory")
    except ConfigError:
        return None  # the API server's own validation will say so


def _workload_env(c: dict[str, Any], limit: int, settings: AdmissionSettings) -> None:
    env = c.setdefault("env", [])
    names = {e.get("name") for e in env if isinstance(e, dict)}
    env[:] = [e for e in env if not (isinstance(e, dict) and e.get("name") == "VRAM_LIMIT_BYTES")]
    env.append({"name": "VRAM_LIMIT_BYTES", "value": str(limit)})
    extra = {**(FRAMEWORK_ENV if settings.framework_env else {})}
    if settings.gpu_exposure == "env" and not _requests_gpus(c):
        extra.update(GPU_ENV)  # a container given GPUs by the device plugin keeps those
    env.extend({"name": k, "value": v} for k, v in extra.items() if k not in names)


def _requests_gpus(c: Mapping[str, Any]) -> bool:
    resources = _dict(c.get("resources"))
    return any(
        key.startswith("nvidia.com/")
        for part in ("limits", "requests")
        for key in _dict(resources.get(part))
    )


def _add_shm(spec: dict[str, Any], size: int | None) -> None:
    missing = [
        c
        for c in _list(spec.get("containers"))
        if isinstance(c, dict)
        and not any(
            isinstance(m, dict) and str(m.get("mountPath", "")).rstrip("/") == SHM_DIR
            for m in _list(c.get("volumeMounts"))
        )
    ]
    if not missing:
        return
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if size is not None:
        empty_dir["sizeLimit"] = format_quantity(size)
    spec.setdefault("volumes", []).append({"name": SHM_VOLUME, "emptyDir": empty_dir})
    for c in missing:
        c.setdefault("volumeMounts", []).append({"name": SHM_VOLUME, "mountPath": SHM_DIR})


def _add_sidecar(spec: dict[str, Any], limits: Mapping[str, int], settings_env: Mapping[str, str],
                 metrics_port: int, settings: AdmissionSettings) -> None:  # fmt: skip
    env = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("NODE_NAME", "spec.nodeName"),
        {"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps(dict(limits), separators=(",", ":"))},
        {
            "name": "VRAM_ENFORCER_CONTAINERS",
            "value": ",".join(c["name"] for c in _containers(spec)),
        },
        *({"name": k, "value": v} for k, v in settings_env.items()),
        {"name": "VRAM_ENFORCER_AGENT_SOCKET", "value": settings.agent_socket},
        {"name": "VRAM_ENFORCER_SIDECAR_MODE", "value": settings.sidecar_mode},
        {"name": "VRAM_ENFORCER_METRICS_PORT", "value": str(metrics_port)},
    ]
    mounts = [{"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR, "readOnly": True}]
    volumes = spec.setdefault("volumes", [])
    volumes.append(
        {"name": SOCKET_VOLUME, "hostPath": {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}}
    )
    if spec.get("automountServiceAccountToken") is False:
        # The pod opted out of the API token; the sidecar still needs one, for itself only.
        volumes.append(_token_volume())
        mounts.append({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
    sidecar: dict[str, Any] = {
        "name": SIDECAR,
        "image": settings.sidecar_image,
        "command": ["vram-enforcer", "sidecar"],
        "env": env,
        "ports": [{"name": "vram-metrics", "containerPort": metrics_port, "protocol": "TCP"}],
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
    }
    if settings.sidecar_mode == "native":
        sidecar["restartPolicy"] = "Always"
        spec.setdefault("initContainers", []).insert(0, sidecar)
    else:
        spec.setdefault("containers", []).append(sidecar)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _token_volume() -> dict[str, Any]:
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt",
                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace",
                                            "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]
        },
    }  # fmt: skip


_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def format_quantity(n: int) -> str:
    """Bytes as the shortest exact binary quantity: 8589934592 -> 8Gi."""
    for suffix, shift in _SUFFIXES:
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def sidecar_mode_for(git_version: str) -> str:
    """native from Kubernetes 1.29 (sidecar containers on by default), else container."""
    m = re.match(r"v?(\d+)\.(\d+)", git_version)
    if m is None:
        raise ValueError(f"cannot read a Kubernetes version from {git_version!r}")
    return "native" if (int(m[1]), int(m[2])) >= (1, 29) else "container"


def _containers(spec: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for _, c in _named_containers(spec):
        yield c


def _named_containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers"):
        for c in _list(spec.get(field)):
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                yield f"spec.{field}", c


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
