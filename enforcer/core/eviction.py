"""When the node agent evicts a pod instead of signalling it: the kernel refused a signal
to one of its victims (EPERM: a security module, an agent without CAP_KILL), and the
victim's unit is still over its limit.

The pod is first asked to leave through the API (policy/v1 Eviction), as `kubectl drain`
asks, which its PodDisruptionBudgets may refuse; the tenant writes those, and one with
`maxUnavailable: 0` (or two that select the pod) refuses for ever. So a refusal that lasts
`--eviction-timeout` ends as the kubelet's node-pressure eviction ends a pod it cannot hold
to its memory, budgets or not: the pod is deleted. Either way its containers get the grace
period of the pod's policy, never the `terminationGracePeriodSeconds` its author chose."""

from __future__ import annotations

import math
from collections.abc import Iterable

from enforcer.core import messages
from enforcer.core.model import Action, UnitUsage
from enforcer.core.parsing import format_duration
from enforcer.core.policy import PolicyConfig


def to_evict(denied: Iterable[str], units: Iterable[UnitUsage]) -> UnitUsage | None:
    """The unit the pod is evicted for: of the units a signal was refused for (`denied`,
    by name), the one most over its limit now; None while none of them is over."""
    refused = frozenset(denied)
    over = [u for u in units if u.name in refused and u.used_bytes > u.limit_bytes]
    return max(over, key=lambda u: u.used_bytes - u.limit_bytes, default=None)


def grace_seconds(policy: PolicyConfig) -> int:
    """The pod's grace period once it is evicted: its policy's (what its victim would have
    had between SIGTERM and SIGKILL), whole seconds up; `kill`: 1 s, as the kubelet gives a
    pod on a hard eviction threshold. Never 0: the API then removes the pod's object at once,
    before its containers have stopped (a force delete)."""
    if policy.action is Action.KILL:
        return 1
    return max(1, math.ceil(policy.grace_period))


def cause(unit: UnitUsage, label: str) -> str:
    """Why the pod is evicted: which unit, its usage and limit, and the refused signal."""
    return (
        f"{messages.usage(unit, label)}; the kernel refused the signal to its process "
        "(EPERM: a security module, or the agent lacks CAP_KILL)"
    )


def evicted(why: str, grace: int) -> str:
    """The Event that says the pod is evicted, and why (`cause`)."""
    return f"{why}, so the pod is evicted instead, with a grace period of {format_duration(grace)}"


def refused(why: str, retry_in: float, deleted_in: float) -> str:
    """The Event that says the eviction is refused for now (`why`: a PodDisruptionBudget),
    and when the pod is deleted all the same."""
    return (
        f"the eviction of this pod, over its VRAM limit and out of reach of signals, is "
        f"refused for now ({why}); retrying in {_seconds(retry_in)}. If it is still refused "
        f"in {_seconds(deleted_in)}, the pod is deleted whatever its PodDisruptionBudgets, as "
        "the kubelet's node-pressure eviction stops a pod"
    )


def deleted(why: str, refusal: str | None, refused_for: float, grace: int) -> str:
    """The Event that says the pod is deleted, and why (`cause`): its eviction was refused
    for `refused_for` seconds (`refusal`: the last refusal), or never asked for
    (`--eviction-timeout 0`: None)."""
    if refusal is None:
        asked = "without an eviction asked for first (--eviction-timeout 0)"
    else:
        asked = f"after its eviction was refused for {_seconds(refused_for)} ({refusal})"
    return (
        f"{why}, so the pod is deleted instead, {asked}, whatever its PodDisruptionBudgets, "
        "as the kubelet's node-pressure eviction stops a pod, with a grace period of "
        f"{format_duration(grace)}"
    )


def forbidden(why: str, retry_in: float) -> str:
    """The Event that says the agent may not make this pod leave (RBAC, or the chart's
    policy, refused it: `why`), and that it tries again."""
    return (
        f"this pod, over its VRAM limit and out of reach of signals, cannot be made to leave: "
        f"the agent may not ({why}); retrying in {_seconds(retry_in)}. Give the agent's "
        "ClusterRole create on pods/eviction and delete on pods (the chart's, or "
        "deploy/rbac/agent.yaml)"
    )


def _seconds(seconds: float) -> str:
    """A wait or an age, in whole seconds (at least 1)."""
    return format_duration(max(1, round(seconds)))
