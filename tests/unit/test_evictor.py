"""The agent's evictions: each pod asked for once, with its policy's grace period; a refusal
said and retried with backoff; a refusal that lasts `--eviction-timeout` ends in a deletion
of the pod, whatever its budgets."""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import pytest

from enforcer.core.payloads import ObjectReference
from enforcer.edge.eviction import RETRY_FIRST, Evictor
from enforcer.edge.kube import Conflict, Forbidden, KubeError, NotFound, TooManyRequests
from enforcer.edge.metrics import AgentTelemetry

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

POD: ObjectReference = {
    "apiVersion": "v1",
    "kind": "Pod",
    "namespace": "team",
    "name": "p",
    "uid": "u",
}
PDB = TooManyRequests("HTTP 429: Cannot evict pod as it would violate the pod's disruption budget")


class Api:
    """The eviction and deletion requests, answered in turn by `evicting` and `deleting`
    (the last answer of each, again and again)."""

    def __init__(
        self, evicting: list[KubeError | None], deleting: list[KubeError | None] | None = None
    ) -> None:
        self.replies = {"evict": evicting, "delete": deleting or [None]}
        self.asked: list[tuple[str, str, str, str, int]] = []

    def _answer(self, verb: str, namespace: str, name: str, uid: str, grace: int) -> Any:
        self.asked.append((verb, namespace, name, uid, grace))
        replies = self.replies[verb]
        return replies.pop(0) if len(replies) > 1 else replies[0]

    def evict(self, api: Any, namespace: str, name: str, uid: str, grace: int) -> KubeError | None:
        return self._answer("evict", namespace, name, uid, grace)  # type: ignore[no-any-return]

    def delete(self, api: Any, namespace: str, name: str, uid: str, grace: int) -> KubeError | None:
        return self._answer("delete", namespace, name, uid, grace)  # type: ignore[no-any-return]

    @property
    def verbs(self) -> list[str]:
        return [verb for verb, *_ in self.asked]


class Recorded:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def record(self, about: object, reason: str, message: str, warning: bool) -> None:
        self.events.append((reason, message))


def evictor(api: Api, recorder: Recorded, now: list[float], timeout: float = 60.0) -> Evictor:
    return Evictor(
        cast(Any, None),
        cast("EventRecorder", recorder),
        AgentTelemetry().unexpected.labels("evictor"),
        timeout,
        lambda: now[0],
        (api.evict, api.delete),
    )


def test_a_refused_eviction_is_said_and_retried_after_a_backoff_not_at_once() -> None:
    api, recorder, now = Api([PDB, None]), Recorded(), [100.0]
    agent = evictor(api, recorder, now)
    agent.evict(POD, "why", 30)
    agent.evict(POD, "why", 30)  # asked again meanwhile: one eviction
    agent._attempt_due()
    assert api.asked == [("evict", "team", "p", "u", 30)] and agent.pending == 1
    reason, text = recorder.events[0]
    assert reason == "VRAMEvicted" and "disruption budget" in text
    assert re.search(r"retrying in [56]s\.", text), text  # 5 s and up to 1 s of jitter
    assert "deleted whatever its PodDisruptionBudgets" in text
    for _ in range(10):
        agent._attempt_due()  # not due yet: nothing asked
    now[0] += RETRY_FIRST - 0.01
    agent._attempt_due()
    assert len(api.asked) == 1
    now[0] += 2
    agent._attempt_due()
    assert api.verbs == ["evict", "evict"] and agent.pending == 0
    assert recorder.events[-1] == (
        "VRAMEvicted",
        "why, so the pod is evicted instead, with a grace period of 30s",
    )


def test_an_eviction_refused_for_the_timeout_ends_in_a_deletion_the_backoff_does_not_delay() -> (
    None
):
    """A budget that allows no disruption refuses for ever: the retries back off (5, 10,
    20 s ...), but the pod is deleted once the refusal has lasted the timeout, not at the
    next retry after it, with the same grace period; the Event says so."""
    api, recorder, now = Api([PDB]), Recorded(), [0.0]
    agent = evictor(api, recorder, now, timeout=30.0)
    agent.evict(POD, "container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit", 7)
    while agent.pending:
        agent._attempt_due()
        now[0] += 0.5
    assert api.verbs[-1] == "delete" and api.verbs.count("delete") == 1
    assert set(api.verbs[:-1]) == {"evict"} and 2 <= len(api.verbs[:-1]) <= 4
    assert api.asked[-1] == ("delete", "team", "p", "u", 7)
    assert 30.0 <= now[0] <= 31.0  # deleted at the timeout, not a backoff later
    reason, text = recorder.events[-1]
    assert reason == "VRAMEvicted" and text.startswith("container 'trainer' uses 5.00 GiB")
    assert "deleted instead, after its eviction was refused for 30s" in text
    assert "(HTTP 429: Cannot evict pod" in text and "grace period of 7s" in text
    assert "as the kubelet's node-pressure eviction stops a pod" in text


