"""Which enforced pods of the node have no sidecar enforcing them, and which sidecars the
agent should connect to.

The agent connects to each running sidecar (`reachable`) through the socket in the
sidecar's own filesystem, and tries again on a doubling schedule while it cannot
(`to_dial`): a sidecar still starting, or one of 0.1.0 that connects by itself.

Only pods the webhook injected are looked at (`declaration.injected`: the caller keeps to
them).

The workload shares its sidecar's PID namespace, and a root workload can stop (SIGSTOP) or
kill it: enforcement by sampling then ends for that pod, and the agent enforces the pod
itself (`modes/backstop.py`) while it is said to be unguarded (an Event on the pod, a
metric, the log), until its sidecar is heard again. The rule (`unguarded`) is over what the
agent sees of each sidecar (`Sidecar`): one whose process is stopped or has ended, or that
hung up its connection (a killed one does), or whose signals the kernel refused within
REFUSED_FOR seconds (it decides, but cannot act: a security module labels the workload
apart), is unguarded at once; one that runs but is not heard (merely slow, starting, or
not reached yet) only after SILENT_AFTER seconds, so that the agent does not take over
from a sidecar that is still there. A pod is watched while a
container that its sidecar enforces runs (`guarded`), not by its phase: a GPU job in a
regular init container runs while the pod is still Pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from enforcer.core.cgroups import status_container_id
from enforcer.core.declaration import SIDECAR
from enforcer.core.dra import finished
from enforcer.core.payloads import Pod
from enforcer.core.pod import STATUSES, json_map, json_maps

SILENT_AFTER = 10.0  # seconds a running sidecar may go unheard before its pod is unguarded
REFUSED_FOR = 30.0  # seconds a pod is held by the agent after its sidecar's last refused signal
FIRST_RETRY, LAST_RETRY = 1.0, 30.0  # seconds between attempts to connect to a sidecar
STOPPED = frozenset("Tt")  # stopped by a signal (SIGSTOP), or by a tracer: it runs no code
ENDED = frozenset("ZX")  # a zombie (its main thread, the sidecar's loop, has ended), or dead
# The statuses of a pod's containers, init and ephemeral ones too: the sidecar enforces each.


@dataclass(frozen=True, slots=True)
class Sidecar:
    """What the agent saw of one sidecar on a check, as plain data."""

    heard: bool = False  # it reads its subscription: the agent's replies do not wait unread
    closed: bool = False  # it hung up its connection to the agent, and has opened none since
    state: str | None = None  # its process's state in /proc/<pid>/stat; None: not read
    refused: bool = False  # the kernel refused one of its signals within REFUSED_FOR


UNSEEN = Sidecar()  # none of it known: not reached yet, or no container of it (back-off)


def halted(sidecar: Sidecar) -> bool:
    """It cannot be enforcing, and waiting would only lengthen the episode: its process is
    stopped or has ended, or it hung up (its process was killed, or is ending), or the
    kernel refuses its signals."""
    stopped_or_ended = sidecar.state is not None and sidecar.state in STOPPED | ENDED
    return sidecar.closed or stopped_or_ended or sidecar.refused


def halt(sidecar: Sidecar) -> str | None:
    """How a halted sidecar halted, for the pod's Event: "stopped" (a signal or a tracer
    holds it), "ended" (its process ended, or it hung up), "refused" (the kernel refuses
    its signals); None when it has not halted."""
    if sidecar.state is not None and sidecar.state in STOPPED:
        return "stopped"
    if sidecar.closed or (sidecar.state is not None and sidecar.state in ENDED):
        return "ended"
    return "refused" if sidecar.refused else None


def refusing(last_refused: float | None, now: float) -> bool:
    """Whether a sidecar whose signal the kernel last refused at `last_refused` still
    leaves its pod to the agent."""
    return last_refused is not None and now - last_refused < REFUSED_FOR


def unguarded(sidecar: Sidecar, last_heard: float, now: float) -> bool:
    """The rule: a halted sidecar leaves its pod unguarded at once; any other (it runs, or
    its process cannot be read) after SILENT_AFTER unheard."""
    return halted(sidecar) or now - last_heard >= SILENT_AFTER


@dataclass(frozen=True, slots=True)
class Presence:
    """Per pod UID: since when its sidecar has gone unheard, and the pods said unguarded."""

    missing_since: Mapping[str, float] = field(default_factory=dict)
    silent: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Change:
    presence: Presence
    went_silent: tuple[str, ...] = ()  # pod UIDs, newly unguarded
    came_back: tuple[str, ...] = ()


def _sidecar_status(pod: Pod) -> Mapping[str, object] | None:
    status = json_map(pod.get("status"))
    for field_name in STATUSES:
        for cs in json_maps(status.get(field_name)):
            if cs.get("name") == SIDECAR:
                return cs
    return None


def _runs(cs: Mapping[str, object]) -> bool:
    return "running" in json_map(cs.get("state"))


def running_containers(pod: Pod) -> frozenset[str]:
    """The names of the pod's containers that run now, as their statuses say, whatever the
    pod's phase: its regular init containers run while it is still Pending."""
    status = json_map(pod.get("status"))
    return frozenset(
        name
        for field_name in STATUSES
        for cs in json_maps(status.get(field_name))
        if isinstance(name := cs.get("name"), str) and _runs(cs)
    )


