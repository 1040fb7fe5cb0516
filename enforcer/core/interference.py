"""`vram-enforcer interference`, the pure part: what is measured, and what it means.

Given the workloads, `plan` says which runs to make (warm-ups, each workload alone, each
pair together), `classify` turns what `exec` said about one run into its outcome,
`read_section` checks the section a workload timed itself, and `analyse` turns every run
into the report: per workload and neighbour, the slowdown (median time next to the
neighbour over median time alone), the peak GPU memory, what went wrong, how stable the
figures are and how much the two runs of a pair overlapped. The report is then text,
markdown or a JSON document. The mode (`enforcer.modes.interference`) does the running.

Whose time: a workload that does its start-up (importing a framework, creating a CUDA
context, loading data) before its work may time the work itself and write the section to
the file named by `TIMING_ENV`; its figures are then those sections, which its start-up
no longer dilutes toward 1.00x. Otherwise they are exec's times of the whole command.
"""

from __future__ import annotations

import re
import shlex
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from enforcer.core.exec_summary import ExecSummary
from enforcer.core.model import GiB, format_bytes
from enforcer.core.parsing import ConfigError, ascii_int, format_duration, parse_bytes

REPORT_VERSION = 1

# Below this share of its time next to its neighbour, a paired run is flagged: the
# neighbour finished first, and the rest of the run was a run alone.
OVERLAP_NOTE = 0.9

SPREAD_METRIC = "(max - min) / median"

# Set for every run: where the workload may write the section it timed itself, as
# {"start_monotonic": S, "end_monotonic": E} on CLOCK_MONOTONIC (Python's time.monotonic()).
# The built-in workloads do (enforcer.workloads keeps its own copy of the name).
TIMING_ENV = "VRAM_ENFORCER_TIMING_FILE"
TIMING_FORM = '{"start_monotonic": S, "end_monotonic": E}, on CLOCK_MONOTONIC'

# The start gate, for the runs of a pair that wait at it (the built-ins; commands of one's
# own with --start-gate): once set up, a workload creates the file READY_ENV names and waits
# until the file GO_ENV names exists; the mode creates it once every such run of the pair is
# ready or gone. The two timed sections then start together, however long each start-up
# took, instead of the shorter one being over before the longer one has begun.
READY_ENV = "VRAM_ENFORCER_READY_FILE"
GO_ENV = "VRAM_ENFORCER_GO_FILE"

# ---------------------------------------------------------------------------- workloads

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
WORKLOAD_FORM = "NAME:LIMIT:COMMAND, e.g. trainer:4Gi:python train.py --epochs 1"


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload: its name in the report, the GPU memory it declares, its command, and
    whether it waits at the start gate (READY_ENV, GO_ENV) when it runs in a pair."""

    name: str
    limit_bytes: int
    command: tuple[str, ...]
    gated: bool = False


@dataclass(frozen=True, slots=True)
class Builtin:
    """A built-in workload (`python -m enforcer.workloads NAME`) and its declared limit."""

    name: str
    limit_bytes: int
    profile: str


BUILTINS: Mapping[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("matmul", 2 * GiB, "compute-bound: 8192x8192 bf16 matrix multiplications"),
        Builtin("copy", 4 * GiB, "memory-bandwidth-bound: copies between two 1 GiB tensors"),
        Builtin("cnn", 4 * GiB, "training steps of a small ResNet: batch 256, 32x32, SGD"),
        Builtin("infer", 2 * GiB, "latency-bound: a 6-layer transformer answering batches of 1-8"),
    )
}


def parse_workload(text: str, field: str = "--workload") -> Workload:
    """`NAME:LIMIT:COMMAND`; only the first two colons split, and the command is split as
    a shell would (`shlex`), so a command may hold colons and quoted spaces."""
    name, _, rest = text.partition(":")
    limit, colon, command = rest.partition(":")
    if not colon:
        raise ConfigError(field, text, f"is not NAME:LIMIT:COMMAND; use {WORKLOAD_FORM}")
    if not _NAME.fullmatch(name):
        raise ConfigError(
            field,
            text,
            f"has the name {name!r}; a name is 1 to 32 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, e.g. trainer",
        )
    limit_bytes = parse_bytes(limit, f"{field} {name}: LIMIT")
    if limit_bytes == 0:
        raise ConfigError(
            f"{field} {name}: LIMIT", limit, "is 0; declare the GPU memory it needs, e.g. 4Gi"
        )
    try:
        argv = tuple(shlex.split(command))
    except ValueError as exc:
        raise ConfigError(
            field, text, f"has a COMMAND that cannot be split ({exc}); quote it as in a shell"
        ) from None
    if not argv:
        raise ConfigError(field, text, f"has no COMMAND; use {WORKLOAD_FORM}")
    return Workload(name, limit_bytes, argv)


def parse_builtins(text: str, field: str) -> tuple[str, ...]:
    """Names of built-in workloads, comma-separated, each once."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = ", ".join(BUILTINS)
    for name in names:
        if name not in BUILTINS:
            raise ConfigError(field, text, f"names {name!r}, which is not built in; use {known}")
    if not names:
        raise ConfigError(field, text, f"names no workload; use some of {known}")
    if len(set(names)) != len(names):
        raise ConfigError(field, text, "names a workload twice; name each once")
    return names


