"""Pure enforcement decisions: usage per unit, limits, previous state and time in; actions out.

Everything that makes enforcement predictable lives here, where it can be tested without
a GPU, a process or a clock: when a warning is due (once per crossing), how long usage may
stay over the limit (`over_for`), which process pays for it (the largest), that nobody
new is picked while an earlier victim is still on its way out, and when one victim at a time
is not enough: a unit still over its limit one grace period after its first victim was
signalled loses every process at once (a supervisor that replaces each worker it loses
would otherwise keep it over its limit for as long as it runs). A unit whose GPU needs
back the memory it borrowed above its request (`reclaim.py` says which) is held to its
request the same way, at once, one victim on that GPU at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from enforcer.core.model import Action, ProcessKey, ProcessTotal, UnitUsage
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import Reclaim

# The near-limit warning re-arms only once usage falls below this share of the warn
# threshold, so usage hovering around the threshold gives one warning, not one per tick.
REARM_FRACTION = 0.95
# With `kill` (no grace period), a victim's exit and its memory's release still take a tick
# or two to show in NVML: escalate no sooner than this after the first victim.
ESCALATE_AFTER_AT_LEAST = 1.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    action: Action = Action.TERMINATE
    warn_at: float = 0.9
    over_for: float = 0.0
    grace_period: float = 5.0
    dry_run: bool = False

    @property
    def reports_only(self) -> bool:
        """Whether nothing is enforced, only reported (`warn`, or a dry run): the webhook's
        report-only actions (`tenancy.REPORT_ONLY`) as the sidecar and the agent run them.
        Such a unit is given no hard limit (the driver would refuse its allocations: that
        is enforcing) and borrows nothing above its request (what it borrowed could not be
        taken back, and its neighbours' requests would go unmet)."""
        return self.dry_run or self.action is Action.WARN


@dataclass(frozen=True, slots=True)
class UnitState:
    """What the policy remembers about one unit between ticks."""

    near_warned: bool = False
    over_since: float | None = None
    exceeded_reported: bool = False
    dry_run_reported: bool = False
    # This excursion over the limit: when its first victim was signalled, and when the whole
    # unit last was.
    signalled_at: float | None = None
    escalated_at: float | None = None
    reclaim_reported: bool = False  # this reclaim of memory lent above the request
    over_peak: int = 0  # the most the unit held in this excursion over its limit, as sampled


@dataclass(frozen=True, slots=True)
class Notice:
    """A unit crossed a threshold; nothing is signalled because of it."""

    reason: Reason
    unit: UnitUsage
    over_for_left: float = 0.0
    reclaim: Reclaim | None = None  # RECLAIMED: the GPU's shortfall that needs it back


@dataclass(frozen=True, slots=True)
class Enforcement:
    """Signal `victim` because `unit` has been over its limit for long enough; or, with
    `whole_unit`, every process of the unit (`victim` is then its largest, for the report)."""

    unit: UnitUsage
    victim: ProcessTotal
    action: Action
    grace_period: float
    dry_run: bool = False
    whole_unit: bool = False
    reclaim: Reclaim | None = None  # memory lent above the request, taken back
    peak_bytes: int = 0  # the most the unit held in this excursion over its limit, so far


@dataclass(frozen=True, slots=True)
class Decision:
    state: Mapping[str, UnitState]
    notices: tuple[Notice, ...] = ()
    enforcements: tuple[Enforcement, ...] = ()


def choose_victim(
    unit: UnitUsage, busy: frozenset[ProcessKey], on_gpu: str | None = None
) -> ProcessTotal | None:
    """The process to signal: the largest known user (of `on_gpu`, when given); the
    youngest on a tie.

    A process whose usage is unknown everywhere holds no known bytes and is never chosen.
    """

    def held(p: ProcessTotal) -> int:
        if on_gpu is None:
            return p.used_bytes
        return sum(used or 0 for uuid, used in p.by_device if uuid == on_gpu)

    candidates = [p for p in unit.processes if held(p) > 0 and p.key not in busy]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (held(p), p.key.start_time, p.key.pid))


NO_RECLAIMS: Mapping[str, Reclaim] = MappingProxyType({})


def decide(
    units: Iterable[UnitUsage],
    config: PolicyConfig,
    state: Mapping[str, UnitState],
    now: float,
    busy: frozenset[ProcessKey] = frozenset(),
    reclaims: Mapping[str, Reclaim] = NO_RECLAIMS,
) -> Decision:
    """One tick of policy for every unit; `busy` holds victims still being terminated,
    `reclaims` the units whose GPU needs back what they lent above their requests."""
    new_state: dict[str, UnitState] = {}
    notices: list[Notice] = []
    enforcements: list[Enforcement] = []
    for unit in units:
        prev = state.get(unit.name, UnitState())
        reclaim = reclaims.get(unit.name)
        unit_state, notice, enforcement = _decide_unit(unit, config, prev, now, busy, reclaim)
        new_state[unit.name] = unit_state
        if notice is not None:
            notices.append(notice)
        if enforcement is not None:
            enforcements.append(enforcement)
    return Decision(new_state, tuple(notices), tuple(enforcements))


