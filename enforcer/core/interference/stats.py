"""The figures, from every run: medians, slowdowns, spreads and overlaps, per cell."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from enforcer.core.interference.outcomes import MARKS, Outcome, RunResult, Timing
from enforcer.core.interference.plan import Phase, RunSpec
from enforcer.core.interference.workloads import Workload

# Below this share of its time next to its neighbour, a paired run is flagged: the
# neighbour finished first, and the rest of the run was a run alone.
OVERLAP_NOTE = 0.9

SPREAD_METRIC = "(max - min) / median"


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median: by how much the repetitions of one figure differ, as a share.

    Not the coefficient of variation: with the 2 to 5 repetitions people can afford, a
    standard deviation is a poor estimate, and the range says plainly what was seen.
    None with fewer than two values.
    """
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else None


Window = tuple[float, float]


def window(run: RunResult, timing: Timing) -> Window | None:
    """The span of `run` that its workload's figures measure."""
    if timing is Timing.SECTION:
        return run.section
    return None if run.start is None or run.end is None else (run.start, run.end)


def overlap(mine: Window | None, other: Window | None) -> float | None:
    """The share of `mine` during which `other` ran too."""
    if mine is None or other is None or mine[1] <= mine[0]:
        return None
    return max(0.0, min(mine[1], other[1]) - max(mine[0], other[0])) / (mine[1] - mine[0])


@dataclass(frozen=True, slots=True)
class Cell:
    """One workload alone (`neighbour` None) or next to one neighbour, over the repetitions."""

    workload: str
    neighbour: str | None
    seconds: tuple[float, ...]  # the runs that went well
    outcomes: tuple[tuple[Outcome, int], ...]  # counted, interrupted runs left out
    peak_bytes: int | None
    median: float | None
    spread: float | None
    slowdown: float | None = None  # median over the median alone
    overlap: float | None = None  # median share of its time next to a running neighbour
    problems: tuple[tuple[Outcome, str, int], ...] = ()  # why runs went wrong, and how often
    sm_percent: float | None = None  # median over the good runs of their mean SM utilisation
    memory_percent: float | None = None

    @property
    def runs(self) -> int:
        return sum(n for _, n in self.outcomes)

    @property
    def failures(self) -> tuple[tuple[Outcome, int], ...]:
        return tuple((o, n) for o, n in self.outcomes if o is not Outcome.OK)

    @property
    def failure_marks(self) -> list[str]:
        """What went wrong, as the tables show it: `OOM 1/3` (in 1 of 3 runs)."""
        return [f"{MARKS[o]} {n}/{self.runs}" for o, n in self.failures]

    def marks(self, max_spread: float) -> str:
        """`*` for a spread above `max_spread`, `~` for a pair that overlapped too little."""
        unstable = self.spread is not None and self.spread > max_spread
        short = self.overlap is not None and self.overlap < OVERLAP_NOTE
        return ("*" if unstable else "") + ("~" if short else "")

    @property
    def where(self) -> str:
        return f"{self.workload} " + (f"next to {self.neighbour}" if self.neighbour else "alone")


@dataclass(frozen=True, slots=True)
class Report:
    """Everything the measurement found, and how it was made."""

    workloads: tuple[Workload, ...]
    repeat: int
    warmup: int
    max_spread: float
    planned_runs: int
    runs: tuple[RunResult, ...]
    cells: tuple[Cell, ...]
    partial: bool = False
    gpu: str | None = None
    timeout: float | None = None
    timing: Mapping[str, Timing] = field(default_factory=dict)  # by workload

    def cell(self, workload: str, neighbour: str | None) -> Cell:
        return next(c for c in self.cells if (c.workload, c.neighbour) == (workload, neighbour))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workloads)

    @property
    def largest_spread(self) -> Cell | None:
        spread_cells = [c for c in self.cells if c.spread is not None]
        return max(spread_cells, key=lambda c: c.spread or 0.0, default=None)

    @property
    def unstable(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.spread is not None and c.spread > self.max_spread)

    @property
    def partly_alone(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.overlap is not None and c.overlap < OVERLAP_NOTE)


@dataclass(frozen=True, slots=True)
class Method:
    """How the runs were made, as the report says it: runs per cell, warm-ups, the spread
    above which a cell is unstable, the runs planned; whether they were interrupted, on
    which GPU, with which timeout per run."""

    repeat: int
    warmup: int
    max_spread: float
    planned_runs: int
    partial: bool = False
    gpu: str | None = None
    timeout: float | None = None


