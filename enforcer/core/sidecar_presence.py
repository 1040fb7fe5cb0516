"""Which enforced pods of the node have no sidecar connected to the agent, and which
sidecars the agent should connect to.

The agent connects to each running sidecar (`reachable`) through the socket in the
sidecar's own filesystem, and tries again on a doubling schedule while it cannot
(`to_dial`): a sidecar still starting, or one of 0.1.0 that connects by itself.

The workload shares its sidecar's PID namespace, and a root workload can stop (SIGSTOP) or
kill it: enforcement by sampling then ends for that pod. The agent sees every sidecar's
connection, so it can at least tell: a running enforced pod whose sidecar has had no
working connection for SILENT_AFTER seconds is said to be unguarded (an Event on the pod,
a metric, the log), and said to be guarded again once its sidecar is back. (Enforcing
such a pod from the agent is the next step; until then the driver's hard limit, where
there is one, still holds.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

from enforcer.core.cgroups import status_container_id
from enforcer.core.declaration import ENFORCED, SIDECAR
from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map, json_maps

SILENT_AFTER = 10.0  # seconds without a connected sidecar before a pod is said unguarded
FIRST_RETRY, LAST_RETRY = 1.0, 30.0  # seconds between attempts to connect to a sidecar


@dataclass(frozen=True, slots=True)
class Presence:
    """Per pod UID: since when its sidecar has been missing, and the pods said unguarded."""

    missing_since: Mapping[str, float] = field(default_factory=dict)
    silent: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Change:
    presence: Presence
    went_silent: tuple[str, ...] = ()  # pod UIDs, newly unguarded
    came_back: tuple[str, ...] = ()


def _enforced(pod: Pod) -> bool:
    """Injected by the webhook (its label, kept by the chart's policy)."""
    return json_map(json_map(pod.get("metadata")).get("labels")).get(ENFORCED) == "true"


def _sidecar_status(pod: Pod) -> Mapping[str, object] | None:
    status = json_map(pod.get("status"))
    for field_name in ("initContainerStatuses", "containerStatuses"):
        for cs in json_maps(status.get(field_name)):
            if cs.get("name") == SIDECAR:
                return cs
    return None


def guarded(pod: Pod) -> bool:
    """A running pod that the webhook injected."""
    return _enforced(pod) and json_map(pod.get("status")).get("phase") == "Running"


def sidecar_id(pod: Pod) -> str | None:
    """The ID of the pod's sidecar container now (a restart gives it a new one)."""
    cs = _sidecar_status(pod)
    return None if cs is None else status_container_id(cs.get("containerID"))


def reachable(pod: Pod) -> str | None:
    """The container ID of an enforced pod's sidecar while it runs, whatever the pod's phase
    (a native sidecar runs before the workload does): the one to connect to."""
    cs = _sidecar_status(pod) if _enforced(pod) else None
    if cs is None or "running" not in json_map(cs.get("state")):
        return None
    return status_container_id(cs.get("containerID"))


@dataclass(frozen=True, slots=True)
class Attempt:
    at: float
    wait: float  # until the next one


def to_dial(
    unconnected: Iterable[str], tried: Mapping[str, Attempt], now: float
) -> tuple[tuple[str, ...], dict[str, Attempt]]:
    """The sidecars (container IDs) to connect to now, and the attempts to remember: the
    first at once, then after FIRST_RETRY, doubling up to LAST_RETRY. A sidecar that is
    connected (not in `unconnected`) is forgotten, so that it is tried at once if lost."""
    due, kept = [], {}
    for cid in unconnected:
        last = tried.get(cid)
        if last is not None and now < last.at + last.wait:
            kept[cid] = last
            continue
        due.append(cid)
        wait = FIRST_RETRY if last is None else min(LAST_RETRY, 2 * last.wait)
        kept[cid] = Attempt(now, wait)
    return tuple(due), kept


def update(previous: Presence, pods: Mapping[str, Pod], connected: Set[str], now: float) -> Change:
    """`pods` by UID; `connected`: the container IDs with a working subscription now."""
    missing: dict[str, float] = {}
    silent = set()
    went, back = [], []
    for uid, pod in pods.items():
        if not guarded(pod):
            continue
        if (cid := sidecar_id(pod)) is not None and cid in connected:
            if uid in previous.silent:
                back.append(uid)
            continue
        since = previous.missing_since.get(uid, now)
        missing[uid] = since
        if now - since >= SILENT_AFTER:
            silent.add(uid)
            if uid not in previous.silent:
                went.append(uid)
    return Change(Presence(missing, frozenset(silent)), tuple(went), tuple(back))
