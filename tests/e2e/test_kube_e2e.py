"""`kube.request`, the one path every API call takes, and the Events the sidecar posts,
against the real API server."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, Counter

from enforcer.core.payloads import ObjectReference
from enforcer.core.reasons import Reason
from enforcer.core.units import POD_UNIT
from enforcer.edge.events import EventRecorder
from enforcer.edge.kube import POD, KubeError, NotFound, call, request
from enforcer.modes.pipeline import Report
from enforcer.modes.sidecar import EventReporter
from enforcer.modes.sidecar_access import RecordedEvents
from tests.helpers import configured, wait_for


@pytest.fixture(scope="module")
def pod(admin: client.ApiClient) -> dict[str, str]:
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": "kube-request"}})
    core.create_namespaced_pod(
        "kube-request",
        {
            "metadata": {"name": "p", "labels": {"app": "x"}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        },
    )
    return {"namespace": "kube-request", "name": "p"}


def test_an_object_comes_back_as_the_json_the_server_sent(
    admin: client.ApiClient, pod: dict[str, str]
) -> None:
    got = request(admin, "GET", POD, params=pod)
    typed = admin.sanitize_for_serialization(
        client.CoreV1Api(admin).read_namespaced_pod("p", "kube-request")
    )
    assert got["metadata"]["uid"] == typed["metadata"]["uid"]
    assert got["spec"]["containers"][0]["name"] == "c"
    assert got["kind"] == "Pod"  # the typed client's models drop nothing we read, nor do we


def test_a_json_patch_is_sent_as_one(admin: client.ApiClient, pod: dict[str, str]) -> None:
    ops = [{"op": "add", "path": "/metadata/labels/patched", "value": "yes"}]
    got = request(admin, "PATCH", POD, params=pod, body=ops)
    assert got["metadata"]["labels"] == {"app": "x", "patched": "yes"}


def test_a_missing_object_is_an_error_that_names_it(
    admin: client.ApiClient, pod: dict[str, str]
) -> None:
    with pytest.raises(KubeError) as raised:
        call(admin, "GET", POD, "pods", params={**pod, "name": "absent"}, deadline=1.0)
    assert str(raised.value) == 'get pods failed: HTTP 404 Not Found: pods "absent" not found'
    assert isinstance(raised.value, NotFound)  # which a caller may expect (a claim not made yet)


def test_reports_become_events_on_the_container_that_they_concern(admin: client.ApiClient) -> None:
    """The sidecar's EventReporter with the real EventRecorder: which Event each report
    makes, pointed at which container, and which reports make none."""
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": "kube-events"}})
    created = core.create_namespaced_pod(
        "kube-events",
        {
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [{"name": "warmup", "image": "busybox"}],
                "containers": [{"name": "trainer", "image": "busybox"}],
            },
        },
    )
    pod = admin.sanitize_for_serialization(created)
    failures = Counter("failures", "test", ["reason"], registry=CollectorRegistry())
    recorder = EventRecorder(admin, "p", "node-1", failures)
    recorder.start()
    settings = configured(
        ["sidecar"],
        {
            "POD_NAME": "p",
            "POD_NAMESPACE": "kube-events",
            "POD_UID": pod["metadata"]["uid"],
            "NODE_NAME": "node-1",
            "VRAM_ENFORCER_LIMITS": "{}",
        },
    )
    reporter = EventReporter(RecordedEvents(recorder, settings), lambda: {}, lambda: pod)
    reporter.report(Report(Reason.ENFORCED, "sent SIGTERM to pid 7", "trainer", 7))
    reporter.report(Report(Reason.NEAR_LIMIT, "warm-up near its limit", "warmup", normal=True))
    reporter.report(Report(Reason.LIMIT_EXCEEDED, "the pod as a whole is over", POD_UNIT))
    reporter.report(Report(Reason.ENFORCED, "pid 7 has exited", "trainer", 7, quiet=True))
    recorder.close(timeout=30)

    def posted() -> dict[str, Any]:
        events = core.list_namespaced_event("kube-events").items
        return {e.message: e for e in events}

    events = wait_for(lambda: len(e := posted()) == 3 and e, what="three Events")
    assert "pid 7 has exited" not in events  # routine news stays in the log
    enforced = events["sent SIGTERM to pid 7"]
    assert (enforced.reason, enforced.type) == ("VRAMEnforced", "Warning")
    assert enforced.involved_object.field_path == "spec.containers{trainer}"
    assert enforced.involved_object.uid == pod["metadata"]["uid"]
    near = events["warm-up near its limit"]
    assert (near.type, near.involved_object.field_path) == ("Normal", "spec.initContainers{warmup}")
    assert events["the pod as a whole is over"].involved_object.field_path is None
    assert failures.labels("api")._value.get() == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pod_in(core: client.CoreV1Api, namespace: str, name: str) -> ObjectReference:
    created = core.create_namespaced_pod(
        namespace,
        {"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}},
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": namespace,
        "name": name,
        "uid": created.metadata.uid,
    }


def test_one_object_cannot_flood_events_and_what_is_kept_is_pruned(
    admin: client.ApiClient,
) -> None:
    """A hostile pod can make its sidecar report as often as it likes, and an agent posts
    about every pod its node ever ran: a burst of 25 per object, then the rest counted as
    spam; and what aggregation keeps is forgotten 10 minutes after its last use."""
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": "kube-spam"}})
    noisy, quiet = _pod_in(core, "kube-spam", "noisy"), _pod_in(core, "kube-spam", "quiet")
    failures = Counter("failures", "test", ["reason"], registry=CollectorRegistry())
    clock = Clock()
    recorder = EventRecorder(admin, "node-1", "node-1", failures, clock=clock)
    recorder.start()
    for i in range(40):
        recorder.record(noisy, "VRAMLimitExceeded", f"over, time {i}", True)
    recorder.record(quiet, "VRAMLimitExceeded", "over once", True)
    assert failures.labels("spam")._value.get() == 15

    def counts() -> dict[str, int]:
        events = core.list_namespaced_event("kube-spam").items
        return {e.involved_object.name: e.count for e in events}

    wait_for(lambda: counts() == {"noisy": 25, "quiet": 1}, what="25 + 1 Events, aggregated")
    assert recorder.remembered == 4  # two buckets, two Events being aggregated
    clock.now += 25 * 300  # long enough for the burst to refill, and past the window
    recorder.record(quiet, "VRAMNearLimit", "near", False)
    wait_for(lambda: recorder.remembered == 2, what="the old entries to be forgotten")
    recorder.close(timeout=30)


def test_a_lasting_fact_is_not_said_again_by_a_restarted_agent(admin: client.ApiClient) -> None:
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": "kube-once"}})
    pod = _pod_in(core, "kube-once", "p")
    failures = Counter("failures", "test", ["reason"], registry=CollectorRegistry())
    for _ in range(2):  # the agent, then the agent restarted
        recorder = EventRecorder(admin, "node-1", "node-1", failures)
        recorder.start()
        recorder.record(pod, "VRAMHardLimit", "hard limit in place: 4 GiB", False, once=True)
        recorder.close(timeout=30)
    recorder = EventRecorder(admin, "node-1", "node-1", failures)
    recorder.start()
    recorder.record(pod, "VRAMHardLimit", "hard limit in place: 8 GiB", False, once=True)
    recorder.close(timeout=30)
    events = sorted((e.message, e.count) for e in core.list_namespaced_event("kube-once").items)
    assert events == [("hard limit in place: 4 GiB", 1), ("hard limit in place: 8 GiB", 1)]
    assert failures.labels("api")._value.get() == 0
