"""exec's allocation gate (`--allocation-gate on`): the listener that judges the command's
driver allocation calls, fed by exec's own sampling, with its metrics and its counts.

The command tree is held to `--limit` summed over GPUs, as sampling holds it. After each
tick with a good pass the ledger learns what the tree holds and when that pass began (a
pass the source could not read, one that missed a GPU, or one with usage it could not
place, keeps the last good view: usage the gate cannot see never makes room). A call that
waits for a fresh pass asks the main loop for an early tick by waking it (SIGCHLD, which it
waits on); the loop ticks then, at most once per `EARLY_TICK_GAP`. The listener's threads
are started inside exec's blocked signals, so they inherit the mask that keeps SIGCHLD for
the main loop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Collection

from enforcer.core.exec_summary import GateCounts
from enforcer.core.model import Sample, UnitUsage
from enforcer.core.settings.exec import ExecSettings
from enforcer.edge.gate_listener import GateListener, Ledger, Outcome
from enforcer.edge.guard import ErrorCounter
from enforcer.edge.metrics import GateMetrics, Telemetry
from enforcer.modes.exec_spawn import spawn_gated

log = logging.getLogger(__name__)

EARLY_TICK_GAP = 0.01  # s: the closest an early tick follows the last tick
RECHECK_WAIT = 0.25  # s: the least a call over the limit waits for a fresh pass


class ExecGate:
    """One command's gate: `spawn` the command under it, `ticking` as each tick begins,
    `saw` each pass, `ticked` after it, `early` for an early tick, `stop` at the end;
    `counts` for the summary."""

    def __init__(
        self,
        name: str,
        limit_bytes: int,
        interval: float,
        majors: Collection[int],
        metrics: GateMetrics,
        errors: ErrorCounter,
        refused: Callable[[str], None],
    ) -> None:
        """`name`: the `container` label; `majors`: NVIDIA's device majors; `refused(line)`:
        told of each refusal."""
        self._name = name
        self._ledger = Ledger(limit_bytes)
        self._interval = interval
        self._majors = frozenset(majors)
        self._metrics = metrics
        self._errors = errors
        self._refused = refused
        self._main = threading.get_ident()
        self._wanted = threading.Event()
        self._began = float("-inf")  # the last tick's
        self._read = False  # the last tick's pass read the tree's usage
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._slowest = 0.0
        self._listener: GateListener | None = None
        self._fd: int | None = None
        for outcome in Outcome:  # every series at 0 from the start
            metrics.calls.labels(name, outcome)
        metrics.refusals.labels(name)

    @classmethod
    def of(
        cls,
        settings: ExecSettings,
        majors: Collection[int] | None,
        telemetry: Telemetry,
        refused: Callable[[str], None],
    ) -> ExecGate | None:
        """exec's gate, where it holds the command (`majors` not None)."""
        if majors is None:
            return None
        errors = telemetry.unexpected.labels("allocation-gate")
        name, limit, every = settings.name, settings.limit_bytes, settings.interval
        return cls(name, limit, every, majors, telemetry.gate, errors, refused)

    def spawn(self, command: tuple[str, ...], required: bool) -> int:
        """The command started under the gate (or without it, said, where it cannot be
        installed: `installed` is then False); its pid."""
        pid, fd = spawn_gated(command, required, self._interval)
        if fd is None:
            return pid
        self._fd = fd
        self._listener = GateListener(
            fd,
            self._ledger,
            self._majors,
            self._errors,
            count=self._count,
            want_pass=self._want_pass,
            recheck_wait=max(2 * self._interval, RECHECK_WAIT),
            pid=pid,
        )
        self._listener.refused = self._refused
        self._listener.start()
        log.info(
            "the allocation gate is installed on pid %d: the driver's allocation calls of "
            "the command tree are checked before they run",
            pid,
        )
        return pid

    @property
    def installed(self) -> bool:
        return self._listener is not None

    def early(self) -> float | None:
        """When the main loop should tick early, for a call that waits for a fresh pass
        (None: no call waits)."""
        return self._began + EARLY_TICK_GAP if self._wanted.is_set() else None

    def ticking(self, now: float) -> None:
        """The main loop's, as a tick begins at `now` (monotonic): the listener restarted
        if it stopped, and whether it is stuck."""
        self._wanted.clear()
        self._began, self._read = now, False
        if self._listener is not None:
            self._listener.check()
            self._metrics.stalled.set(int(self._listener.stalled))

    def saw(self, sample: Sample, units: tuple[UnitUsage, ...]) -> None:
        """The tree's usage in the pass of the tick that began last. A pass that could not
        read some GPU, or with usage it could not place, keeps the last view."""
        if not sample.failed and not any(unit.has_unknown for unit in units):
            self._ledger.saw(sum(unit.used_bytes for unit in units), self._began)
            self._read = True

    def ticked(self) -> None:
        """The main loop's, once the tick's pass is done: one that could not read (NVML
        down, usage it could not place) is told to the gate too, which refuses on the last
        good pass a call that waited for it."""
        if not self._read:
            self._ledger.tried(self._began)

    def stop(self) -> None:
        if self._listener is not None and not self._listener.stop():
            return  # a thread held inside a call still reads the fd: it stays open
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def counts(self) -> GateCounts:
        with self._lock:
            return GateCounts(tuple(sorted(self._calls.items())), self._slowest * 1e6)

    def _count(self, outcome: Outcome, seconds: float) -> None:
        self._metrics.calls.labels(self._name, outcome).inc()
        self._metrics.seconds.observe(seconds)
        if outcome is Outcome.REFUSED:
            self._metrics.refusals.labels(self._name).inc()
        with self._lock:
            self._calls[str(outcome)] += 1
            self._slowest = max(self._slowest, seconds)

    def _want_pass(self) -> None:
        """From the recheck worker: wake the main loop for an early tick."""
        self._wanted.set()
        signal.pthread_kill(self._main, signal.SIGCHLD)