def _decide_unit(
    unit: UnitUsage,
    config: PolicyConfig,
    prev: UnitState,
    now: float,
    busy: frozenset[ProcessKey],
    reclaim: Reclaim | None = None,
) -> tuple[UnitState, Notice | None, Enforcement | None]:
    used, limit = unit.used_bytes, unit.limit_bytes
    if used <= limit and reclaim is not None:
        return _reclaim(unit, config, prev, busy, reclaim)
    if used <= limit:
        return _below_limit(unit, config, prev), _near_notice(unit, config, prev), None

    over_since = prev.over_since if prev.over_since is not None else now
    peak = max(prev.over_peak, used)
    state = replace(
        prev, near_warned=True, over_since=over_since, exceeded_reported=True, over_peak=peak
    )
    left = max(0.0, config.over_for - (now - over_since))
    notice = None if prev.exceeded_reported else Notice(Reason.LIMIT_EXCEEDED, unit, left)
    if left > 0 or config.action is Action.WARN or not unit.enforceable:
        return state, notice, None
    if _escalation_due(prev, config, now):
        largest = choose_victim(unit, frozenset()) or unit.init_process
        if largest is not None:
            state = replace(state, escalated_at=now)
            return state, notice, Enforcement(unit, largest, Action.KILL, 0.0, whole_unit=True)
    if _exiting(unit, busy):
        return state, notice, None  # an earlier victim is still exiting: wait for it
    if config.dry_run and prev.dry_run_reported:
        return state, notice, None
    victim = choose_victim(unit, busy) if config.action is not Action.RESTART else unit.init_process
    if victim is None or victim.key in busy:
        return state, notice, None
    if config.dry_run:
        state = replace(state, dry_run_reported=True)
    elif state.signalled_at is None:
        state = replace(state, signalled_at=now)
    enforcement = Enforcement(
        unit, victim, config.action, config.grace_period, config.dry_run, peak_bytes=peak
    )
    return state, notice, enforcement


def _reclaim(
    unit: UnitUsage,
    config: PolicyConfig,
    prev: UnitState,
    busy: frozenset[ProcessKey],
    reclaim: Reclaim,
) -> tuple[UnitState, Notice | None, Enforcement | None]:
    """Held to its request while its GPU needs memory back. No tolerance window: the
    containers it borrowed from are short now. One victim at a time, the largest on that
    GPU, and no whole-unit escalation: `reclaim.plan` asks again on every tick, and stops
    asking once the GPU is safe (or while a victim exits, whose memory is coming back)."""
    state = replace(
        _below_limit(unit, config, prev),
        reclaim_reported=True,
        dry_run_reported=prev.dry_run_reported,
    )
    # Said once per reclaim: by the signal's own report (which carries the why), or by a
    # notice when nothing is signalled (warn, a unit not proven, a victim still exiting).
    notice = None if prev.reclaim_reported else Notice(Reason.RECLAIMED, unit, reclaim=reclaim)
    if config.action is Action.WARN or not unit.enforceable:
        return state, notice, None
    if _exiting(unit, busy) or (config.dry_run and prev.dry_run_reported):
        return state, notice, None
    if config.action is Action.RESTART:
        victim = unit.init_process
    else:
        victim = choose_victim(unit, busy, reclaim.gpu)
    if victim is None or victim.key in busy:
        return state, notice, None
    if config.dry_run:
        state = replace(state, dry_run_reported=True)
    enforcement = Enforcement(
        unit, victim, config.action, config.grace_period, config.dry_run, reclaim=reclaim
    )
    return state, None, enforcement


def _exiting(unit: UnitUsage, busy: frozenset[ProcessKey]) -> bool:
    """Whether a victim of the unit (its init among them) is still on its way out."""
    init = unit.init_process
    return any(p.key in busy for p in unit.processes) or (init is not None and init.key in busy)


def _escalation_due(prev: UnitState, config: PolicyConfig, now: float) -> bool:
    """Still over one grace period after this excursion's first victim was signalled (and
    after the last escalation): victims are being replaced as fast as they are stopped."""
    if prev.signalled_at is None:
        return False
    wait = max(config.grace_period, ESCALATE_AFTER_AT_LEAST)
    since = prev.escalated_at if prev.escalated_at is not None else prev.signalled_at
    return now - since >= wait


def _below_limit(unit: UnitUsage, config: PolicyConfig, prev: UnitState) -> UnitState:
    """Leaving the excursion over the limit re-arms its reports; hysteresis re-arms 'near'."""
    near_warned = prev.near_warned or _is_near(unit, config)
    if unit.used_bytes < _warn_threshold(unit, config) * REARM_FRACTION:
        near_warned = False
    return UnitState(near_warned=near_warned)


def _near_notice(unit: UnitUsage, config: PolicyConfig, prev: UnitState) -> Notice | None:
    if prev.near_warned or not _is_near(unit, config):
        return None
    return Notice(Reason.NEAR_LIMIT, unit)


def _is_near(unit: UnitUsage, config: PolicyConfig) -> bool:
    return unit.used_bytes > 0 and unit.used_bytes >= _warn_threshold(unit, config)


def _warn_threshold(unit: UnitUsage, config: PolicyConfig) -> float:
    return unit.limit_bytes * config.warn_at
