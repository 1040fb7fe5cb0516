"""`vram-enforcer interference`: run each workload alone and each pair together on one GPU,
every run under `vram-enforcer exec` with its declared limit, and report what sharing
costs.

Each run is a `python -m enforcer exec --limit LIMIT --summary FILE -- CMD` subprocess in
a session of its own. exec times the command, samples its peak GPU memory and stops it
if it goes over its limit; its summary says which. Each run is told, in
VRAM_ENFORCER_TIMING_FILE, where it may write the section of its work it timed itself.
The two runs of a pair are started together; those that wait at the start gate (the
built-ins, and commands of one's own with --start-gate) begin their work together too,
once each is set up, so that a longer start-up does not leave one running alone. We
wait on their pidfds next to the pipe that our signal handlers write to, so an exit, a
`--timeout` and a ^C are each seen the moment they happen, without polling. On SIGINT,
SIGTERM or SIGHUP the runs in flight get the signal (exec passes it on to its command),
and the report of what was measured so far is still printed and written, marked partial.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from enforcer.core import exec_summary
from enforcer.core.exec_summary import ExecSummary
from enforcer.core.interference.outcomes import Outcome, RunResult, classify, read_section
from enforcer.core.interference.plan import Phase, Round, RunSpec, plan
from enforcer.core.interference.report import to_json, to_markdown, to_text
from enforcer.core.interference.stats import Method, Report, analyse, measured_ok
from enforcer.core.interference.workloads import GO_ENV, READY_ENV, TIMING_ENV, Workload
from enforcer.core.model import format_bytes
from enforcer.core.settings.interference import InterferenceSettings
from enforcer.edge.heatmap import write_heatmap

log = logging.getLogger(__name__)

EXIT_USAGE = 2  # bad input, or exec cannot start here: nothing runs
EXIT_NOT_WRITTEN = 1  # measured, but the report files could not be written
EXIT_NOTHING_MEASURED = 3  # not one measured run went well: the report has no figure
KILL_AFTER = 15.0  # from our SIGTERM to exec to SIGKILL: exec's own grace period fits in
GATE_POLL_MS = 5  # how often the ready files are looked at: the pair starts within this
STDERR_TAIL = 64 * 1024  # how much of a run's stderr is read to tell why it failed
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class _Stop:
    """The signals that end the measurement early: each is noted by its handler, and the
    wait loop sees it at once through the wake-up pipe."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_fd = -1
        self._old: dict[signal.Signals, _Handler] = {}

    def __enter__(self) -> _Stop:
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._note) for s in _STOP_SIGNALS}
        return self

    def __exit__(self, *_: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._read)
        os.close(self._write)

    def _note(self, signum: int, _: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def fileno(self) -> int:
        return self._read

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)


@dataclass(slots=True)
class _Running:
    """One run in flight: exec's process, held by a pidfd until it is reaped."""

    spec: RunSpec
    proc: subprocess.Popen[bytes]
    pidfd: int
    deadline: float  # --timeout
    files: Path  # the stem of its files: .stdout, .stderr, .summary.json
    ready: Path | None  # the file it creates once set up, if it waits at the start gate
    signalled_at: float | None = None
    killed: bool = False
    timed_out: bool = False
    interrupted: bool = False

    @property
    def summary(self) -> Path:
        return _file(self.files, ".summary.json")

    @property
    def stderr(self) -> Path:
        return _file(self.files, ".stderr")

    @property
    def timing(self) -> Path:
        return _file(self.files, ".timing.json")

    def wake(self) -> float:
        """When this run next needs us: its timeout, then the SIGKILL after a stop."""
        if self.signalled_at is None:
            return self.deadline
        return self.signalled_at + KILL_AFTER if not self.killed else time.monotonic() + 1.0


