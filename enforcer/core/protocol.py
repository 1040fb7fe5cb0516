"""The agent's usage protocol, version 1: newline-delimited JSON over a Unix socket.

Pure encoding and decoding, shared by the agent (server) and `AgentLink` (client), so
that both sides agree by construction. See docs/agent-protocol.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from enforcer.core.dra import DraObjects
from enforcer.core.model import Activity, Device, ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.core.payloads import Pod
from enforcer.core.reasons import FROM_SIDECAR
from enforcer.core.reclaim import Reclaim, Share
from enforcer.core.sidecar_report import FAMILIES, SidecarReport, parse_report

VERSION = 1
# Where the agent finds each sidecar: a socket in the sidecar's own filesystem, which the
# agent connects to through /proc/<pid>/root (the pod needs no hostPath). Its directory is
# an emptyDir that only the sidecar mounts.
SIDECAR_SOCKET_DIR = "/run/vram-enforcer"
SIDECAR_SOCKET = f"{SIDECAR_SOCKET_DIR}/sidecar.sock"
# Beside it: the allocation gate's second holder of the pod's listener fds (`gate_holder`).
GATE_HOLDER_SOCKET = f"{SIDECAR_SOCKET_DIR}/gate-holder.sock"
MAX_REQUEST_BYTES = 4096
OPS = ("usage", "subscribe", "event", "report")
_CONTAINER = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class ProtocolError(ValueError):
    """A request or reply that does not follow the protocol; the message says how."""


@dataclass(frozen=True, slots=True)
class EventRequest:
    """A sidecar's report, for the agent to post as an Event on the caller's own pod (about
    `container` when it is one of that pod's). The agent answers nothing: the request
    travels on the subscription, whose every reply a client reads as usage or its pod."""

    reason: str
    message: str
    warning: bool
    container: str | None = None


@dataclass(frozen=True, slots=True)
class Request:
    op: str
    challenge: str | None = None  # the answer to the agent's challenge, when it sent one
    pod: bool = False  # a subscriber that also wants its own pod, pushed when it changes
    event: EventRequest | str | None = None  # op "event": the report, or what is wrong in it
    report: SidecarReport | str | None = None  # op "report": the counts, or what is wrong


@dataclass(frozen=True, slots=True)
class Challenge:
    """The agent cannot tell from the kernel alone who connected (no SO_PEERPIDFD): the
    caller is to send its request again with this challenge, and is identified by that."""

    nonce: str
    message: str


def parse_request(line: bytes) -> Request:
    try:
        doc = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProtocolError('not JSON; send one line like {"v": 1, "op": "usage"}') from None
    if not isinstance(doc, dict):
        raise ProtocolError('a request is a JSON object like {"v": 1, "op": "usage"}')
    if doc.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {doc.get('v')!r}; this agent speaks v1")
    op = doc.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; supported: {', '.join(OPS)}")
    challenge = doc.get("challenge")
    wants_pod = op == "subscribe" and doc.get("pod") is True
    event = _event(doc) if op == "event" else None
    report = parse_report(doc) if op == "report" else None
    return Request(op, challenge if isinstance(challenge, str) else None, wants_pod, event, report)


def _event(doc: dict[str, Any]) -> EventRequest | str:
    """The report in an event request, or what is wrong with it (never an exception: the
    agent does not answer event requests, it counts and drops bad ones)."""
    reason, message = doc.get("reason"), doc.get("message")
    warning, container = doc.get("warning"), doc.get("container")
    if not isinstance(reason, str) or reason not in FROM_SIDECAR:
        known = ", ".join(sorted(FROM_SIDECAR))
        return f"reason {reason!r} is not one a sidecar reports ({known})"
    if not isinstance(message, str) or not message:
        return "message must be a non-empty string"
    if not isinstance(warning, bool):
        return f"warning {warning!r} is not true or false"
    if container is not None and (
        not isinstance(container, str) or not _CONTAINER.fullmatch(container)
    ):
        return f"container {container!r} is not a container name"
    return EventRequest(reason, message, warning, container)


def encode_event(event: EventRequest) -> bytes:
    doc = {
        "v": VERSION,
        "op": "event",
        "reason": event.reason,
        "message": event.message,
        "warning": event.warning,
        "container": event.container,
    }
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def encode_report(report: SidecarReport) -> bytes:
    """A sidecar's counts (`core/sidecar_report.py`), which the agent serves as its pod's
    metrics; never answered, as an event is not."""
    doc: dict[str, object] = {"v": VERSION, "op": "report"}
    doc.update({name: dict(report.family(name)) for name in FAMILIES})
    doc["ticks"], doc["tick_seconds"] = report.ticks, round(report.tick_seconds, 6)
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def encode_request(op: str = "usage", challenge: str | None = None, pod: bool = False) -> bytes:
    doc: dict[str, object] = {"v": VERSION, "op": op}
    if challenge is not None:
        doc["challenge"] = challenge
    if pod:
        doc["pod"] = True
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def encode_error(message: str) -> bytes:
    return json.dumps({"v": VERSION, "error": message}, separators=(",", ":")).encode() + b"\n"


def encode_challenge(challenge: Challenge) -> bytes:
    """An error reply (so that a client that does not know challenges reports it) that
    carries the challenge."""
    doc = {"v": VERSION, "error": challenge.message, "challenge": challenge.nonce}
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def usage_head(sampled_at: float, devices: Iterable[Device]) -> bytes:
    """A usage reply up to its process list. The agent assembles a reply from the pieces
    (head, one `usage_process` per process, `USAGE_TAIL`) once per sample and namespace."""
    listed = [
        {
            "index": d.index,
            "uuid": d.uuid,
            "name": d.name,
            "total_bytes": d.total_bytes,
            "used_bytes": d.used_bytes,
            "parent_uuid": d.parent_uuid,
            "reserved_bytes": d.reserved_bytes,
        }
        for d in devices
    ]
    return b'{"v":%d,"sampled_at":%s,"devices":%s,"processes":[' % (
        VERSION,
        _json(sampled_at),
        _json(listed),
    )


def usage_process(
    pid: int,
    start_time: int,
    device_json: bytes,
    used_bytes: int | None,
    activity: Activity | None = None,
) -> bytes:
    """One entry of a usage reply's process list; `device_json` is `json_string(uuid)`.
    `sm` and `mem` (utilisation, percent) are left out when not known.

    Hand-formatted: the agent encodes every process for every namespace on each sample.
    """
    used = b"null" if used_bytes is None else b"%d" % used_bytes
    busy = (
        b""
        if activity is None
        else b',"sm":%d,"mem":%d' % (activity.sm_percent, activity.memory_percent)
    )
    return b'{"pid":%d,"start_time":%d,"device_uuid":%s,"used_bytes":%s%s}' % (
        pid,
        start_time,
        device_json,
        used,
        busy,
    )


def json_string(text: str) -> bytes:
    return _json(text)


USAGE_TAIL = b"]}\n"


@dataclass(frozen=True, slots=True)
class Usage:
    """A usage reply: the sample, and the reclaims the agent asks of the caller's pod
    (container ID -> what to take back where, and why)."""

    sample: Sample
    reclaims: dict[str, Reclaim]
    # The agent decides reclaims (a release that lends): only then may a container borrow
    # above its request, since only then is it ever asked to give the memory back. With
    # `lending_dra`, it decides them for DRA allocations too (earlier releases did not).
    lending: bool = False
    lending_dra: bool = False


def encode_reclaim(container_id: str, r: Reclaim) -> bytes:
    """One entry of a usage reply's `reclaims`: a container of the caller's pod is to give
    back what it lent above its request on a GPU. Ends the reply in place of `USAGE_TAIL`
    (`usage_tail`)."""
    v = r.victim
    return _json(
        {
            "container_id": container_id,
            "gpu": r.gpu,
            "unit": v.unit,
            "request": v.request,
            "ceiling": v.ceiling,
            "used": v.used,
            "priority": v.priority,
            "shortfall": r.shortfall,
            "owed_to": list(r.owed_to),
            "free": r.free,
            "for_unrequested": r.for_unrequested,
        }
    )


def usage_tail(reclaims: Iterable[bytes], lending: bool = False) -> bytes:
    """The end of a usage reply: with `lending`, the agent says that it decides reclaims,
    for declared limits and DRA allocations alike, and lists those of the caller's pod."""
    if not lending:
        return USAGE_TAIL
    return b'],"lending":true,"lending_dra":true,"reclaims":[%s]}\n' % b",".join(reclaims)


def _reclaim(d: dict[str, Any]) -> tuple[str, Reclaim]:
    victim = Share(
        str(d["unit"]),
        int(d["request"]),
        int(d["ceiling"]),
        int(d["used"]),
        int(d.get("priority", 0)),
    )
    owed = tuple(str(u) for u in d["owed_to"])
    reclaim = Reclaim(
        str(d["gpu"]), victim, int(d["shortfall"]), owed, int(d["free"]), bool(d["for_unrequested"])
    )
    return str(d["container_id"]), reclaim


@dataclass(frozen=True, slots=True)
class PodReply:
    """The caller's own pod, as the agent's watch of its node last saw it.

    `pod` is None while the agent knows of no pod on its node whose status lists the
    caller's container (a pod just started: the kubelet has not reported it yet), and
    `problem` says so. `problem` is also set when the pod may be out of date (the agent
    cannot watch the API just now), with the last pod seen kept. `dra` is the pod's
    ResourceClaims and its node's ResourceSlices, when it has claims and the agent reads
    DRA; `dra_problem` says why they could not be read (the last good read is kept)."""

    pod: Pod | None
    problem: str | None = None
    dra: DraObjects | None = None
    dra_problem: str | None = None


def encode_pod(reply: PodReply) -> bytes:
    doc: dict[str, object] = {"v": VERSION, "pod": reply.pod}
    if reply.problem is not None:
        doc["pod_problem"] = reply.problem
    if reply.dra is not None:
        doc["claims"], doc["slices"] = reply.dra.claims, list(reply.dra.slices)
    if reply.dra_problem is not None:
        doc["dra_problem"] = reply.dra_problem
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _pod_reply(doc: dict[str, Any]) -> PodReply:
    pod, claims, slices = doc["pod"], doc.get("claims"), doc.get("slices")
    if pod is not None and not isinstance(pod, dict):
        raise TypeError("the pod is not a JSON object")
    dra = None
    if isinstance(claims, dict) and isinstance(slices, list):
        dra = DraObjects(
            {str(k): v for k, v in claims.items() if isinstance(v, dict)},
            tuple(s for s in slices if isinstance(s, dict)),
        )
    problem, dra_problem = doc.get("pod_problem"), doc.get("dra_problem")
    return PodReply(
        cast(Pod | None, pod),
        None if problem is None else str(problem),
        dra,
        None if dra_problem is None else str(dra_problem),
    )


def decode_reply(line: bytes) -> Usage | SourceDown | Challenge | PodReply:
    """A reply as the client sees it: a sample (with the reclaims asked of the caller's
    pod), the agent's error as `SourceDown`, a challenge to answer, or (to a subscriber
    that asked for it) its pod."""
    try:
        doc = json.loads(line)
        if doc.get("v") != VERSION:
            raise ProtocolError(f"the agent speaks protocol version {doc.get('v')!r}, not v1")
        if "pod" in doc:
            return _pod_reply(doc)
        if isinstance(doc.get("challenge"), str):
            return Challenge(doc["challenge"], str(doc.get("error", "")))
        if "error" in doc:
            return SourceDown(f"the agent says: {doc['error']}")
        devices = tuple(_device(d) for d in doc["devices"])
        processes = tuple(_process(p) for p in doc["processes"])
        reclaims = dict(_reclaim(r) for r in doc.get("reclaims", ()))
        sample = Sample(float(doc["sampled_at"]), devices, processes)
        return Usage(sample, reclaims, doc.get("lending") is True, doc.get("lending_dra") is True)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"malformed reply from the agent: {exc}") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _device(d: dict[str, Any]) -> Device:
    return Device(
        int(d["index"]),
        str(d["uuid"]),
        str(d["name"]),
        _optional_int(d["total_bytes"]),
        _optional_int(d["used_bytes"]),
        d.get("parent_uuid"),
        _optional_int(d.get("reserved_bytes")),  # an older agent does not send it
    )


def _process(p: dict[str, Any]) -> ProcessUsage:
    key = ProcessKey(int(p["pid"]), int(p["start_time"]))
    sm, mem = p.get("sm"), p.get("mem")
    activity = None if sm is None or mem is None else Activity(int(sm), int(mem))
    return ProcessUsage(key, str(p["device_uuid"]), _optional_int(p["used_bytes"]), (), activity)
