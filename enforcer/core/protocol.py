"""The agent's usage protocol, version 1: newline-delimited JSON over a Unix socket.

Pure encoding and decoding, shared by the agent (server) and `AgentSource` (client), so
that both sides agree by construction. See docs/agent-protocol.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from enforcer.core.model import Activity, Device, ProcessKey, ProcessUsage, Sample, SourceDown

VERSION = 1
MAX_REQUEST_BYTES = 4096
OPS = ("usage", "subscribe")


class ProtocolError(ValueError):
    """A request or reply that does not follow the protocol; the message says how."""


@dataclass(frozen=True, slots=True)
class Request:
    op: str
    challenge: str | None = None  # the answer to the agent's challenge, when it sent one


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
    return Request(op, challenge if isinstance(challenge, str) else None)


def encode_request(op: str = "usage", challenge: str | None = None) -> bytes:
    doc: dict[str, object] = {"v": VERSION, "op": op}
    if challenge is not None:
        doc["challenge"] = challenge
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
        {"index": d.index, "uuid": d.uuid, "name": d.name, "total_bytes": d.total_bytes,
         "used_bytes": d.used_bytes, "parent_uuid": d.parent_uuid}
        for d in devices
    ]  # fmt: skip
    return b'{"v":%d,"sampled_at":%s,"devices":%s,"processes":[' % (
        VERSION, _json(sampled_at), _json(listed)
    )  # fmt: skip


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
    busy = b"" if activity is None else b',"sm":%d,"mem":%d' % (
        activity.sm_percent, activity.memory_percent
    )  # fmt: skip
    return b'{"pid":%d,"start_time":%d,"device_uuid":%s,"used_bytes":%s%s}' % (
        pid, start_time, device_json, used, busy
    )  # fmt: skip


def json_string(text: str) -> bytes:
    return _json(text)


USAGE_TAIL = b"]}\n"


def decode_reply(line: bytes) -> Sample | SourceDown | Challenge:
    """A reply as the client sees it: a sample, the agent's error as `SourceDown`, or a
    challenge to answer."""
    try:
        doc = json.loads(line)
        if doc.get("v") != VERSION:
            raise ProtocolError(f"the agent speaks protocol version {doc.get('v')!r}, not v1")
        if isinstance(doc.get("challenge"), str):
            return Challenge(doc["challenge"], str(doc.get("error", "")))
        if "error" in doc:
            return SourceDown(f"the agent says: {doc['error']}")
        devices = tuple(_device(d) for d in doc["devices"])
        processes = tuple(_process(p) for p in doc["processes"])
        return Sample(float(doc["sampled_at"]), devices, processes)
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
    )


def _process(p: dict[str, Any]) -> ProcessUsage:
    key = ProcessKey(int(p["pid"]), int(p["start_time"]))
    sm, mem = p.get("sm"), p.get("mem")
    activity = None if sm is None or mem is None else Activity(int(sm), int(mem))
    return ProcessUsage(key, str(p["device_uuid"]), _optional_int(p["used_bytes"]), (), activity)
