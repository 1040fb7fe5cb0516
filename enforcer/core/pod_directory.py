"""Which pod a caller of the agent's socket is in, and what it is told about that pod.

The agent watches its node's pods; a sidecar no longer reads the API. A caller is in the
pod whose status lists the container its process runs in: the container ID in the
caller's cgroup, which the runtime set and a tenant cannot change, as the kubelet
reported it. Nothing the caller says counts. Each reply is encoded once per change of its
pod, so a push costs the agent a lookup and a write.

Only the sidecar of a pod the webhook injected is served (`declaration.injected`): its pod,
its usage, its Events and its counts. Any other container, of such a pod or of a pod that
merely carries the label and a container under the sidecar's name, is told why not.

Any tenant on the node can make its pods large (a pod may be 1.5 MiB: annotations, labels,
env, and the managedFields that name each), and the agent holds every pod of its node in a
160Mi limit. So it keeps of each pod only what it and the sidecars read (`kept`), as the
pod arrives from the watch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, cast

from enforcer.core.declaration import ENFORCED, OPT_IN, SIDECAR, injected
from enforcer.core.dra import DraObjects
from enforcer.core.hard_limits import TOOLKIT_LIMIT_ENV
from enforcer.core.owners import TEMPLATE_HASH
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod import (
    ContainerRef,
    containers_by_id,
    json_map,
    json_maps,
    pod_reference,
    spec_field_of,
)
from enforcer.core.protocol import PodReply, encode_pod

# What is kept of an object: per field, True for all of it, a shape for what is kept of an
# object, or a function of the value (a list's objects, each trimmed).
_Shape: TypeAlias = "Mapping[str, Literal[True] | _Shape | Callable[[object], object]]"


@dataclass(frozen=True, slots=True)
class DraRead:
    """The agent's last good read of a pod's ResourceClaims and its node's ResourceSlices
    (None before one succeeded), and why the latest read failed, if it did."""

    objects: DraObjects | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Encoded:
    """A pod's reply, and what it was encoded from."""

    pod: Pod
    dra: DraRead | None
    watch_problem: str | None
    reply: bytes

    def made_from(self, pod: Pod, dra: DraRead | None, watch_problem: str | None) -> bool:
        """Whether it is the reply for these: the watch and the claim cache hand on the
        same objects until they change."""
        return self.pod is pod and self.dra is dra and self.watch_problem == watch_problem


@dataclass(frozen=True, slots=True)
class Directory:
    """By the container ID of each injected pod's sidecar: its encoded pod reply, and the
    pod (what its Events are posted on, its counts kept for); by the ID of any other
    container of the node's pods, why a caller there is not served; by pod UID, each reply
    as it was encoded."""

    replies: dict[str, bytes] = field(default_factory=dict)
    pods: dict[str, Pod] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    encoded: dict[str, Encoded] = field(default_factory=dict)

    def refusal(self, container_id: str | None) -> str | None:
        """Why a caller in this container is not served; None when it is."""
        if container_id is None:
            return "the caller runs in no container (its cgroup names none)"
        if container_id in self.replies:
            return None
        return self.refusals.get(container_id) or (
            f"no pod on this node lists container {container_id[:12]} in its status yet "
            "(the kubelet reports a new container within seconds)"
        )


def directory(
    pods: Iterable[Pod],
    dra: Mapping[str, DraRead],
    watch_problem: str | None,
    previous: Directory | None = None,
    *,
    opted_in: AbstractSet[str],
) -> Directory:
    """The sidecar of each pod the webhook injected (`declaration.injected`, in the
    namespaces of `opted_in`) -> its pod reply, and its pod; every other container -> why
    it is not served.

    `dra` is by pod UID; `watch_problem` says that the agent's view may be out of date.
    A container ID that two pods list belongs to neither: only the kubelet writes a pod's
    status, but a caller must never be told about a pod it is not proven to be in. The
    replies of `previous` are taken again for the pods that have not changed since: a
    change of one pod encodes that pod, not the node's.
    """
    found: dict[str, bytes] = {}
    owners: dict[str, Pod] = {}
    refusals: dict[str, str] = {}
    encoded: dict[str, Encoded] = {}
    listed: set[str] = set()
    for pod in pods:
        ids = containers_by_id(pod)
        if not ids:
            continue
        meta = json_map(pod.get("metadata"))
        named = f"{meta.get('namespace')}/{meta.get('name')}"
        clashes = ids.keys() & listed
        listed |= ids.keys()
        for cid in clashes:
            found.pop(cid, None)
            owners.pop(cid, None)
            refusals[cid] = f"container {cid[:12]} is listed by two pods: it is in neither"
        if not injected(pod, opted_in):
            for cid in ids.keys() - clashes:
                refusals[cid] = (
                    f"pod {named} was not injected by vram-enforcer's webhook (not of a "
                    f"namespace labelled {OPT_IN[0]}={OPT_IN[1]}, or not labelled enforced): "
                    "the agent serves only the sidecars of the pods the webhook injected"
                )
            continue
        uid = str(meta.get("uid") or "")
        read = dra.get(uid)
        last = previous.encoded.get(uid) if previous is not None else None
        if last is None or not last.made_from(pod, read, watch_problem):
            objects, problem = (None, None) if read is None else (read.objects, read.problem)
            reply = encode_pod(PodReply(pod, watch_problem, objects, problem))
            last = Encoded(pod, read, watch_problem, reply)
        encoded[uid] = last
        for cid, ref in ids.items():
            if cid in clashes:
                continue
            if ref.name != SIDECAR:
                refusals[cid] = (
                    f"container {ref.name!r} of pod {named} is not its vram-enforcer sidecar: "
                    "the agent serves only the sidecar"
                )
                continue
            found[cid], owners[cid] = last.reply, pod
    return Directory(found, owners, refusals, encoded)


