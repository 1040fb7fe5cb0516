"""One enforcement tick: sample -> attribute -> decide -> act -> report.

`exec` and the sidecar run this same tick; they differ only in their attributor (process
tree or cgroups) and their reporters (stderr or Kubernetes Events). When the source is
down the tick still follows victims already being terminated, but decides nothing new:
the policy state is kept as it was, and nobody is signalled on stale or missing data.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from enforcer.core import messages
from enforcer.core.model import ProcessTotal, Sample, SignalResult, SourceDown, UnitUsage
from enforcer.core.policy import Decision, Enforcement, PolicyConfig, UnitState, decide
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import DEFAULT_WATERMARK, Gpu, Reclaim, reclaims, views
from enforcer.core.sidecar_report import TICK_LOOP
from enforcer.edge.guard import LoopGuard
from enforcer.edge.signals import Escalation, EscalationEvent, Membership, Terminator
from enforcer.edge.sources import UsageSource
from enforcer.edge.telemetry import LoopTelemetry, View

log = logging.getLogger(__name__)

WHOLE_UNIT_ROUNDS = 3  # passes over a unit taken whole: a fork in flight shows in the next


class Reclaimer(Protocol):
    """Each GPU's view of the tick in, the units to hold to their requests out."""

    def __call__(self, gpus: tuple[Gpu, ...], /) -> Mapping[str, Reclaim]: ...


def reclaim_here(watermark: int = DEFAULT_WATERMARK) -> Reclaimer:
    """Decided from this tick's own view (`exec`: its one unit against all else on its
    GPUs)."""
    return functools.partial(reclaims, watermark=watermark)


class Attributor(Protocol):
    """Maps a sample's processes to units; knows how to re-check membership before a signal."""

    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]: ...

    def membership(self, unit: str) -> Membership: ...

    def label(self, unit: str) -> str: ...

    def whole(self, unit: UnitUsage) -> WholeUnit:
        """What to stop when one victim at a time is not enough: `exec`'s whole tree, or a
        container's init (restart semantics; else each of its GPU processes)."""
        ...


@dataclass(frozen=True, slots=True)
class WholeUnit:
    """Every process to stop at once; `restart`: the one process is a container's init."""

    processes: tuple[ProcessTotal, ...]
    restart: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """Something a person should hear about: a reason, a sentence, and what it is about."""

    reason: Reason
    message: str
    unit: str | None = None
    pid: int | None = None
    normal: bool = False  # good news (Event type Normal rather than Warning)
    quiet: bool = False  # routine: logged at INFO, so `exec` does not print it by default


class Reporter(Protocol):
    def report(self, report: Report) -> None: ...


class LogReporter:
    """Reports as log lines, with the report's fields as structured data."""

    def report(self, report: Report) -> None:
        fields = {"reason": str(report.reason), "unit": report.unit, "pid": report.pid}
        level = logging.INFO if report.quiet else logging.WARNING
        log.log(level, report.message, extra={k: v for k, v in fields.items() if v is not None})