def builtin_workloads(
    names: Iterable[str], python: str, device: str, scale: float
) -> tuple[Workload, ...]:
    """The built-ins, each run by `python` with its declared limit."""
    extra = ("--scale", f"{scale:g}") if scale != 1 else ()
    return tuple(
        Workload(
            name,
            BUILTINS[name].limit_bytes,
            (python, "-m", "enforcer.workloads", name, "--device", device, *extra),
            gated=True,
        )
        for name in names
    )


def check_workloads(workloads: Sequence[Workload]) -> tuple[Workload, ...]:
    """At least two workloads, each with a name of its own."""
    seen: set[str] = set()
    for w in workloads:
        if w.name in seen:
            raise ConfigError(
                "--workload", w.name, "is the name of two workloads; give each its own name"
            )
        seen.add(w.name)
    if len(workloads) < 2:
        raise ConfigError(
            "--workload",
            None,
            f"gives {len(workloads)} workload(s), and a pair needs two; add --workload "
            f"{WORKLOAD_FORM}, or --builtin {','.join(BUILTINS)}",
        )
    return tuple(workloads)


def parse_count(minimum: int) -> Callable[[str, str], int]:
    """A parser of whole numbers of at least `minimum` (repetitions, warm-ups)."""

    def parse(text: str, field: str) -> int:
        count = ascii_int(text, 9)
        if count is None or count < minimum:
            raise ConfigError(field, text, f"is not a whole number of at least {minimum}")
        return count

    return parse


def parse_scale(text: str, field: str) -> float:
    """A positive factor (`0.2`, `2`)."""
    try:
        factor = float(text)
    except ValueError:
        factor = -1.0
    if not 0 < factor <= 1000:
        raise ConfigError(field, text, "is not a factor; use a number above 0, e.g. 0.5 or 2")
    return factor


def parse_gpu(text: str, field: str) -> str:
    """A GPU as CUDA_VISIBLE_DEVICES names one: its index, or its UUID (`GPU-...`, `MIG-...`)."""
    if (text.isascii() and text.isdigit()) or re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", text):
        return text
    raise ConfigError(
        field, text, "is not a GPU; use its index (0, 1, ...) or its UUID (GPU-...), as "
        "nvidia-smi -L lists them",
    )  # fmt: skip


# ---------------------------------------------------------------------------- the plan


