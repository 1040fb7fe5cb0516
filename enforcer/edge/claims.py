"""The DRA objects behind a pod's GPU limits: its ResourceClaims and its node's
ResourceSlices, read from the API as JSON (resource.k8s.io/v1, Kubernetes 1.34+).

Both are read again on each call (the sidecar's pod refresh, the agent's pod change): a
claim gets its allocation after the pod was first read, and a driver that restarts may
publish a new generation of slices. A read that fails fails whole; the caller keeps its
last good one (`ClaimState`, or the agent's last parse of the pod).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes import client

from enforcer.core.dra import DraObjects, claim_names
from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import DraRead
from enforcer.edge import logs
from enforcer.edge.kube import KubeError, NotFound, call

log = logging.getLogger(__name__)

CLAIM = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"

# One read of a claim or of the slices, retries included: it runs in the agent's publisher
# or limiter thread, or the sidecar's pod watcher, never in a tick or in the sampler.
READ_DEADLINE = 10.0
RETRY_AFTER = 5.0  # a read that failed is tried again this much later, the last good one kept
REFRESH_EVERY = 300.0  # a good read is read again this much later: a restarted DRA driver
# may publish a new generation of slices without any pod changing


class ClaimReader:
    """Reads a pod's ResourceClaims (namespaced: get) and the ResourceSlices of the node
    (cluster-scoped: list, by the `spec.nodeName` field selector)."""

    def __init__(self, api: client.ApiClient, node: str) -> None:
        self._api = api
        self._node = node

    def read(self, pod: Pod) -> DraObjects:
        """Raises KubeError (naming the verb and resource, and Forbidden for RBAC)."""
        claims: dict[str, dict[str, Any]] = {}
        namespace = str((pod.get("metadata") or {}).get("namespace", ""))
        for name in {n for n in claim_names(pod).values() if n is not None}:
            claim = self._claim(namespace, name)
            if claim is not None:
                claims[name] = claim
        if not self._node:
            raise KubeError("NODE_NAME is unset: this node's ResourceSlices cannot be listed")
        on_this_node = {"fieldSelector": f"spec.nodeName={self._node}"}
        listed = call(
            self._api,
            "GET",
            SLICES,
            "resourceslices",
            deadline=READ_DEADLINE,
            verb="list",
            query=on_this_node,
        )
        items = listed.get("items") if isinstance(listed, dict) else None
        slices = tuple(s for s in items if isinstance(s, dict)) if isinstance(items, list) else ()
        return DraObjects(claims, slices)

    def _claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim, or None when it does not exist (deleted, or not made yet)."""
        try:
            where = {"namespace": namespace, "name": name}
            claim: dict[str, Any] = call(
                self._api, "GET", CLAIM, "resourceclaims", deadline=READ_DEADLINE, params=where
            )
        except NotFound:
            return None
        return claim


class ClaimCache:
    """The agent's one read of each pod's DRA objects per change of the pod, shared by its
    hard limiter and the pod replies to sidecars. A read that fails keeps the last good
    one, says why, and is tried again after `retry` seconds; a good one is read again after
    `refresh` (a driver that restarted may publish new slices), or when the pod changes."""

    def __init__(
        self,
        reader: ClaimReader,
        retry: float = RETRY_AFTER,
        refresh: float = REFRESH_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._retry = retry
        self._refresh = refresh
        self._clock = clock
        self._lock = threading.Lock()  # the limiter's and the publisher's threads
        # Pod UID -> (its resourceVersion when read, the read, when to read it again)
        self._reads: dict[str, tuple[str, DraRead, float]] = {}

    def read(self, pod: Pod) -> DraRead:
        meta = pod.get("metadata") or {}
        uid, version = str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")
        with self._lock:
            known = self._reads.get(uid)
            now = self._clock()
            if known is not None and known[0] == version and now < known[2]:
                return known[1]
            try:
                found, again = DraRead(self._reader.read(pod)), now + self._refresh
            except KubeError as exc:
                last = known[1].objects if known is not None else None
                found, again = DraRead(last, str(exc)), now + self._retry
            self._reads[uid] = (version, found, again)
            return found

    def last(self, pod: Pod) -> DraObjects | None:
        """The pod's objects as last read well, without reading: for a caller that must
        not wait on the API (the agent's sampler). None before a good read."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        with self._lock:
            known = self._reads.get(uid)
        return known[1].objects if known is not None else None

    def objects_or_problem(self, pod: Pod) -> DraObjects | str:
        """The limiter's view: the objects, or why they cannot be read now."""
        found = self.read(pod)
        if found.problem is not None or found.objects is None:
            return found.problem or "not read yet"
        return found.objects

    def retain(self, uids: Iterable[str]) -> None:
        """Forget the pods that are gone."""
        alive = set(uids)
        with self._lock:
            for uid in [u for u in self._reads if u not in alive]:
                del self._reads[uid]

    def next_read(self) -> float | None:
        """Seconds until a pod's objects are due to be read again (None: no pod's are)."""
        with self._lock:
            due = [again for _, _, again in self._reads.values()]
        return max(0.0, min(due) - self._clock()) if due else None


class ClaimState:
    """The last DRA objects read for the pod, refreshed from the pod watcher's thread.

    Errors are values: the last good read is kept (None until there is one), and `error`
    says what failed, logged once per change.
    """

    def __init__(self, reader: ClaimReader) -> None:
        self._reader = reader
        self.objects: DraObjects | None = None
        self._outage = logs.Outage(log)

    @property
    def error(self) -> str | None:
        return self._outage.error

    def refresh(self, pod: Pod) -> None:
        try:
            self.objects = self._reader.read(pod)
        except KubeError as exc:
            what = "cannot read this pod's ResourceClaims or its node's ResourceSlices"
            self._outage.failed(f"{what}; the last read is kept", exc)
        else:
            self._outage.ended("reading this pod's ResourceClaims again")
