"""The last enforcement on a pod as a pod condition (pure): what outlives its Events.

Events expire after an hour (the API server's `--event-ttl`); a pod condition stays while
the pod does, `kubectl describe pod` shows it under Conditions, and a failed Job's pod keeps
it. The agent writes one condition of its own type per pod, the latest enforcement
replacing the one before (a strategic-merge patch of `status.conditions` merges by
`type`: the kubelet's conditions are left as they are, and the kubelet keeps ours, as it
keeps every condition it does not own).

Its message is built from the agent's own view only: which container (one of the pod's),
that container's instance (its container ID and restarts, as the pod's status named them),
what the agent's NVML pass saw it use and what the pod declares. A sidecar's report is the
tenant's: it can make the agent write the condition of its own pod, with one of the
`ENFORCING` reasons, and nothing of its text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from enforcer.core.model import Action, format_bytes
from enforcer.core.payloads import Pod
from enforcer.core.pod import STATUSES, json_map, json_maps
from enforcer.core.pod_metrics import ContainerSeries
from enforcer.core.reasons import Reason

# A condition type of our own is a qualified name, as readiness gates' are: none of the
# kubelet's own (Ready, PodScheduled, ...), which the kubelet owns and rewrites.
CONDITION_TYPE = "vram-enforcer.io/Enforced"
MESSAGE_CHARS = 1024  # as an Event's: `kubectl describe` shows it whole on one line

# The Events that are enforcements on a pod, and so set the condition; a would-be one
# (dry-run) sets it to "False", so that a rollout can list who would have been stopped.
ENFORCING = frozenset({Reason.ENFORCED, Reason.RECLAIMED, Reason.EVICTED, Reason.WOULD_ENFORCE})

_WHAT = {
    Reason.ENFORCED: "was enforced over its VRAM limit",
    Reason.RECLAIMED: "was asked to give back GPU memory it borrowed above its request",
    Reason.EVICTED: "was over its VRAM limit and out of reach of signals: the pod is made to "
    "leave (evicted, or deleted once its budgets have refused that for long)",
    Reason.WOULD_ENFORCE: "would have been enforced (dry-run): nothing was signalled",
}


# What each action does, as the pod's policy (its sidecar's, which the webhook wrote) says.
_ACTION = {
    Action.TERMINATE: "SIGTERM to its largest process, SIGKILL after the grace period",
    Action.KILL: "SIGKILL to its largest process",
    Action.RESTART: "the container is killed, and the kubelet starts it again",
}


@dataclass(frozen=True, slots=True)
class Enforced:
    """One enforcement on a container, as the agent saw it. `container` is None when the
    enforcement names no container of the pod (the pod as a whole); `instance` and
    `restarts` are the container's as the pod's status showed them ("" and None: not
    known yet); `used` is what the agent's NVML pass saw its processes hold (None: not
    seen), and `limit` and `ceiling` what the pod declares for it (None: nothing the agent
    reads); `action` is the pod's (None: not known)."""

    reason: Reason
    container: str | None
    instance: str = ""
    restarts: int | None = None
    used: int | None = None
    limit: int | None = None
    ceiling: int | None = None
    action: Action | None = None


_FIELD_PATH = re.compile(r"spec\.(?:containers|initContainers|ephemeralContainers)\{(.+)\}")


def container_named(field_path: str) -> str | None:
    """The container an Event's `fieldPath` names (`spec.containers{trainer}`), if any."""
    match = _FIELD_PATH.fullmatch(field_path)
    return match[1] if match else None


def as_policy_says(reason: Reason, dry_run: bool) -> Reason | None:
    """The reason an Event about to be posted gives the pod's condition, as the pod's policy
    says (`dry_run`: the agent's view of it, not the report's): a pod in a dry run was not
    enforced, whatever a report says, it would have been; and a pod that is not in a dry run
    was never "would have been" enforced: such a report (a sidecar's, so the tenant's, who
    may forge it) sets no condition. None: none."""
    if dry_run and reason in (Reason.ENFORCED, Reason.RECLAIMED):
        return Reason.WOULD_ENFORCE
    if not dry_run and reason is Reason.WOULD_ENFORCE:
        return None
    return reason


