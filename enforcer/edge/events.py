"""Kubernetes Events: aggregated like client-go's recorder, rate-limited per object, never
blocking.

An Event is helpful but auxiliary: failing to post one is counted and logged, and never
delays a kill. Three things keep the Events of a node (the agent posts about every pod of
it) and of a hostile pod (whose tenant can make its sidecar report as often as it likes)
from growing without bound or flooding the API server:

- A repeat (same object, container, reason and type) within ten minutes patches the
  Event's count, lastTimestamp and message instead of creating one, as client-go does; what
  is remembered for that is forgotten ten minutes after its last use.
- Each object may post a burst of 25 Events, then one per 5 minutes (client-go's
  EventSourceObjectSpamFilter); the rest are dropped at once, counted as `spam`, before they
  take a place in the queue that other objects' Events need. A sidecar's reports, which
  the agent posts on the sidecar's pod (`from_sidecar`), have a budget of their own: a
  tenant that floods its reports spends none of the agent's own Events about its pod (an
  enforcement, an eviction), which are said all the same.
- An Event that says a lasting fact about an object (`once`: the agent's VRAMHardLimit) is
  posted only if the API does not already hold it, so a restarted agent does not say it
  again about every pod of its node.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from enforcer.core import messages
from enforcer.core.payloads import Event, ObjectReference
from enforcer.edge import logs
from enforcer.edge.guard import LoopGuard
from enforcer.edge.kube import COMPONENT, EVENTS, Forbidden, KubeError, call

log = logging.getLogger(__name__)

WINDOW = 600.0  # a repeat within this long bumps the Event's count (client-go's window)
SPAM_BURST = 25  # client-go's EventSourceObjectSpamFilter: a burst per object, ...
SPAM_REFILL = 300.0  # ... then one Event per this many seconds
QUEUED = 1000  # Events waiting to be posted; past this, new ones are dropped
_MAX_OBJECTS = 10_000  # buckets kept; the least recently used full ones go first
MESSAGE_CHARS = 1024  # of an Event's message: the bound events.k8s.io sets on a note

_Key = tuple[str, str, str, bool]  # object uid, fieldPath, reason, warning
_Item = tuple[ObjectReference, str, str, bool, bool]


@dataclass(slots=True)
class _Sent:
    name: str
    count: int
    at: float  # on the monotonic clock
    message: str


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class EventRecorder(threading.Thread):
    """`record()` only checks the object's rate and queues; a background thread posts."""

    def __init__(
        self,
        api: client.ApiClient,
        instance: str,
        host: str,
        failures: Any,
        deadline: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="event-recorder", daemon=True)
        self._api = api
        self._instance = instance  # reportingInstance: the sidecar's pod, the agent's node
        self._host = host
        self._failures = failures
        self._deadline = deadline
        self._clock = clock
        # Called with each Event's object and reason as it is queued, once set (before the
        # threads start): the agent keeps a pod's last enforcement as its condition
        # (`modes/last_enforcement.py`), made after the recorder, as the pod watch is.
        self.told: Callable[[ObjectReference, str], None] | None = None
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=QUEUED)
        self._sent: OrderedDict[_Key, _Sent] = OrderedDict()  # least recently used first
        # (object, from a sidecar's report) -> its budget
        self._buckets: OrderedDict[tuple[str, bool], _Bucket] = OrderedDict()
        self._lock = threading.Lock()  # the buckets: record() runs in any thread
        self._forbidden_logged = False
        self._list_forbidden_logged = False

    def record(
        self,
        about: ObjectReference,
        reason: str,
        message: str,
        warning: bool,
        once: bool = False,
        from_sidecar: bool = False,
    ) -> None:
        """Queue an Event about `about` (a pod, with a fieldPath for one of its containers).
        `once`: a lasting fact, not posted again if the API already holds it. `from_sidecar`:
        a sidecar's report, whose budget on its pod is not the agent's own Events'. Told
        (the pod's condition): the agent's own whatever their budget, so that no flood
        hides an enforcement; a sidecar's report only within its budget, so that a flood of
        forged ones is not a flood of status patches."""
        allowed = self._allowed((about.get("uid", "") or about.get("name", ""), from_sidecar))
        if self.told is not None and (allowed or not from_sidecar):
            self.told(about, reason)
        if not allowed:
            self._failures.labels("spam").inc()
            return
        try:
            self._queue.put_nowait((about, reason, message, warning, once))
        except queue.Full:
            self._failures.labels("dropped").inc()

    def _allowed(self, obj: tuple[str, bool]) -> bool:
        """A token of the object's bucket, if it has one left."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.pop(obj, None) or _Bucket(SPAM_BURST, now)
            bucket.tokens = min(SPAM_BURST, bucket.tokens + (now - bucket.at) / SPAM_REFILL)
            bucket.at = now
            allowed = bucket.tokens >= 1
            if allowed:
                bucket.tokens -= 1
            self._buckets[obj] = bucket  # the most recently used, last
            while len(self._buckets) > _MAX_OBJECTS:
                self._buckets.popitem(last=False)
            self._forget_full_buckets(now)
        return allowed

    def _forget_full_buckets(self, now: float) -> None:
        """A bucket that has filled up again is the same as none: drop those at the front."""
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if oldest.tokens + (now - oldest.at) / SPAM_REFILL < SPAM_BURST:
                return
            self._buckets.popitem(last=False)

    @property
    def remembered(self) -> int:
        """Objects and Events held for rate limits and aggregation (bounded, and pruned)."""
        return len(self._buckets) + len(self._sent)

    def close(self, timeout: float = 2.0) -> None:
        """Let queued Events go out for up to `timeout`, then stop."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self.join(timeout)

    def run(self) -> None:
        guard = LoopGuard("event-recorder", self._failures.labels("unexpected"), log)
        while (item := self._queue.get()) is not None:
            guard.run(functools.partial(self._post, item))

    def _post(self, item: _Item) -> None:
        """One Event; an API failure is counted, a bug is the guard's (counted as
        `unexpected`), and the next Event goes on either way."""
        try:
            self._send(*item)
        except Forbidden as exc:
            self._failures.labels("forbidden").inc()
            if not self._forbidden_logged:
                log.error("cannot post Events: %s", exc, exc_info=logs.detail(exc))
                self._forbidden_logged = True
        except KubeError as exc:
            self._failures.labels("api").inc()
            log.warning("an Event was not posted: %s", exc, exc_info=logs.detail(exc))

    def _send(
        self, about: ObjectReference, reason: str, message: str, warning: bool, once: bool
    ) -> None:
        message = messages.one_line(message, MESSAGE_CHARS)  # may carry a pod's own text
        now = self._clock()
        self._forget_old(now)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        namespace = about.get("namespace") or "default"
        key = (about.get("uid", ""), about.get("fieldPath", ""), reason, warning)
        sent = self._sent.pop(key, None)
        if once:
            sent = sent or self._existing(about, reason, message)
            if sent is not None and sent.message == message:
                sent.at = now  # a lasting fact, already said (maybe by an earlier run)
                self._sent[key] = sent
                return
        if sent is not None:
            sent.count += 1
            ops = [
                {"op": "replace", "path": "/count", "value": sent.count},
                {"op": "replace", "path": "/lastTimestamp", "value": stamp},
                {"op": "replace", "path": "/message", "value": message},
            ]
            try:
                call(
                    self._api,
                    "PATCH",
                    EVENTS + "/{name}",
                    "events",
                    body=ops,
                    params={"namespace": namespace, "name": sent.name},
                    deadline=self._deadline,
                )
            except KubeError:
                sent = None  # the Event is gone (expired, deleted): start a new one
            else:
                sent.at, sent.message = now, message
        if sent is None:
            sent = self._create(about, reason, message, warning, stamp, now)
        self._sent[key] = sent  # the most recently used, last

    def _create(
        self,
        about: ObjectReference,
        reason: str,
        message: str,
        warning: bool,
        stamp: str,
        now: float,
    ) -> _Sent:
        namespace = about.get("namespace") or "default"  # a Node's Events live in default
        body: Event = {
            "metadata": {
                "generateName": f"{about.get('name', COMPONENT)}.",
                "namespace": namespace,
            },
            "involvedObject": about,
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self._host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        created: Event = call(
            self._api,
            "POST",
            EVENTS,
            "events",
            body=body,
            params={"namespace": namespace},
            deadline=self._deadline,
        )
        return _Sent(str((created.get("metadata") or {}).get("name")), 1, now, message)

    def _existing(self, about: ObjectReference, reason: str, message: str) -> _Sent | None:
        """The API's Event of ours that already says `message` about the object, if any."""
        selector = f"involvedObject.uid={about.get('uid', '')},reason={reason},source={COMPONENT}"
        try:
            found = call(
                self._api,
                "GET",
                EVENTS,
                "events",
                deadline=self._deadline,
                params={"namespace": about.get("namespace", "")},
                query={"fieldSelector": selector},
            )
        except Forbidden as exc:  # RBAC of an older release: say it, rather than not at all
            if not self._list_forbidden_logged:
                log.warning(
                    "cannot tell whether an Event was already posted: %s",
                    exc,
                    exc_info=logs.detail(exc),
                )
                self._list_forbidden_logged = True
            return None
        for event in found.get("items") or ():
            if event.get("message") == message:
                name = str((event.get("metadata") or {}).get("name"))
                return _Sent(name, int(event.get("count") or 1), self._clock(), message)
        return None

    def _forget_old(self, now: float) -> None:
        """What was sent more than WINDOW ago can no longer be aggregated: forget it."""
        while self._sent and now - next(iter(self._sent.values())).at >= WINDOW:
            self._sent.popitem(last=False)
