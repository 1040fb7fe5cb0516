"""`vram-enforcer exec`: enforce a VRAM limit on one command and all of its descendants.

The enforcer becomes a child subreaper, so a grandchild whose parent exits is re-parented
to us and stays in the tree we enforce, also after the command itself has exited: we exit
once the last descendant has. Signals are taken synchronously (`sigtimedwait`) in the one
loop that also ticks, so forwarding a signal, reaping a child and escalating a termination
never race each other.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from enforcer.core import messages
from enforcer.core.attribution import attribute, unit_activity
from enforcer.core.exec_summary import ExecSummary, SummaryEvent
from enforcer.core.model import (
    IDLE,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
    format_bytes,
)
from enforcer.core.reasons import Reason
from enforcer.core.settings.exec import ExecSettings
from enforcer.core.tier_choice import TierName
from enforcer.edge import logs
from enforcer.edge.cgroupfs import CgroupFsError
from enforcer.edge.metrics import Telemetry
from enforcer.edge.metrics_server import MetricsPortError, serve_metrics
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors
from enforcer.edge.pid_view import PidView, PidViewError
from enforcer.edge.procfs import INITIAL_PID_NS, ProcFs
from enforcer.edge.signals import Membership, Signaller, Terminator, signal_children
from enforcer.modes.exec_gate import ExecGate
from enforcer.modes.exec_limits import CgroupKeeper, ChargeWatch, Placed, hard_limits
from enforcer.modes.exec_spawn import SpawnError, StartupError, spawn
from enforcer.modes.pipeline import LogReporter, Pipeline, Report, WholeUnit, reclaim_here

log = logging.getLogger(__name__)

EXIT_USAGE = 2  # our own failure to start: bad flags, no NVML, wrong namespace

# How often per-process utilisation is read from NVML: for the metrics and the summary's
# mean. Often enough for a run of a few seconds to have samples; a read costs about as
# much as one pass over memory, so twice a second is nothing next to the 10 passes.
UTILISATION_EVERY = 0.5
MOST_REFUSALS = 100  # the allocation gate's refusals that --summary tells one by one

_PR_SET_CHILD_SUBREAPER = 36
_SI_KERNEL = 0x80  # si_code of signals the kernel generates (the terminal's ^C)
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_WAITED = frozenset({*_FORWARDED, signal.SIGCHLD})


class TreeAttributor:
    """The unit is every descendant of this process: the command and whatever it spawns."""

    def __init__(
        self,
        procfs: ProcFs,
        name: str,
        limit_bytes: int,
        on_pass: Callable[[Sample, tuple[UnitUsage, ...]], None] = lambda sample, units: None,
    ) -> None:
        """`on_pass(sample, units)`: told of the tree's usage in each pass that came."""
        self._procfs = procfs
        self._on_pass = on_pass
        self._root = os.getpid()
        self._name = name
        self._limits = {name: limit_bytes}
        # Membership is decided once per process: a descendant stays one (its orphans are
        # re-parented to us, the subreaper) and an outsider can never become one. The
        # command line is kept with it. Processes that leave the sample are forgotten, and
        # so is a process whose ancestry could not be read: it is read again next tick.
        self._known: dict[ProcessKey, str | None] = {}
        # The largest usage of the tree that a sample showed, and how many samples had
        # data (only those are attributed), for --summary; with its utilisation summed
        # over the utilisation reads that could tell it, for the mean.
        self.peak_bytes: int | None = None
        self.samples = 0
        self.busy = IDLE
        self.busy_samples = 0
        self._summed_read: float | None = None  # the utilisation read last summed

    def _is_member(self, pid: int) -> bool:
        return self._procfs.is_descendant(pid, self._root) is True

    def _membership(self, key: ProcessKey) -> tuple[bool, str | None]:
        """(decided, the command line of a member or None for a proven outsider)."""
        member = self._procfs.is_descendant(key.pid, self._root)
        start_time = self._procfs.start_time(key.pid)
        if member is None or start_time is None:
            return False, None  # unreadable now: not remembered
        if member and start_time == key.start_time:
            return True, self._procfs.cmdline(key.pid) or ""
        return True, None  # outside the tree, or the pid names a newer process than the sample's

    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]:
        known: dict[ProcessKey, str | None] = {}
        for key in {p.key for p in sample.processes}:
            decided, cmdline = (
                (True, self._known[key]) if key in self._known else self._membership(key)
            )
            if decided:
                known[key] = cmdline
        self._known = known
        cmdlines = {key: cmd for key, cmd in known.items() if cmd is not None}
        units = attribute(sample, dict.fromkeys(cmdlines, self._name), self._limits, cmdlines)
        self._on_pass(sample, units)
        self.samples += 1
        self.peak_bytes = max([self.peak_bytes or 0, *(u.used_bytes for u in units)])
        # Once per utilisation read, on the first sample that carries it: every reading the
        # metrics show is summed, and the ticks between reads (which carry the same one)
        # cost nothing here.
        read = sample.activity_read_at
        if read is not None and read != self._summed_read:
            self._summed_read = read
            for unit in units:
                if (busy := unit_activity(unit, sample)) is not None:
                    self.busy += busy
                    self.busy_samples += 1
        return units

    def mean_activity(self) -> tuple[float | None, float | None]:
        """The tree's mean SM and memory-controller utilisation, in percent."""
        n = self.busy_samples
        return (self.busy.sm_percent / n, self.busy.memory_percent / n) if n else (None, None)

    def membership(self, unit: str) -> Membership:
        return self._is_member

    def label(self, unit: str) -> str:
        return "the command tree"

    def whole(self, unit: UnitUsage) -> WholeUnit:
        """Every process below us, GPU or not: the one that replaces its workers too."""
        held = {p.key: p for p in unit.processes}
        found = []
        for pid in sorted(self._procfs.descendants(self._root)):
            st = self._procfs.stat(pid)
            if st is None or st.exited:
                continue
            key = ProcessKey(pid, st.start_time)
            found.append(held.get(key) or ProcessTotal(key, 0, (), self._procfs.cmdline(pid) or ""))
        return WholeUnit(tuple(found))