class Phase(StrEnum):
    WARMUP = "warmup"  # alone, discarded
    SOLO = "solo"
    PAIR = "pair"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run of a round: a workload, and the neighbour it runs next to (None: alone)."""

    workload: str
    neighbour: str | None = None
    copy: int = 1  # 2 for the second copy of a workload paired with itself

    @property
    def label(self) -> str:
        return self.workload if self.copy == 1 else f"{self.workload} (copy 2)"


@dataclass(frozen=True, slots=True)
class Round:
    """Runs started together: one alone, or the two of a pair."""

    index: int  # 1, 2, ...
    phase: Phase
    repetition: int  # 1, 2, ... within its phase
    runs: tuple[RunSpec, ...]

    @property
    def label(self) -> str:
        if self.phase is Phase.PAIR:
            a, b = self.runs
            return f"{a.workload} next to {b.workload}, repetition {self.repetition}"
        what = "warm-up" if self.phase is Phase.WARMUP else "repetition"
        return f"{self.runs[0].workload} alone, {what} {self.repetition}"


def plan(names: Sequence[str], repeat: int, warmup: int) -> tuple[Round, ...]:
    """Warm-ups first, then `repeat` rounds of everything: each workload alone, then each
    unordered pair, a workload with a second copy of itself included.

    The repetitions are interleaved (all cells once, then all again) rather than run
    back to back, so that a slow drift of the machine (clocks, temperature, another
    tenant) falls on the runs alone and the paired runs alike instead of biasing their
    ratio. Warm-ups run alone only: what they warm (file cache, kernel caches, clocks) is
    the machine's, and the paired runs come after the runs alone.
    """
    specs: list[tuple[Phase, int, tuple[RunSpec, ...]]] = [
        (Phase.WARMUP, w, (RunSpec(name),)) for w in range(1, warmup + 1) for name in names
    ]
    for r in range(1, repeat + 1):
        specs += [(Phase.SOLO, r, (RunSpec(name),)) for name in names]
        specs += [
            (Phase.PAIR, r, (RunSpec(a, b), RunSpec(b, a, 2 if a == b else 1)))
            for i, a in enumerate(names)
            for b in names[i:]
        ]
    return tuple(Round(i, phase, r, runs) for i, (phase, r, runs) in enumerate(specs, 1))


# ---------------------------------------------------------------------------- outcomes


class Outcome(StrEnum):
    OK = "ok"
    OVER_LIMIT = "over-limit"  # exec saw it over its declared limit and stopped it
    OOM = "oom"  # it crashed out of memory
    FAILED = "failed"  # any other failure
    TIMEOUT = "timeout"  # still running after --timeout; stopped
    INTERRUPTED = "interrupted"  # stopped because the measurement was (^C): not counted


MARKS = {
    Outcome.OVER_LIMIT: "OVER",
    Outcome.OOM: "OOM",
    Outcome.FAILED: "FAIL",
    Outcome.TIMEOUT: "TIMEOUT",
}

OOM_SIGNS = ("out of memory", "outofmemoryerror", "cuda_error_out_of_memory", "resource_exhausted")
_EXEC_LINE = "vram-enforcer: "  # exec's own log lines, in the same stderr as the command's


def classify(
    summary: ExecSummary | None,
    exec_status: int | None,
    stderr: str,
    *,
    timed_out_after: float | None = None,
    interrupted: bool = False,
) -> tuple[Outcome, str]:
    """The outcome of one run and a line that says why (empty when it went well), from
    exec's summary (None: exec left none), exec's exit status and the run's stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if not line.startswith(_EXEC_LINE)]
    last = own[-1] if own else ""
    if interrupted:
        return Outcome.INTERRUPTED, "stopped: the measurement was interrupted"
    if timed_out_after is not None:
        return Outcome.TIMEOUT, f"still running after --timeout {format_duration(timed_out_after)}"
    if summary is None:
        exec_said = lines[-1] if lines else "nothing on stderr"
        return Outcome.FAILED, f"exec exited with status {exec_status} and no summary: {exec_said}"
    if summary.exceeded_after is not None:
        stopped = summary.exit_status != 0 and any(
            e.reason == "VRAMEnforced" for e in summary.events
        )
        what = "exec stopped it" if stopped else "exec reported it and it went on"
        return (
            Outcome.OVER_LIMIT,
            f"went over its {format_bytes(summary.limit_bytes)} limit; {what}",
        )
    if not summary.started:
        exec_said = lines[-1] if lines else f"exit status {summary.exit_status}"
        return Outcome.FAILED, f"not started: {_short(exec_said.removeprefix(_EXEC_LINE))}"
    if summary.exit_status == 0:
        return Outcome.OK, ""
    oom = next((line for line in own if any(s in line.lower() for s in OOM_SIGNS)), None)
    if oom is not None:
        held = f" (held to its {format_bytes(summary.limit_bytes)} limit by the driver)"
        return Outcome.OOM, _oom_reason(oom) + (held if summary.hard_limit else "")
    ended = (
        f"killed by {summary.signal}" if summary.signal else f"exit status {summary.exit_status}"
    )
    return Outcome.FAILED, f"{ended}: {_short(last)}" if last else ended


def _oom_reason(line: str) -> str:
    """The out-of-memory line up to the sentence after the one that says so: `CUDA out of
    memory. Tried to allocate 2.00 GiB`, without what follows (free memory, other
    processes and their pids), which differs from run to run."""
    sentences = line.split(". ")
    said = next(i for i, s in enumerate(sentences) if any(x in s.lower() for x in OOM_SIGNS))
    return _short(". ".join(sentences[: said + 2]).rstrip("."))


