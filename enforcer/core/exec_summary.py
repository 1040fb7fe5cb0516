"""What `vram-enforcer exec --summary FILE` writes at exit, and how it is read back.

`exec` writes it; `vram-enforcer interference` reads it for every run it makes. The two
modes stand alone (neither imports the other), so the format lives here, between them:
one definition, one version number, and a reader that refuses a document it does not
understand rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from enforcer.core.alloc_gate import Verdict
from enforcer.core.reasons import Reason
from enforcer.core.tier_choice import TierName

SUMMARY_VERSION = 1
# The events of an excursion over the limit (a reclaim is not one: it happens under it).
_OVER_THE_LIMIT = frozenset({str(Reason.LIMIT_EXCEEDED), str(Reason.ENFORCED)})

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SummaryEvent:
    """A report about the limit (`VRAMLimitExceeded`, `VRAMEnforced`, a dry run's
    `VRAMWouldEnforce`) or about memory borrowed above the request and taken back
    (`VRAMReclaimed`), timed from the spawn."""

    reason: str
    after_seconds: float
    message: str
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class GateCounts:
    """What the allocation gate answered (`--allocation-gate on`): its calls by outcome
    (`gate_listener.Outcome`'s values), and its slowest answer, in microseconds."""

    calls: tuple[tuple[str, int], ...] = ()
    max_listener_us: float = 0.0

    @property
    def refusals(self) -> int:
        return dict(self.calls).get(str(Verdict.REFUSE), 0)  # a refused call's outcome

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "refusals": self.refusals,
            "max_listener_us": self.max_listener_us,
        }


@dataclass(frozen=True, slots=True)
class ExecSummary:
    """One `exec` run: how the command ended, how long it ran, and what the limit did.

    Times are `exec`'s own: from the spawn of the command to the moment it was reaped, on
    CLOCK_MONOTONIC, which every process of the machine shares, so that the runs of two
    `exec`s can be laid side by side. `peak_bytes` is the largest GPU memory of the
    command tree that a sample saw (None: never sampled with data). `sm_percent` and
    `memory_percent` are its mean SM and memory-controller utilisation, summed over its
    processes and GPUs, over the `busy_samples` samples (one per `--interval`) in which it
    had a process on a GPU and NVML could tell how busy it was (None: never); each sample
    carries NVML's latest utilisation read, made twice a second.
    """

    command: tuple[str, ...]
    limit_bytes: int
    action: str
    dry_run: bool
    exit_status: int  # exec's own exit status
    started: bool  # False: the command never ran (bad command, no NVML, ...)
    signal: str | None = None  # the signal that ended the command, when one did
    start_monotonic: float | None = None
    end_monotonic: float | None = None
    started_at: float | None = None  # the spawn, in seconds since the epoch, for people
    peak_bytes: int | None = None
    samples: int = 0  # ticks that had data
    hard_limit: bool = False  # the driver held the command to the limit as well
    tier: str = TierName.SAMPLING  # the tier that held it, as exec logged it
    events: tuple[SummaryEvent, ...] = field(default=())
    sm_percent: float | None = None
    memory_percent: float | None = None
    busy_samples: int = 0
    request_bytes: int | None = None  # None: the limit, no borrowing
    allocation_gate: GateCounts | None = None  # None: the gate did not hold the command

    @property
    def wall_seconds(self) -> float | None:
        if self.start_monotonic is None or self.end_monotonic is None:
            return None
        return self.end_monotonic - self.start_monotonic

    @property
    def exceeded_after(self) -> float | None:
        """When the command tree was first seen over its limit, or None if it never was."""
        over = (e.after_seconds for e in self.events if e.reason in _OVER_THE_LIMIT)
        return min(over, default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SUMMARY_VERSION,
            "command": list(self.command),
            "limit_bytes": self.limit_bytes,
            "request_bytes": self.request_bytes,
            "action": self.action,
            "dry_run": self.dry_run,
            "exit_status": self.exit_status,
            "started": self.started,
            "signal": self.signal,
            "wall_seconds": self.wall_seconds,
            "start_monotonic": self.start_monotonic,
            "end_monotonic": self.end_monotonic,
            "started_at": self.started_at,
            "peak_bytes": self.peak_bytes,
            "samples": self.samples,
            "hard_limit": self.hard_limit,
            "tier": self.tier,
            "exceeded_after_seconds": self.exceeded_after,
            "sm_percent": self.sm_percent,
            "memory_percent": self.memory_percent,
            "busy_samples": self.busy_samples,
            "allocation_gate": self.allocation_gate and self.allocation_gate.to_json(),
            "events": [
                {
                    "reason": e.reason,
                    "after_seconds": e.after_seconds,
                    "pid": e.pid,
                    "message": e.message,
                }
                for e in self.events
            ],
        }


def from_json(doc: object) -> ExecSummary:
    """The summary in `doc` (a decoded JSON document); ValueError if it is not one."""
    if not isinstance(doc, dict) or doc.get("version") != SUMMARY_VERSION:
        raise ValueError(f"not an exec summary of version {SUMMARY_VERSION}")
    try:
        return ExecSummary(
            command=tuple(str(part) for part in doc["command"]),
            limit_bytes=int(doc["limit_bytes"]),
            action=str(doc["action"]),
            dry_run=bool(doc["dry_run"]),
            exit_status=int(doc["exit_status"]),
            started=bool(doc["started"]),
            signal=_optional(doc["signal"], str),
            start_monotonic=_optional(doc["start_monotonic"], float),
            end_monotonic=_optional(doc["end_monotonic"], float),
            started_at=_optional(doc["started_at"], float),
            peak_bytes=_optional(doc["peak_bytes"], int),
            samples=int(doc["samples"]),
            hard_limit=bool(doc["hard_limit"]),
            # Summaries written before the tier was named have only hard_limit.
            tier=str(
                doc.get("tier") or (TierName.DRIVER if doc["hard_limit"] else TierName.SAMPLING)
            ),
            events=tuple(
                SummaryEvent(
                    str(e["reason"]),
                    float(e["after_seconds"]),
                    str(e["message"]),
                    _optional(e["pid"], int),
                )
                for e in doc["events"]
            ),
            # Summaries written before utilisation was read have none.
            sm_percent=_optional(doc.get("sm_percent"), float),
            memory_percent=_optional(doc.get("memory_percent"), float),
            busy_samples=int(doc.get("busy_samples", 0)),
            request_bytes=_optional(doc.get("request_bytes"), int),  # not before requests
            allocation_gate=_optional(doc.get("allocation_gate"), _gate_counts),  # nor the gate
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a malformed exec summary ({exc!r})") from None


def _gate_counts(doc: dict[str, Any]) -> GateCounts:
    calls = tuple((str(k), int(v)) for k, v in doc["calls"].items())
    return GateCounts(calls, float(doc["max_listener_us"]))


def _optional(value: Any, kind: Callable[[Any], T]) -> T | None:
    return None if value is None else kind(value)
