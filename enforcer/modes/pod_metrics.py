"""The agent's series of its node's enforced pods, assembled when Prometheus scrapes: the
sampler's last pass, the pods, the lender's tenants, and each pod's counts from its sidecar
and from the agent's backstop (`core/pod_metrics.py` works them out)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from enforcer.core.declaration import SIDECAR
from enforcer.core.lending import Tenants
from enforcer.core.model import ProcessKey, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id, json_map
from enforcer.core.pod_metrics import (
    ContainerSeries,
    container_series,
    enforced_containers,
    peak_series,
    pod_owners,
)
from enforcer.core.reclaim import Gpu
from enforcer.core.sidecar_report import SidecarReport
from enforcer.edge.metrics import PodsView
from enforcer.edge.telemetry import SidecarTelemetry

PodKey = tuple[str, str]  # (namespace, pod): the labels of its series


def pod_key(pod: Pod) -> tuple[str, PodKey]:
    """(UID, (namespace, name)) of a pod."""
    meta = json_map(pod.get("metadata"))
    key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
    return str(meta.get("uid") or ""), key


class PodCounts:
    """Each pod's latest counts from its sidecar, by pod UID, for as long as the pod is on
    the node (a sidecar that hangs up keeps its series); only the pod's own sidecar speaks
    for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_uid: dict[str, tuple[PodKey, SidecarReport]] = {}

    def keep(self, pod: Pod, container_id: str, report: SidecarReport) -> SidecarReport | None:
        """Kept only from the pod's sidecar container: another of its containers that
        reaches the agent's socket does not speak for the pod. The report it replaces, if
        it was kept and there was one."""
        ref = containers_by_id(pod).get(container_id)
        if ref is None or ref.name != SIDECAR:
            return None
        uid, key = pod_key(pod)
        with self._lock:
            before = self._by_uid.get(uid)
            self._by_uid[uid] = (key, report)
        return None if before is None else before[1]

    def of(self, pods: Mapping[str, Pod]) -> dict[str, tuple[PodKey, SidecarReport]]:
        """Those of the pods still on the node (by UID); the others are forgotten."""
        with self._lock:
            self._by_uid = {uid: kept for uid, kept in self._by_uid.items() if uid in pods}
            return dict(self._by_uid)


# The sampler's last pass: its sample, and a reader of each process's container ID.
LastPass = tuple[Sample, Callable[[], Mapping[ProcessKey, str]]]


class HasTenants(Protocol):
    """The lender, as the series read it: the node's tenants as last made."""

    @property
    def tenants(self) -> Tenants | None: ...


class HasLending(Protocol):
    """The node's metrics, as the series read them: the GPUs where containers may borrow,
    as of the lender's last pass."""

    @property
    def lending(self) -> Sequence[Gpu]: ...


class HasCounts(Protocol):
    """The backstop, as the series read it: by pod UID, what the agent did in the pod."""

    @property
    def counts(self) -> Mapping[str, SidecarTelemetry]: ...


def pods_view(
    last: Callable[[], LastPass | None],
    pods: Callable[[], Mapping[str, Pod] | None],
    lender: HasTenants,
    node: HasLending,
    sidecars: PodCounts,
    backstop: HasCounts,
    opted_in: Callable[[], frozenset[str] | None],
) -> PodsView:
    """The series as of now: every container of the pods on the node that the webhook
    injected (in the namespaces `opted_in`), and each pod's counts, its sidecar's and the
    backstop's added up. Each part is read as it is now (each value is swapped whole by
    its own thread)."""
    now, passed = pods() or {}, last()
    series: tuple[ContainerSeries, ...] = ()
    if passed is not None:
        sample, containers = passed
        named = enforced_containers(now.values(), opted_in() or frozenset())
        series = container_series(sample, containers(), named, lender.tenants, node.lending)
    reports: dict[PodKey, SidecarReport] = {key: r for key, r in sidecars.of(now).values()}
    for uid, counts in backstop.counts.items():
        if uid in now:
            key = pod_key(now[uid])[1]
            done = replace(counts.report(), ticks=0, tick_seconds=0.0)  # not a sidecar's ticks
            reports[key] = reports.get(key, SidecarReport()) + done
    return PodsView(series, reports)


class Peaks:
    """Each container's highest GPU memory over all its GPUs, as the sampler's passes saw
    it, by container ID: a restarted container has a new ID, and its peak starts again.
    Only the containers of the node's pods (and those holding memory now, their pod's
    status not read yet) are kept: a pod that left is forgotten once the pods are read
    again. Fed by the sampler's thread, read by the scrapes'."""

    def __init__(self, pods: Callable[[], Mapping[str, Pod] | None]) -> None:
        self._pods = pods
        self._lock = threading.Lock()
        self._peaks: dict[str, int] = {}
        self._kept_for: Mapping[str, Pod] | None = None  # the pods it was last pruned to

    def see(self, usage: Mapping[str, Mapping[str, int]]) -> None:
        """One pass's usage: container ID -> GPU -> bytes."""
        now = self._pods()
        with self._lock:
            for cid, per_gpu in usage.items():
                held = sum(per_gpu.values())
                if held > self._peaks.get(cid, 0):
                    self._peaks[cid] = held
            if now is not None and now is not self._kept_for:  # the pods changed
                ids = {cid for pod in now.values() for cid in containers_by_id(pod)}
                self._peaks = {c: p for c, p in self._peaks.items() if c in ids or c in usage}
                self._kept_for = now

    @property
    def by_container(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peaks)


def with_workloads(
    view: Callable[[], PodsView],
    pods: Callable[[], Mapping[str, Pod] | None],
    peaks: Peaks,
    opted_in: Callable[[], frozenset[str] | None],
) -> PodsView:
    """`view`'s series, with each enforced container's peak and the owner of each pod that
    is enforced or had a container on a GPU (a pod that declares nothing is recommended
    for too): what `vram-enforcer recommend` reads."""
    now = (pods() or {}).values()
    seen = peaks.by_container
    named = enforced_containers(now, opted_in() or frozenset())
    counted = seen.keys() | named.keys()
    owned = [pod for pod in now if not counted.isdisjoint(containers_by_id(pod))]
    return replace(view(), peaks=peak_series(named, seen), owners=pod_owners(owned))