def run(settings: InterferenceSettings) -> int:
    """Measure, print the table, write the report files; the exit status to exit with."""
    if settings.builtins and importlib.util.find_spec("torch") is None:
        log.error(
            "--builtin %s: the built-in workloads need PyTorch, and this Python (%s) does "
            "not have it; install it (pip install torch), or run vram-enforcer from a "
            "Python that has it",
            ",".join(settings.builtins),
            sys.executable,
        )
        return EXIT_USAGE
    if (why := _exec_cannot_start(settings.timeout)) is not None:
        log.error(
            "every run goes through vram-enforcer exec, which cannot start here: %s. "
            "--builtin-device cpu does not avoid it: exec reads GPU memory through NVML "
            "whatever the workloads compute on. Without an NVIDIA GPU, vram-enforcer "
            "demo shows exec at work on a simulated one",
            why,
        )
        return EXIT_USAGE
    try:
        workdir = _workdir(settings.output)
    except OSError as exc:
        log.error("--output %s: cannot create it: %s", settings.output, exc.strerror or exc)
        return EXIT_USAGE
    names = [w.name for w in settings.workloads]
    rounds = plan(names, settings.repeat, settings.warmup)
    planned = sum(len(r.runs) for r in rounds)
    with workdir as runs_dir, _Stop() as stop:
        log.info(
            "measuring %s: %d warm-up round(s), then %d repetition(s) of each alone and "
            "each pair: %d rounds, %d runs; each run's output is in %s",
            ", ".join(names),
            settings.warmup * len(names),
            settings.repeat,
            len(rounds),
            planned,
            runs_dir,
        )
        results: list[RunResult] = []
        for rnd in rounds:
            if stop.signum is not None:
                break
            done = _round(rnd, settings, Path(runs_dir), stop)
            log.info(
                "[%d/%d] %s: %s",
                rnd.index,
                len(rounds),
                rnd.label,
                "; ".join(_said(r) for r in done),
            )
            results += done
        if stop.signum is not None:
            made = sum(r.outcome is not Outcome.INTERRUPTED for r in results)
            log.warning(
                "stopped by %s after %d of %d runs; the report covers those",
                signal.Signals(stop.signum).name,
                made,
                planned,
            )
        how = Method(
            settings.repeat,
            settings.warmup,
            settings.max_spread,
            planned,
            stop.signum is not None,
            settings.gpu,
            settings.timeout,
        )
        report = analyse(settings.workloads, results, how)
        print(to_text(report), end="", flush=True)
        written = _write_report(report, settings.output) if settings.output else True
    if stop.signum is not None:
        return 128 + stop.signum
    if (why := _nothing_measured(results)) is not None:
        log.error("%s", why)
        return EXIT_NOTHING_MEASURED
    return 0 if written else EXIT_NOT_WRITTEN


def _exec_cannot_start(timeout: float) -> str | None:
    """Why exec cannot start here, in its own words (no NVML, a PID namespace it cannot
    translate), asked once with a command that does nothing; None when it can. Otherwise
    every run would fail the same way, and the report would be a table of failures."""
    probe = [
        sys.executable,
        "-m",
        "enforcer",
        "exec",
        "--limit",
        "1",
        "--hard-limits",
        "off",
        "--",
        sys.executable,
        "-c",
        "",
    ]
    try:
        out = subprocess.run(
            probe,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"a command that does nothing did not end within --timeout {timeout:g}s"
    if out.returncode != EXIT_USAGE:
        return None
    lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
    return lines[-1].removeprefix("vram-enforcer: error: ")


def _nothing_measured(results: list[RunResult]) -> str | None:
    """Why the report has no figure at all (no measured run went well), or None."""
    if measured_ok(results):
        return None
    measured = [r for r in results if r.phase is not Phase.WARMUP]
    outcomes = Counter(r.outcome for r in measured).most_common()
    tally = ", ".join(f"{n} {outcome}" for outcome, n in outcomes)
    first = next((r for r in measured if r.detail), None)
    said = f"; the first: {first.spec.label} ({first.detail})" if first else ""
    return (
        f"not one of the {len(measured)} measured runs went well ({tally}), so the report "
        f"has no figure{said}"
    )


def _workdir(output: str | None) -> contextlib.AbstractContextManager[str]:
    """Where each run's output goes: `<output>/runs`, kept; or a directory removed after."""
    if output is None:
        return tempfile.TemporaryDirectory(prefix="vram-enforcer-interference-")
    runs = Path(output) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(runs))


