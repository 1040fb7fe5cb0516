"""The namespaces whose pods the webhook mutates, as the node agent knows them: those
labelled `vram-enforcer.io/inject=enabled` (the chart's namespaceSelector), kept current by
a list and a watch (`node_pods.WatchedPods`: resumed, listed again after a failure or an
expiry, the last good view kept meanwhile), as their names.

The agent reads a pod's sidecar environment only on pods of these (`declaration.of_pod`):
anywhere else the webhook wrote none, and a container named like the sidecar is its
author's. Never in the agent's own namespace, which the webhook leaves out by name
whatever its labels. A namespace that loses the label is left out from the next event on:
its pods, injected before, then declare through their resources alone.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from enforcer.core.declaration import OPT_IN, opts_in
from enforcer.core.payloads import ObjectMeta, Pod
from enforcer.core.pod import json_map
from enforcer.edge.node_pods import WatchedPods

NAMESPACES = "/api/v1/namespaces"


class OptedInNamespaces(WatchedPods):
    """The names of the namespaces that opted in, but `own`; None before the first list."""

    path, resource = NAMESPACES, "namespaces"

    def __init__(
        self, api: client.ApiClient, own: str, changed: tuple[threading.Event, ...], **options: Any
    ) -> None:
        """`own`: the agent's namespace ("" when it is not known: then none is left out by
        name); each of `changed` is set on every change of the namespaces."""
        options = {"keep": _opt_in_of, **options}
        super().__init__(
            api,
            {"labelSelector": f"{OPT_IN[0]}={OPT_IN[1]}"},
            changed,
            name="opted-in-namespaces",
            **options,
        )
        self._own = own

    def names(self) -> frozenset[str] | None:
        """The namespaces whose pods' sidecar environment is read; None until the first list
        has succeeded (no pod's is, and the agent's passes wait)."""
        listed = self.snapshot()
        if listed is None:
            return None
        return _names(listed, self._own)

    def _what(self) -> str:
        return f"the namespaces labelled {OPT_IN[0]}={OPT_IN[1]}"


def _names(listed: Mapping[str, Pod], own: str) -> frozenset[str]:
    """Those that carry the label (checked again here, whatever the selector let through)."""
    found = (json_map(ns.get("metadata")).get("name") for ns in listed.values() if opts_in(ns))
    return frozenset(name for name in found if isinstance(name, str) and name and name != own)


def _opt_in_of(namespace: Pod) -> Pod:
    """What is kept of a Namespace: its name, and its label of OPT_IN."""
    meta = json_map(namespace.get("metadata"))
    kept = ObjectMeta()
    if isinstance(name := meta.get("name"), str):
        kept["name"] = name
    label = json_map(meta.get("labels")).get(OPT_IN[0])
    if isinstance(label, str):
        kept["labels"] = {OPT_IN[0]: label}
    return Pod(metadata=kept)
