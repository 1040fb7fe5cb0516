"""What the agent sends its callers: one sample, indexed by the PID namespace each process
is seen from (inode, level), with each one's JSON pre-encoded once per sample, and the
reclaims that only the victim's own namespaces are told. A reply is then a lookup."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from enforcer.core.lending import Lending
from enforcer.core.model import ProcessKey, Sample, SourceDown
from enforcer.core.protocol import (
    encode_error,
    encode_reclaim,
    json_string,
    usage_head,
    usage_process,
    usage_tail,
)
from enforcer.edge.pid_view import PidView


@dataclass(slots=True)
class Published:
    """One sample, indexed by (namespace inode, level) with its JSON pre-encoded."""

    error: bytes | None = None
    head: bytes = b""
    by_namespace: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)
    replies: dict[tuple[int, int], bytes] = field(default_factory=dict)
    # When it was published, on the monotonic clock: a step of the wall clock (which the
    # sample's own `sampled_at` is on) must not make it look fresh, or stale.
    published_at: float = field(default_factory=time.monotonic)

    # The reclaims to tell, by the same key: each goes to the namespaces its victim's
    # processes are in, so that only the victim's own pod (its sidecar) hears of it.
    reclaims: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)
    lending: bool = False  # the agent decides reclaims: it says so in every reply

    @classmethod
    def of(cls, sample: Sample | SourceDown, lending: Lending | None = None) -> Published:
        if isinstance(sample, SourceDown):
            return cls(
                error=encode_error(f"GPU usage is unavailable on this node: {sample.reason}")
            )
        index: dict[tuple[int, int], list[bytes]] = {}
        uuids = {d.uuid: json_string(d.uuid) for d in sample.devices}
        told: dict[ProcessKey, list[bytes]] = {}
        for cid, reclaim in (lending.reclaims if lending is not None else {}).items():
            entry = encode_reclaim(cid, reclaim)
            for key in lending.victims.get(cid, ()) if lending is not None else ():
                told.setdefault(key, []).append(entry)
        reclaims: dict[tuple[int, int], list[bytes]] = {}
        for p in sample.processes:
            uuid = uuids.get(p.device_uuid) or json_string(p.device_uuid)
            for level, (inode, pid) in enumerate(p.namespaces):
                entry = usage_process(pid, p.key.start_time, uuid, p.used_bytes, p.activity)
                index.setdefault((inode, level), []).append(entry)
                for line in told.get(p.key, ()):
                    listed = reclaims.setdefault((inode, level), [])
                    if line not in listed:
                        listed.append(line)
        head = usage_head(sample.sampled_at, sample.devices)
        return cls(head=head, by_namespace=index, reclaims=reclaims, lending=lending is not None)

    def reply(self, view: PidView) -> bytes:
        key = (view.ns_inode, view.level)
        cached = self.replies.get(key)
        if cached is None:
            body = b",".join(self.by_namespace.get(key, ()))
            tail = usage_tail(self.reclaims.get(key, ()), self.lending)
            cached = self.replies[key] = self.head + body + tail
        return cached