def seen(
    reason: Reason,
    pod: Pod | None,
    container: str | None,
    series: Iterable[ContainerSeries],
    action: Action | None = None,
) -> Enforced:
    """The enforcement of `reason` (`as_policy_says`) on `container` of `pod` (None: the
    agent does not have it), with the container's instance from the pod's status, what the
    agent's series of that container (`series`, of that instance) show, and the pod's
    `action`."""
    instance, restarts = "", None
    statuses = json_map((pod or {}).get("status"))
    for status in (s for field in STATUSES for s in json_maps(statuses.get(field))):
        if container is not None and status.get("name") == container:
            cid, count = status.get("containerID"), status.get("restartCount")
            instance = cid if isinstance(cid, str) else ""
            restarts = count if isinstance(count, int) and not isinstance(count, bool) else None
    found = next((s for s in series if s.who.container == container), None)
    if found is None:
        return Enforced(reason, container, instance, restarts, action=action)
    limit = found.limit
    if limit is None and any(g.limit is not None for g in found.gpus):  # DRA: per GPU
        limit = sum(g.limit or 0 for g in found.gpus)
    return Enforced(reason, container, instance, restarts, found.used, limit, found.ceiling, action)


def condition(e: Enforced, at: str) -> dict[str, str]:
    """The pod condition that says `e`, which happened at `at` (RFC 3339)."""
    return {
        "type": CONDITION_TYPE,
        "status": "False" if e.reason is Reason.WOULD_ENFORCE else "True",
        "reason": str(e.reason),
        "message": message(e, at)[:MESSAGE_CHARS],
        "lastTransitionTime": at,
    }


def message(e: Enforced, at: str) -> str:
    """`container 'trainer' was enforced over its VRAM limit ...: the node agent saw it hold
    5.10 GiB of its 4.00 GiB limit (127%) at ...`, and where to read the rest."""
    who = f"container {e.container!r}" if e.container else "the pod"
    how = ""
    if e.reason is Reason.ENFORCED and e.action in _ACTION:
        how = f" with its action, {e.action} ({_ACTION[e.action]})"
    said = [f"{who} {_WHAT[e.reason]}{how} ({e.reason}, at {at})"]
    said.append(f"the node agent saw it hold {_held(e)}")
    if e.instance:
        restarts = "" if e.restarts is None else f", after {e.restarts} restarts"
        said.append(
            f"that was its instance {e.instance}{restarts}: if the container was restarted "
            "since, its status.containerStatuses[].lastState shows how that instance ended"
        )
    said.append("the pod's Events (kept an hour) and the node agent's log have the details")
    return "; ".join(said)


def _held(e: Enforced) -> str:
    used = format_bytes(e.used) if e.used is not None else "no GPU memory it could see"
    if e.limit is None:
        return f"{used} (it declares no VRAM limit the node agent reads)"
    share = f" ({100 * e.used / e.limit:.0f}%)" if e.used is not None and e.limit else ""
    if e.reason is Reason.RECLAIMED and e.ceiling is not None:
        ceiling = format_bytes(e.ceiling)
        return f"{used}{share} of its {format_bytes(e.limit)} request, ceiling {ceiling}"
    return f"{used} of its {format_bytes(e.limit)} limit{share}"


def status_patch(uid: str, cond: dict[str, str]) -> dict[str, object]:
    """A strategic-merge patch of the pod's status that sets `cond` (merged by `type`), only
    on the pod of `uid`: a newcomer with the same name is refused (its UID differs)."""
    return {"metadata": {"uid": uid}, "status": {"conditions": [cond]}}
