"""Protocol v1: what the agent sends is what AgentLink reads back."""

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.dra import DraObjects
from enforcer.core.model import Activity, Device, ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.core.protocol import (
    USAGE_TAIL,
    PodReply,
    ProtocolError,
    Usage,
    decode_reply,
    encode_error,
    encode_pod,
    encode_reclaim,
    encode_request,
    json_string,
    parse_request,
    usage_head,
    usage_process,
    usage_tail,
)
from enforcer.core.reasons import Reason
from enforcer.core.reclaim import Reclaim, Share


def encode_usage(
    sampled_at: float, devices: tuple[Device, ...], processes: tuple[ProcessUsage, ...]
) -> bytes:
    """A usage reply assembled from the pieces, as the agent assembles it."""
    entries = (
        usage_process(
            p.key.pid, p.key.start_time, json_string(p.device_uuid), p.used_bytes, p.activity
        )
        for p in processes
    )
    return usage_head(sampled_at, devices) + b",".join(entries) + USAGE_TAIL


def test_request_round_trip() -> None:
    assert parse_request(encode_request()).op == "usage"
    assert parse_request(encode_request("subscribe")).op == "subscribe"
    assert parse_request(b'{"op": "usage", "v": 1, "extra": true}\n').op == "usage"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"nope\n", "not JSON"),
        (b"\xff\n", "not JSON"),
        (b"42\n", "a request is a JSON object"),
        (b'{"op":"usage"}\n', "unsupported protocol version None"),
        (b'{"v":"1","op":"usage"}\n', "unsupported protocol version '1'"),
        (b'{"v":1}\n', "unknown op None"),
    ],
)
def test_bad_requests(line: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_request(line)


def test_a_sidecar_may_report_its_own_reasons_and_no_other() -> None:
    """A dry run's would-be enforcement is one of a sidecar's reports; the agent's own
    reasons, and anything else, are not: a process of the pod could forge them."""

    def event(reason: object) -> object:
        line = json.dumps({"v": 1, "op": "event", "reason": reason, "message": "m"})
        return parse_request(line.replace('"m"}', '"m", "warning": true}').encode()).event

    for ours in ("VRAMWouldEnforce", "VRAMEnforced", "VRAMReclaimed", "VRAMAllocationUnknown"):
        assert getattr(event(ours), "reason", None) == ours
    agents = (Reason.SIDECAR_SILENT, Reason.EVICTED, Reason.HARD_LIMIT, Reason.SAMPLING_ONLY)
    for theirs in (*map(str, agents), "VRAMSomethingElse", "Killing", ["VRAMEnforced"], None):
        refused = event(theirs)
        assert isinstance(refused, str) and "is not one a sidecar reports" in refused, refused


def test_usage_reply_round_trip() -> None:
    devices = (
        Device(0, "GPU-a", 'NVIDIA "quoted"', 80, 10, None, reserved_bytes=3),
        Device(0, "MIG-b", "m", 40, None, "GPU-a"),
    )
    procs = (
        ProcessUsage(ProcessKey(7, 123), "GPU-a", 5),
        ProcessUsage(ProcessKey(8, 124), "MIG-b", None),
    )
    line = encode_usage(1700000000.25, devices, procs)
    older = json.loads(line)  # an agent that does not send the driver's reserve
    del older["devices"][0]["reserved_bytes"]
    reply = decode_reply(json.dumps(older).encode())
    assert isinstance(reply, Usage) and reply.sample.devices[0].reserved_bytes is None
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    doc = json.loads(line)
    assert doc["processes"][0] == {
        "pid": 7,
        "start_time": 123,
        "device_uuid": "GPU-a",
        "used_bytes": 5,
    }
    assert decode_reply(line) == Usage(Sample(1700000000.25, devices, procs), {})


def test_utilisation_travels_when_known_and_is_absent_when_not() -> None:
    """`sm` and `mem` are additions to v1: a sidecar that predates them ignores them, and
    one that knows them reads their absence as unknown, never as idle."""
    procs = (
        ProcessUsage(ProcessKey(7, 123), "GPU-a", 5, (), Activity(87, 0)),
        ProcessUsage(ProcessKey(8, 124), "GPU-a", 6, (), None),
    )
    line = encode_usage(1.0, (Device(0, "GPU-a", "m", 80, 11, None),), procs)
    doc = json.loads(line)
    assert (doc["processes"][0]["sm"], doc["processes"][0]["mem"]) == (87, 0)
    assert "sm" not in doc["processes"][1]
    sample = Sample(1.0, (Device(0, "GPU-a", "m", 80, 11, None),), procs)
    assert decode_reply(line) == Usage(sample, {})


def test_error_reply_is_a_source_down() -> None:
    assert decode_reply(encode_error("GPU is lost")) == SourceDown("the agent says: GPU is lost")


def test_only_a_subscriber_asks_for_its_pod() -> None:
    assert parse_request(encode_request("subscribe", pod=True)).pod
    assert not parse_request(encode_request("subscribe")).pod
    assert not parse_request(b'{"v":1,"op":"usage","pod":true}\n').pod  # nothing to push to
    assert not parse_request(b'{"v":1,"op":"subscribe","pod":"yes"}\n').pod


def test_pod_reply_round_trip() -> None:
    pod = {"metadata": {"name": "trainer", "uid": "u"}, "status": {}}
    dra = DraObjects({"c": {"status": {}}}, ({"spec": {"nodeName": "n"}},))
    reply = PodReply(pod, "the API is slow", dra, "forbidden")  # type: ignore[arg-type]
    assert decode_reply(encode_pod(reply)) == reply
    unknown = PodReply(None, "no pod on this node lists container 0123")
    assert decode_reply(encode_pod(unknown)) == unknown
    # a usage reply is never read as a pod, nor a pod as usage
    assert isinstance(decode_reply(encode_pod(PodReply(None, "x"))), PodReply)


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"{",
        b"[]",
        b'{"v":2}',
        b'{"v":1,"devices":[{}],"processes":[]}',
        b'{"v":1,"pod":[]}',
        b'{"v":1,"pod":"trainer"}',
    ],
)
def test_malformed_replies_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(line)