def test_with_a_timeout_of_0_the_pod_is_deleted_at_once() -> None:
    api, recorder, now = Api([PDB]), Recorded(), [0.0]
    agent = evictor(api, recorder, now, timeout=0.0)
    agent.evict(POD, "why", 1)
    agent._attempt_due()
    assert api.asked == [("delete", "team", "p", "u", 1)] and agent.pending == 0
    assert "without an eviction asked for first (--eviction-timeout 0)" in recorder.events[0][1]


def test_a_pod_already_gone_or_replaced_under_its_name_is_not_asked_for_again() -> None:
    api, recorder, now = Api([NotFound("gone")]), Recorded(), [0.0]
    agent = evictor(api, recorder, now)
    agent.evict(POD, "why", 5)
    agent._attempt_due()
    assert agent.pending == 0 and recorder.events == []
    for gone in (NotFound("gone"), Conflict("HTTP 409: Precondition failed: UID")):
        api, recorder, now = Api([PDB], [gone]), Recorded(), [0.0]
        agent = evictor(api, recorder, now, timeout=0.0)
        agent.evict(POD, "why", 5)
        agent._attempt_due()
        assert api.verbs == ["delete"] and agent.pending == 0 and recorder.events == []


def test_an_evictions_conflict_is_retried_and_the_deletion_tells_whether_the_pod_is_gone() -> None:
    """The eviction answers 409 when its budget's status kept changing under it, not only
    when a newcomer has the pod's name: it is retried as a refusal, and the deletion at the
    timeout, whose UID precondition is the proof, says whether the pod is gone (found by
    review of issue 42's change: the pod was let go at the first 409)."""
    raced = Conflict("HTTP 409: the PodDisruptionBudget's status changed; retry")
    api, recorder, now = Api([raced], [None]), Recorded(), [0.0]
    agent = evictor(api, recorder, now, timeout=30.0)
    agent.evict(POD, "why", 5)
    agent._attempt_due()
    assert api.verbs == ["evict"] and agent.pending == 1
    while agent.pending:
        now[0] += 0.5
        agent._attempt_due()
    assert api.verbs[-1] == "delete" and "deleted instead" in recorder.events[-1][1]


def test_a_pod_the_agent_may_not_make_leave_is_told_so_once_and_tried_again() -> None:
    """RBAC (or the chart's policy) refuses: the pod stays over its limit out of reach of
    signals, which its Event says, once, naming the refusal; the agent tries again, in case
    its role is mended (found by review of issue 42's change: it was said in the log only)."""
    refused = Forbidden("create", "pods/eviction", "the ClusterRole does not grant it")
    api, recorder, now = Api([refused, refused, None]), Recorded(), [0.0]
    agent = evictor(api, recorder, now)
    agent.evict(POD, "why", 5)
    while agent.pending and now[0] < 60:  # within the timeout: no deletion
        agent._attempt_due()
        now[0] += 0.5
    assert api.verbs == ["evict"] * 3 and agent.pending == 0
    said = [text for _, text in recorder.events]
    assert len([t for t in said if "cannot be made to leave" in t]) == 1, said
    assert "RBAC forbids 'create' on 'pods/eviction'" in said[0]
    assert said[-1].endswith("evicted instead, with a grace period of 5s")


def test_the_evictors_thread_evicts_and_ends_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own loop, not `_attempt_due` called by hand: before, the evictor kept its
    deletion request in `_delete`, which `threading.Thread` calls as the thread ends, and
    every agent's evictor died with a TypeError at shutdown."""
    raised: list[object] = []  # in its run, or (as `_delete` did) after it
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    monkeypatch.setattr(sys, "unraisablehook", lambda args: raised.append(args.exc_value))
    api, recorder = Api([None]), Recorded()
    agent = Evictor(
        cast(Any, None),
        cast("EventRecorder", recorder),
        AgentTelemetry().unexpected.labels("evictor"),
        60.0,
        requests=(api.evict, api.delete),
    )
    agent.start()
    agent.evict(POD, "why", 5)
    deadline = time.monotonic() + 10
    while agent.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.stop.set()
    agent.join(10)
    assert api.verbs == ["evict"] and not agent.is_alive()
    assert not raised, raised


def test_a_bug_one_pod_trips_is_retried_after_a_backoff_and_the_others_are_evicted() -> None:
    """Before, one guard covered every due pod: the pod whose request raised stayed due,
    the loop tried it again at once, for ever, and the pods after it were never tried."""
    api, recorder, now = Api([None]), Recorded(), [0.0]
    tried: list[str] = []

    def evict(api_: Any, namespace: str, name: str, uid: str, grace: int) -> KubeError | None:
        tried.append(uid)
        if uid == "bad":
            raise ValueError("a bug in this pod's request")
        return api.evict(api_, namespace, name, uid, grace)

    agent = Evictor(
        cast(Any, None),
        cast("EventRecorder", recorder),
        AgentTelemetry().unexpected.labels("evictor"),
        60.0,
        lambda: now[0],
        (evict, api.delete),
    )
    agent.evict({**POD, "uid": "bad"}, "why", 5)
    agent.evict(POD, "why", 5)
    agent._attempt_due()
    agent._attempt_due()  # at the same moment: the bad pod is not due again yet
    assert tried == ["bad", "u"] and agent.pending == 1
    now[0] += RETRY_FIRST * 2
    agent._attempt_due()
    assert tried == ["bad", "u", "bad"]
