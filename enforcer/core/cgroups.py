"""Which container a process runs in, from its `/proc/<pid>/cgroup` lines (pure).

Container runtimes name a container's cgroup after its ID, in a handful of forms:

    containerd, systemd driver   .../kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope
    containerd, cgroupfs driver  /kubepods/burstable/pod<uid>/<id>
    CRI-O                        .../crio-<id>.scope   (but crio-conmon-<id>.scope is conmon)
    Docker / cri-dockerd         .../docker-<id>.scope   or   /docker/<id>
    cgroup namespaces            /../cri-containerd-<id>.scope  (relative to the reader's root)

The ID alone proves nothing: it becomes a container of *this pod* only when it matches the
pod's `status.containerStatuses[].containerID`, which the sidecar checks.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

_ID = r"[0-9a-f]{64}"
# The last path component that names a container: a runtime prefix and suffix, or a bare ID
# (the cgroupfs driver) directly below a pod or docker directory.
_NAMED = re.compile(rf"(?:^|/)(?:cri-containerd|crio|docker)-({_ID})\.scope(?:/|$)")
_BARE = re.compile(rf"(?:^|/)(?:pod[0-9a-f_-]+|docker|\.\.)/({_ID})(?:/|$)")
_STATUS_ID = re.compile(rf"^[a-z0-9-]+://({_ID})$")
# A container's own directory: systemd-style `<runtime>-<id>.scope`, or a bare ID (cgroupfs).
_CONTAINER_DIR = re.compile(rf"^(?:(?:cri-containerd|crio|docker)-({_ID})\.scope|({_ID}))$")
# A pod's directory: `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid with _>.slice` (systemd).
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_DIR = re.compile(rf"^(?:kubepods(?:-[a-z]+)?-pod({_UID})\.slice|pod({_UID}))$")


@dataclass(frozen=True, slots=True)
class CgroupEntry:
    """One line of `/proc/<pid>/cgroup`: `hierarchy-id:controllers:path`."""

    hierarchy_id: int
    controllers: tuple[str, ...]
    path: str


def parse_cgroup(text: str) -> tuple[CgroupEntry, ...]:
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        hid, controllers, path = line.split(":", 2)
        names = tuple(c for c in controllers.split(",") if c)
        entries.append(CgroupEntry(int(hid), names, path))
    return tuple(entries)


def container_id(entries: Sequence[CgroupEntry]) -> str | None:
    """The container ID in a process's cgroup lines; None when there is none or they disagree.

    cgroup v1 lists one line per hierarchy and v2 one line in all; some v1 hierarchies may
    be unrelated (a host's `memory` cgroup, say). Every line that names a container must
    name the same one.
    """
    found = set()
    for entry in entries:
        if "conmon" in entry.path:
            return None  # CRI-O's container monitor, not a process of the container
        match = _NAMED.search(entry.path) or _BARE.search(entry.path)
        if match:
            found.add(match[1])
    return found.pop() if len(found) == 1 else None


CONTAINER = "container:"  # a tenant that is a container: its ID follows


def tenant(entries: Sequence[CgroupEntry]) -> str | None:
    """Who a process runs for, to count a GPU's tenants: its container, or else its cgroup
    (the v2 line, or the first one) for processes outside containers; None without lines."""
    cid = container_id(entries)
    if cid is not None:
        return f"{CONTAINER}{cid}"
    v2 = [e.path for e in entries if e.hierarchy_id == 0]
    paths = v2 or [e.path for e in entries]
    return f"cgroup:{paths[0]}" if paths else None


def status_container_id(value: object) -> str | None:
    """`containerd://<id>` (or `cri-o://`, `docker://`) from a containerStatus, as a bare ID;
    None for anything else, of any type."""
    match = _STATUS_ID.match(value) if isinstance(value, str) else None
    return match[1] if match else None


def is_kubepods_dir(name: str) -> bool:
    """The kubelet's top cgroup of all pods, as the systemd or the cgroupfs driver names it."""
    return name in ("kubepods.slice", "kubepods")


def pod_uid_of_dir(name: str) -> str | None:
    """The pod UID that the kubelet put in the name of a pod's cgroup directory.

    UIDs are unique for the life of a cluster, so below the kubepods directory this name
    proves which pod the cgroup belongs to.
    """
    match = _POD_DIR.match(name)
    return (match[1] or match[2]).replace("_", "-") if match else None


def pod_uid(entries: Sequence[CgroupEntry]) -> str | None:
    """The pod UID in a process's cgroup lines (its pod's directory, as the kubelet names
    it); None where there is none or they disagree."""
    found = {
        uid for entry in entries for name in entry.path.split("/") if (uid := pod_uid_of_dir(name))
    }
    return found.pop() if len(found) == 1 else None


def container_id_of_dir(name: str) -> str | None:
    """The container ID in the name of a container's cgroup directory (not conmon's)."""
    match = _CONTAINER_DIR.match(name)
    return (match[1] or match[2]) if match else None


class Level(enum.Enum):
    """Where a directory sits in the kubelet's cgroups: its top (`kubepods`), a QoS class's
    (`burstable`, `kubepods-besteffort.slice`; not under every driver), a pod's."""

    KUBEPODS = "kubepods"
    QOS = "qos"
    POD = "pod"


def made_in(level: Level, name: str) -> tuple[Level | None, bool]:
    """What a directory `name` made in a directory at `level` is to the hard limiter: the
    level to watch it at (None: not watched), and whether there is work for it now (a pod's
    cgroup, which takes the pod's limit; a container's, which takes the container's).

    Nothing below a pod's own directory is ever watched: a container with a cgroup namespace
    of its own may make any number of directories below its cgroup, and they hold no one
    the kubelet started."""
    if level is Level.POD:
        return None, container_id_of_dir(name) is not None
    if pod_uid_of_dir(name) is not None:
        return Level.POD, True
    return (Level.QOS if level is Level.KUBEPODS else None), False
