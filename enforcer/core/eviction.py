"""When the node agent evicts a pod instead of signalling it: the kernel refused a signal
to one of its victims (EPERM: a security module, an agent without CAP_KILL), and the
victim's unit is still over its limit. The kubelet does the same for a pod it cannot hold
to its memory: it asks the API to evict it (policy/v1 Eviction), which a
PodDisruptionBudget may refuse for a while."""

from __future__ import annotations

from collections.abc import Iterable

from enforcer.core import messages
from enforcer.core.model import UnitUsage
from enforcer.core.parsing import format_duration


def to_evict(denied: Iterable[str], units: Iterable[UnitUsage]) -> UnitUsage | None:
    """The unit the pod is evicted for: of the units a signal was refused for (`denied`,
    by name), the one most over its limit now; None while none of them is over."""
    refused = frozenset(denied)
    over = [u for u in units if u.name in refused and u.used_bytes > u.limit_bytes]
    return max(over, key=lambda u: u.used_bytes - u.limit_bytes, default=None)


def evicted(unit: UnitUsage, label: str) -> str:
    """The Event that says why the pod is evicted."""
    return (
        f"{messages.usage(unit, label)}; the kernel refused the signal to its process "
        "(EPERM: a security module, or the agent lacks CAP_KILL), so the pod is evicted instead"
    )


def refused(why: str, retry_in: float) -> str:
    """The Event that says the eviction is refused for now (a PodDisruptionBudget)."""
    return (
        f"the eviction of this pod, over its VRAM limit and out of reach of signals, is "
        f"refused for now ({why}); retrying in {format_duration(retry_in)}"
    )
