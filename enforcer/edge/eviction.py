"""The node agent's evictions: a pod over its VRAM limit that the kernel will not let the
agent signal (EPERM) is made to leave through the API (`core.eviction` says how).

`evict()` only queues, and never blocks the sampler's pass that asks for it; this thread
makes the requests. A pod is asked for once: a repeat while its eviction is pending is
ignored. First a policy/v1 Eviction, with the pod's UID as a precondition and the grace
period of its policy. A refusal (HTTP 429: a PodDisruptionBudget does not allow it now; a
500: two budgets select the pod) is said in an Event on the pod and tried again after a
backoff that grows to RETRY_MAX, never in a busy loop; so is any other failure of the API.
Once the eviction has been refused for `timeout` since it was first asked for, the pod is
deleted instead (the same precondition and grace period), whatever its budgets, as the
kubelet's node-pressure eviction stops a pod: a tenant writes its own budgets, and one
that never allows a disruption would keep the pod over its limit for ever. The pod gone
(404, or 409: a newcomer has its name) ends it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tenacity
from kubernetes import client

from enforcer.core import eviction
from enforcer.core.payloads import ObjectReference
from enforcer.core.reasons import Reason
from enforcer.edge import logs
from enforcer.edge.backoff import Backoff
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.kube import (
    Conflict,
    Forbidden,
    KubeError,
    NotFound,
    TooManyRequests,
    delete_pod,
    evict,
)

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)

RETRY_FIRST = 5.0  # seconds before the first retry of a refused eviction, doubling ...
RETRY_MAX = 300.0  # ... up to this
STOP_CHECK = 1.0  # seconds: how soon `stop` is seen
Request = Callable[[client.ApiClient, str, str, str, int], KubeError | None]
"""An eviction or a deletion of the pod (namespace, name, UID), with a grace period."""


def _backoff() -> Backoff:
    wait = tenacity.wait_exponential(multiplier=RETRY_FIRST, max=RETRY_MAX)
    return Backoff(wait + tenacity.wait_random(0, 1))


@dataclass(slots=True)
class _Pending:
    about: ObjectReference  # the pod (and the container it is evicted for)
    why: str  # `eviction.cause`: said in the Event once the API accepts
    grace: int  # seconds its containers get to stop
    since: float | None = None  # when the eviction was first asked for
    refusal: str | None = None  # the last refusal, while the eviction is refused
    forbidden: bool = False  # a refusal by RBAC or a policy, said on the pod once
    backoff: Backoff = field(default_factory=_backoff)


class Evictor(threading.Thread):
    """Makes the pods it is asked to leave, in the background, each until the API accepts:
    an eviction, refused for at most `timeout` (0: none is asked for), then a deletion."""

    def __init__(
        self,
        api: client.ApiClient,
        recorder: EventRecorder,
        unexpected: ErrorCounter,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        requests: tuple[Request, Request] = (evict, delete_pod),
    ) -> None:
        """`requests`: the eviction's and the deletion's."""
        super().__init__(name="evictor", daemon=True)
        self.stop = threading.Event()
        self._api = api
        self._recorder = recorder
        self._timeout = timeout
        self._clock = clock
        self._eviction, self._deletion = requests
        self._pending: dict[str, _Pending] = {}  # pod UID -> its eviction, until done
        self._lock = threading.Lock()
        self._woken = threading.Event()
        self._guard = LoopGuard("evictor", unexpected, log)
        self._forbidden_logged: set[str] = set()  # the verbs RBAC refused, said once each

    def evict(self, about: ObjectReference, why: str, grace: int) -> None:
        """Make the pod `about` names (its namespace, name and UID) leave, its containers
        given `grace` seconds; `why` (`eviction.cause`) is said in the Event on it once the
        API accepts. Never blocks."""
        uid = about.get("uid", "")
        with self._lock:
            if not uid or uid in self._pending:
                return
            self._pending[uid] = _Pending(about, why, grace)
        self._woken.set()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def run(self) -> None:
        while not self.stop.is_set():
            self._woken.clear()
            self._guard.run(self._attempt_due)
            with self._lock:
                due = min((p.backoff.next_attempt for p in self._pending.values()), default=None)
            pause = STOP_CHECK if due is None else min(STOP_CHECK, due - self._clock())
            if pause > 0:
                self._woken.wait(pause)

    def _attempt_due(self) -> None:
        """Each due pod's attempt guarded on its own: a bug one pod trips is counted, and
        that pod tried again after a backoff, while the others are tried as ever (with
        one guard for all, its attempt stayed due, the loop spun on it, and the pods after
        it were never tried)."""
        now = self._clock()
        with self._lock:
            due = [(uid, p) for uid, p in self._pending.items() if p.backoff.ready(now)]
        for uid, pending in due:
            if not self._guard.run(functools.partial(self._settle, uid, pending)):
                pending.backoff.failed(self._clock())

    def _settle(self, uid: str, pending: _Pending) -> None:
        """One attempt; the pod forgotten once it is done with."""
        if self._attempt(pending):
            with self._lock:
                self._pending.pop(uid, None)

    def _attempt(self, pending: _Pending) -> bool:
        """One request; whether the pod is done with (accepted, or the pod gone)."""
        if pending.since is None:
            pending.since = self._clock()
        if self._clock() - pending.since >= self._timeout:
            return self._deleted(pending)
        error = self._request(self._eviction, pending)
        if error is None:
            self._say(pending, "evicted", eviction.evicted(pending.why, pending.grace))
            return True
        if isinstance(error, NotFound):
            return self._gone(pending)
        # A 409 from an eviction is not proof that a newcomer has the name: the eviction
        # also answers it when its budget's status kept changing under it. It is retried as
        # any refusal; the deletion, at the timeout, tells (its UID precondition).
        pending.refusal = str(error)
        now = self._clock()
        deleted_in = pending.since + self._timeout - now
        if deleted_in <= 0:  # refused for long enough, the last try included
            return self._deleted(pending)
        retry_in = pending.backoff.failed(now, most=deleted_in)  # the deletion is not put off
        if isinstance(error, TooManyRequests):
            text = eviction.refused(str(error), retry_in, deleted_in)
            log.warning("pod %s: %s", _named(pending), text)
            self._recorder.record(pending.about, str(Reason.EVICTED), text, True)
        else:
            self._failed(pending, error, retry_in)
        return False

    def _deleted(self, pending: _Pending) -> bool:
        """The pod deleted, whatever its budgets; whether it is done with."""
        error = self._request(self._deletion, pending)
        if error is None:
            since = pending.since if pending.since is not None else self._clock()
            refused_for = self._clock() - since
            refusal = pending.refusal if self._timeout > 0 else None
            text = eviction.deleted(pending.why, refusal, refused_for, pending.grace)
            self._say(pending, "deleted", text)
            return True
        if isinstance(error, (NotFound, Conflict)):
            return self._gone(pending)
        self._failed(pending, error, pending.backoff.failed(self._clock()))
        return False

    def _request(self, request: Request, pending: _Pending) -> KubeError | None:
        about = pending.about
        return request(
            self._api,
            about.get("namespace", ""),
            about.get("name", ""),
            about.get("uid", ""),
            pending.grace,
        )

    def _say(self, pending: _Pending, done: str, text: str) -> None:
        log.warning("pod %s: %s: %s", _named(pending), done, text)
        self._recorder.record(pending.about, str(Reason.EVICTED), text, True)

    @staticmethod
    def _gone(pending: _Pending) -> bool:
        log.info("pod %s: not evicted, it is gone already", _named(pending))
        return True

    def _failed(self, pending: _Pending, error: KubeError, retry_in: float) -> None:
        if isinstance(error, Forbidden):
            if error.verb not in self._forbidden_logged:
                log.error("cannot make pods leave: %s", error, exc_info=logs.detail(error))
                self._forbidden_logged.add(error.verb)
            if not pending.forbidden:  # said on the pod once: it stays out of reach
                pending.forbidden = True
                text = eviction.forbidden(str(error), retry_in)
                self._recorder.record(pending.about, str(Reason.EVICTED), text, True)
            return
        log.warning(
            "pod %s: the request failed (%s); retrying in %.0fs",
            _named(pending),
            error,
            retry_in,
            exc_info=logs.detail(error),
        )


def _named(pending: _Pending) -> str:
    return f"{pending.about.get('namespace')}/{pending.about.get('name')}"
