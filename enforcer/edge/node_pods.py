"""Pods kept current by a list and a watch: the pods bound to this node (the node agent's
view), or those of a selector (the webhook's pending pods, for their claim templates).

The agent needs each pod's limits the moment its cgroup appears, so it watches rather than
polls: one list (`fieldSelector=spec.nodeName=<node>`), then a watch from that list's
resourceVersion. A watch that ends is resumed from the last version seen; one the server
has expired (410 Gone) or that failed starts again with a list. Failures back off, are
logged once each, and never lose what is known: the last good view stays in place.

A selector may match thousands of pods (the webhook's pending pods in a creation storm):
the list comes in pages, and each pod is kept only as much as its reader needs (`keep`),
so memory grows with what is read, not with whole pods. The agent's pods are few, but any
tenant on the node can make each one large (1.5 MiB): it keeps what it and the sidecars
read (`pod_directory.kept`), and lists them a few at a time, since a page is held whole
until its pods are trimmed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import urllib3.exceptions
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import kept
from enforcer.edge import logs
from enforcer.edge.backoff import Backoff
from enforcer.edge.kube import KubeError, WatchStream, call, watch_error

log = logging.getLogger(__name__)

PODS = "/api/v1/pods"
# One page of the list, retries included: a page of a busy node's pods is large, and this
# runs in the watch's own thread, whose view stays the last one meanwhile.
LIST_DEADLINE = 30.0
PAGE = 500  # pods per page of a list
# Pods per page of the node's list: a page is held whole until its pods are trimmed, and a
# 1.5 MiB pod of short labels takes up to ten times that while it is decoded.
NODE_PAGE = 5
# What a list or a watch can fail with: the API's answers, the network, a garbled line.
_FAILURES = (KubeError, ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


class WatchedPods(threading.Thread):
    """Pod UID -> pod, for the pods that `query` selects (a field and a label selector);
    each of `changed` is set on every change, and when the watch fails or recovers. (A
    subclass may watch other objects of the core group: `path`, `resource`.)"""

    path, resource = PODS, "pods"  # what is listed and watched, and the resource RBAC names

    def __init__(
        self,
        api: client.ApiClient,
        query: Mapping[str, str],
        changed: tuple[threading.Event, ...],
        *,
        name: str = "watched-pods",
        watch_seconds: int = 300,
        backoff: Backoff | None = None,
        keep: Callable[[Pod], Pod] | None = None,
        page: int = PAGE,
    ) -> None:
        """`keep`: what of each pod to hold (default: all of it); `page`: pods per page of a
        list."""
        super().__init__(name=name, daemon=True)
        self._api = api
        self._keep = keep or _whole
        self._page = str(page)
        self._query = dict(query)
        self._changed = changed
        self._watch_seconds = watch_seconds
        self._backoff = backoff or Backoff()
        self._pods: dict[str, Pod] = {}
        self._synced = False
        self._lock = threading.Lock()
        self._stream: WatchStream | None = None
        self.stop = threading.Event()
        self.error = ""

    def _changed_now(self) -> None:
        for event in self._changed:
            event.set()

    def snapshot(self) -> Mapping[str, Pod] | None:
        """The pods as last seen, or None before the first list has succeeded."""
        with self._lock:
            return dict(self._pods) if self._synced else None

    def close(self) -> None:
        self.stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                version = self._list()
                while version and not self.stop.is_set():
                    version = self._watch(version)
            except (
                KubeError,
                ApiException,
                urllib3.exceptions.HTTPError,
                OSError,
                ValueError,
            ) as exc:
                if self.stop.is_set():
                    return
                self.stop.wait(self._failed(exc))

    def _list(self) -> str:
        """List in pages (one consistent snapshot, followed by its `continue` token); the
        pods replace the view at once, and the snapshot's version is returned."""
        pods: dict[str, Pod] = {}
        page = {"limit": self._page}
        while True:
            reply = call(
                self._api,
                "GET",
                self.path,
                self.resource,
                query={**self._query, **page},
                deadline=LIST_DEADLINE,
                timeout=LIST_DEADLINE,
                verb="list",
            )
            for pod in reply.get("items") or ():
                if uid := _uid(pod):
                    pods[uid] = self._keep(pod)
            meta = reply.get("metadata") or {}
            if not meta.get("continue"):
                break
            page = {"limit": self._page, "continue": str(meta["continue"])}
        with self._lock:
            self._pods = pods
            self._synced = True
        self._changed_now()
        if self.error:
            log.info("watching %s again (%d %s)", self._what(), len(pods), self.resource)
            self.error = ""
        self._backoff.succeeded()
        return str(meta.get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """Apply events until the watch ends; returns the version to resume from, or ""
        when a new list is needed (the server expired `version`)."""
        query = {
            **self._query,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_seconds),
        }
        self._stream = WatchStream(self._api, self.path, query, timeout=self._watch_seconds + 30.0)
        try:
            for event in self._stream:
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise watch_error(obj)
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply(kind, obj)
        finally:
            self._stream.close()
            self._stream = None
        return version

    def _apply(self, kind: str, pod: Any) -> None:
        uid = _uid(pod)
        if not uid:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = self._keep(pod)
        self._changed_now()

    def _failed(self, exc: Exception) -> float:
        """Log a new failure once; returns the pause before listing again."""
        if isinstance(exc, ApiException) and exc.status == 410:
            log.debug("the watch of %s expired; listing again", self._what())
            return 0.0
        delay = self._backoff.failed(0.0)
        message = f"cannot watch {self._what()}: {exc}"
        if message != self.error:
            log.warning(
                "%s; keeping the last view and retrying", message, exc_info=logs.detail(exc)
            )
            self.error = message
            self._changed_now()  # those who pass the view on say that it may be out of date
        return delay

    def _what(self) -> str:
        return "this node's pods" if self.name == "node-pods" else f"pods ({self._query})"


class NodePods(WatchedPods):
    """The pods bound to `node`, as much of each as the agent and the sidecars read: the
    agent's hard limits, its reclaims, and each sidecar's own pod."""

    def __init__(
        self, api: client.ApiClient, node: str, changed: tuple[threading.Event, ...], **options: Any
    ) -> None:
        options = {"keep": kept, "page": NODE_PAGE, **options}
        super().__init__(
            api, {"fieldSelector": f"spec.nodeName={node}"}, changed, name="node-pods", **options
        )


def _whole(pod: Pod) -> Pod:
    return pod


def _uid(pod: Any) -> str:
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) else ""