def analyse(workloads: Sequence[Workload], runs: Sequence[RunResult], how: Method) -> Report:
    """The report over every run made so far (a partial one after an interruption)."""
    names = [w.name for w in workloads]
    timing = {n: _timing([r for r in measured_ok(runs) if r.spec.workload == n]) for n in names}
    overlaps = _overlaps(runs, timing)
    alone = {n: _cell(n, None, _of(runs, n, None), {}, timing[n]) for n in names}
    cells = list(alone.values())
    for name in names:
        for neighbour in names:
            cell = _cell(name, neighbour, _of(runs, name, neighbour), overlaps, timing[name])
            solo = alone[name].median
            slowdown = cell.median / solo if cell.median is not None and solo else None
            cells.append(replace(cell, slowdown=slowdown))
    return Report(
        tuple(workloads),
        how.repeat,
        how.warmup,
        how.max_spread,
        how.planned_runs,
        tuple(runs),
        tuple(cells),
        how.partial,
        how.gpu,
        how.timeout,
        timing,
    )


def measured_ok(runs: Iterable[RunResult]) -> list[RunResult]:
    """The runs that count toward a figure: measured (not warm-ups) and gone well."""
    return [r for r in runs if r.phase is not Phase.WARMUP and r.outcome is Outcome.OK]


def _timing(good: Sequence[RunResult]) -> Timing:
    """Sections only if every good run of the workload timed one: a ratio of two medians
    means something only when both are the same kind of time."""
    if good and all(r.section is not None for r in good):
        return Timing.SECTION
    return Timing.COMMAND


def _of(runs: Iterable[RunResult], workload: str, neighbour: str | None) -> list[RunResult]:
    return [r for r in runs if _in(r, workload, neighbour)]


def _in(run: RunResult, workload: str, neighbour: str | None) -> bool:
    phase = Phase.PAIR if neighbour else Phase.SOLO
    return run.phase is phase and (run.spec.workload, run.spec.neighbour) == (workload, neighbour)


def _overlaps(
    runs: Sequence[RunResult], timing: Mapping[str, Timing]
) -> dict[tuple[int, RunSpec], float]:
    """Each paired run's overlap with its neighbour, by round and run: of the span its
    figures measure, the share during which the neighbour's did too."""
    by_round: dict[int, list[RunResult]] = {}
    for r in runs:
        if r.phase is Phase.PAIR:
            by_round.setdefault(r.round, []).append(r)
    found: dict[tuple[int, RunSpec], float] = {}
    for pair in by_round.values():
        if len(pair) == 2:
            for run, other in (pair, pair[::-1]):
                mine = window(run, timing.get(run.spec.workload, Timing.COMMAND))
                theirs = window(other, timing.get(other.spec.workload, Timing.COMMAND))
                if (share := overlap(mine, theirs)) is not None:
                    found[(run.round, run.spec)] = share
    return found


def _cell(
    workload: str,
    neighbour: str | None,
    runs: Sequence[RunResult],
    overlaps: Mapping[tuple[int, RunSpec], float],
    timing: Timing,
) -> Cell:
    counted = [r for r in runs if r.outcome is not Outcome.INTERRUPTED]
    went_well = measured_ok(counted)
    times = [r.section_seconds if timing is Timing.SECTION else r.seconds for r in went_well]
    good = tuple(t for t in times if t is not None)
    outcomes = Counter(r.outcome for r in counted)
    peaks = [r.peak_bytes for r in counted if r.peak_bytes is not None]
    shares = [
        overlaps[(r.round, r.spec)]
        for r in counted
        if r.outcome is Outcome.OK and (r.round, r.spec) in overlaps
    ]
    problems = Counter((r.outcome, r.detail) for r in counted if r.outcome is not Outcome.OK)
    sm = [r.sm_percent for r in went_well if r.sm_percent is not None]
    memory = [r.memory_percent for r in went_well if r.memory_percent is not None]
    return Cell(
        workload=workload,
        neighbour=neighbour,
        seconds=good,
        outcomes=tuple(sorted(outcomes.items(), key=lambda item: list(Outcome).index(item[0]))),
        peak_bytes=max(peaks, default=None),
        median=statistics.median(good) if good else None,
        spread=spread(good),
        overlap=statistics.median(shares) if shares else None,
        problems=tuple((o, detail, n) for (o, detail), n in problems.most_common()),
        sm_percent=statistics.median(sm) if sm else None,
        memory_percent=statistics.median(memory) if memory else None,
    )
