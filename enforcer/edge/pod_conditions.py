"""The agent's condition on a pod (`core/last_enforcement.py`), written in the background.

Like an Event, the condition is helpful but auxiliary: `set()` never blocks and never
fails, and a failure to write it is counted (`vram_enforcer_conditions_failed_total`) and
logged, never delaying a kill. What waits is bounded: one condition per pod (a newer one
replaces the one still waiting: the latest enforcement is what the pod keeps), and at most
QUEUED pods; past that, the newcomer is dropped and counted.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kubernetes import client

from enforcer.core.last_enforcement import status_patch
from enforcer.core.payloads import ObjectReference
from enforcer.edge import logs
from enforcer.edge.guard import LoopGuard
from enforcer.edge.kube import (
    POD_STATUS,
    STRATEGIC_MERGE_PATCH,
    Forbidden,
    KubeError,
    NotFound,
    call,
)

log = logging.getLogger(__name__)

STOP_CHECK = 1.0  # seconds between looks at `stop` while nothing waits
QUEUED = 1000  # pods whose condition waits to be written; past this, new ones are dropped
FAILURES = ("api", "forbidden", "dropped", "gone", "unexpected")  # each at 0 from the start

# The condition is made on the writer's thread, not the caller's: a tenant whose sidecar
# reports as often as it likes costs the caller a dict entry, and a bug in the making is
# the writer's guard's.
Build = Callable[[], dict[str, str] | None]
_Item = tuple[ObjectReference, Build]


class ConditionWriter(threading.Thread):
    """`set()` only keeps the pod's latest condition; a background thread patches it."""

    def __init__(self, api: client.ApiClient, failures: Any, deadline: float = 30.0) -> None:
        """`failures`: a counter labelled by reason (FAILURES)."""
        super().__init__(name="condition-writer", daemon=True)
        self._api = api
        self._failures = failures
        self._deadline = deadline
        self._waiting: OrderedDict[str, _Item] = OrderedDict()  # pod UID -> its latest
        self._lock = threading.Lock()
        self._woken = threading.Event()
        self.stop = threading.Event()
        self._forbidden_logged = False
        for reason in FAILURES:
            failures.labels(reason)

    def set(self, pod: ObjectReference, build: Build) -> None:
        """Write the condition `build` makes (None: none) on the pod `pod` names (its
        namespace, name and UID), replacing any of that pod's still waiting. Never blocks."""
        uid = pod.get("uid", "")
        if not uid:
            return
        with self._lock:
            if uid not in self._waiting and len(self._waiting) >= QUEUED:
                self._failures.labels("dropped").inc()
                return
            self._waiting[uid] = (pod, build)
        self._woken.set()

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def run(self) -> None:
        """Until `stop`: what waits is written, oldest pod first, then the thread sleeps
        until woken (or STOP_CHECK, to see its stop)."""
        guard = LoopGuard("condition-writer", self._failures.labels("unexpected"), log)
        while not self.stop.is_set():
            self._woken.wait(STOP_CHECK)
            self._woken.clear()
            while not self.stop.is_set() and (item := self._next()) is not None:
                guard.run(functools.partial(self._write, *item))

    def _next(self) -> _Item | None:
        with self._lock:
            return self._waiting.popitem(last=False)[1] if self._waiting else None

    def _write(self, pod: ObjectReference, build: Build) -> None:
        """One patch; an API failure is counted and logged, and the next pod goes on."""
        condition = build()
        if condition is None:
            return
        named = f"{pod.get('namespace')}/{pod.get('name')}"
        try:
            call(
                self._api,
                "PATCH",
                POD_STATUS,
                "pods/status",
                body=status_patch(pod.get("uid", ""), condition),
                params={"namespace": pod.get("namespace", ""), "name": pod.get("name", "")},
                deadline=self._deadline,
                patch=STRATEGIC_MERGE_PATCH,
            )
        except Forbidden as exc:
            self._failures.labels("forbidden").inc()
            if not self._forbidden_logged:
                log.error("cannot set pods' conditions: %s", exc, exc_info=logs.detail(exc))
                self._forbidden_logged = True
        except NotFound:
            self._failures.labels("gone").inc()
            log.info("pod %s: its condition was not set, it is gone", named)
        except KubeError as exc:
            self._failures.labels("api").inc()
            log.warning(
                "pod %s: its condition was not set: %s", named, exc, exc_info=logs.detail(exc)
            )
