"""The JSON shapes the webhook relies on, checked before it reads or writes anything (pure).

The API server sends pods as it decoded them, but a webhook must answer any body with a
well-formed AdmissionReview: a list where a map belongs, a string where a list belongs, a
container without a name. `check()` denies such a pod with the field, what it holds and
what belongs there. `null` is the one oddity that is accepted: it means "absent" (the
webhook's patch replaces a null it adds to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from enforcer.core.payloads import Pod

CONTAINER_FIELDS = ("initContainers", "containers", "ephemeralContainers")
# Per container: the fields the webhook reads or writes, and what each holds.
_CONTAINER = {
    "env": list,
    "volumeMounts": list,
    "ports": list,
    "resources": dict,
    "securityContext": dict,
}
# In a securityContext (the pod's, or a container's): the maps the webhook reads, and the
# values each holds (`_SECURITY_VALUES`; capabilities hold lists of them).
_SECURITY_MAPS = ("appArmorProfile", "seLinuxOptions", "capabilities", "seccompProfile")
_SECURITY_VALUES: dict[str, type | tuple[type, ...]] = {
    "appArmorProfile": str,
    "seLinuxOptions": str,
    "capabilities": list,
    "seccompProfile": str,
}
_ITEM_NAMES = {"env": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
_ITEM_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "mountPath": str,
    "containerPort": int,
}


class ShapeError(ValueError):
    """A field holds the wrong kind of JSON value; the message says which, and what fits."""

    def __init__(self, field: str, value: object, expected: type | tuple[type, ...]) -> None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        super().__init__(
            f"{field}: {shown} is {_kind(value)}, where {_kind_of(expected)} belongs; fix the "
            'pod\'s manifest (or opt the pod out with vram-enforcer.io/inject: "false")'
        )
        self.field = field


def check(pod: Mapping[str, object]) -> Pod:
    """`pod`, typed, once every field the webhook uses has its JSON type (null: absent);
    else ShapeError for the first one that has not."""
    meta = _expect(pod.get("metadata"), dict, "metadata")
    _expect(meta.get("annotations"), dict, "metadata.annotations")
    _expect(meta.get("labels"), dict, "metadata.labels")
    spec = _expect(pod.get("spec"), dict, "spec")
    _security(_expect(spec.get("securityContext"), dict, "spec.securityContext"), "spec")
    for field in ("volumes", "resourceClaims"):  # DRA mode adds to the second
        for i, item in enumerate(_expect(spec.get(field), list, f"spec.{field}")):
            _expect(item, dict, f"spec.{field}[{i}]", nullable=False)
    for field in CONTAINER_FIELDS:
        for i, c in enumerate(_expect(spec.get(field), list, f"spec.{field}")):
            where = f"spec.{field}[{i}]"
            container = _expect(c, dict, where, nullable=False)
            name = _expect(container.get("name"), str, f"{where}.name", nullable=False)
            _container(container, f"spec.{field}[{name!r}]")
    return cast(Pod, pod)


def _container(c: Mapping[str, Any], where: str) -> None:
    _expect(c.get("targetContainerName"), str, f"{where}.targetContainerName")
    for field, kind in _CONTAINER.items():
        value = _expect(c.get(field), kind, f"{where}.{field}")
        if field == "resources":
            for part in ("limits", "requests"):
                _expect(value.get(part), dict, f"{where}.{field}.{part}")
            for j, claim in enumerate(
                _expect(value.get("claims"), list, f"{where}.{field}.claims")
            ):
                _expect(claim, dict, f"{where}.{field}.claims[{j}]", nullable=False)
        elif field == "securityContext":
            _expect(value.get("privileged"), bool, f"{where}.{field}.privileged")
            _security(value, where)
        else:
            key = _ITEM_NAMES[field]
            for j, item in enumerate(value):
                entry = _expect(item, dict, f"{where}.{field}[{j}]", nullable=False)
                _expect(entry.get(key), _ITEM_TYPES[key], f"{where}.{field}[{j}].{key}")


def _security(sc: Mapping[str, Any], where: str) -> None:
    """A securityContext's maps that the webhook reads: each value a string, and the
    capabilities lists of strings."""
    for field in _SECURITY_MAPS:
        part = f"{where}.securityContext.{field}"
        for key, value in _expect(sc.get(field), dict, part).items():
            held = _expect(value, _SECURITY_VALUES[field], f"{part}.{key}")
            if field == "capabilities":
                for j, item in enumerate(held):
                    _expect(item, str, f"{part}.{key}[{j}]", nullable=False)


def _expect(value: Any, kind: type | tuple[type, ...], field: str, nullable: bool = True) -> Any:
    """`value` if it has the right kind (None: empty, when `nullable`); else ShapeError."""
    if value is None and nullable:
        return {} if kind is dict else [] if kind is list else None
    if isinstance(value, bool) and kind is int:
        raise ShapeError(field, value, kind)  # JSON true is not a number
    if not isinstance(value, kind):
        raise ShapeError(field, value, kind)
    return value


_NAMES = {
    dict: "a map",
    list: "a list",
    str: "a string",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _kind(value: object) -> str:
    return _NAMES.get(type(value), type(value).__name__)


def _kind_of(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
