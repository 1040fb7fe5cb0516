"""What the agent's loops read of their node, each as last seen, passed as one (the lender,
the backstop and the hard limiter read the same three)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from enforcer.core.payloads import Pod


@dataclass(frozen=True, slots=True)
class NodeView:
    """The node's pods by UID (None before the first list), the namespaces that opted in
    (None before theirs: no pod's sidecar environment is read until then), and the
    resource that declares VRAM (its name, and bytes per unit)."""

    pods: Callable[[], Mapping[str, Pod] | None]
    opted_in: Callable[[], frozenset[str] | None]
    resource: tuple[str, int]
