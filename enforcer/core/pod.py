"""What the sidecar needs to know about its own pod, read from the pod's JSON (pure).

Kept as plain functions over the API server's JSON, so that they are tested with real
pod documents and do not depend on the kubernetes client's generated models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from enforcer.core.cgroups import status_container_id
from enforcer.core.payloads import ObjectReference, Pod

_STATUS_FIELDS = (
    ("initContainerStatuses", "initContainers"),
    ("containerStatuses", "containers"),
    ("ephemeralContainerStatuses", "ephemeralContainers"),
)
STATUSES = tuple(status for status, _ in _STATUS_FIELDS)  # a pod's container status lists


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container of the pod: its name and where it is declared (for Events' fieldPath)."""

    name: str
    spec_field: str  # containers, initContainers or ephemeralContainers

    @property
    def field_path(self) -> str:
        return f"spec.{self.spec_field}{{{self.name}}}"


def pod_reference(
    namespace: str, name: str, uid: str, container: ContainerRef | None = None
) -> ObjectReference:
    """What an Event is about: the pod, or one of its containers (fieldPath)."""
    ref: ObjectReference = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": namespace,
        "name": name,
        "uid": uid,
    }
    if container is not None:
        ref["fieldPath"] = container.field_path
    return ref


def containers_by_id(pod: Pod) -> dict[str, ContainerRef]:
    """Container ID -> container, for every container that kubelet reports as created.

    Only IDs in the pod's own status count: a process in any other container, of this pod
    or not, is never attributed to a container of this pod. Entries of the wrong shape
    count for nothing.
    """
    status = json_map(pod.get("status"))
    found: dict[str, ContainerRef] = {}
    for status_field, spec_field in _STATUS_FIELDS:
        for cs in json_maps(status.get(status_field)):
            name = cs.get("name")
            cid = status_container_id(cs.get("containerID"))
            if isinstance(name, str) and name and cid:
                found[cid] = ContainerRef(name, spec_field)
    return found


def container_limits(
    declared: Mapping[str, int], containers: Iterable[ContainerRef], undeclared_allowed: bool
) -> dict[str, int]:
    """The limit of each container that is checked: its declaration; for a container that
    declares none, 0, so that any GPU memory it takes is a violation (unless undeclared
    containers are allowed, and then it is not checked)."""
    limits = dict(declared)
    if not undeclared_allowed:
        for ref in containers:
            limits.setdefault(ref.name, 0)
    return limits


def sole_container(
    spec_containers: Sequence[str], seen_ids: AbstractSet[str]
) -> dict[str, ContainerRef]:
    """Container ID -> container before the pod's status has been read.

    Proven in one case only: the pod has a single container besides the sidecar, and a
    single container ID (other than the sidecar's and pause's) has been seen in the pod
    since the sidecar started. A second ID (an ephemeral container, a restart) leaves
    nothing proven until the status is read.
    """
    if len(spec_containers) == 1 and len(seen_ids) == 1:
        (cid,) = seen_ids
        return {cid: ContainerRef(spec_containers[0], "containers")}
    return {}


def spec_field_of(pod: Pod, name: str) -> str:
    """Where container `name` is declared, `containers` when the pod is not known."""
    spec = json_map(pod.get("spec"))
    for field in ("initContainers", "ephemeralContainers"):
        if any(c.get("name") == name for c in json_maps(spec.get(field))):
            return field
    return "containers"


def others_finished(pod: Pod, me: str) -> bool:
    """Whether every container but `me` has terminated and will not be restarted.

    For the legacy "regular container" sidecar, which must exit by itself for a Job to
    complete: with restartPolicy Never any termination is final, with OnFailure only a
    successful one, and with Always none.
    """
    policy = json_map(pod.get("spec")).get("restartPolicy", "Always")
    statuses = [
        s
        for s in json_maps(json_map(pod.get("status")).get("containerStatuses"))
        if s.get("name") != me
    ]
    if not statuses or policy == "Always":
        return False
    for s in statuses:
        terminated = json_map(s.get("state")).get("terminated")
        if not isinstance(terminated, dict):
            return False
        if policy == "OnFailure" and terminated.get("exitCode") != 0:
            return False
    return True


def json_map(value: object) -> Mapping[str, Any]:
    """A field of the API's JSON that should be an object; {} when it is anything else."""
    return value if isinstance(value, dict) else {}


def json_maps(value: object) -> list[Mapping[str, Any]]:
    """A field that should be a list of objects; the objects in it, or [] when it is not a list."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