def _short(line: str, limit: int = 200) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run as it went: its outcome, exec's time for it and its peak GPU memory."""

    round: int
    phase: Phase
    repetition: int
    spec: RunSpec
    outcome: Outcome
    detail: str = ""
    seconds: float | None = None
    start: float | None = None  # CLOCK_MONOTONIC, as exec measured the command
    end: float | None = None
    peak_bytes: int | None = None
    exit_status: int | None = None
    log: str | None = None  # the run's stderr, when it was kept (--output)
    section: tuple[float, float] | None = None  # what the workload timed itself (TIMING_ENV)
    section_problem: str = ""  # why a section it wrote was not taken
    sm_percent: float | None = None  # its mean SM utilisation on the GPU, as exec sampled it
    memory_percent: float | None = None  # and memory-controller utilisation

    @property
    def section_seconds(self) -> float | None:
        return None if self.section is None else self.section[1] - self.section[0]


class Timing(StrEnum):
    """Which time a workload's figures are."""

    SECTION = "section"  # the section it timed itself, in every good run
    COMMAND = "command"  # exec's time of the whole command, start-up included


def read_section(
    doc: object, start: float | None, end: float | None
) -> tuple[tuple[float, float] | None, str]:
    """The section a workload wrote (`doc`, a decoded TIMING_ENV file), checked against
    exec's own time of the run, `start` to `end`; else None and why it was not taken.

    Both ends must lie inside exec's time: exec reads its clock before it spawns the
    command and after it reaps it, and the workload reads the same clock in between, so
    a section outside it is not of this run or not on CLOCK_MONOTONIC.
    """
    if not isinstance(doc, dict) or not all(
        isinstance(doc.get(k), int | float) and not isinstance(doc.get(k), bool)
        for k in ("start_monotonic", "end_monotonic")
    ):
        return None, f"is not {TIMING_FORM}"
    s, e = float(doc["start_monotonic"]), float(doc["end_monotonic"])
    if not s < e:
        return None, f"ends ({e:.3f}) before it starts ({s:.3f})"
    if start is None or end is None:
        return None, "cannot be checked: exec did not time the run"
    if s < start or e > end:
        return None, (
            f"runs from {s:.3f} to {e:.3f}, outside the command's own run, {start:.3f} to "
            f"{end:.3f}; write time.monotonic() (CLOCK_MONOTONIC) from the workload itself"
        )
    return (s, e), ""


# ---------------------------------------------------------------------------- analysis


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


def analyse(
    workloads: Sequence[Workload],
    runs: Sequence[RunResult],
    *,
    repeat: int,
    warmup: int,
    max_spread: float,
    planned_runs: int,
    partial: bool = False,
    gpu: str | None = None,
    timeout: float | None = None,
) -> Report:
    """The report over every run made so far (a partial one after an interruption)."""
    names = [w.name for w in workloads]
    timing = {n: _timing([r for r in _good(runs) if r.spec.workload == n]) for n in names}
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
        tuple(workloads), repeat, warmup, max_spread, planned_runs, tuple(runs), tuple(cells),
        partial, gpu, timeout, timing,
    )  # fmt: skip


def _good(runs: Iterable[RunResult]) -> list[RunResult]:
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
    went_well = _good(counted)
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


# ---------------------------------------------------------------------------- rendering


def cell_text(cell: Cell, max_spread: float) -> str:
    """A cell as the tables show it: `1.42x` (or the time alone), the workload's peak
    GPU memory, the marks of runs that went wrong (`OOM 1/3`), `*` for a spread above
    `max_spread` and `~` for a pair that overlapped too little."""
    if cell.runs == 0:
        return "-"
    parts = []
    if cell.slowdown is not None:
        parts.append(f"{cell.slowdown:.2f}x")
    elif cell.median is not None:  # alone, or next to a neighbour with no time alone
        parts.append(f"{cell.median:.2f} s")
    parts += cell.failure_marks
    if cell.peak_bytes is not None:
        parts.append(format_bytes(cell.peak_bytes))
    if cell.neighbour is None and cell.sm_percent is not None:
        parts.append(f"SM {cell.sm_percent:.0f}%")
    marks = cell.marks(max_spread)
    return " ".join(parts) + (f" {marks}" if marks else "")


