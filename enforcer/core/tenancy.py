"""What a pod's author may loosen by annotation, as the operator decides (pure).

A pod's annotations choose how its sidecar enforces: the action, the grace period, and
whether it is injected at all. The author is the tenant, and the tenant may be hostile:
`action: warn`, a grace period of a year, or `inject: "false"` on a pod that declares VRAM
would each switch enforcement off. So the operator bounds them, cluster-wide and per
namespace, and the webhook denies a pod beyond its bounds, naming the annotation, the value
and the bound.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from enforcer.core.model import Action
from enforcer.core.parsing import ConfigError, format_duration, parse_action, parse_duration

ALL_ACTIONS = (Action.TERMINATE, Action.KILL, Action.RESTART, Action.WARN)
# `warn` only reports: a tenant who may choose it may choose to be over its limit.
DEFAULT_ACTIONS = (Action.TERMINATE, Action.KILL, Action.RESTART)
DEFAULT_MAX_GRACE = 30.0  # Kubernetes' own default terminationGracePeriodSeconds


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the pods of one namespace may ask for."""

    actions: tuple[Action, ...] = DEFAULT_ACTIONS
    max_grace_period: float = DEFAULT_MAX_GRACE
    allow_opt_out: bool = False


@dataclass(frozen=True, slots=True)
class Tenancy:
    """The cluster-wide bounds, and the namespaces that have their own."""

    default: Bounds = Bounds()
    namespaces: Mapping[str, Bounds] = field(default_factory=dict)

    def bounds(self, namespace: str) -> Bounds:
        return self.namespaces.get(namespace, self.default)


def check_action(value: str, bounds: Bounds, where: str, namespace: str) -> Action:
    """The annotation's action, if the operator lets this namespace choose it."""
    action = parse_action(value, where, ALL_ACTIONS)
    if action not in bounds.actions:
        allowed = ", ".join(a.value for a in bounds.actions)
        raise ConfigError(
            where, value, f"is not allowed {in_namespace(namespace)}; the operator allows: "
            f"{allowed} (the webhook's --tenant-actions or --namespace-bounds)",
        )  # fmt: skip
    return action


def check_grace_period(value: str, bounds: Bounds, where: str, namespace: str) -> float:
    seconds = parse_duration(value, where)
    if seconds > bounds.max_grace_period:
        most = format_duration(bounds.max_grace_period)
        raise ConfigError(
            where, value, f"is longer than the {most} allowed {in_namespace(namespace)}; use at "
            f"most {most} (the webhook's --max-grace-period or --namespace-bounds)",
        )  # fmt: skip
    return seconds


def in_namespace(namespace: str) -> str:
    """`in namespace 'ml'`, for a message that says where a bound holds."""
    return f"in namespace {namespace!r}" if namespace else "here"


_BOUND_KEYS = ("actions", "maxGracePeriod", "allowOptOut")


def parse_namespace_bounds(text: str, field: str, default: Bounds) -> dict[str, Bounds]:
    """`{"research": {"actions": ["warn", "terminate"], "maxGracePeriod": "2m",
    "allowOptOut": true}}`: each namespace's bounds; a key left out keeps the default."""
    try:
        doc = json.loads(text) if text.strip() else {}
    except ValueError:
        raise ConfigError(field, text, f"is not JSON; use {_BOUNDS_FORM}") from None
    if not isinstance(doc, dict):
        raise ConfigError(field, text, f"is not a JSON object; use {_BOUNDS_FORM}")
    found = {}
    for namespace, given in doc.items():
        where = f"{field} {namespace!r}"
        if not isinstance(given, dict) or not set(given) <= set(_BOUND_KEYS):
            raise ConfigError(where, given, f"must be an object of {', '.join(_BOUND_KEYS)}")
        found[namespace] = _bounds(given, where, default)
    return found


_BOUNDS_FORM = '{"NAMESPACE": {"actions": [...], "maxGracePeriod": "30s", "allowOptOut": false}}'


def _bounds(given: Mapping[str, object], where: str, default: Bounds) -> Bounds:
    bounds = default
    if "actions" in given:
        actions = given["actions"]
        if (
            not isinstance(actions, list)
            or not actions
            or not all(isinstance(a, str) for a in actions)
        ):
            raise ConfigError(f"{where}.actions", actions, "must be a list of action names")
        parsed = tuple(parse_action(a, f"{where}.actions", ALL_ACTIONS) for a in actions)
        bounds = replace(bounds, actions=parsed)
    if "maxGracePeriod" in given:
        value = given["maxGracePeriod"]
        if not isinstance(value, str):
            raise ConfigError(f"{where}.maxGracePeriod", value, "must be a duration, e.g. 30s")
        seconds = parse_duration(value, f"{where}.maxGracePeriod")
        bounds = replace(bounds, max_grace_period=seconds)
    if "allowOptOut" in given:
        value = given["allowOptOut"]
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.allowOptOut", value, "must be true or false")
        bounds = replace(bounds, allow_opt_out=value)
    return bounds
