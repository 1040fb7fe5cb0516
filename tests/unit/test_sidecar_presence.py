"""Which enforced pods have lost their sidecar: said after SILENT_AFTER, once, and when back."""

from __future__ import annotations

from typing import Any, cast

from enforcer.core.payloads import Pod
from enforcer.core.sidecar_presence import (
    FIRST_RETRY,
    LAST_RETRY,
    SILENT_AFTER,
    Presence,
    reachable,
    to_dial,
    update,
)

SIDE, OTHER = "a" * 64, "b" * 64


def pod(
    sidecar_id: str | None = SIDE,
    enforced: bool = True,
    phase: str = "Running",
    state: str = "running",
) -> Pod:
    statuses = [{"name": "trainer", "containerID": f"containerd://{OTHER}",
                 "state": {"running": {}}}]  # fmt: skip
    if sidecar_id is not None:
        statuses.append({"name": "vram-enforcer", "containerID": f"containerd://{sidecar_id}",
                         "state": {state: {}}})  # fmt: skip
    doc: dict[str, Any] = {
        "metadata": {"labels": {"vram-enforcer.io/enforced": "true"} if enforced else {}},
        "status": {"phase": phase, "initContainerStatuses": statuses[1:],
                   "containerStatuses": statuses[:1]},
    }  # fmt: skip
    return cast(Pod, doc)


def test_a_pod_whose_sidecar_is_away_is_said_once_after_the_delay_and_again_when_back() -> None:
    pods = {"u": pod()}
    state = update(Presence(), pods, {SIDE}, 0.0)
    assert state.presence.silent == frozenset() and not state.went_silent
    state = update(state.presence, pods, frozenset(), 1.0)  # stopped: its connection went
    assert not state.went_silent
    state = update(state.presence, pods, frozenset(), 1.0 + SILENT_AFTER - 0.1)
    assert not state.went_silent
    state = update(state.presence, pods, frozenset(), 1.0 + SILENT_AFTER)
    assert state.went_silent == ("u",)
    state = update(state.presence, pods, frozenset(), 100.0)
    assert not state.went_silent and state.presence.silent == {"u"}  # said once
    state = update(state.presence, pods, {SIDE}, 101.0)
    assert state.came_back == ("u",) and not state.presence.silent


def test_a_workload_connection_does_not_stand_for_the_sidecar() -> None:
    """Only the sidecar container's own ID counts: the workload connecting (any process of
    the pod may) does not hide that the sidecar is gone."""
    pods = {"u": pod()}
    state = update(Presence(), pods, {OTHER}, 0.0)
    state = update(state.presence, pods, {OTHER}, SILENT_AFTER)
    assert state.went_silent == ("u",)


def test_a_restarted_sidecar_counts_by_its_new_id_and_a_killed_one_by_none() -> None:
    pods = {"u": pod("c" * 64)}
    assert update(Presence(), pods, {SIDE}, 0.0).presence.missing_since == {"u": 0.0}
    assert not update(Presence(), pods, {"c" * 64}, 0.0).presence.missing_since
    crashed = {"u": pod(None)}  # in back-off: no container ID in the status
    state = update(update(Presence(), crashed, {SIDE}, 0.0).presence, crashed, {SIDE}, SILENT_AFTER)
    assert state.went_silent == ("u",)


def test_only_running_enforced_pods_are_watched() -> None:
    pods = {"plain": pod(enforced=False), "pending": pod(phase="Pending"),
            "done": pod(phase="Succeeded")}  # fmt: skip
    state = update(Presence(), pods, frozenset(), 0.0)
    state = update(state.presence, pods, frozenset(), SILENT_AFTER * 2)
    assert not state.went_silent and not state.presence.missing_since


def test_the_agent_connects_to_running_sidecars_of_enforced_pods_in_any_phase() -> None:
    """A native sidecar runs while the pod is still Pending (its workload starting): it is
    connected to then. A sidecar that waits (crash loop) or has ended is not."""
    assert reachable(pod(phase="Pending")) == SIDE
    assert reachable(pod()) == SIDE
    assert reachable(pod(state="waiting")) is None
    assert reachable(pod(state="terminated")) is None
    assert reachable(pod(enforced=False)) is None
    assert reachable(pod(None)) is None


def test_a_sidecar_that_cannot_be_reached_is_tried_again_less_and_less_often() -> None:
    due, tried = to_dial([SIDE], {}, 0.0)
    assert due == (SIDE,)
    assert to_dial([SIDE], tried, FIRST_RETRY - 0.1)[0] == ()
    times, now = [], 0.0
    while now < 200:
        now += 0.5
        due, tried = to_dial([SIDE], tried, now)
        if due:
            times.append(now)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 16.0] and set(gaps[5:]) == {LAST_RETRY}


def test_a_connected_sidecar_is_forgotten_and_tried_at_once_when_lost() -> None:
    _, tried = to_dial([SIDE, OTHER], {}, 0.0)
    _, tried = to_dial([SIDE], tried, 5.0)  # OTHER connected meanwhile
    assert set(tried) == {SIDE}
    assert to_dial([SIDE, OTHER], tried, 5.5)[0] == (OTHER,)  # lost: at once, SIDE waits
