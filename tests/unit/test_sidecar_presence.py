"""Which injected pods have lost their sidecar: at once when it is stopped, has ended or hung
up, or the kernel refuses its signals, after SILENT_AFTER when it runs but is not heard;
said once, and again when back. (Which pods are injected at all: `declaration.injected`,
tests/unit/test_declaration.py; the watch keeps to those.)"""

from __future__ import annotations

from typing import Any, cast

from enforcer.core import messages
from enforcer.core.payloads import Pod
from enforcer.core.sidecar_presence import (
    FIRST_RETRY,
    LAST_RETRY,
    REFUSED_FOR,
    SILENT_AFTER,
    UNSEEN,
    Presence,
    Sidecar,
    guarded,
    halt,
    reachable,
    refusing,
    sidecar_id,
    to_dial,
    update,
)

SIDE, OTHER = "a" * 64, "b" * 64


def heard(*cids: str) -> dict[str, Sidecar]:
    """Sidecars that read their subscriptions, their processes not read."""
    return {cid: Sidecar(heard=True) for cid in cids}


def pod(sidecar_id: str | None = SIDE, phase: str = "Running", state: str = "running") -> Pod:
    statuses = [
        {"name": "trainer", "containerID": f"containerd://{OTHER}", "state": {"running": {}}}
    ]
    if sidecar_id is not None:
        statuses.append(
            {
                "name": "vram-enforcer",
                "containerID": f"containerd://{sidecar_id}",
                "state": {state: {}},
            }
        )
    doc: dict[str, Any] = {
        "metadata": {"labels": {"vram-enforcer.io/enforced": "true"}},
        "status": {
            "phase": phase,
            "initContainerStatuses": statuses[1:],
            "containerStatuses": statuses[:1],
        },
    }
    return cast(Pod, doc)


def test_a_pod_whose_sidecar_is_away_is_said_once_after_the_delay_and_again_when_back() -> None:
    pods = {"u": pod()}
    state = update(Presence(), pods, heard(SIDE), 0.0)
    assert state.presence.silent == frozenset() and not state.went_silent
    state = update(state.presence, pods, {}, 1.0)  # unheard, its process not read
    assert not state.went_silent
    state = update(state.presence, pods, {}, 1.0 + SILENT_AFTER - 0.1)
    assert not state.went_silent
    state = update(state.presence, pods, {}, 1.0 + SILENT_AFTER)
    assert state.went_silent == ("u",)
    state = update(state.presence, pods, {}, 100.0)
    assert not state.went_silent and state.presence.silent == {"u"}  # said once
    state = update(state.presence, pods, heard(SIDE), 101.0)
    assert state.came_back == ("u",) and not state.presence.silent


def test_a_workload_connection_does_not_stand_for_the_sidecar() -> None:
    """Only the sidecar container's own ID counts: the workload connecting (any process of
    the pod may) does not hide that the sidecar is gone."""
    pods = {"u": pod()}
    state = update(Presence(), pods, heard(OTHER), 0.0)
    state = update(state.presence, pods, heard(OTHER), SILENT_AFTER)
    assert state.went_silent == ("u",)


def test_a_restarted_sidecar_counts_by_its_new_id_and_a_killed_one_by_none() -> None:
    pods = {"u": pod("c" * 64)}
    assert update(Presence(), pods, heard(SIDE), 0.0).presence.missing_since == {"u": 0.0}
    assert not update(Presence(), pods, heard("c" * 64), 0.0).presence.missing_since
    crashed = {"u": pod(None)}  # in back-off: no container ID in the status
    state = update(
        update(Presence(), crashed, heard(SIDE), 0.0).presence, crashed, heard(SIDE), SILENT_AFTER
    )
    assert state.went_silent == ("u",)


def test_a_stopped_or_traced_sidecar_leaves_its_pod_unguarded_at_once() -> None:
    """SIGSTOP (T) or a tracer's stop (t): its process runs no code, though its connection
    is open and, until its buffer fills, still read. Nothing is gained by waiting."""
    pods = {"u": pod()}
    state = update(Presence(), pods, {SIDE: Sidecar(heard=True, state="S")}, 0.0)
    assert not state.presence.missing_since
    for stopped in ("T", "t"):
        change = update(state.presence, pods, {SIDE: Sidecar(heard=True, state=stopped)}, 0.5)
        assert change.went_silent == ("u",)


