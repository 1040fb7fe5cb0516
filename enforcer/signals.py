"""Verified signalling: never signal a process whose identity and membership are not proven.

Every signal goes through a pidfd. The pidfd is opened first, then the start time and the
unit membership are read from `/proc`, then the pidfd is checked to still be alive. If it
is, the reads were of the process the pidfd pins (a pid cannot be reused while its process
lives), so the signal cannot reach a newcomer that inherited the pid. A terminated victim
keeps its pidfd until it exits, so its SIGKILL after the grace period needs no second
lookup and survives a process that ignores SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from enforcer.model import Action, ProcessKey, ProcessTotal, SignalResult
from enforcer.policy import Enforcement
from enforcer.procfs import ProcFs

log = logging.getLogger(__name__)

Membership = Callable[[int], bool]
"""Whether a pid (in our namespace) still belongs to the unit being enforced."""

# How long a victim may take to vanish after SIGKILL before we stop waiting for it
# (a process stuck in uninterruptible sleep inside the driver cannot die sooner).
STUCK_AFTER = 30.0


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class Signaller:
    """Sends one signal to a process identified by (pid, start time), or says why not."""

    def __init__(self, procfs: ProcFs, protected: frozenset[int]) -> None:
        self._procfs = procfs
        self._protected = protected | {os.getpid()}

    def open_verified(self, key: ProcessKey, is_member: Membership) -> tuple[SignalResult, int]:
        """A pidfd for `key` if it is alive, unchanged and a member; else the reason and -1."""
        if key.pid in self._protected or key.pid <= 1:
            return SignalResult.PROTECTED, -1
        try:
            pidfd = os.pidfd_open(key.pid)
        except ProcessLookupError:
            return SignalResult.GONE, -1
        result = SignalResult.SENT
        if self._procfs.start_time(key.pid) != key.start_time:
            result = SignalResult.IDENTITY_CHANGED
        elif not is_member(key.pid):
            result = SignalResult.NOT_MEMBER
        if result is SignalResult.SENT and _exited(pidfd):
            result = SignalResult.GONE
        if result is not SignalResult.SENT:
            os.close(pidfd)
            return result, -1
        return result, pidfd

    @staticmethod
    def send_pidfd(pidfd: int, sig: signal.Signals) -> SignalResult:
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return SignalResult.GONE
        except PermissionError:
            return SignalResult.DENIED
        return SignalResult.SENT

    def send(self, key: ProcessKey, sig: signal.Signals, is_member: Membership) -> SignalResult:
        result, pidfd = self.open_verified(key, is_member)
        if result is not SignalResult.SENT:
            return result
        try:
            return self.send_pidfd(pidfd, sig)
        finally:
            os.close(pidfd)


class Escalation(StrEnum):
    EXITED = "exited"
    KILLED = "killed"  # SIGKILL sent after the grace period
    STUCK = "stuck"  # still there STUCK_AFTER seconds after SIGKILL
    ABANDONED = "abandoned"  # lost membership or the kernel refused SIGKILL


@dataclass(slots=True)
class _Victim:
    enforcement: Enforcement
    pidfd: int
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
            return SignalResult.SENT
        result, pidfd = self._signaller.open_verified(key, is_member)
        if result is not SignalResult.SENT:
            return result
        terminate = enforcement.action is not Action.KILL
        result = self._signaller.send_pidfd(pidfd, signal.SIGTERM if terminate else signal.SIGKILL)
        if result is not SignalResult.SENT:
            os.close(pidfd)
            return result
        kill_at = now + enforcement.grace_period if terminate else None
        give_up_at = (kill_at if kill_at is not None else now) + STUCK_AFTER
        self._victims[key] = _Victim(enforcement, pidfd, is_member, kill_at, give_up_at)
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
                os.close(victim.pidfd)
                del self._victims[key]
        return events

    def _step(self, victim: _Victim, now: float) -> Escalation | None:
        if _exited(victim.pidfd):
            return Escalation.EXITED
        if victim.kill_at is not None and now >= victim.kill_at:
            victim.kill_at = None
            victim.give_up_at = now + STUCK_AFTER
            if not victim.is_member(victim.enforcement.victim.key.pid):
                return Escalation.ABANDONED
            sent = self._signaller.send_pidfd(victim.pidfd, signal.SIGKILL)
            if sent is SignalResult.GONE:
                return Escalation.EXITED
            return Escalation.KILLED if sent is SignalResult.SENT else Escalation.ABANDONED
        if victim.kill_at is None and now >= victim.give_up_at:
            return Escalation.STUCK
        return None

    def close(self) -> None:
        for victim in self._victims.values():
            with contextlib.suppress(OSError):
                os.close(victim.pidfd)
        self._victims.clear()