class Pipeline:
    def __init__(
        self,
        source: UsageSource,
        attributor: Attributor,
        config: PolicyConfig,
        terminator: Terminator,
        reporters: Sequence[Reporter],
        telemetry: LoopTelemetry,
        requests: Callable[[], Mapping[str, int]] | None = None,
        reclaimer: Reclaimer | None = None,
    ) -> None:
        """`requests`: the units that may borrow above a request (unit name -> bytes) up
        to their limit, as of the tick's attribution; `reclaimer` says, from each GPU's
        view, which must give back what they borrowed (`exec`: decided here; the sidecar:
        as the agent asks)."""
        self._source = source
        self._attributor = attributor
        self._config = config
        self._terminator = terminator
        self._reporters = reporters
        self._telemetry = telemetry
        self._requests = requests or dict
        self._reclaimer = reclaimer
        self._state: dict[str, UnitState] = {}
        self._source_up: bool | None = None
        self._guard = LoopGuard(TICK_LOOP, telemetry.unexpected.labels(TICK_LOOP), log)
        self.last_units: tuple[UnitUsage, ...] = ()

    def tick(self) -> None:
        """One tick; a bug in it is reported and the next tick runs as usual."""
        started = time.perf_counter()
        self._guard.run(self._tick)
        self._telemetry.tick_duration.observe(time.perf_counter() - started)

    def follow_victims(self) -> None:
        """Escalate or forget victims; runs every tick, and between ticks at their deadlines."""
        self._guard.run(self._follow_victims)

    def _follow_victims(self) -> None:
        for event in self._terminator.poll(time.monotonic()):
            self._escalation(event)

    def _tick(self) -> None:
        self._follow_victims()
        sample = self._source.sample()
        if isinstance(sample, SourceDown):
            self._source_changed(False, sample.reason)
            self._telemetry.collector.show(View(self.last_units, (), source_up=False))
            return
        self._source_changed(True, "")
        units = self._attributor.attribute(sample)
        busy = self._terminator.busy()
        gpus: tuple[Gpu, ...] = ()
        if requests := self._requests():
            exiting = frozenset(u.name for u in units if any(p.key in busy for p in u.processes))
            gpus = views(sample.devices, units, requests, exiting)
        reclaimed = self._reclaimer(gpus) if self._reclaimer is not None else {}
        decision = decide(units, self._config, self._state, time.monotonic(), busy, reclaimed)
        self._state = dict(decision.state)
        self._act(decision)
        self.last_units = units
        self._telemetry.collector.show(View(units, sample.devices, True, sample, gpus))

    def _act(self, decision: Decision) -> None:
        for notice in decision.notices:
            label = self._attributor.label(notice.unit.name)
            config = self._config
            text = messages.notice(notice, label, config.action, config.warn_at, config.dry_run)
            self._telemetry.actions.labels("warn").inc()
            self._emit(Report(notice.reason, text, notice.unit.name))
        for enf in decision.enforcements:
            name = enf.unit.name
            if enf.whole_unit:
                self._take_whole_unit(enf)
                continue
            if enf.dry_run:  # a reclaim too: nothing is taken back, so it is no VRAMReclaimed
                self._telemetry.actions.labels("dry-run").inc()
                text = messages.would_enforce(enf, self._attributor.label(name))
                self._emit(Report(Reason.WOULD_ENFORCE, text, name, enf.victim.key.pid))
                continue
            membership = self._attributor.membership(name)
            result = self._terminator.start(enf, membership, time.monotonic())
            if result is SignalResult.SENT:
                self._telemetry.actions.labels(str(enf.action)).inc()
                if enf.reclaim is not None:
                    needed = "requests" if enf.reclaim.owed_to else "unrequested"
                    self._telemetry.reclaims.labels(needed).inc()
            else:
                self._telemetry.refused.labels(str(result)).inc()
            text = messages.enforcement(enf, self._attributor.label(name), result)
            # A victim that exited before the signal (often the previous victim, still in a
            # sample taken before it went) is routine: the log has it, an Event would bury
            # the message that says what was actually done.
            gone = result is SignalResult.GONE
            reason = _reason(enf)
            self._emit(Report(reason, text, name, enf.victim.key.pid, normal=gone, quiet=gone))

    def _take_whole_unit(self, enf: Enforcement) -> None:
        """SIGKILL every process `whole()` names, each proven as any victim is; a victim
        already on its way out gets its SIGKILL now. Looked for again, a few times, while
        new ones appear: forks in flight as their parent was being killed."""
        name = enf.unit.name
        membership = self._attributor.membership(name)
        targets: list[ProcessTotal] = []
        results: list[SignalResult] = []
        restart = False
        for _ in range(WHOLE_UNIT_ROUNDS):
            whole = self._attributor.whole(enf.unit)
            restart = whole.restart
            fresh = [t for t in whole.processes if t.key not in {s.key for s in targets}]
            for target in fresh:
                result = self._terminator.start(
                    replace(enf, victim=target), membership, time.monotonic()
                )
                targets.append(target)
                results.append(result)
                if result is SignalResult.SENT:
                    self._telemetry.actions.labels("kill").inc()
                elif result is not SignalResult.IN_PROGRESS:
                    self._telemetry.refused.labels(str(result)).inc()
            if not fresh or restart:
                break
        label = self._attributor.label(name)
        text = messages.whole_unit(enf, label, targets, results, self._config.grace_period, restart)
        self._emit(Report(Reason.ENFORCED, text, name, enf.victim.key.pid))

    def _escalation(self, event: EscalationEvent) -> None:
        enf = event.enforcement
        victim = event.victim
        if event.kind is Escalation.EXITED:
            text = f"{messages.process(victim)} has exited"
            exited = Report(
                _reason(enf), text, enf.unit.name, victim.key.pid, normal=True, quiet=True
            )
            self._emit(exited)
            return
        if event.kind is Escalation.KILLED:
            self._telemetry.actions.labels("kill").inc()
            text = messages.escalated(victim, enf.grace_period)
        elif event.kind is Escalation.STUCK:
            text = f"{messages.process(victim)} is still there after SIGKILL; giving up on it"
        else:
            text = (
                f"did not send SIGKILL to {messages.process(victim)}: it could not be re-verified"
            )
        about = messages.about(enf, self._attributor.label(enf.unit.name))
        self._emit(Report(_reason(enf), about + text, enf.unit.name, victim.key.pid))

    def _source_changed(self, up: bool, reason: str) -> None:
        if self._source_up is up:
            return
        first = self._source_up is None
        self._source_up = up
        if up and not first:
            self._emit(Report(Reason.USAGE_UNKNOWN, messages.source_up(), normal=True))
        elif not up:
            self._emit(Report(Reason.USAGE_UNKNOWN, messages.source_down(reason)))

    def _emit(self, report: Report) -> None:
        for reporter in self._reporters:
            reporter.report(report)


def _reason(enf: Enforcement) -> Reason:
    """A signal sent to take back borrowed memory is said as a reclaim, so that every
    reclaim (`VRAMReclaimed`) can be told from limits enforced (`VRAMEnforced`)."""
    return Reason.RECLAIMED if enf.reclaim is not None else Reason.ENFORCED
