"""The ResourceClaimTemplates that the webhook's DRA mode makes claims from, made when
missing (resource.k8s.io/v1)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client

from enforcer.edge.kube import KubeError, NotFound, call

TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
TEMPLATE = TEMPLATES + "/{name}"
SEEN_FOR = 60.0  # a template seen or made is not asked about again for this long


class TemplateKeeper:
    """Makes the ResourceClaimTemplates that the webhook's DRA-mode pods name, when missing.

    One per size and namespace, shared by every pod that declares that size; the claim made
    from it for each pod is owned by the pod (the controller-manager's doing) and goes with
    it. A template seen or made is not asked about again for `ttl` seconds (the maker looks
    at every pending pod it marked), and one deleted meanwhile is made again after that.
    """

    def __init__(
        self,
        api: client.ApiClient,
        deadline: float,
        ttl: float = SEEN_FOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._ttl = ttl
        self._deadline = deadline
        self._clock = clock
        self._seen: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()  # one thread per webhook connection

    def ensure(self, template: Mapping[str, Any]) -> str | None:
        """None once the template exists; else why it could not be made, to be said."""
        meta = template["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        with self._lock:
            if self._clock() - self._seen.get(key, -self._ttl) < self._ttl:
                return None
        where = {"namespace": key[0], "name": key[1]}
        try:
            if not self._exists(where):
                try:
                    call(
                        self._api,
                        "POST",
                        TEMPLATES,
                        "resourceclaimtemplates",
                        body=template,
                        params={"namespace": key[0]},
                        deadline=self._deadline,
                    )
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
            call(
                self._api,
                "GET",
                TEMPLATE,
                "resourceclaimtemplates",
                params=where,
                deadline=self._deadline,
            )
        except NotFound:
            return False
        return True
