"""What `exec --summary` writes is what `interference` reads back, and nothing else is."""

from __future__ import annotations

import json

import pytest

from enforcer.core import exec_summary
from enforcer.core.exec_summary import ExecSummary, GateCounts, SummaryEvent


def test_the_summary_reads_back_what_was_written() -> None:
    reclaim = SummaryEvent("VRAMReclaimed", 0.5, "taking back the 1.00 KiB", 7)
    event = SummaryEvent("VRAMEnforced", 1.5, "sent SIGTERM", 7)
    written = ExecSummary(
        command=("python", "train.py"),
        limit_bytes=1024,
        action="terminate",
        dry_run=False,
        exit_status=143,
        started=True,
        signal="SIGTERM",
        start_monotonic=10.0,
        end_monotonic=12.0,
        started_at=1.7e9,
        peak_bytes=2048,
        samples=3,
        hard_limit=True,
        tier="driver-limit",
        events=(reclaim, event),
        sm_percent=87.5,
        memory_percent=12.25,
        busy_samples=2,
        request_bytes=512,
    )
    doc = json.loads(json.dumps(written.to_json()))
    # A reclaim happens under the limit: the excursion over it began with the later event.
    assert doc["wall_seconds"] == 2.0 and doc["exceeded_after_seconds"] == 1.5
    assert exec_summary.from_json(doc) == written


def test_a_summary_written_before_utilisation_was_read_has_none() -> None:
    doc = ExecSummary(("x",), 1, "terminate", False, exit_status=0, started=True).to_json()
    for key in ("sm_percent", "memory_percent", "busy_samples", "request_bytes"):
        del doc[key]
    read = exec_summary.from_json(doc)
    assert (read.sm_percent, read.memory_percent, read.busy_samples) == (None, None, 0)
    assert read.request_bytes is None


def test_the_allocation_gates_counts_read_back_and_are_absent_from_older_summaries() -> None:
    refusal = SummaryEvent("VRAMAllocationRefused", 0.25, "refused a GPU allocation of 2.00 GiB")
    counts = GateCounts((("allowed", 3), ("not_memory", 9), ("refused", 2)), 41.5)
    written = ExecSummary(
        ("x",), 1, "terminate", False, exit_status=0, started=True, tier="allocation-gate",
        events=(refusal,), allocation_gate=counts,
    )  # fmt: skip
    doc = json.loads(json.dumps(written.to_json()))
    assert doc["allocation_gate"] == {
        "calls": {"allowed": 3, "not_memory": 9, "refused": 2},
        "refusals": 2,
        "max_listener_us": 41.5,
    }
    assert exec_summary.from_json(doc) == written
    del doc["allocation_gate"]
    assert exec_summary.from_json(doc).allocation_gate is None


@pytest.mark.parametrize(("hard_limit", "tier"), [(True, "driver-limit"), (False, "sampling")])
def test_a_summary_written_before_the_tier_was_named_has_it_from_hard_limit(
    hard_limit: bool, tier: str
) -> None:
    doc = ExecSummary(
        ("x",), 1, "terminate", False, exit_status=0, started=True, hard_limit=hard_limit
    ).to_json()
    del doc["tier"]
    assert exec_summary.from_json(doc).tier == tier


def test_a_command_that_never_ran_has_no_time() -> None:
    never = ExecSummary(("x",), 1, "terminate", False, exit_status=127, started=False)
    assert never.wall_seconds is None and never.exceeded_after is None
    assert exec_summary.from_json(never.to_json()) == never


@pytest.mark.parametrize(
    "doc", [None, [], {"version": 2}, {"version": 1}, {"version": 1, "command": 5}]
)
def test_a_document_that_is_not_a_summary_is_refused(doc: object) -> None:
    with pytest.raises(ValueError, match="summary"):
        exec_summary.from_json(doc)
