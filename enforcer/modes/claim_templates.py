"""The webhook's DRA mode, outside admission: the ResourceClaimTemplates its pods name.

A declaration of 16Gi becomes a claim from the template `vram-enforcer-16gi` of the pod's
namespace. The webhook used to make that template while it reviewed the pod; but anyone who
reaches the webhook's Service can send it a review, naming any namespace, and it had a
cluster-wide `create` grant: a confused deputy. So admission writes nothing, and this
thread makes the templates from what the API holds instead: the pending pods that the
webhook marked (`vram-enforcer.io/enforced=true`), in namespaces that opted in
(`vram-enforcer.io/inject=enabled`, read from the Namespace), at most `MAX_PER_NAMESPACE`
sizes per namespace. A pod waits for its template for as long as this takes (the
controller-manager retries the claim); nothing that does not exist in the API makes an
object.

In a creation storm thousands of pods are pending at once, and each changes several times
(created, bound, started): the pods are held only as their namespace and claims, and a
pass reads only the pods whose templates were not all there yet, all of them again once
a minute (`RESYNC`), when a template deleted meanwhile is made again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client

from enforcer.core.admission import AdmissionSettings, templates_named
from enforcer.core.declaration import ENFORCED, OPT_IN, opts_in
from enforcer.core.payloads import Pod
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.kube import KubeError, NotFound, call
from enforcer.edge.node_pods import WatchedPods
from enforcer.edge.template_keeper import TemplateKeeper

log = logging.getLogger(__name__)

MAX_PER_NAMESPACE = 32  # distinct VRAM sizes, each a template, per namespace
RESYNC = 60.0  # look again this often even without a change (a template deleted meanwhile)
NAMESPACE_TTL = 60.0  # a namespace's opt-in, as read, is trusted this long
API_DEADLINE = 10.0  # one call, retries included: this maker runs outside admission
NAMESPACE = "/api/v1/namespaces/{name}"
PENDING_ENFORCED = {"labelSelector": f"{ENFORCED}=true", "fieldSelector": "status.phase=Pending"}


class TemplateMaker(threading.Thread):
    """Makes the templates that pending enforced pods name, in opted-in namespaces."""

    def __init__(
        self,
        api: client.ApiClient,
        settings: AdmissionSettings,
        unexpected: ErrorCounter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="claim-templates", daemon=True)
        self._api = api
        self._settings = settings
        self._clock = clock
        self._keeper = TemplateKeeper(api, deadline=API_DEADLINE, clock=clock)
        self.changed = threading.Event()
        self.pods = WatchedPods(
            api, PENDING_ENFORCED, (self.changed,), name="pending-pods", keep=claims_of
        )
        self.stop = threading.Event()
        self._guard = LoopGuard("claim-templates", unexpected, log)
        self._opted_in: dict[str, tuple[bool, float]] = {}
        self._sizes: dict[str, set[str]] = {}  # namespace -> templates of ours known there
        self._said: set[str] = set()
        self._done: set[str] = set()  # UIDs of pods whose templates all exist

    def start(self) -> None:
        self.pods.start()
        super().start()

    def close(self) -> None:
        self.stop.set()
        self.changed.set()
        self.pods.close()

    def run(self) -> None:
        read_all_at = self._clock()
        while not self.stop.is_set():
            self.changed.wait(RESYNC)
            self.changed.clear()
            if self.stop.is_set():
                return
            pods = self.pods.snapshot()
            if pods is None:
                continue
            # Every pod once a minute, even while changes keep coming faster than that.
            everything = self._clock() - read_all_at >= RESYNC
            if everything:
                read_all_at = self._clock()
            self._guard.run(functools.partial(self.make, pods, everything))

    def make(self, pods: Mapping[str, Pod], everything: bool = True) -> None:
        """One pass over the pods (by UID), or over those not yet done: each missing
        template made, or why not said once."""
        if everything:
            self._done.clear()
        self._done.intersection_update(pods)
        for uid, pod in pods.items():
            if uid in self._done:
                continue
            if all([self._ensure(t) for t in templates_named(pod, self._settings)]):  # each tried
                self._done.add(uid)

    def _ensure(self, template: dict[str, Any]) -> bool:
        """Whether the template exists (made now, or known)."""
        meta = template["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        if not self._is_opted_in(namespace):
            self._say(
                f"{namespace}/{name}",
                f"not making ResourceClaimTemplate {name!r} in "
                f"namespace {namespace!r}: the namespace has not opted in "
                f"({OPT_IN[0]}={OPT_IN[1]})",
            )
            return False
        known = self._sizes.setdefault(namespace, set())
        if name not in known and len(known) >= MAX_PER_NAMESPACE:
            self._say(
                f"{namespace}/{name}",
                f"not making ResourceClaimTemplate {name!r}: "
                f"namespace {namespace!r} already has {MAX_PER_NAMESPACE} VRAM sizes of "
                "ours; declare one of the sizes in use there",
            )
            return False
        problem = self._keeper.ensure(template)
        if problem is not None:
            self._say(f"{namespace}/{name}", problem)
            return False
        known.add(name)
        self._said.discard(f"{namespace}/{name}")
        return True

    def _is_opted_in(self, namespace: str) -> bool:
        now = self._clock()
        cached = self._opted_in.get(namespace)
        if cached is not None and now - cached[1] < NAMESPACE_TTL:
            return cached[0]
        try:
            ns = call(
                self._api,
                "GET",
                NAMESPACE,
                "namespaces",
                params={"name": namespace},
                deadline=API_DEADLINE,
            )
        except NotFound:
            opted = False
        except KubeError as exc:
            self._say(f"namespace {namespace}", f"cannot read namespace {namespace!r}: {exc}")
            return False
        else:
            opted = opts_in(ns)
        self._opted_in[namespace] = (opted, now)
        return opted

    def _say(self, key: str, text: str) -> None:
        """Each problem once, until it is solved."""
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", text)


def claims_of(pod: Pod) -> Pod:
    """What a pass reads of a pending pod: its namespace and the claims that name templates
    (a pod's claims never change)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    kept: Pod = {"metadata": {}, "spec": {}}
    if "namespace" in meta:
        kept["metadata"]["namespace"] = meta["namespace"]
    if "resourceClaims" in spec:
        kept["spec"]["resourceClaims"] = spec["resourceClaims"]
    return kept
