"""GPU memory that no declaration accounts for (pure): what the containers of pods the
webhook did not inject hold where they declare no VRAM (or hold more than they declare),
and what processes in no pod of the node hold.

The agent places every process NVML lists by its cgroup (`core/cgroups.py`), so each byte
it lists lands in one place: a container of a pod the webhook injected (its series, held to
its declaration: `pod_metrics`), a container of another pod of the node, or no pod at all
(a host process, a container the kubelet did not start); what cannot be placed is counted
apart (`Sample.unplaced`). Only what the kubelet and NVML say counts: a pod is injected by
`declaration.injected` (its namespace opted in: a label or an annotation proves nothing),
and a process is in a pod when its container ID is in that pod's status. A pod outside the
opted-in namespaces declares only in its resources (what the scheduler counted): a
container that holds more than that is not held to it by a sidecar, so its whole usage is
shown, and declaring a byte hides nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import Declares, Undeclarable, declared_limits, injected
from enforcer.core.model import ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import ContainerRef, containers_by_id, json_map


@dataclass(frozen=True, slots=True)
class UndeclaredContainer:
    """A container of a pod the webhook did not inject, and what it holds on each GPU."""

    namespace: str
    pod: str
    uid: str
    container: ContainerRef
    declared: int  # bytes its resources declare over all GPUs; 0: none
    gpus: tuple[tuple[str, int], ...]  # (GPU UUID, bytes held there), by GPU
    opted_in: bool  # whether its namespace opted in (then the pod opted out, or was missed)


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


def unaccounted(
    sample: Sample,
    containers: Mapping[ProcessKey, str],
    pods: Mapping[str, Pod] | None,
    opted_in: AbstractSet[str] | None,
    declares: Declares,
) -> Unaccounted | None:
    """What the pass's processes hold outside the injected pods' containers (`containers`:
    each process's container ID; `pods`: the node's, by UID). None until the pods and the
    namespaces that opted in are listed: until then nothing is known to be unaccounted."""
    if pods is None or opted_in is None:
        return None
    accounted: set[str] = set()  # container IDs of the injected pods: their series hold them
    owners: dict[str, list[tuple[Pod, ContainerRef]]] = {}
    for pod in pods.values():
        listed = containers_by_id(pod)
        if injected(pod, opted_in):
            accounted.update(listed)
        else:
            for cid, ref in listed.items():
                owners.setdefault(cid, []).append((pod, ref))
    held = usage_by_container(sample, containers)
    found = []
    for cid, per_gpu in held.items():
        claimed = owners.get(cid, [])
        if cid in accounted or len(claimed) != 1:
            continue  # two pods that list one container: in neither (below, in no pod)
        ((pod, ref),) = claimed
        declared = _declared(pod, declares).get(ref.name, 0)
        if declared == 0 or sum(per_gpu.values()) > declared:
            meta = json_map(pod.get("metadata"))
            namespace = str(meta.get("namespace") or "")
            found.append(
                UndeclaredContainer(
                    namespace,
                    str(meta.get("name") or ""),
                    str(meta.get("uid") or ""),
                    ref,
                    declared,
                    tuple(sorted(per_gpu.items())),
                    namespace in opted_in,
                )
            )
    found.sort(key=lambda c: (c.namespace, c.pod, c.container.name))
    in_pods = accounted | {cid for cid, claimed in owners.items() if len(claimed) == 1}
    outside = tuple(
        InNoPod(usage, containers.get(usage.key))
        for usage in sample.processes
        if usage.used_bytes and containers.get(usage.key) not in in_pods
    )
    return Unaccounted(tuple(found), outside)


def _declared(pod: Pod, declares: Declares) -> dict[str, int]:
    """Container name -> the bytes its resources declare; a pod whose resources cannot be
    read (the API server would have refused them) declares nothing."""
    try:
        return declared_limits(json_map(pod.get("spec")), declares.resource, declares.unit)
    except Undeclarable:
        return {}
