"""Verified signalling: never signal a process whose identity and membership are not proven.

Every signal goes through a pidfd. The pidfd is opened first, then the start time and the
unit membership are read from `/proc`, then the pidfd is checked to still be alive. If it
is, the reads were of the process the pidfd pins (a pid cannot be reused while its process
lives), so the signal cannot reach a newcomer that inherited the pid. A terminated victim
keeps its pidfd until it exits, so its SIGKILL after the grace period needs no second
lookup and survives a process that ignores SIGTERM.

Each pidfd has one owner, a `Pinned`, which closes it exactly once. Any error from the
kernel while pinning or reading a process means "not proven": the process is left alone.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from enforcer.core.model import Action, ProcessKey, ProcessTotal, SignalResult
from enforcer.core.policy import Enforcement
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs

Membership = Callable[[int], bool]
"""Whether a pid (in our namespace) is proven, now, to belong to the unit being enforced."""

# How long a victim may take to vanish after SIGKILL before we stop waiting for it
# (a process stuck in uninterruptible sleep inside the driver cannot die sooner).
STUCK_AFTER = 30.0


class Signaller:
    """Proves a process's identity (pid, start time) and membership, and pins it."""

    def __init__(self, procfs: ProcFs, protected: frozenset[int]) -> None:
        self._procfs = procfs
        self._protected = protected | {os.getpid()}

    def verify(self, key: ProcessKey, is_member: Membership) -> Pinned | SignalResult:
        """The process pinned if it is alive, unchanged and a member; else why not."""
        if key.pid in self._protected or key.pid <= 1:
            return SignalResult.PROTECTED
        pinned = Pinned.open(key.pid)
        if isinstance(pinned, SignalResult):
            return pinned
        refusal = self.refusal(pinned, key, is_member)
        if refusal is not None:
            pinned.close()
            return refusal
        return pinned

    def refusal(
        self, pinned: Pinned, key: ProcessKey, is_member: Membership
    ) -> SignalResult | None:
        """Why the pinned process is not proven, now, to be `key` and a member; None when it
        is. Run again before every later signal to it (the SIGKILL after the grace period)."""
        start_time = self._procfs.start_time(key.pid)
        if start_time is None:
            return SignalResult.GONE if pinned.exited() else SignalResult.UNVERIFIED
        if start_time != key.start_time:
            return SignalResult.IDENTITY_CHANGED
        if not is_member(key.pid):
            return SignalResult.NOT_MEMBER
        if pinned.exited():  # last: the reads above were of the pinned process
            return SignalResult.GONE
        return None


def signal_children(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send `sig` to our own children, through pidfds.

    Only for children we have not reaped: until we do, their pids cannot be reused, so the
    pid alone proves the identity. (`exec` forwards the signals it receives this way.)
    """
    for pid in pids:
        pinned = Pinned.open(pid)
        if isinstance(pinned, Pinned):
            with pinned:
                pinned.send(sig)


class Escalation(StrEnum):
    EXITED = "exited"
    KILLED = "killed"  # SIGKILL sent after the grace period
    STUCK = "stuck"  # still there STUCK_AFTER seconds after SIGKILL
    ABANDONED = "abandoned"  # lost membership or the kernel refused SIGKILL


@dataclass(slots=True)
class _Victim:
    enforcement: Enforcement
    process: Pinned
    is_member: Membership
    kill_at: float | None
    give_up_at: float


@dataclass(frozen=True, slots=True)
class EscalationEvent:
    kind: Escalation
    enforcement: Enforcement

    @property
    def victim(self) -> ProcessTotal:
        return self.enforcement.victim


class Terminator:
    """Carries out enforcements and follows each victim until it is gone."""

    def __init__(self, signaller: Signaller) -> None:
        self._signaller = signaller
        self._victims: dict[ProcessKey, _Victim] = {}

    def busy(self) -> frozenset[ProcessKey]:
        return frozenset(self._victims)

    def next_deadline(self) -> float | None:
        deadlines = [
            v.kill_at if v.kill_at is not None else v.give_up_at for v in self._victims.values()
        ]
        return min(deadlines, default=None)

    def start(self, enforcement: Enforcement, is_member: Membership, now: float) -> SignalResult:
        """SIGTERM (then SIGKILL after the grace period) or SIGKILL, as the enforcement says."""
        key = enforcement.victim.key
        if key in self._victims:
            victim = self._victims[key]
            if enforcement.action is Action.KILL and victim.kill_at is not None:
                victim.kill_at = now  # taken with its whole unit: SIGKILL on the next poll
            return SignalResult.IN_PROGRESS
        pinned = self._signaller.verify(key, is_member)
        if isinstance(pinned, SignalResult):
            return pinned
        terminate = enforcement.action is not Action.KILL
        result = pinned.send(signal.SIGTERM if terminate else signal.SIGKILL)
        if result is not SignalResult.SENT:
            pinned.close()
            return result
        kill_at = now + enforcement.grace_period if terminate else None
        give_up_at = (kill_at if kill_at is not None else now) + STUCK_AFTER
        self._victims[key] = _Victim(enforcement, pinned, is_member, kill_at, give_up_at)
        return result

    def poll(self, now: float) -> list[EscalationEvent]:
        """Forget victims that exited; SIGKILL those whose grace period is over."""
        events = []
        for key, victim in list(self._victims.items()):
            kind = self._step(victim, now)
            if kind is None:
                continue
            events.append(EscalationEvent(kind, victim.enforcement))
            if kind is not Escalation.KILLED:
                victim.process.close()
                del self._victims[key]
        return events

    def _step(self, victim: _Victim, now: float) -> Escalation | None:
        if victim.process.exited():
            return Escalation.EXITED
        if victim.kill_at is not None and now >= victim.kill_at:
            victim.kill_at = None
            victim.give_up_at = now + STUCK_AFTER
            refusal = self._signaller.refusal(
                victim.process, victim.enforcement.victim.key, victim.is_member
            )
            if refusal is not None:
                return Escalation.EXITED if refusal is SignalResult.GONE else Escalation.ABANDONED
            sent = victim.process.send(signal.SIGKILL)
            if sent is SignalResult.GONE:
                return Escalation.EXITED
            return Escalation.KILLED if sent is SignalResult.SENT else Escalation.ABANDONED
        if victim.kill_at is None and now >= victim.give_up_at:
            return Escalation.STUCK
        return None

    def close(self) -> None:
        for victim in self._victims.values():
            victim.process.close()
        self._victims.clear()