def event_about(pod: Pod, container: str | None) -> ObjectReference:
    """What a caller's Event is about: its own pod, and the container it names when that is
    one of the pod's (anything else, the pod as a whole)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    declared = {
        c.get("name")
        for field_name in ("containers", "initContainers", "ephemeralContainers")
        for c in json_maps(json_map(spec).get(field_name))
    }
    ref = None
    if container is not None and container in declared:
        ref = ContainerRef(container, spec_field_of(pod, container))
    return pod_reference(
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        str(meta.get("uid") or ""),
        ref,
    )


def kept(pod: Pod) -> Pod:
    """What the agent keeps of a pod of its node: exactly the fields that it and the sidecars
    read (`_KEPT`), whatever else a tenant put in the pod."""
    return cast(Pod, _trim(pod, _KEPT))


def _trim(obj: Mapping[str, Any], shape: _Shape) -> dict[str, Any]:
    """The fields of `obj` that `shape` names, each trimmed in turn. A field that should be
    an object and is not is left out: its readers take it as absent either way."""
    found: dict[str, Any] = {}
    for name, inner in shape.items():
        if name not in obj:
            continue
        value = obj[name]
        if inner is True:
            found[name] = value
        elif callable(inner):
            found[name] = inner(value)
        elif isinstance(value, dict):
            found[name] = _trim(value, inner)
    return found


def _each(shape: _Shape) -> Callable[[object], object]:
    """A list's objects, each trimmed to `shape` (anything else in it is read by no one)."""
    return lambda value: [_trim(item, shape) for item in json_maps(value)]


# The variables that the webhook writes into the sidecar: its declaration and its policy,
# which the agent reads (`declaration.sidecar_env`, the backstop's policy).
_OURS = "VRAM_ENFORCER_"
_CONTAINER: _Shape = {
    "name": True,
    "resources": {
        "limits": True,
        "requests": True,
        "claims": _each({"name": True, "request": True}),
    },
}


def _containers(value: object) -> list[dict[str, Any]]:
    """Each container's name and resources (declared limits, DRA claims); the sidecar's own
    variables too; and on any other, the NVIDIA toolkit hook's limit where its spec gives
    one (the last, as the kubelet does: one at most, however many a pod repeats), by which
    the hard limiter knows whose a limit it did not set is (`hard_limits.owner`)."""
    found = []
    for container in json_maps(value):
        trimmed = _trim(container, _CONTAINER)
        variables = json_maps(container.get("env"))
        if container.get("name") == SIDECAR and "env" in container:
            trimmed["env"] = [
                _trim(variable, {"name": True, "value": True})
                for variable in variables
                if str(variable.get("name")).startswith(_OURS)
            ]
        elif toolkit := [v for v in variables if v.get("name") == TOOLKIT_LIMIT_ENV][-1:]:
            trimmed["env"] = [_trim(toolkit[0], {"name": True, "value": True})]
        found.append(trimmed)
    return found


_CLAIM = _each({"name": True, "resourceClaimName": True})


def _controllers(value: object) -> list[dict[str, Any]]:
    """The pod's controllers, each its kind and name: two at most (`owners.owner_of` takes
    two for none), each text cut past the longest it reads."""
    found = [r for r in json_maps(value) if r.get("controller") is True][:2]
    return [
        {"kind": _cut(r.get("kind"), 64), "name": _cut(r.get("name"), 254), "controller": True}
        for r in found
    ]


def _cut(text: object, most: int) -> object:
    return text[:most] if isinstance(text, str) else None


_STATUSES = _each(
    {
        "name": True,
        "containerID": True,
        "restartCount": True,
        "state": {"running": {}, "terminated": {"exitCode": True}},
    }
)
# Who reads what: the container IDs and names in the status, for every reply, Event and
# signal (`pod.containers_by_id`, `spec_field_of`); the declaration (`declaration.of_pod`);
# DRA claims (`dra.claim_names`, `container_claims`); the phase and priority (the hard
# limits and reclaims: `hard_limits`, `lending`); the enforced label and the sidecar's
# state (`sidecar_presence`); the restart policy and exit codes (the sidecar's
# `pod.others_finished`); the restart count (a pod's condition names the instance
# enforced: `last_enforcement.seen`); the resourceVersion (what changed: the limiter, the
# claim cache); the controller and the template hash (the pod's owner series:
# `owners.owner_of`).
_KEPT: _Shape = {
    "metadata": {
        "name": True,
        "namespace": True,
        "uid": True,
        "resourceVersion": True,
        "labels": {ENFORCED: True, TEMPLATE_HASH: True},
        "ownerReferences": _controllers,
    },
    "spec": {
        "initContainers": _containers,
        "containers": _containers,
        "ephemeralContainers": _containers,
        "restartPolicy": True,
        "priority": True,
        "resourceClaims": _CLAIM,
    },
    "status": {
        "phase": True,
        "initContainerStatuses": _STATUSES,
        "containerStatuses": _STATUSES,
        "ephemeralContainerStatuses": _STATUSES,
        "resourceClaimStatuses": _CLAIM,
    },
}
