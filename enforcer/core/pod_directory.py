"""Which pod a caller of the agent's socket is in, and what it is told about that pod.

The agent watches its node's pods; a sidecar no longer reads the API. A caller is in the
pod whose status lists the container its process runs in: the container ID in the
caller's cgroup, which the runtime set and a tenant cannot change, as the kubelet
reported it. Nothing the caller says counts. The replies are encoded once per change of
the node's pods, so a push costs the agent a lookup and a write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from enforcer.core.dra import DraObjects
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


@dataclass(frozen=True, slots=True)
class DraRead:
    """The agent's last good read of a pod's ResourceClaims and its node's ResourceSlices
    (None before one succeeded), and why the latest read failed, if it did."""

    objects: DraObjects | None
    problem: str | None = None


def unknown(container_id: str | None) -> bytes:
    """What a caller whose container is in no pod of the node is told (yet)."""
    if container_id is None:
        why = "the caller runs in no container (its cgroup names none)"
    else:
        why = (
            f"no pod on this node lists container {container_id[:12]} in its status yet "
            "(the kubelet reports a new container within seconds)"
        )
    return encode_pod(PodReply(None, why))


@dataclass(frozen=True, slots=True)
class Directory:
    """By container ID: the encoded pod reply for a process of that container, and the pod
    (what a caller's Events are posted on)."""

    replies: dict[str, bytes] = field(default_factory=dict)
    pods: dict[str, Pod] = field(default_factory=dict)


def directory(
    pods: Iterable[Pod], dra: Mapping[str, DraRead], watch_problem: str | None
) -> Directory:
    """Container ID -> the pod reply for a process of that container, and the pod.

    `dra` is by pod UID; `watch_problem` says that the agent's view may be out of date.
    A container ID that two pods list belongs to neither: only the kubelet writes a pod's
    status, but a caller must never be told about a pod it is not proven to be in.
    """
    found: dict[str, bytes] = {}
    owners: dict[str, Pod] = {}
    claimed: set[str] = set()
    for pod in pods:
        ids = containers_by_id(pod)
        if not ids:
            continue
        meta = pod.get("metadata") or {}
        read = dra.get(str(meta.get("uid") or ""))
        reply = encode_pod(
            PodReply(
                _trimmed(pod),
                watch_problem,
                None if read is None else read.objects,
                None if read is None else read.problem,
            )
        )
        for cid in ids:
            if cid in found or cid in claimed:
                claimed.add(cid)
                found.pop(cid, None)
                owners.pop(cid, None)
                continue
            found[cid], owners[cid] = reply, pod
    return Directory(found, owners)


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


def _trimmed(pod: Pod) -> Pod:
    """The pod without its managedFields: the largest part of a pod, and nothing a sidecar
    reads."""
    meta = pod.get("metadata")
    if not isinstance(meta, dict) or "managedFields" not in meta:
        return pod
    kept = {k: v for k, v in meta.items() if k != "managedFields"}
    return {**pod, "metadata": kept}  # type: ignore[typeddict-item]