@given(st.binary(max_size=200))
def test_parse_request_raises_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_request(data)


def test_reclaims_travel_with_the_sample_they_were_decided_on() -> None:
    """An addition to v1: a sidecar that predates it ignores the key (and has no ceilings,
    so is never asked)."""
    victim = Share("ml/a/trainer", 2 * 1024**3, 8 * 1024**3, 6 * 1024**3, 100)
    asked = Reclaim("GPU-a", victim, 1024**3, ("ml/b/server",), 1024**2, for_unrequested=True)
    head = usage_head(1.0, (Device(0, "GPU-a", "m", 80, 11, None),))
    line = head + usage_tail([encode_reclaim("c" * 64, asked)], lending=True)
    assert json.loads(line)["reclaims"][0]["container_id"] == "c" * 64
    reply = decode_reply(line)
    assert isinstance(reply, Usage) and reply.reclaims == {"c" * 64: asked} and reply.lending
    # An agent that lends says so in every reply; one that does not (an earlier release)
    # says nothing, and its callers' containers are held to their requests.
    quiet = decode_reply(head + usage_tail([], lending=True))
    assert isinstance(quiet, Usage) and quiet.lending and quiet.reclaims == {}
    assert quiet.lending_dra  # this release decides for DRA allocations too
    assert usage_tail([]) == USAGE_TAIL
    older = decode_reply(head + USAGE_TAIL)
    assert isinstance(older, Usage) and not older.lending
    # The release before DRA ceilings lent to declared limits only: its DRA pods' sidecars
    # must not let a claim borrow, since that agent never asks an allocation back.
    before_dra = decode_reply(head + b'],"lending":true,"reclaims":[]}\n')
    assert isinstance(before_dra, Usage) and before_dra.lending and not before_dra.lending_dra
