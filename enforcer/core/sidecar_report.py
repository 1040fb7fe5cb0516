"""What a sidecar alone knows about its pod, reported to its node's agent (pure).

The agent serves every enforced pod's metrics (one scrape target per node): what NVML and
the pods show it works out itself; what only the sidecar sees (the actions it took, the
reclaims it carried out, the signals it refused to send, its bugs, its ticks) the sidecar
sends as one `report` request on its connection, cumulative since it started, whenever it
changed (`REPORT_EVERY`). The agent puts it on the pod the connection is proven to belong
to: a tenant that forges one can only lie about its own pod. So every label value is one
of a known few, and every count is bounded, before the agent keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

from enforcer.core.model import SignalResult

ACTIONS = ("warn", "terminate", "kill", "restart", "dry-run")
NEEDED_BY = ("requests", "unrequested")
REFUSED = tuple(str(r) for r in SignalResult if r is not SignalResult.SENT)
# The sidecar's loops, as its guards name them (`LoopGuard`): the tick, and with
# `--api-access direct` the pod watcher. No other name is taken from a report.
TICK_LOOP, POD_WATCHER_LOOP = "tick", "pod-watcher"
LOOPS = (TICK_LOOP, POD_WATCHER_LOOP)
MAX_COUNT = 2**53  # exact in JSON's numbers, and more than any sidecar will count
REPORT_EVERY = 5.0  # seconds: a report that changed waits at most this long

# The report's families, and the label values each may hold.
FAMILIES: Mapping[str, tuple[str, ...]] = {
    "actions": ACTIONS,
    "reclaims": NEEDED_BY,
    "refused": REFUSED,
    "unexpected": LOOPS,
}


@dataclass(frozen=True, slots=True)
class SidecarReport:
    """Counts since the sidecar started: actions by action, reclaims by whose need, refused
    signals by reason, bugs by loop; and its ticks, with their wall time in all."""

    actions: Mapping[str, int] = field(default_factory=dict)
    reclaims: Mapping[str, int] = field(default_factory=dict)
    refused: Mapping[str, int] = field(default_factory=dict)
    unexpected: Mapping[str, int] = field(default_factory=dict)
    ticks: int = 0
    tick_seconds: float = 0.0

    def family(self, name: str) -> Mapping[str, int]:
        found: Mapping[str, int] = getattr(self, name)
        return found

    def __add__(self, other: SidecarReport) -> SidecarReport:
        """Both counts: a pod's sidecar's, and the agent's while it held the pod."""

        def added(name: str) -> dict[str, int]:
            mine, theirs = self.family(name), other.family(name)
            return {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}}

        return SidecarReport(
            added("actions"),
            added("reclaims"),
            added("refused"),
            added("unexpected"),
            self.ticks + other.ticks,
            self.tick_seconds + other.tick_seconds,
        )


def parse_report(doc: Mapping[str, object]) -> SidecarReport | str:
    """The report in a request, or what is wrong with it (never an exception: the agent
    answers no report, it counts and drops a bad one)."""
    families: dict[str, dict[str, int]] = {}
    for name, allowed in FAMILIES.items():
        given = doc.get(name, {})
        if not isinstance(given, dict):
            return f"{name} is not a JSON object"
        counts: dict[str, int] = {}
        for label, count in given.items():
            if label not in allowed:
                return f"{name} has {label!r}, which is not one of vram-enforcer's"
            if not _count(count):
                return f"{name}[{label!r}] is {count!r}, not a count from 0 to 2^53"
            counts[label] = count
        families[name] = counts
    ticks, seconds = doc.get("ticks", 0), doc.get("tick_seconds", 0.0)
    if not _count(ticks):
        return f"ticks is {ticks!r}, not a count from 0 to 2^53"
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not (math.isfinite(seconds) and 0 <= seconds <= MAX_COUNT)
    ):
        return f"tick_seconds is {seconds!r}, not a number of seconds from 0"
    return SidecarReport(
        families["actions"],
        families["reclaims"],
        families["refused"],
        families["unexpected"],
        ticks,
        float(seconds),
    )


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def newly_denied(before: SidecarReport | None, after: SidecarReport) -> bool:
    """Whether the kernel refused a signal of the sidecar's (EPERM) since its last report:
    it decides, but cannot act. A sidecar's counts start again at 0 when it restarts
    (fewer ticks than before)."""
    denied = str(SignalResult.DENIED)
    was = 0 if before is None or after.ticks < before.ticks else before.refused.get(denied, 0)
    return after.refused.get(denied, 0) > was
