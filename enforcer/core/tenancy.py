"""What a pod's author may loosen by annotation, as the operator decides (pure).

A pod's annotations choose how its sidecar enforces: the action, the grace period, how
far above its request a container may borrow (its ceiling), and whether it is injected at
all. The author is the tenant, and the tenant may be hostile: `action: warn`, a grace
period of a year, a ceiling of a whole GPU, or `inject: "false"` on a pod that declares
VRAM would each switch enforcement off or loosen it. So the operator bounds them,
cluster-wide and per namespace, and the webhook denies a pod beyond its bounds, naming the
annotation, the value and the bound.

The operator also says what a pod gets without asking: its action (`dry-run` or `warn`
while a namespace is rolled out, an enforcing one after), and what becomes of a container
that asks for a GPU and declares no VRAM (`UNDECLARED_GPU`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from enforcer.core.model import Action, format_bytes
from enforcer.core.parsing import (
    ConfigError,
    format_duration,
    parse_bytes,
    parse_duration,
)

# The webhook's actions: the sidecar's, and `dry-run`, the sidecar's dry run of `terminate`.
DRY_RUN = "dry-run"
ALL_ACTIONS: tuple[str, ...] = (
    Action.TERMINATE.value,
    Action.KILL.value,
    Action.RESTART.value,
    Action.WARN.value,
    DRY_RUN,
)
# Strictness has two levels: these signal nothing (a pod may stay over its limit), every
# other action enforces. A tenant who may choose one of these may choose to be over its limit.
REPORT_ONLY = (Action.WARN.value, DRY_RUN)
DEFAULT_ACTIONS = tuple(a for a in ALL_ACTIONS if a not in REPORT_ONLY)
DEFAULT_MAX_GRACE = 30.0  # Kubernetes' own default terminationGracePeriodSeconds

# What becomes of a container that asks for a GPU resource and declares no VRAM: denied,
# given `default_vram` as a LimitRange gives a default, or admitted as it is (the node agent
# accounts for the memory it holds).
DENY, OBSERVE, DEFAULT = "deny", "observe", "default"
UNDECLARED_GPU = (DENY, OBSERVE, DEFAULT)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the pods of one namespace may ask for, and what they get without asking."""

    actions: tuple[str, ...] = DEFAULT_ACTIONS
    max_grace_period: float = DEFAULT_MAX_GRACE
    allow_opt_out: bool = False
    # The highest ceiling a container may borrow up to; 0: no borrowing above requests.
    max_ceiling: int = 0
    # The action of a pod without the action annotation.
    default_action: str = Action.TERMINATE.value
    # A container that asks for a GPU and declares no VRAM: DENY, OBSERVE, or DEFAULT (it is
    # declared with `default_vram` bytes; 0: none).
    undeclared_gpu: str = DENY
    default_vram: int = 0


@dataclass(frozen=True, slots=True)
class Tenancy:
    """The cluster-wide bounds, and the namespaces that have their own."""

    default: Bounds = Bounds()
    namespaces: Mapping[str, Bounds] = field(default_factory=dict)

    def bounds(self, namespace: str) -> Bounds:
        return self.namespaces.get(namespace, self.default)


def parse_action_name(text: str, where: str) -> str:
    """One of the webhook's actions (`ALL_ACTIONS`), as given in any case."""
    action = text.strip().lower()
    if action not in ALL_ACTIONS:
        raise ConfigError(where, text, f"is not an action; use one of: {', '.join(ALL_ACTIONS)}")
    return action


def check_action(value: str, bounds: Bounds, where: str, namespace: str) -> str:
    """The annotation's action, if the operator lets this namespace choose it."""
    action = parse_action_name(value, where)
    if action not in bounds.actions:
        allowed = ", ".join(bounds.actions)
        raise ConfigError(
            where,
            value,
            f"is not allowed {in_namespace(namespace)}; the operator allows: "
            f"{allowed} (the webhook's --tenant-actions or --namespace-bounds)",
        )
    return action


def check_grace_period(value: str, bounds: Bounds, where: str, namespace: str) -> float:
    seconds = parse_duration(value, where)
    if seconds > bounds.max_grace_period:
        most = format_duration(bounds.max_grace_period)
        raise ConfigError(
            where,
            value,
            f"is longer than the {most} allowed {in_namespace(namespace)}; use at "
            f"most {most} (the webhook's --max-grace-period or --namespace-bounds)",
        )
    return seconds


CEILING_BY_NAME = "trainer=20Gi,server=8Gi"
CEILING_FORM = f"20Gi (a pod with one container that declares VRAM) or {CEILING_BY_NAME}"


def check_ceilings(
    value: str, requests: Mapping[str, int], bounds: Bounds, where: str, namespace: str
) -> dict[str, int]:
    """Container name -> ceiling, from the annotation's `value`: a quantity for the one
    container that declares VRAM, or `name=quantity` pairs. Each names a container that
    declares VRAM (`requests`, what its limits declare), is at least that request, and at
    most what the operator allows; a ceiling equal to the request borrows nothing and is
    left out."""
    pairs = [part.strip() for part in value.split(",")] if value.strip() else []
    if not pairs:
        raise ConfigError(where, value, f"is empty; use {CEILING_FORM}")
    if len(pairs) == 1 and "=" not in pairs[0]:
        if len(requests) != 1:
            raise ConfigError(
                where,
                value,
                f"names no container, and {len(requests)} containers declare "
                f"VRAM ({', '.join(sorted(requests))}); use name=quantity pairs, e.g. "
                f"{CEILING_BY_NAME}",
            )
        pairs = [f"{next(iter(requests))}={pairs[0]}"]
    found: dict[str, int] = {}
    for pair in pairs:
        name, sep, quantity = pair.partition("=")
        name, quantity = name.strip(), quantity.strip()
        if not sep or not name or name in found:
            problem = "is given twice" if name in found else "is not name=quantity"
            raise ConfigError(where, value, f"{pair!r} {problem}; use {CEILING_FORM}")
        if name not in requests:
            raise ConfigError(
                where,
                value,
                f"names container {name!r}, which declares no VRAM; a ceiling "
                f"is for a container that declares it ({', '.join(sorted(requests)) or 'none'})",
            )
        found[name] = _ceiling(quantity, requests[name], bounds, f"{where} {name!r}", namespace)
    return {name: c for name, c in found.items() if c > requests[name]}