def _set_child_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise StartupError(f"cannot become a child subreaper: {os.strerror(err)}")


def _pid_view(settings: ExecSettings) -> PidView:
    """Where NVML's host pids can be read; refuses to guess inside a container."""
    if settings.host_proc:
        try:
            return PidView.of_process(ProcFs(settings.host_proc), "self")
        except PidViewError as exc:
            raise StartupError(f"--host-proc {settings.host_proc}: {exc}") from None
    local = ProcFs()
    ns = local.pid_ns("self")
    if ns != INITIAL_PID_NS:
        raise StartupError(
            f"this process runs in a PID namespace (inode {ns}) other than the host's "
            f"({INITIAL_PID_NS}), so the host PIDs that NVML reports name other processes "
            "here. Run the container with --pid=host, or mount the host's /proc read-only "
            "and pass --host-proc (e.g. -v /proc:/host/proc:ro --host-proc /host/proc)"
        )
    return PidView.host(local)


@contextlib.contextmanager
def _blocked_signals() -> Iterator[None]:
    """Hold our signals for `sigtimedwait`; threads started inside inherit the mask."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(slots=True)
class _Record:
    """What --summary tells: the spawn and the exit of the command, the tree's usage, and
    each report about its limit (as one of the pipeline's reporters)."""

    start: float | None = None
    started_at: float | None = None
    end: float | None = None
    signal: str | None = None
    tier: TierName = TierName.SAMPLING
    tree: TreeAttributor | None = None
    gate: ExecGate | None = None
    events: list[SummaryEvent] = field(default_factory=list)

    def exited(self, code: int) -> None:
        """The command was reaped; `code` as `os.waitstatus_to_exitcode` gives it."""
        self.end = time.monotonic()
        self.signal = signal.Signals(-code).name if code < 0 else None

    def held(self, tier: TierName) -> None:
        """Which tier holds the command (sampling as the backstop of any other)."""
        self.tier = tier

    def unbound(self) -> None:
        """The tier chosen does not hold the tree (the driver does not charge it, the gate
        could not be installed): the summary claims no tier but sampling."""
        self.held(TierName.SAMPLING)

    def refused(self, line: str) -> None:
        """The allocation gate refused an allocation (the first `MOST_REFUSALS` are told)."""
        if sum(e.reason == Reason.ALLOCATION_REFUSED for e in self.events) < MOST_REFUSALS:
            after = time.monotonic() - self.start if self.start is not None else 0.0
            self.events.append(SummaryEvent(str(Reason.ALLOCATION_REFUSED), after, line))

    def report(self, report: Report) -> None:
        limit = report.reason in (
            Reason.LIMIT_EXCEEDED,
            Reason.ENFORCED,
            Reason.WOULD_ENFORCE,
            Reason.RECLAIMED,
        )
        if limit and not report.quiet and self.start is not None:
            after = time.monotonic() - self.start
            self.events.append(SummaryEvent(str(report.reason), after, report.message, report.pid))

    def summary(self, settings: ExecSettings, status: int) -> ExecSummary:
        sm, memory = self.tree.mean_activity() if self.tree else (None, None)
        return ExecSummary(
            command=settings.command,
            limit_bytes=settings.limit_bytes,
            request_bytes=settings.request_bytes,
            action=settings.policy.action.value,
            dry_run=settings.policy.dry_run,
            exit_status=status,
            started=self.start is not None,
            signal=self.signal,
            start_monotonic=self.start,
            end_monotonic=self.end,
            started_at=self.started_at,
            peak_bytes=self.tree.peak_bytes if self.tree else None,
            samples=self.tree.samples if self.tree else 0,
            hard_limit=self.tier is TierName.DRIVER,
            tier=str(self.tier),
            events=tuple(self.events),
            sm_percent=sm,
            memory_percent=memory,
            busy_samples=self.tree.busy_samples if self.tree else 0,
            allocation_gate=self.gate.counts() if self.gate and self.gate.installed else None,
        )


def _write_summary(path: str, summary: ExecSummary) -> None:
    """Replace `path` at once, so that a reader never sees half a summary."""
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.error("could not write the summary to %s: %s", path, exc.strerror or exc)


@dataclass(frozen=True, slots=True)
class Gpus:
    """Where the command tree's GPU memory is read: a started NVML session, the view that
    names its pids, and the devices a process listed before the first pass must be seen
    holding (`NvmlSource`)."""

    nvml: Nvml
    view: PidView
    majors: frozenset[int] | None


def _nvml_gpus(settings: ExecSettings) -> Gpus:
    """This machine's GPUs, through NVML: what `exec` reads unless told otherwise in code."""
    view = _pid_view(settings)
    nvml = Nvml(utilisation_every=UTILISATION_EVERY)
    nvml.init()
    return Gpus(nvml, view, gpu_device_majors())


def run(settings: ExecSettings, gpus: Gpus | None = None) -> int:
    """Run the command under enforcement; returns the exit status to exit with.

    `gpus`: this machine's, through NVML, unless a caller passes others. Only `vram-enforcer
    demo` does (its simulated GPU); no flag or variable of `exec` can.
    """
    if settings.summary and not Path(settings.summary).parent.is_dir():
        log.error(
            "--summary %s: the directory %s does not exist; create it first",
            settings.summary,
            Path(settings.summary).parent,
        )
        return EXIT_USAGE
    record = _Record()
    status = _run(settings, record, gpus)
    if settings.summary:
        _write_summary(settings.summary, record.summary(settings, status))
    return status


def _run(settings: ExecSettings, record: _Record, gpus: Gpus | None) -> int:
    # Block first: libnvidia-ml may start threads in nvmlInit, and a thread that does not
    # block SIGCHLD would take it, so that sigtimedwait never saw the command exit.
    with _blocked_signals():
        try:
            gpu = gpus if gpus is not None else _nvml_gpus(settings)
        except StartupError as exc:
            log.error("%s", exc)
            return EXIT_USAGE
        except NvmlError as exc:
            log.error(
                "cannot read GPU memory usage, so the command was not started: %s",
                exc,
                exc_info=logs.detail(exc),
            )
            return EXIT_USAGE
        try:
            _set_child_subreaper()
            source = NvmlSource(gpu.nvml, gpu.view, gpu.majors)
            with hard_limits(settings, gpu.nvml) as (placed, majors):
                gated = TierName.GATE if majors is not None else TierName.SAMPLING
                record.held(TierName.DRIVER if placed is not None else gated)
                watch = (
                    ChargeWatch(gpu.nvml, placed, settings.interval, record.unbound)
                    if placed
                    else None
                )
                return _supervise(settings, source, placed, record, watch, majors)
        except (StartupError, MetricsPortError) as exc:
            log.error("%s", exc, exc_info=logs.detail(exc))
            return EXIT_USAGE
        finally:
            gpu.nvml.shutdown()


def _supervise(
    settings: ExecSettings,
    source: NvmlSource,
    placed: Placed | None,
    record: _Record,
    watch: ChargeWatch | None = None,
    majors: tuple[int, ...] | None = None,
) -> int:
    """`majors`: NVIDIA's device majors where the allocation gate holds the command."""
    procfs = ProcFs()
    telemetry = Telemetry({}, unit_label="container")
    limits = placed.limits if placed else {"": settings.limit_bytes} if majors else {}
    for gpu, limit in limits.items():  # the gate's is the tree's, over every GPU
        telemetry.hard_limits.labels(settings.name, gpu).set(limit)
    terminator = Terminator(Signaller(procfs, protected=frozenset({1})))
    gate = record.gate = ExecGate.of(settings, majors, telemetry, record.refused)
    on_pass = gate.saw if gate else lambda sample, units: None
    record.tree = TreeAttributor(procfs, settings.name, settings.limit_bytes, on_pass)
    requests = {} if settings.request_bytes is None else {settings.name: settings.request_bytes}
    pipeline = Pipeline(
        source,
        record.tree,
        settings.policy,
        terminator,
        [LogReporter(), record],
        telemetry,
        requests=lambda: requests,
        reclaimer=reclaim_here(settings.reclaim_watermark),
    )
    server = serve_metrics(telemetry, settings.metrics_port, settings.metrics_address)
    try:
        try:
            with placed.cgroup.entered() if placed else contextlib.nullcontext():
                spawned = time.monotonic(), time.time()
                required = settings.hard_limits == "required"
                child = gate.spawn(settings.command, required) if gate else spawn(settings.command)
            record.start, record.started_at = spawned
            if gate is not None and not gate.installed:
                record.unbound()
                telemetry.hard_limits.clear()
        except CgroupFsError as exc:
            raise StartupError(str(exc)) from exc
        except SpawnError as exc:
            log.error("%s", exc)
            return exc.status
        request = settings.request_bytes
        log.info(
            "enforcing a %s limit%s on pid %d (%s), every %.0f ms",
            format_bytes(settings.limit_bytes),
            "" if request is None else f" ({format_bytes(request)} guaranteed, the rest lent)",
            child,
            " ".join(settings.command),
            settings.interval * 1000,
        )
        keeper = CgroupKeeper(placed.cgroup) if placed is not None else None
        return _loop(child, pipeline, terminator, procfs, settings.interval, record, keeper, watch)
    finally:
        if gate is not None:
            gate.stop()
        terminator.close()
        if server is not None:
            server.close()


def _loop(
    child: int,
    pipeline: Pipeline,
    terminator: Terminator,
    procfs: ProcFs,
    interval: float,
    record: _Record,
    keeper: CgroupKeeper | None = None,
    watch: ChargeWatch | None = None,
) -> int:
    """Tick, forward signals and reap children until the last descendant has exited.

    A descendant that outlives the command (a double fork) is re-parented to us, the
    subreaper, and stays under the limit: we are done when we have no children left and
    no victim is being terminated, and then exit with the command's own status.
    """
    status: int | None = None
    children_left = True
    announced = False
    next_tick = time.monotonic()
    gate = record.gate if record.gate and record.gate.installed else None
    while status is None or children_left or terminator.busy():
        now = time.monotonic()
        early = gate.early() if gate else None  # a gated call waits for a fresh pass
        if now >= next_tick or (early is not None and now >= early):
            if gate is not None:
                gate.ticking(now)
            pipeline.tick()
            if gate is not None:
                gate.ticked()
            next_tick = max(next_tick + interval, now) if now >= next_tick else next_tick
            if keeper is not None:
                keeper.check(pipeline.last_units, now)
            if watch is not None:
                watch.check(pipeline.last_units)
        deadline = terminator.next_deadline()
        early = gate.early() if gate else None
        wake = min(t for t in (next_tick, deadline, early) if t is not None)
        info = signal.sigtimedwait(_WAITED, max(0.0, wake - time.monotonic()))
        if info is not None and info.si_signo != signal.SIGCHLD:
            _forward(info, procfs)
        # Reap on every wake-up: a SIGCHLD taken by a thread we did not start must not hang us.
        status, children_left = _reap(child, status, record)
        pipeline.follow_victims()
        if status is not None and children_left and not announced:
            announced = True
            _announce_leftovers(status, procfs)
    return status


def _children(procfs: ProcFs) -> list[int]:
    """Our own children: the command, and orphans re-parented to us."""
    me = os.getpid()
    return [pid for pid in procfs.pids() if (st := procfs.stat(pid)) is not None and st.ppid == me]


def _forward(info: signal.struct_siginfo, procfs: ProcFs) -> None:
    """Pass a signal we received to our children: the command and the leftovers.

    One that the kernel sent (the terminal's ^C, a hangup) has already reached every
    process of our process group, so it goes only to children outside it (the same rule
    as sudo's, extended to orphans that started a session of their own).
    """
    targets = _children(procfs)
    if info.si_code == _SI_KERNEL:
        group = os.getpgrp()
        targets = [pid for pid in targets if _process_group(pid) not in (group, None)]
    signal_children(targets, signal.Signals(info.si_signo))


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _announce_leftovers(status: int, procfs: ProcFs) -> None:
    leftovers = sorted(procfs.descendants(os.getpid()))
    named = [
        (pid, messages.shown(procfs.cmdline(pid) or "?", messages.COMMAND_CHARS))
        for pid in leftovers[:5]
    ]
    shown = ", ".join(f"{pid} ({command})" for pid, command in named)
    more = f" and {len(leftovers) - 5} more" if len(leftovers) > 5 else ""
    log.warning(
        "the command exited with status %d, but %d process(es) it started are still running: "
        "%s%s. They stay under the limit until they exit; vram-enforcer then exits with the "
        "command's status. To end them now, send SIGTERM to vram-enforcer (pid %d)",
        status,
        len(leftovers),
        shown,
        more,
        os.getpid(),
    )


def _reap(child: int, status: int | None, record: _Record) -> tuple[int | None, bool]:
    """Collect every exited child (orphans are ours too); remember the command's status,
    and when and how it ended.

    Returns the status (None while the command runs) and whether any child is left.
    """
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, False
        if pid == 0:
            return status, True
        if pid == child:
            code = os.waitstatus_to_exitcode(wait_status)
            status = 128 - code if code < 0 else code
            record.exited(code)
