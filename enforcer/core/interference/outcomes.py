"""What one run came to, from what `exec` said about it, and the section it timed."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from enforcer.core.exec_summary import ExecSummary
from enforcer.core.interference.plan import Phase, RunSpec
from enforcer.core.interference.workloads import TIMING_FORM
from enforcer.core.model import format_bytes
from enforcer.core.parsing import format_duration


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