def matrix(report: Report) -> list[list[str]]:
    """The table: a header row, then one row per workload (name, limit, alone, next to each)."""
    head = ["workload", "limit", "alone", *(f"next to {n}" for n in report.names)]
    rows = [head]
    for w in report.workloads:
        cells = [report.cell(w.name, None), *(report.cell(w.name, n) for n in report.names)]
        rows.append(
            [w.name, format_bytes(w.limit_bytes), *(cell_text(c, report.max_spread) for c in cells)]
        )
    return rows


def _headline(report: Report) -> str:
    done = sum(1 for r in report.runs if r.outcome is not Outcome.INTERRUPTED)
    warm = f"after {report.warmup} warm-up run(s) alone" if report.warmup else "without warm-up"
    gpu = f" on GPU {report.gpu}" if report.gpu is not None else ""
    return (
        f"{len(report.workloads)} workloads{gpu}: each alone and next to each (itself "
        f"included), {report.repeat} repetition(s) {warm}; {done} of {report.planned_runs} runs"
    )


def notes(report: Report) -> list[str]:
    """The paragraphs under the table: the legend, stability, overlap, problems, partial."""
    out = []
    if report.partial:
        out.append(
            "PARTIAL: the measurement was interrupted; these figures cover only the runs "
            "made before it was (a cell with '-' was not run)."
        )
    sm = any(report.cell(n, None).sm_percent is not None for n in report.names)
    out.append(
        f"slowdown = median time next to the neighbour / median time alone. {_times(report)} "
        "GPU memory is the workload's own peak, as exec sampled it"
        + (SM_LEGEND if sm else "")
        + ". OVER: stopped by exec for going over its declared limit; OOM: crashed out of "
        "memory; FAIL: failed otherwise; TIMEOUT: stopped after --timeout (n/m: in n of m "
        "runs)."
    )
    out += [n for n in (_timing_note(report, name) for name in report.names) if n]
    out.append(_stability(report))
    out += [_overlap_note(report, c) for c in report.partly_alone]
    problems = _problems(report)
    if problems:
        out.append("What went wrong:\n" + "\n".join(f"  - {p}" for p in problems))
    return out


SM_LEGEND = (
    "; SM, its mean SM utilisation alone while it had a process on the GPU (NVML's "
    "per-process samples; memory-controller utilisation, and both next to each neighbour, "
    "are in report.json)"
)


def _times(report: Report) -> str:
    """Which time the figures are, by workload."""
    sections = [n for n in report.names if report.timing.get(n) is Timing.SECTION]
    commands = [n for n in report.names if n not in sections]
    section = "the section the workload timed itself (its work, after its start-up)"
    command = "exec's time of the whole command, start-up included"
    if not commands:
        return f"Times are {section}."
    if not sections:
        return f"Times are {command}."
    return f"Times are {section} for {', '.join(sections)}; {command} for {', '.join(commands)}."


def _timing_note(report: Report, name: str) -> str | None:
    """Why a workload that timed sections in some runs is measured by whole commands."""
    if report.timing.get(name) is not Timing.COMMAND:
        return None
    good = [r for r in _good(report.runs) if r.spec.workload == name]
    timed = sum(r.section is not None for r in good)
    problems = Counter(r.section_problem for r in good if r.section_problem)
    if not timed and not problems:
        return None
    why = "".join(f" In {n} run(s), the {TIMING_ENV} file it wrote {p}." for p, n in
                  problems.most_common())  # fmt: skip
    return (
        f"{name}'s figures are exec's times of the whole command, start-up included: it "
        f"timed its own section in only {timed} of its {len(good)} good run(s).{why}"
    )


def _overlap_note(report: Report, cell: Cell) -> str:
    neighbour = cell.neighbour or ""
    crashed = report.cell(neighbour, cell.workload).failures
    how = " (it was stopped or crashed: see below)" if crashed else ""
    return (
        f"~ {cell.where} ran alongside it for {cell.overlap or 0:.0%} of its time "
        f"(median): {neighbour} ended first{how}, so the rest was a run alone, and this "
        f"slowdown understates running next to {neighbour} throughout."
    )


def _problems(report: Report) -> list[str]:
    """One line per workload, outcome and reason, with where and how often it happened."""
    where: dict[tuple[str, Outcome, str], list[str]] = {}
    for c in report.cells:
        for outcome, detail, n in c.problems:
            place = f"next to {c.neighbour}" if c.neighbour else "alone"
            where.setdefault((c.workload, outcome, detail), []).append(f"{place} {n}/{c.runs}")
    return [
        f"{workload} {MARKS[outcome]} ({', '.join(places)}): {detail}"
        for (workload, outcome, detail), places in where.items()
    ]


