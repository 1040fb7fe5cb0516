"""The DRA objects behind a pod's GPU limits: its ResourceClaims and its node's
ResourceSlices, read from the API as JSON (resource.k8s.io/v1, Kubernetes 1.34+); and the
ResourceClaimTemplates that the webhook's DRA mode makes claims from.

Both are read again on each call (the sidecar's pod refresh, the agent's pod change): a
claim gets its allocation after the pod was first read, and a driver that restarts may
publish a new generation of slices. A read that fails fails whole; the caller keeps its
last good one (`ClaimState`, or the agent's last parse of the pod).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from enforcer.core.dra import claim_names
from enforcer.core.payloads import Pod
from enforcer.edge import logs
from enforcer.edge.kube import KubeError, NotFound, call

log = logging.getLogger(__name__)

CLAIM = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
TEMPLATE = TEMPLATES + "/{name}"


@dataclass(frozen=True, slots=True)
class DraObjects:
    """What `enforcer.core.dra.allocations` needs besides the pod."""

    claims: dict[str, dict[str, Any]] = field(default_factory=dict)  # by ResourceClaim name
    slices: tuple[dict[str, Any], ...] = ()


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
        listed = call(self._api, "GET", SLICES, "resourceslices", deadline=10.0, verb="list",
                      query={"fieldSelector": f"spec.nodeName={self._node}"})  # fmt: skip
        items = listed.get("items") if isinstance(listed, dict) else None
        slices = tuple(s for s in items if isinstance(s, dict)) if isinstance(items, list) else ()
        return DraObjects(claims, slices)

    def _claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim, or None when it does not exist (deleted, or not made yet)."""
        try:
            where = {"namespace": namespace, "name": name}
            claim: dict[str, Any] = call(
                self._api, "GET", CLAIM, "resourceclaims", deadline=10.0, params=where
            )
        except NotFound:
            return None
        return claim


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


class TemplateKeeper:
    """Makes the ResourceClaimTemplates that the webhook's DRA-mode pods name, when missing.

    One per size and namespace, shared by every pod that declares that size; the claim made
    from it for each pod is owned by the pod (the controller-manager's doing) and goes with
    it. A template seen or made is not asked about again for `ttl` seconds: admission must
    stay fast, and a template deleted meanwhile is made again after that.
    """

    def __init__(
        self,
        api: client.ApiClient,
        ttl: float = 60.0,
        deadline: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._ttl = ttl
        self._deadline = deadline  # within the API server's timeout for the webhook (5 s)
        self._clock = clock
        self._seen: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()  # one thread per webhook connection

    def ensure(self, template: Mapping[str, Any]) -> str | None:
        """None once the template exists; else why it could not be made, for the denial."""
        meta = template["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        with self._lock:
            if self._clock() - self._seen.get(key, -self._ttl) < self._ttl:
                return None
        where = {"namespace": key[0], "name": key[1]}
        try:
            if not self._exists(where):
                try:
                    call(self._api, "POST", TEMPLATES, "resourceclaimtemplates", body=template,
                         params={"namespace": key[0]}, deadline=self._deadline)  # fmt: skip
                except KubeError:
                    if not self._exists(where):  # else another replica made it meanwhile
                        raise
        except KubeError as exc:
            return (
                f"the ResourceClaimTemplate {key[1]!r} that this pod's VRAM is claimed from "
                f"could not be made in namespace {key[0]!r}: {exc}"
            )
        with self._lock:
            self._seen[key] = self._clock()
        return None

    def _exists(self, where: dict[str, str]) -> bool:
        try:
            call(self._api, "GET", TEMPLATE, "resourceclaimtemplates", params=where,
                 deadline=self._deadline)  # fmt: skip
        except NotFound:
            return False
        return True
