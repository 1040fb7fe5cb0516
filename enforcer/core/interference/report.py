"""The report as text, markdown and a JSON document."""

from __future__ import annotations

import shlex
from collections import Counter
from typing import Any

from enforcer.core.interference.outcomes import MARKS, Outcome, RunResult, Timing
from enforcer.core.interference.stats import SPREAD_METRIC, Cell, Report, measured_ok
from enforcer.core.interference.workloads import TIMING_ENV, Workload
from enforcer.core.model import format_bytes

REPORT_VERSION = 1


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
    good = [r for r in measured_ok(report.runs) if r.spec.workload == name]
    timed = sum(r.section is not None for r in good)
    problems = Counter(r.section_problem for r in good if r.section_problem)
    if not timed and not problems:
        return None
    why = "".join(
        f" In {n} run(s), the {TIMING_ENV} file it wrote {p}." for p, n in problems.most_common()
    )
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
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n\n".join([_headline(report), "\n".join(lines), *notes(report)]) + "\n"


def to_markdown(report: Report) -> str:
    rows = matrix(report)
    table = ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    table.insert(1, "|" + "---|" * len(rows[0]))
    commands = [
        f"| {w.name} | {format_bytes(w.limit_bytes)} | `{shlex.join(w.command)}` |"
        for w in report.workloads
    ]
    return (
        "\n\n".join(
            [
                "# Interference on a shared GPU",
                _headline(report),
                "\n".join(table),
                *notes(report),
                "## Workloads\n\n| workload | limit | command |\n|---|---|---|\n"
                + "\n".join(commands),
            ]
        )
        + "\n"
    )


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
