"""The agent's writer of pods' conditions (issue 43, item 5) against a stand-in of the API
server: the latest condition per pod, a bound on what waits, and each failure counted and
never raised (a condition is auxiliary: it never holds up enforcement)."""

from __future__ import annotations

import logging

import pytest
from kubernetes import client

from enforcer.core.payloads import ObjectReference
from enforcer.edge import pod_conditions
from enforcer.edge.kube import api_client
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.pod_conditions import ConditionWriter
from tests.helpers import wait_for
from tests.pods_api import PodsApi, serving


def about(name: str) -> ObjectReference:
    return {"apiVersion": "v1", "kind": "Pod", "namespace": "team", "name": name, "uid": name}


def said(reason: str) -> dict[str, str]:
    return {"type": "vram-enforcer.io/Enforced", "status": "True", "reason": reason}


def writer_of(api: PodsApi, telemetry: AgentTelemetry) -> ConditionWriter:
    configuration = client.Configuration()
    configuration.host = api.url
    return ConditionWriter(api_client(configuration), telemetry.condition_failures, deadline=1.0)


def failed(telemetry: AgentTelemetry, reason: str) -> float | None:
    return telemetry.registry.get_sample_value(
        "vram_enforcer_conditions_failed_total", {"reason": reason}
    )


def test_the_latest_condition_of_a_pod_is_written_once_and_the_others_wait_their_turn() -> None:
    telemetry = AgentTelemetry()
    with serving([]) as api:
        writer = writer_of(api, telemetry)
        writer.set(about("a"), lambda: said("VRAMWouldEnforce"))
        writer.set(about("b"), lambda: said("VRAMReclaimed"))
        writer.set(about("a"), lambda: said("VRAMEnforced"))  # replaces a's, in its place
        writer.set(about("c"), lambda: None)  # nothing to say: nothing written
        assert writer.waiting == 3
        writer.start()
        wait_for(lambda: len(api.patches) == 2 and writer.waiting == 0, what="two patches")
        writer.stop.set()
        writer.join(5)
    assert [(path, body["status"]["conditions"][0]["reason"]) for path, _, body in api.patches] == [
        ("/api/v1/namespaces/team/pods/a/status", "VRAMEnforced"),
        ("/api/v1/namespaces/team/pods/b/status", "VRAMReclaimed"),
    ]
    assert {kind for _, kind, _ in api.patches} == {"application/strategic-merge-patch+json"}
    assert api.patches[0][2]["metadata"] == {"uid": "a"}
    assert not writer.is_alive()
    for reason in pod_conditions.FAILURES:  # each at 0 from the start
        assert failed(telemetry, reason) == 0


def test_what_waits_is_bounded_and_the_rest_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pod_conditions, "QUEUED", 3)
    telemetry = AgentTelemetry()
    with serving([]) as api:
        writer = writer_of(api, telemetry)
        for name in "abcd":
            writer.set(about(name), lambda: said("VRAMEnforced"))
        writer.set(about("a"), lambda: said("VRAMEvicted"))  # a pod that waits: replaced
    assert writer.waiting == 3
    assert failed(telemetry, "dropped") == 1


@pytest.mark.parametrize(("code", "reason"), [(403, "forbidden"), (404, "gone"), (422, "api")])
def test_a_refusal_is_counted_and_the_writer_goes_on(
    code: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    telemetry = AgentTelemetry()
    with serving([]) as api, caplog.at_level(logging.INFO, "enforcer.edge.pod_conditions"):
        api.patch_status = code
        writer = writer_of(api, telemetry)
        writer.start()
        for name in "ab":
            writer.set(about(name), lambda: said("VRAMEnforced"))
        wait_for(lambda: failed(telemetry, reason) == 2, what="both failures counted")
        writer.stop.set()
        writer.join(5)
    if code == 403:  # said once, not for every pod
        assert sum("cannot set pods' conditions" in r.message for r in caplog.records) == 1