def _ceiling(quantity: str, request: int, bounds: Bounds, where: str, namespace: str) -> int:
    ceiling = parse_bytes(quantity, where)
    if ceiling < request:
        raise ConfigError(
            where,
            quantity,
            f"is below the container's request of {format_bytes(request)} "
            "(its resources.limits): a ceiling is what it may borrow up to, at least what it "
            "is guaranteed",
        )
    check_borrowing(ceiling, request, bounds, where, quantity, namespace)
    return ceiling


def check_borrowing(
    ceiling: int | None, request: int, bounds: Bounds, where: str, value: object, namespace: str
) -> None:
    """Whether the operator lets this namespace borrow up to `ceiling` above `request`. A
    ceiling not known in bytes yet (a portion of a GPU) passes only where some borrowing
    is allowed: how much it is depends on the GPU."""
    if ceiling is None:
        too_far = not bounds.max_ceiling
    else:
        too_far = request < ceiling and bounds.max_ceiling < ceiling
    if too_far:
        allowed = (
            f"the operator allows ceilings up to {format_bytes(bounds.max_ceiling)}"
            if bounds.max_ceiling
            else "the operator allows no borrowing above requests"
        )
        raise ConfigError(
            where,
            value,
            f"is above what is allowed {in_namespace(namespace)}: {allowed} "
            "(the webhook's --max-vram-ceiling or --namespace-bounds)",
        )


def in_namespace(namespace: str) -> str:
    """`in namespace 'ml'`, for a message that says where a bound holds."""
    return f"in namespace {namespace!r}" if namespace else "here"


_BOUND_KEYS = (
    "actions",
    "maxGracePeriod",
    "allowOptOut",
    "maxCeiling",
    "defaultAction",
    "undeclaredGpu",
    "defaultVram",
)


def parse_namespace_bounds(text: str, field: str, default: Bounds) -> dict[str, Bounds]:
    """`{"research": {"actions": ["warn", "terminate"], "maxGracePeriod": "2m",
    "allowOptOut": true, "defaultAction": "dry-run"}}`: each namespace's bounds; a key left
    out keeps the default. See `check_defaults` for what holds only with the defaults known."""
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


_BOUNDS_FORM = (
    '{"NAMESPACE": {"actions": [...], "maxGracePeriod": "30s", "allowOptOut": false, '
    '"maxCeiling": "40Gi", "defaultAction": "dry-run", "undeclaredGpu": "default", '
    '"defaultVram": "8Gi"}}'
)


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
        parsed = tuple(parse_action_name(a, f"{where}.actions") for a in actions)
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
    if "maxCeiling" in given:
        value = given["maxCeiling"]
        if not isinstance(value, str):
            raise ConfigError(f"{where}.maxCeiling", value, "must be a quantity, e.g. 40Gi")
        bounds = replace(bounds, max_ceiling=parse_bytes(value, f"{where}.maxCeiling"))
    if "defaultAction" in given:
        value = given["defaultAction"]
        if not isinstance(value, str):
            raise ConfigError(f"{where}.defaultAction", value, "must be an action, e.g. dry-run")
        bounds = replace(bounds, default_action=parse_action_name(value, f"{where}.defaultAction"))
    if "undeclaredGpu" in given:
        value = given["undeclaredGpu"]
        if value not in UNDECLARED_GPU:
            raise ConfigError(
                f"{where}.undeclaredGpu", value, f"must be one of: {', '.join(UNDECLARED_GPU)}"
            )
        bounds = replace(bounds, undeclared_gpu=str(value))
    if "defaultVram" in given:
        value = given["defaultVram"]
        if not isinstance(value, str):
            raise ConfigError(f"{where}.defaultVram", value, "must be a quantity, e.g. 8Gi")
        bounds = replace(bounds, default_vram=parse_bytes(value, f"{where}.defaultVram"))
    return bounds


def check_defaults(bounds: Bounds, namespace: str | None, unit: int) -> None:
    """What holds once a namespace's bounds are complete (None: the cluster-wide ones):
    `default` has a size to give, and that size is a whole number of the resource's units
    (it is written into the pod as a declaration)."""
    mode, vram = ("--undeclared-gpu", "--default-vram")
    if namespace is not None:
        mode, vram = (f"--namespace-bounds {namespace!r}.{key}" for key in _DEFAULT_KEYS)
    if bounds.undeclared_gpu == DEFAULT and not bounds.default_vram:
        raise ConfigError(
            mode,
            DEFAULT,
            "declares a default VRAM for each container that asks for a GPU and declares "
            "none, and no default is set; set the webhook's --default-vram (or the "
            "namespace's defaultVram), e.g. 8Gi",
        )
    if bounds.default_vram % unit:
        raise ConfigError(
            vram,
            bounds.default_vram,
            f"(bytes) is not a whole number of {unit}-byte units (--resource-unit); give a "
            "multiple of it",
        )


_DEFAULT_KEYS = ("undeclaredGpu", "defaultVram")