def _before_sidecar(pod: Pod) -> set[str]:
    """The init containers of a pod whose sidecar is one of its containers (`--sidecar-mode
    container`): the kubelet starts the containers only once every init container has ended,
    so none of them has a sidecar to be silent. None where the sidecar is native: an init
    container ahead of it (the webhook replaces a tenant's forged sidecar where it stands)
    runs with no sidecar at all, and the backstop must hold it."""
    spec = json_map(pod.get("spec"))
    if all(c.get("name") != SIDECAR for c in json_maps(spec.get("containers"))):
        return set()
    return {str(c.get("name")) for c in json_maps(spec.get("initContainers"))}


def guarded(pod: Pod) -> bool:
    """An injected pod (`declaration.injected`: the caller keeps to those) while a container
    that its sidecar enforces runs, Pending or Running: any but the sidecar, init containers
    included (a regular one runs while its pod is Pending). Its silence is judged then, and
    only then: a pod that runs nothing yet, or has finished (the kubelet stops its
    containers, and so its sidecar), needs no sidecar."""
    held = running_containers(pod) - _before_sidecar(pod) - {SIDECAR}
    return bool(held) and not finished(pod)


def sidecar_id(pod: Pod) -> str | None:
    """The ID of the pod's sidecar container now (a restart gives it a new one)."""
    cs = _sidecar_status(pod)
    return None if cs is None else status_container_id(cs.get("containerID"))


def reachable(pod: Pod) -> str | None:
    """The container ID of an injected pod's sidecar while it runs, whatever the pod's phase
    (a native sidecar runs before the workload does): the one to connect to."""
    cs = _sidecar_status(pod)
    if cs is None or not _runs(cs):
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


def update(
    previous: Presence, pods: Mapping[str, Pod], sidecars: Mapping[str, Sidecar], now: float
) -> Change:
    """`pods` by UID; `sidecars` by container ID: what the agent saw of each (none: UNSEEN).
    A pod said unguarded stays so until its sidecar is heard again, and not halted."""
    missing: dict[str, float] = {}
    silent = set()
    went, back = [], []
    for uid, pod in pods.items():
        if not guarded(pod):
            continue
        cid = sidecar_id(pod)
        seen = sidecars.get(cid, UNSEEN) if cid is not None else UNSEEN
        if seen.heard and not halted(seen):
            if uid in previous.silent:
                back.append(uid)
            continue
        since = previous.missing_since.get(uid, now)
        missing[uid] = since
        if uid in previous.silent or unguarded(seen, since, now):
            silent.add(uid)
            if uid not in previous.silent:
                went.append(uid)
    return Change(Presence(missing, frozenset(silent)), tuple(went), tuple(back))