def test_an_ended_sidecar_or_one_that_hung_up_leaves_its_pod_unguarded_at_once() -> None:
    """A zombie (Z) or a dead process (X), or a sidecar that closed its connection (a
    SIGKILL does), though the last look said it was read."""
    pods = {"u": pod()}
    for seen in (
        Sidecar(heard=True, state="Z"),
        Sidecar(state="X"),
        Sidecar(closed=True),
        Sidecar(heard=True, closed=True, state="R"),
    ):
        assert update(Presence(), pods, {SIDE: seen}, 0.0).went_silent == ("u",), seen


def test_a_sidecar_whose_signals_the_kernel_refuses_leaves_its_pod_to_the_agent() -> None:
    """Heard, running, but its last signal was refused (EPERM: the workload runs under
    another security label): it decides and cannot act, so the agent holds the pod at once,
    for REFUSED_FOR after the last refusal, and hands it back then."""
    pods = {"u": pod()}
    state = update(Presence(), pods, heard(SIDE), 0.0)
    assert not state.went_silent
    assert refusing(10.0, 10.0) and refusing(10.0, 10.0 + REFUSED_FOR - 0.1)
    assert not refusing(10.0, 10.0 + REFUSED_FOR) and not refusing(None, 10.0)
    refused = {SIDE: Sidecar(heard=True, state="S", refused=refusing(10.0, 10.5))}
    state = update(state.presence, pods, refused, 10.5)
    assert state.went_silent == ("u",) and halt(refused[SIDE]) == "refused"
    assert not update(state.presence, pods, refused, 20.0).came_back
    later = {SIDE: Sidecar(heard=True, state="S", refused=refusing(10.0, 10.0 + REFUSED_FOR))}
    assert update(state.presence, pods, later, 10.0 + REFUSED_FOR).came_back == ("u",)


def test_a_sidecar_that_runs_but_is_not_heard_is_given_the_delay() -> None:
    """Merely slow (connected, running, not reading), starting, or its process not read:
    the agent does not take over from a sidecar that may still be there before
    SILENT_AFTER."""
    pods = {"u": pod()}
    for seen in (Sidecar(state="R"), Sidecar(state="S"), Sidecar(state="D"), UNSEEN):
        state = update(Presence(), pods, {SIDE: seen}, 0.0)
        assert not update(state.presence, pods, {SIDE: seen}, SILENT_AFTER - 0.1).went_silent
        assert update(state.presence, pods, {SIDE: seen}, SILENT_AFTER).went_silent == ("u",)


def test_a_pod_unguarded_at_once_stays_so_until_its_sidecar_is_heard_running() -> None:
    """Continued (SIGCONT), the sidecar runs, but its pod is handed back only once it reads
    again; one still read while stopped is not back."""
    pods = {"u": pod()}
    state = update(Presence(), pods, {SIDE: Sidecar(heard=True, state="T")}, 0.0)
    assert state.went_silent == ("u",)
    for seen in (Sidecar(heard=True, state="T"), Sidecar(state="S")):
        state = update(state.presence, pods, {SIDE: seen}, 1.0)
        assert state.presence.silent == {"u"} and not state.came_back and not state.went_silent
    state = update(state.presence, pods, {SIDE: Sidecar(heard=True, state="S")}, 2.0)
    assert state.came_back == ("u",) and not state.presence.silent


def staged(phase: str, native: bool = True, **states: str) -> Pod:
    """An injected pod with init containers `warm` (ahead of the sidecar) and `fetch`, and
    the container `trainer`; each container's state (`states`, by name; else waiting) as the
    kubelet reports it. `native`: the sidecar is the init container between them (else a
    container: `--sidecar-mode container`)."""
    ids = {"warm": "1" * 64, "fetch": "2" * 64, "trainer": "3" * 64, "vram-enforcer": SIDE}
    inits = ["warm", "vram-enforcer", "fetch"] if native else ["warm", "fetch"]
    containers = ["trainer"] if native else ["trainer", "vram-enforcer"]

    def statuses(of: list[str]) -> list[dict[str, Any]]:
        """A container not created yet (waiting) has no ID."""
        return [
            {"name": n, "state": {states.get(n, "waiting"): {}}}
            | ({"containerID": f"containerd://{ids[n]}"} if n in states else {})
            for n in of
        ]

    doc = {
        "metadata": {"labels": {"vram-enforcer.io/enforced": "true"}},
        "spec": {
            "initContainers": [{"name": n} for n in inits],
            "containers": [{"name": n} for n in containers],
        },
        "status": {
            "phase": phase,
            "initContainerStatuses": statuses(inits),
            "containerStatuses": statuses(containers),
        },
    }
    return cast(Pod, doc)


