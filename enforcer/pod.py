"""What the sidecar needs to know about its own pod, read from the pod's JSON (pure).

Kept as plain functions over the API server's JSON, so that they are tested with real
pod documents and do not depend on the kubernetes client's generated models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from enforcer.cgroups import status_container_id

_STATUS_FIELDS = (
    ("initContainerStatuses", "initContainers"),
    ("containerStatuses", "containers"),
    ("ephemeralContainerStatuses", "ephemeralContainers"),
)


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container of the pod: its name and where it is declared (for Events' fieldPath)."""

    name: str
    spec_field: str  # containers, initContainers or ephemeralContainers

    @property
    def field_path(self) -> str:
        return f"spec.{self.spec_field}{{{self.name}}}"


def containers_by_id(pod: Mapping[str, Any]) -> dict[str, ContainerRef]:
    """Container ID -> container, for every container that kubelet reports as created.

    Only IDs in the pod's own status count: a process in any other container, of this pod
    or not, is never attributed to a container of this pod.
    """
    status = pod.get("status") or {}
    found: dict[str, ContainerRef] = {}
    for status_field, spec_field in _STATUS_FIELDS:
        for cs in status.get(status_field) or ():
            name = cs.get("name")
            cid = status_container_id(cs.get("containerID"))
            if name and cid:
                found[cid] = ContainerRef(name, spec_field)
    return found


def spec_field_of(pod: Mapping[str, Any], name: str) -> str:
    """Where container `name` is declared, `containers` when the pod is not known."""
    spec = pod.get("spec") or {}
    for field in ("initContainers", "ephemeralContainers"):
        if any(c.get("name") == name for c in spec.get(field) or ()):
            return field
    return "containers"


def others_finished(pod: Mapping[str, Any], me: str) -> bool:
    """Whether every container but `me` has terminated and will not be restarted.

    For the legacy "regular container" sidecar, which must exit by itself for a Job to
    complete: with restartPolicy Never any termination is final, with OnFailure only a
    successful one, and with Always none.
    """
    policy = (pod.get("spec") or {}).get("restartPolicy", "Always")
    statuses = [
        s for s in (pod.get("status") or {}).get("containerStatuses") or () if s.get("name") != me
    ]
    if not statuses or policy == "Always":
        return False
    for s in statuses:
        terminated = (s.get("state") or {}).get("terminated")
        if terminated is None:
            return False
        if policy == "OnFailure" and terminated.get("exitCode") != 0:
            return False
    return True