def _stability(report: Report) -> str:
    widest = report.largest_spread
    if widest is None or widest.spread is None:
        return (
            "Stability unknown: no cell has two good repetitions, so their spread cannot "
            "be told; use --repeat 3 or more."
        )
    head = (
        f"Stability: spread = {SPREAD_METRIC} of a cell's repetitions. The largest is "
        f"{widest.spread:.1%} ({widest.where})."
    )
    unstable = report.unstable
    if not unstable:
        return head + f" Every cell is within {report.max_spread:.0%}."
    listed = ", ".join(f"{c.where} {c.spread or 0:.1%}" for c in unstable)
    return (
        f"{head} * {len(unstable)} cell(s) spread more than {report.max_spread:.0%}: "
        f"{listed}. Their slowdowns are less certain than they look: measure again with "
        f"more repetitions (--repeat {max(5, report.repeat + 2)}) or longer workloads "
        "(--builtin-scale 2 for the built-ins), on a GPU nothing else uses."
    )


def to_text(report: Report) -> str:
    rows = matrix(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    return "\n\n".join([_headline(report), "\n".join(lines), *notes(report)]) + "\n"


def to_markdown(report: Report) -> str:
    rows = matrix(report)
    table = ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    table.insert(1, "|" + "---|" * len(rows[0]))
    commands = [f"| {w.name} | {format_bytes(w.limit_bytes)} | `{shlex.join(w.command)}` |"
                for w in report.workloads]  # fmt: skip
    return "\n\n".join([
        "# Interference on a shared GPU",
        _headline(report),
        "\n".join(table),
        *notes(report),
        "## Workloads\n\n| workload | limit | command |\n|---|---|---|\n" + "\n".join(commands),
    ]) + "\n"  # fmt: skip


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("~", "\\~")


def to_json(report: Report) -> dict[str, Any]:
    """Everything, every run's raw figures included."""
    widest = report.largest_spread
    return {
        "version": REPORT_VERSION,
        "partial": report.partial,
        "planned_runs": report.planned_runs,
        "repeat": report.repeat,
        "warmup": report.warmup,
        "gpu": report.gpu,
        "timeout_seconds": report.timeout,
        "workloads": [_workload_json(w, report.timing.get(w.name)) for w in report.workloads],
        "cells": [_cell_json(c) for c in report.cells],
        "stability": {
            "metric": SPREAD_METRIC,
            "threshold": report.max_spread,
            "largest": None if widest is None else _where(widest) | {"spread": widest.spread},
            "unstable": [_where(c) | {"spread": c.spread} for c in report.unstable],
        },
        "runs": [_run_json(r) for r in report.runs],
    }


def _workload_json(w: Workload, timing: Timing | None) -> dict[str, Any]:
    return {
        "name": w.name,
        "limit_bytes": w.limit_bytes,
        "command": list(w.command),
        "timing": str(timing or Timing.COMMAND),
    }


def _where(cell: Cell) -> dict[str, Any]:
    return {"workload": cell.workload, "neighbour": cell.neighbour}


def _cell_json(c: Cell) -> dict[str, Any]:
    return _where(c) | {
        "slowdown": c.slowdown,
        "median_seconds": c.median,
        "seconds": list(c.seconds),
        "spread": c.spread,
        "peak_bytes": c.peak_bytes,
        "outcomes": {str(o): n for o, n in c.outcomes},
        "overlap": c.overlap,
        "sm_percent": c.sm_percent,
        "memory_percent": c.memory_percent,
        "problems": [{"outcome": str(o), "detail": d, "runs": n} for o, d, n in c.problems],
    }


def _run_json(r: RunResult) -> dict[str, Any]:
    return {
        "round": r.round,
        "phase": str(r.phase),
        "repetition": r.repetition,
        "workload": r.spec.workload,
        "neighbour": r.spec.neighbour,
        "copy": r.spec.copy,
        "outcome": str(r.outcome),
        "detail": r.detail,
        "seconds": r.seconds,
        "start_monotonic": r.start,
        "end_monotonic": r.end,
        "peak_bytes": r.peak_bytes,
        "exit_status": r.exit_status,
        "log": r.log,
        "section_start_monotonic": r.section[0] if r.section else None,
        "section_end_monotonic": r.section[1] if r.section else None,
        "section_seconds": r.section_seconds,
        "section_problem": r.section_problem,
        "sm_percent": r.sm_percent,
        "memory_percent": r.memory_percent,
    }