def _said(result: RunResult) -> str:
    took = f"{result.seconds:.2f} s" if result.seconds is not None else "no time"
    if result.section_seconds is not None:
        took += f" (timed work {result.section_seconds:.2f} s)"
    peak = format_bytes(result.peak_bytes) if result.peak_bytes is not None else "peak unknown"
    tail = f" ({result.detail})" if result.detail else ""
    return f"{result.spec.label} {took}, {peak}, {result.outcome}{tail}"


def _round(
    rnd: Round, settings: InterferenceSettings, runs_dir: Path, stop: _Stop
) -> list[RunResult]:
    """Start the runs of one round together and wait until all have ended."""
    workloads = {w.name: w for w in settings.workloads}
    go = runs_dir / f"{rnd.index:03d}.go" if len(rnd.runs) > 1 else None
    running: list[_Running] = []
    try:
        for spec in rnd.runs:
            workload = workloads[spec.workload]
            gate = go if workload.gated else None
            running.append(_start(rnd, spec, workload, settings, runs_dir, gate))
        if go is not None:
            _open_gate(running, go, stop)
        _wait(running, stop)
    finally:
        _abandon(running)
        for left in [go, *(r.ready for r in running)]:
            if left is not None:
                left.unlink(missing_ok=True)
    keep = settings.output is not None
    return [_result(rnd, r, settings.timeout, keep) for r in running]


def _start(
    rnd: Round,
    spec: RunSpec,
    workload: Workload,
    settings: InterferenceSettings,
    runs_dir: Path,
    go: Path | None,
) -> _Running:
    neighbour = f"-next-to-{spec.neighbour}" if spec.neighbour else ""
    copy = "-copy2" if spec.copy == 2 else ""
    files = runs_dir / f"{rnd.index:03d}-{rnd.phase}-{spec.workload}{neighbour}{copy}"
    summary, timing = _file(files, ".summary.json"), _file(files, ".timing.json")
    for left in (summary, timing):  # what an earlier measurement left is not this run's
        left.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "enforcer",
        "exec",
        "--limit",
        str(workload.limit_bytes),
        "--summary",
        str(summary),
        "--name",
        workload.name,
        "--",
        *workload.command,
    ]
    env = dict(os.environ, **{TIMING_ENV: str(timing)})
    ready = None
    if go is not None:
        ready = _file(files, ".ready")
        ready.unlink(missing_ok=True)
        env.update({READY_ENV: str(ready), GO_ENV: str(go)})
    if settings.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"] = settings.gpu
    with _file(files, ".stdout").open("wb") as out, _file(files, ".stderr").open("wb") as err:
        # A session of its own: a ^C at the terminal reaches us alone, and we pass it on,
        # so that every run in flight is stopped the same way and counted as interrupted.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    log.debug("started %s: pid %d: %s", spec.label, proc.pid, " ".join(command))
    deadline = time.monotonic() + settings.timeout
    return _Running(spec, proc, os.pidfd_open(proc.pid), deadline, files, ready)


def _file(stem: Path, suffix: str) -> Path:
    return stem.with_name(stem.name + suffix)


def _open_gate(running: list[_Running], go: Path, stop: _Stop) -> None:
    """Create `go` once every run that waits at the gate is set up (has created its ready
    file) or has exited, or once the first run reaches its --timeout (`_wait` stops it).
    On a stop signal the gate stays shut: `_wait` passes the signal on."""
    pending = {r.pidfd: r.ready for r in running if r.ready is not None}
    poller = select.poll()
    poller.register(stop.fileno(), select.POLLIN)
    for fd in pending:
        poller.register(fd, select.POLLIN)
    deadline = min(r.deadline for r in running)
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(GATE_POLL_MS):
            if fd == stop.fileno():
                return
            pending.pop(fd, None)  # exited: it will not get ready
            poller.unregister(fd)
        pending = {fd: ready for fd, ready in pending.items() if not ready.exists()}
    go.touch()
    log.debug("the start gate of %s is open", go.name)


