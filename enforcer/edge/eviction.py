"""The node agent's evictions: a pod over its VRAM limit that the kernel will not let the
agent signal (EPERM) is evicted through the API, as the kubelet evicts a pod it cannot
hold to its memory (policy/v1 Eviction, so that a PodDisruptionBudget is obeyed).

`evict()` only queues, and never blocks the sampler's pass that asks for it; this thread
makes the requests. A pod is asked for once: a repeat while its eviction is pending is
ignored. A refusal (HTTP 429: a PodDisruptionBudget does not allow it now) is said in an
Event on the pod and tried again after a backoff that grows to RETRY_MAX, never in a busy
loop; so is any other failure of the API. The pod gone (404) ends it.
"""

from __future__ import annotations

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
from enforcer.edge.kube import Forbidden, KubeError, NotFound, TooManyRequests, evict

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

log = logging.getLogger(__name__)

RETRY_FIRST = 5.0  # seconds before the first retry of a refused eviction, doubling ...
RETRY_MAX = 300.0  # ... up to this
STOP_CHECK = 1.0  # seconds: how soon `stop` is seen
Evict = Callable[[client.ApiClient, str, str, str], KubeError | None]


def _backoff() -> Backoff:
    wait = tenacity.wait_exponential(multiplier=RETRY_FIRST, max=RETRY_MAX)
    return Backoff(wait + tenacity.wait_random(0, 1))


@dataclass(slots=True)
class _Pending:
    about: ObjectReference  # the pod (and the container it is evicted for)
    message: str
    backoff: Backoff = field(default_factory=_backoff)


class Evictor(threading.Thread):
    """Evicts the pods it is asked to, in the background, each until the API accepts it."""

    def __init__(
        self,
        api: client.ApiClient,
        recorder: EventRecorder,
        unexpected: ErrorCounter,
        clock: Callable[[], float] = time.monotonic,
        request: Evict = evict,
    ) -> None:
        super().__init__(name="evictor", daemon=True)
        self.stop = threading.Event()
        self._api = api
        self._recorder = recorder
        self._clock = clock
        self._request = request
        self._pending: dict[str, _Pending] = {}  # pod UID -> its eviction, until done
        self._lock = threading.Lock()
        self._woken = threading.Event()
        self._guard = LoopGuard("evictor", unexpected, log)
        self._forbidden_logged = False

    def evict(self, about: ObjectReference, message: str) -> None:
        """Evict the pod `about` names (its namespace, name and UID); `message` says why,
        in the Event on it once the API accepts. Never blocks."""
        uid = about.get("uid", "")
        with self._lock:
            if not uid or uid in self._pending:
                return
            self._pending[uid] = _Pending(about, message)
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
        now = self._clock()
        with self._lock:
            due = [(uid, p) for uid, p in self._pending.items() if p.backoff.ready(now)]
        for uid, pending in due:
            if self._attempt(pending):
                with self._lock:
                    self._pending.pop(uid, None)

    def _attempt(self, pending: _Pending) -> bool:
        """One request; whether the pod's eviction is done with (accepted, or the pod gone)."""
        about = pending.about
        named = f"{about.get('namespace')}/{about.get('name')}"
        error = self._request(
            self._api, about.get("namespace", ""), about.get("name", ""), about.get("uid", "")
        )
        if error is None:
            log.warning("pod %s: evicted: %s", named, pending.message)
            self._recorder.record(about, str(Reason.EVICTED), pending.message, True)
            return True
        if isinstance(error, NotFound):
            log.info("pod %s: not evicted, it is gone already", named)
            return True
        retry_in = pending.backoff.failed(self._clock())
        if isinstance(error, TooManyRequests):
            text = eviction.refused(str(error), retry_in)
            log.warning("pod %s: %s", named, text)
            self._recorder.record(about, str(Reason.EVICTED), text, True)
        elif isinstance(error, Forbidden):
            if not self._forbidden_logged:
                log.error("cannot evict pods: %s", error, exc_info=logs.detail(error))
                self._forbidden_logged = True
        else:
            log.warning(
                "pod %s: the eviction failed (%s); retrying in %.0fs",
                named,
                error,
                retry_in,
                exc_info=logs.detail(error),
            )
        return False
