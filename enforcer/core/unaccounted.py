"""GPU memory that no declaration accounts for (pure): what the containers of pods the
webhook did not inject hold where they declare no VRAM (or hold more than they declare),
what the sidecar's container of a pod it injected holds (the sidecar uses none, and
declares none: someone else's process is there), and what processes in no pod of the node
hold.

The agent places every process NVML lists by its cgroup (`core/cgroups.py`), so each byte
it lists lands in one place: a container of a pod the webhook injected (its series, held to
its declaration: `pod_metrics`), the sidecar's container of such a pod, a container of
another pod of the node, or no pod at all (a host process, a container the kubelet did not
start); what cannot be placed is counted apart (`Sample.unplaced`). Only what the kubelet
and NVML say counts: a pod is injected by `declaration.injected` (its namespace opted in: a
label or an annotation proves nothing), and a process is in a pod when its container ID is
in that pod's status. A pod outside the opted-in namespaces declares only in its resources
(what the scheduler counted): a container that holds more than that is not held to it by a
sidecar, so its whole usage is shown, and declaring a byte hides nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import (
    SIDECAR,
    Declares,
    Undeclarable,
    declared_limits,
    injected,
)
from enforcer.core.model import ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import ContainerRef, containers_by_id, json_map


@dataclass(frozen=True, slots=True)
class UndeclaredContainer:
    """A container of a pod the webhook did not inject, or the sidecar's container of a pod
    it did, and what it holds on each GPU."""

    namespace: str
    pod: str
    uid: str
    container: ContainerRef
    declared: int  # bytes its resources declare over all GPUs; 0: none
    gpus: tuple[tuple[str, int], ...]  # (GPU UUID, bytes held there), by GPU
    opted_in: bool  # whether its namespace opted in (then the pod opted out, or was missed)
    sidecar: bool = False  # the sidecar's container of a pod the webhook injected


@dataclass(frozen=True, slots=True)
class InNoPod:
    """What a process in no pod of the node holds on one GPU, and its container ID (None:
    it runs in no container, a host process)."""

    usage: ProcessUsage
    container: str | None


@dataclass(frozen=True, slots=True)
class Unaccounted:
    """The node's GPU memory that no declaration accounts for, as of one NVML pass."""

    undeclared: tuple[UndeclaredContainer, ...]  # by namespace, pod and container
    in_no_pod: tuple[InNoPod, ...] = ()

    @property
    def outside_pods(self) -> dict[str, int]:
        """GPU UUID -> what processes in no pod of the node hold there."""
        held: dict[str, int] = {}
        for each in self.in_no_pod:
            gpu = each.usage.device_uuid
            held[gpu] = held.get(gpu, 0) + (each.usage.used_bytes or 0)
        return held


@dataclass(frozen=True, slots=True)
class Owner:
    """The pod that a container ID is of, where nothing holds the container to a
    declaration: a pod the webhook did not inject, and what the pod declares in its
    resources (container name -> bytes), or the sidecar's container of one it did (which
    declares nothing)."""

    pod: Pod
    container: ContainerRef
    declared: Mapping[str, int]
    sidecar: bool = False


@dataclass(frozen=True, slots=True)
class PodIndex:
    """The node's pods as the passes read them, made once per change of the pods: the
    container IDs of the pods the webhook injected, their sidecar's aside (their series
    hold them), and the owner of each other container ID that one pod alone lists."""

    accounted: frozenset[str]
    owners: Mapping[str, Owner]
    opted_in: AbstractSet[str]


def pod_index(pods: Mapping[str, Pod], opted_in: AbstractSet[str], declares: Declares) -> PodIndex:
    """The index of `pods` (by UID): injected is `declaration.injected` (its namespace in
    `opted_in`); an injected pod's sidecar is in no series (`pod_metrics`), and uses no GPU
    memory, so it is owned as a container that declares nothing; a container ID two pods
    list is neither's (nor accounted: in no pod)."""
    accounted: set[str] = set()
    claimed: dict[str, list[Owner]] = {}
    for pod in pods.values():
        listed = containers_by_id(pod)
        if injected(pod, opted_in):
            for cid, ref in listed.items():
                if ref.name == SIDECAR:
                    claimed.setdefault(cid, []).append(Owner(pod, ref, {}, sidecar=True))
                else:
                    accounted.add(cid)
        elif listed:
            declared = _declared(pod, declares)
            for cid, ref in listed.items():
                claimed.setdefault(cid, []).append(Owner(pod, ref, declared))
    owners = {cid: o[0] for cid, o in claimed.items() if len(o) == 1 and cid not in accounted}
    return PodIndex(frozenset(accounted), owners, opted_in)


def unaccounted(
    sample: Sample, containers: Mapping[ProcessKey, str], index: PodIndex
) -> Unaccounted:
    """What the pass's processes hold outside the injected pods' containers (`containers`:
    each process's container ID; `index`: the node's pods)."""
    found = []
    for cid, per_gpu in usage_by_container(sample, containers).items():
        owner = index.owners.get(cid)
        if owner is None:
            continue  # an injected pod's, or in no pod (below)
        declared = owner.declared.get(owner.container.name, 0)
        if declared == 0 or sum(per_gpu.values()) > declared:
            meta = json_map(owner.pod.get("metadata"))
            namespace = str(meta.get("namespace") or "")
            found.append(
                UndeclaredContainer(
                    namespace,
                    str(meta.get("name") or ""),
                    str(meta.get("uid") or ""),
                    owner.container,
                    declared,
                    tuple(sorted(per_gpu.items())),
                    namespace in index.opted_in,
                    owner.sidecar,
                )
            )
    found.sort(key=lambda c: (c.namespace, c.pod, c.container.name))
    outside = []
    for usage in sample.processes:
        of = containers.get(usage.key)
        if usage.used_bytes and of not in index.accounted and of not in index.owners:
            outside.append(InNoPod(usage, of))
    return Unaccounted(tuple(found), tuple(outside))


def _declared(pod: Pod, declares: Declares) -> dict[str, int]:
    """Container name -> the bytes its resources declare; a pod whose resources cannot be
    read (the API server would have refused them) declares nothing."""
    try:
        return declared_limits(json_map(pod.get("spec")), declares.resource, declares.unit)
    except Undeclarable:
        return {}
