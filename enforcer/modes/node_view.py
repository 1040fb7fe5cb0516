"""What the agent's loops read of their node, each as last seen, passed as one (the lender,
the backstop and the hard limiter read the same)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from enforcer.core.declaration import Declares, injected_pods
from enforcer.core.dra import DraObjects, DraSettings
from enforcer.core.payloads import Pod


@dataclass(frozen=True, slots=True)
class ClaimReads:
    """DRA: a pod's claims and this node's slices, and which allocations are GPUs. The
    sampler's passes take them as last read (`last`: None before a read), never waiting on
    the API; the hard limiter, on its own thread, reads them again where they are stale
    (`now`: the objects, or why they cannot be read)."""

    last: Callable[[Pod], DraObjects | None]
    now: Callable[[Pod], DraObjects | str]
    settings: DraSettings


@dataclass(frozen=True, slots=True)
class NodeView:
    """The node's pods by UID (None before the first list), the namespaces that opted in
    (None before theirs: no pod's sidecar environment is read until then), where the pods
    declare VRAM, with DRA their claims (None: no DRA driver's allocations are GPUs), and
    the Node's labels as last read (none where the agent does not read its Node)."""

    pods: Callable[[], Mapping[str, Pod] | None]
    opted_in: Callable[[], frozenset[str] | None]
    declares: Declares
    claims: ClaimReads | None = None
    labels: Callable[[], Mapping[str, str]] = dict

    def injected(self) -> dict[str, Pod] | None:
        """The node's pods that the webhook injected, by UID (`declaration.injected`); None
        before the pods and the namespaces are listed."""
        return injected_pods(self.pods(), self.opted_in())
