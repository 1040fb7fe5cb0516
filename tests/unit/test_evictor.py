"""The agent's evictions: each pod asked for once, a refusal said and retried with backoff."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from enforcer.core.payloads import ObjectReference
from enforcer.edge.eviction import RETRY_FIRST, Evictor
from enforcer.edge.kube import KubeError, NotFound, TooManyRequests
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


class Api:
    """The eviction requests, answered in turn by `replies`."""

    def __init__(self, *replies: KubeError | None) -> None:
        self.replies = list(replies)
        self.asked: list[tuple[str, str, str]] = []

    def __call__(self, api: Any, namespace: str, name: str, uid: str) -> KubeError | None:
        self.asked.append((namespace, name, uid))
        return self.replies.pop(0)


class Recorded:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def record(self, about: object, reason: str, message: str, warning: bool) -> None:
        self.events.append((reason, message))


def evictor(api: Api, recorder: Recorded, now: list[float]) -> Evictor:
    return Evictor(
        cast(Any, None),
        cast("EventRecorder", recorder),
        AgentTelemetry().unexpected.labels("evictor"),
        lambda: now[0],
        api,
    )


def test_a_refused_eviction_is_said_and_retried_after_a_backoff_not_at_once() -> None:
    api, recorder, now = Api(TooManyRequests("HTTP 429: PDB"), None), Recorded(), [100.0]
    agent = evictor(api, recorder, now)
    agent.evict(POD, "why")
    agent.evict(POD, "why")  # asked again meanwhile: one eviction
    agent._attempt_due()
    assert api.asked == [("team", "p", "u")] and agent.pending == 1
    assert recorder.events[0][0] == "VRAMEvicted" and "HTTP 429: PDB" in recorder.events[0][1]
    for _ in range(10):
        agent._attempt_due()  # not due yet: nothing asked
    now[0] += RETRY_FIRST - 0.01
    agent._attempt_due()
    assert len(api.asked) == 1
    now[0] += 2
    agent._attempt_due()
    assert len(api.asked) == 2 and agent.pending == 0
    assert recorder.events[-1] == ("VRAMEvicted", "why")


def test_a_pod_already_gone_is_not_asked_for_again() -> None:
    api, recorder, now = Api(NotFound("gone")), Recorded(), [0.0]
    agent = evictor(api, recorder, now)
    agent.evict(POD, "why")
    agent._attempt_due()
    assert agent.pending == 0 and recorder.events == []