def _wait(running: list[_Running], stop: _Stop) -> None:
    """Until every run has exited: reap each as it ends, stop them all on a signal, stop
    one past its timeout; SIGKILL whatever has not gone KILL_AFTER later."""
    poller = select.poll()
    poller.register(stop.fileno(), select.POLLIN)
    waiting = {r.pidfd: r for r in running}
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        _escalate(list(waiting.values()), stop.signum)
        wake = min(r.wake() for r in waiting.values())
        for fd, _ in poller.poll(math.ceil(max(0.0, wake - time.monotonic()) * 1000)):
            if fd == stop.fileno():
                stop.drain()
            elif (ended := waiting.pop(fd, None)) is not None:
                poller.unregister(fd)
                ended.proc.wait()


def _escalate(running: list[_Running], stop_signal: int | None) -> None:
    now = time.monotonic()
    for r in running:
        if r.signalled_at is None and stop_signal is not None:
            r.interrupted = True
            _signal(r, stop_signal, now)
        elif r.signalled_at is None and now >= r.deadline:
            log.warning("%s is still running after --timeout; sending it SIGTERM", r.spec.label)
            r.timed_out = True
            _signal(r, signal.SIGTERM, now)
        elif r.signalled_at is not None and not r.killed and now >= r.signalled_at + KILL_AFTER:
            log.warning(
                "%s has not exited %.0f s after the signal; sending SIGKILL to its process group",
                r.spec.label,
                KILL_AFTER,
            )
            r.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)


def _signal(r: _Running, signum: int, now: float) -> None:
    """Signal exec, which passes it on to the command and its leftovers."""
    r.signalled_at = now
    with contextlib.suppress(ProcessLookupError):  # it has exited, and is not reaped yet
        signal.pidfd_send_signal(r.pidfd, signum)


def _abandon(running: list[_Running]) -> None:
    """Close the pidfds; a run still going (we are leaving on an error) is killed first."""
    for r in running:
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        os.close(r.pidfd)


def _result(rnd: Round, r: _Running, timeout: float, keep: bool) -> RunResult:
    summary = _read_summary(r.summary)
    section, section_problem = _read_section(r.timing, summary)
    outcome, detail = classify(
        summary,
        r.proc.returncode,
        _tail(r.stderr),
        timed_out_after=timeout if r.timed_out else None,
        interrupted=r.interrupted,
    )
    return RunResult(
        round=rnd.index,
        phase=rnd.phase,
        repetition=rnd.repetition,
        spec=r.spec,
        outcome=outcome,
        detail=detail,
        seconds=summary.wall_seconds if summary else None,
        start=summary.start_monotonic if summary else None,
        end=summary.end_monotonic if summary else None,
        peak_bytes=summary.peak_bytes if summary else None,
        exit_status=summary.exit_status if summary else r.proc.returncode,
        log=str(r.stderr) if keep else None,
        section=section,
        section_problem=section_problem,
        sm_percent=summary.sm_percent if summary else None,
        memory_percent=summary.memory_percent if summary else None,
    )


def _read_summary(path: Path) -> ExecSummary | None:
    try:
        return exec_summary.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: not a summary exec wrote (%s)", path, exc)
        return None


def _read_section(
    path: Path, summary: ExecSummary | None
) -> tuple[tuple[float, float] | None, str]:
    """The section the workload timed itself, if it wrote one (most workloads do not)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    start, end = (summary.start_monotonic, summary.end_monotonic) if summary else (None, None)
    return read_section(doc, start, end)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - STDERR_TAIL))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _write_report(report: Report, output: str) -> bool:
    """report.json, report.md and heatmap.png in `output`; False if one could not be written."""
    out = Path(output)
    try:
        (out / "report.json").write_text(json.dumps(to_json(report), indent=2) + "\n")
        (out / "report.md").write_text(to_markdown(report))
        why_not = write_heatmap(report, out / "heatmap.png")
    except OSError as exc:
        log.error("could not write the report to %s: %s", out, exc.strerror or exc)
        return False
    if why_not:
        log.warning("%s", why_not)
    log.info("wrote the report to %s", out)
    return True
