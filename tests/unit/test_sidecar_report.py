"""A sidecar's counts, as the agent takes them: every label value one of a known few, every
count bounded, whatever a tenant writes on the sidecar's connection."""

from __future__ import annotations

import json

import pytest

from enforcer.core.protocol import encode_report, parse_request
from enforcer.core.sidecar_report import SidecarReport, parse_report

GOOD = SidecarReport(
    actions={"warn": 2, "kill": 1},
    reclaims={"requests": 3},
    refused={"denied": 1},
    unexpected={"tick": 1, "pod-watcher": 2},
    ticks=120,
    tick_seconds=0.25,
)


def test_a_report_goes_over_the_socket_as_it_was_counted() -> None:
    request = parse_request(encode_report(GOOD))
    assert (request.op, request.report) == ("report", GOOD)
    assert len(encode_report(GOOD)) < 4096  # one request line, as every request is


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("actions", {"evict-everyone": 1}, "actions has 'evict-everyone', which is not one of"),
        ("reclaims", {"requests": -1}, "reclaims['requests'] is -1, not a count from 0 to 2^53"),
        ("refused", {"denied": 2**60}, "not a count from 0 to 2^53"),
        ("refused", {"denied": True}, "not a count"),
        ("unexpected", {"Tick\n": 1}, "unexpected has 'Tick\\n', which is not one of"),
        # A loop's name is one of the sidecar's own (issue 42, item 10): not one a tenant
        # chooses, which would be a series label of its choice.
        ("unexpected", {"sampler": 1}, "unexpected has 'sampler', which is not one of"),
        ("unexpected", {"loop-a": 1}, "unexpected has 'loop-a', which is not one of"),
        ("actions", [], "actions is not a JSON object"),
        ("ticks", 1.5, "ticks is 1.5, not a count"),
        ("tick_seconds", -1, "tick_seconds is -1, not a number of seconds"),
        ("tick_seconds", "1", "tick_seconds is '1', not a number of seconds"),
    ],
)
def test_what_is_not_a_sidecars_count_is_refused_saying_what(
    field: str, value: object, problem: str
) -> None:
    doc = json.loads(encode_report(GOOD))
    doc[field] = value
    found = parse_report(doc)
    assert isinstance(found, str) and problem in found
    assert parse_request(json.dumps(doc).encode()).report == found  # never an exception


def test_a_pods_counts_add_up_with_what_the_agent_did_there() -> None:
    held = SidecarReport(actions={"kill": 2, "terminate": 1})
    assert (GOOD + held).actions == {"warn": 2, "kill": 3, "terminate": 1}
    assert (GOOD + held).ticks == 120