def test_a_pending_pod_whose_init_container_runs_is_unguarded_once_its_sidecar_is_unheard() -> None:
    """Issue 35: a GPU job in a regular init container runs while the pod is Pending, once
    its native sidecar has started. A sidecar that never connects leaves it unguarded after
    SILENT_AFTER, as it would a Running pod's: the backstop then holds it."""
    pods = {
        "u": staged(
            "Pending", **{"vram-enforcer": "running", "warm": "terminated", "fetch": "running"}
        )
    }
    assert reachable(pods["u"]) == SIDE  # dialled, but never answers
    state = update(Presence(), pods, {}, 0.0)
    assert not update(state.presence, pods, {}, SILENT_AFTER - 0.1).went_silent
    state = update(state.presence, pods, {}, SILENT_AFTER)
    assert state.went_silent == ("u",)
    # Stopped at once, as in a Running pod; handed back once heard.
    assert update(Presence(), pods, {SIDE: Sidecar(heard=True, state="T")}, 0.0).went_silent
    assert update(state.presence, pods, heard(SIDE), 11.0).came_back == ("u",)


def test_an_init_container_that_runs_ahead_of_a_native_sidecar_not_started_is_watched() -> None:
    """A tenant forges a sidecar further down its init containers: the webhook replaces it
    where it stands, and the init containers ahead of it run with no sidecar yet (no ID in
    its status). After SILENT_AFTER the pod is unguarded, and the backstop holds them."""
    pods = {"u": staged("Pending", warm="running")}
    assert sidecar_id(pods["u"]) is None
    state = update(Presence(), pods, {}, 0.0)
    assert update(state.presence, pods, {}, SILENT_AFTER).went_silent == ("u",)


def test_a_pod_is_watched_while_a_container_that_its_sidecar_enforces_runs() -> None:
    """What runs decides: any container but the sidecar, init containers included, Pending
    or Running. Not a pod that has finished, nor one that runs only its sidecar, nor the
    init containers of a pod whose sidecar is one of its containers (`container` mode: they
    all run before it starts)."""
    sidecar = {"vram-enforcer": "running"}
    watched = {
        "running": staged("Running", **sidecar, trainer="running"),
        "init": staged("Pending", **sidecar, fetch="running"),
        "container-mode": staged("Running", native=False, trainer="running"),
        "sidecar-away": staged("Running", trainer="running"),  # not started, or in back-off
        "ahead": staged("Pending", warm="running"),  # ahead of the native sidecar
    }
    ended = {n: "terminated" for n in ("warm", "fetch", "trainer", "vram-enforcer")}
    unwatched = {
        "succeeded": staged("Succeeded", **ended),
        "failed": staged("Failed", **ended),
        "failing": staged("Failed", trainer="running"),  # the kubelet stops it, sidecar too
        "sidecar-only": staged("Pending", **sidecar),
        "container-mode-init": staged("Pending", native=False, fetch="running"),
    }
    assert [n for n, p in watched.items() if not guarded(p)] == []
    assert [n for n, p in unwatched.items() if guarded(p)] == []
    state = update(Presence(), unwatched, {}, 0.0)
    state = update(state.presence, unwatched, {}, SILENT_AFTER * 2)
    assert not state.went_silent and not state.presence.missing_since


def test_the_agent_connects_to_running_sidecars_of_injected_pods_in_any_phase() -> None:
    """A native sidecar runs while the pod is still Pending (its workload starting): it is
    connected to then. A sidecar that waits (crash loop) or has ended is not."""
    assert reachable(pod(phase="Pending")) == SIDE
    assert reachable(pod()) == SIDE
    assert reachable(pod(state="waiting")) is None
    assert reachable(pod(state="terminated")) is None
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


def test_the_event_names_how_a_halted_sidecar_halted() -> None:
    """A stopped sidecar's pod is held at once: its Event must not say "for 0s"."""
    assert halt(Sidecar(state="T")) == halt(Sidecar(state="t")) == "stopped"
    assert halt(Sidecar(state="Z")) == halt(Sidecar(closed=True, state="S")) == "ended"
    assert halt(Sidecar(heard=False, state="S")) is None and halt(UNSEEN) is None
    stopped = messages.sidecar_silent(0.0, None, "stopped")
    assert stopped.startswith("the vram-enforcer sidecar of this pod is stopped (SIGSTOP")
    assert " for 0s" not in stopped
    assert "ended or hung up" in messages.sidecar_silent(0.0, None, "ended")
    assert "the kernel refuses the signals" in messages.sidecar_silent(0.0, None, "refused")
    assert "for 12s: it does not read" in messages.sidecar_silent(12.0)
