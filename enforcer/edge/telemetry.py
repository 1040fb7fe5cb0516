"""What an enforcement loop tells about itself, without prometheus_client.

The sidecar serves no metrics: it counts what only it knows (its actions, reclaims, refused
signals, bugs, ticks) in plain counters and reports them to its node's agent, which serves
them with every other series of the pod (`core/sidecar_report.py`). `exec` and the agent
keep prometheus_client (`edge/metrics.py`), whose counters fit the same `LoopTelemetry`.
Not loading prometheus_client is about 12 MiB of the sidecar's memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from enforcer.core.model import Device, Sample, UnitUsage
from enforcer.core.reclaim import Gpu
from enforcer.core.sidecar_report import ACTIONS, NEEDED_BY, REFUSED, SidecarReport


@dataclass(frozen=True, slots=True)
class View:
    """What the gauges show: the latest tick's units and devices, and whether data is flowing."""

    units: Sequence[UnitUsage] = ()
    devices: Sequence[Device] = ()
    source_up: bool = False
    # The tick's sample, for each unit's memory and utilisation per GPU: worked out when
    # scraped, not on every tick.
    sample: Sample | None = None
    # Each GPU's requests and what is lent above them (only where units have requests).
    gpus: Sequence[Gpu] = ()


class Increments(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class CountsBy(Protocol):
    """Counts by one label: a prometheus_client Counter, or a `Tally`."""

    def labels(self, value: str, /) -> Increments: ...


class Observes(Protocol):
    def observe(self, amount: float, /) -> None: ...


class Shows(Protocol):
    def show(self, view: View, /) -> None: ...


class LoopTelemetry(Protocol):
    """What the enforcement pipeline counts and shows, whoever serves it."""

    @property
    def actions(self) -> CountsBy: ...

    @property
    def reclaims(self) -> CountsBy: ...

    @property
    def refused(self) -> CountsBy: ...

    @property
    def unexpected(self) -> CountsBy: ...

    @property
    def tick_duration(self) -> Observes: ...

    @property
    def collector(self) -> Shows: ...


class _Count:
    def __init__(self, tally: Tally, value: str) -> None:
        self._tally, self._value = tally, value

    def inc(self, amount: float = 1) -> None:
        self._tally.add(self._value, int(amount))


class Tally:
    """Counts by one label, used as a prometheus_client Counter is (`labels(x).inc()`);
    safe across threads (the loop counts, the reporter reads)."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(values, 0)  # at 0 from the start, as the Counters

    def labels(self, value: str, /) -> _Count:
        return _Count(self, value)

    def add(self, value: str, amount: int) -> None:
        with self._lock:
            self._counts[value] = self._counts.get(value, 0) + amount

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Ticks:
    """How many ticks ran, and their wall time in all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count, self.seconds = 0, 0.0

    def observe(self, amount: float, /) -> None:
        with self._lock:
            self.count += 1
            self.seconds += amount

    def read(self) -> tuple[int, float]:
        with self._lock:
            return self.count, self.seconds


class _Unshown:
    """The sidecar shows no gauges: the agent works out every unit's from NVML itself."""

    def show(self, view: View, /) -> None:
        pass


class SidecarTelemetry:
    """The sidecar's counts, as one `SidecarReport` for its agent."""

    def __init__(self) -> None:
        self.actions = Tally(ACTIONS)
        self.reclaims = Tally(NEEDED_BY)
        self.refused = Tally(REFUSED)
        self.unexpected = Tally()
        self.event_failures = Tally()  # --api-access direct: Events it could not post
        self.tick_duration = Ticks()
        self.collector = _Unshown()

    def report(self) -> SidecarReport:
        ticks, seconds = self.tick_duration.read()
        return SidecarReport(
            actions=self.actions.counts(),
            reclaims=self.reclaims.counts(),
            refused=self.refused.counts(),
            unexpected=self.unexpected.counts(),
            ticks=ticks,
            tick_seconds=seconds,
        )
