"""The agent's series of its node's enforced pods, assembled when Prometheus scrapes: the
sampler's last pass, the pods, the lender's tenants, and each pod's counts from its sidecar
and from the agent's backstop (`core/pod_metrics.py` works them out)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
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
PodContainer = tuple[str, str]  # (pod UID, container name): a container over its instances


def pod_containers(pods: Iterable[Pod]) -> dict[str, PodContainer]:
    """Container ID -> the container it is an instance of, for each ID the pods' statuses
    name (a container's name is its pod's alone, across its kinds)."""
    found: dict[str, PodContainer] = {}
    for pod in pods:
        uid = pod_key(pod)[0]
        found.update((cid, (uid, ref.name)) for cid, ref in containers_by_id(pod).items())
    return found


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
    it, over its pod's life on the node: kept by pod UID and container name, across the
    container's instances. What an instance reached in its last passes, which no scrape
    may have seen, outlives its container ID (one stopped for going over its limit is at
    its highest then), and a restart does not start it again. A container ID no pod's
    status names yet (its pod's status not read yet) is kept by itself while it holds
    memory, and joins its container once named. A pod that left is forgotten once the
    pods are read again. Fed by the sampler's thread, read by the scrapes'."""

    def __init__(self, pods: Callable[[], Mapping[str, Pod] | None]) -> None:
        self._pods = pods
        self._lock = threading.Lock()
        self._peaks: dict[PodContainer, int] = {}
        self._unnamed: dict[str, int] = {}  # container ID -> its peak, until a pod names it
        self._kept_for: Mapping[str, Pod] | None = None  # the pods last read, and their IDs:
        self._names: dict[str, PodContainer] = {}

    def see(self, usage: Mapping[str, Mapping[str, int]]) -> None:
        """One pass's usage: container ID -> GPU -> bytes."""
        now = self._pods()
        with self._lock:
            if now is not None and now is not self._kept_for:  # the pods changed
                self._kept_for, self._names = now, pod_containers(now.values())
                self._peaks = {k: p for k, p in self._peaks.items() if k[0] in now}
                unnamed, self._unnamed = self._unnamed, {}
                for cid, peak in unnamed.items():
                    if cid in self._names or cid in usage:
                        self._raise(cid, peak)
            for cid, per_gpu in usage.items():
                self._raise(cid, sum(per_gpu.values()))

    def _raise(self, cid: str, held: int) -> None:
        """Raise to `held` the peak of the container `cid` is an instance of (or its own)."""
        key = self._names.get(cid)
        if key is None:
            self._unnamed[cid] = max(held, self._unnamed.get(cid, 0))
        else:
            self._peaks[key] = max(held, self._peaks.get(key, 0))

    def of(self, pods: Iterable[Pod]) -> dict[str, int]:
        """By each container ID that `pods` name, the peak of its container (those that
        held GPU memory)."""
        with self._lock:
            peaks = dict(self._peaks)
        return {cid: peaks[key] for cid, key in pod_containers(pods).items() if key in peaks}


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
    seen = peaks.of(now)
    named = enforced_containers(now, opted_in() or frozenset())
    counted = seen.keys() | named.keys()
    owned = [pod for pod in now if not counted.isdisjoint(containers_by_id(pod))]
    return replace(view(), peaks=peak_series(named, seen), owners=pod_owners(owned))
