"""The last enforcement on a pod as its condition (issue 43, item 5): what `kubectl describe
pod` shows the morning after, once the Events have expired. Made from the agent's view
alone: the container, its instance, what NVML showed it hold and what it declares."""

from __future__ import annotations

from typing import Any, cast

import pytest

from enforcer.core.last_enforcement import (
    CONDITION_TYPE,
    ENFORCING,
    MESSAGE_CHARS,
    Enforced,
    as_policy_says,
    condition,
    container_named,
    seen,
    status_patch,
)
from enforcer.core.model import Action, GiB, MiB
from enforcer.core.payloads import Pod
from enforcer.core.pod_metrics import ContainerSeries, Named, OnGpu
from enforcer.core.reasons import Reason

AT = "2026-11-29T03:12:05Z"
CID = "containerd://" + "a" * 64
RESTART = Action.RESTART


def pod(restarts: object = 0, **extra: Any) -> Pod:
    status = {"name": "trainer", "containerID": CID, "restartCount": restarts, **extra}
    return cast(Pod, {"status": {"containerStatuses": [status]}})


def series(
    used: int, limit: int | None, ceiling: int | None = None, *gpus: OnGpu
) -> ContainerSeries:
    return ContainerSeries(Named("ml", "train-0", "trainer"), used, limit, ceiling, gpus, ())


def test_an_enforced_container_says_what_the_agent_saw_it_hold_and_its_limit() -> None:
    e = seen(Reason.ENFORCED, pod(), "trainer", [series(5 * GiB + 102 * MiB, 4 * GiB)])
    cond = condition(e, AT)
    assert cond == {
        "type": "vram-enforcer.io/Enforced",
        "status": "True",
        "reason": "VRAMEnforced",
        "message": cond["message"],
        "lastTransitionTime": AT,
    }
    assert cond["message"].startswith(
        f"container 'trainer' was enforced over its VRAM limit (VRAMEnforced, at {AT}); the "
        "node agent saw it hold 5.10 GiB of its 4.00 GiB limit (127%); "
    )
    assert f"that was its instance {CID}, after 0 restarts" in cond["message"]
    assert "status.containerStatuses[].lastState shows how that instance ended" in cond["message"]


def test_a_restarted_container_is_named_by_the_instance_that_was_enforced() -> None:
    """Told while the kubelet still showed the instance enforced: the condition names it
    (its container ID, its restarts then), which `lastState.terminated.containerID`
    matches once the container has been restarted; with `restart`, it says so."""
    e = seen(Reason.ENFORCED, pod(restarts=3), "trainer", [series(5 * GiB, 4 * GiB)], RESTART)
    assert (e.instance, e.restarts) == (CID, 3)
    message = condition(e, AT)["message"]
    assert message.startswith(
        "container 'trainer' was enforced over its VRAM limit with its action, restart (the "
        "container is killed, and the kubelet starts it again) (VRAMEnforced"
    )
    assert f"its instance {CID}, after 3 restarts" in message


@pytest.mark.parametrize(
    ("action", "said"),
    [
        (Action.TERMINATE, "terminate (SIGTERM to its largest process, SIGKILL after the grace"),
        (Action.KILL, "kill (SIGKILL to its largest process)"),
    ],
)
def test_the_pods_action_is_said(action: Action, said: str) -> None:
    e = seen(Reason.ENFORCED, pod(), "trainer", [], action)
    assert f"with its action, {said}" in condition(e, AT)["message"]
    reclaimed = seen(Reason.RECLAIMED, pod(), "trainer", [], action)  # a reclaim's own words
    assert "with its action" not in condition(reclaimed, AT)["message"]


@pytest.mark.parametrize("restarts", ["3", True, None, -1.5])
def test_a_restart_count_that_is_not_a_count_is_left_out(restarts: object) -> None:
    e = seen(Reason.ENFORCED, pod(restarts=restarts), "trainer", [])
    assert e.restarts is None
    assert f"its instance {CID}: if the container" in condition(e, AT)["message"]


def test_a_dry_run_sets_the_condition_false_with_its_own_reason() -> None:
    """A rollout lists the pods that would have been stopped: status False, and nothing
    was signalled."""
    cond = condition(seen(Reason.WOULD_ENFORCE, pod(), "trainer", [series(6 * GiB, 4 * GiB)]), AT)
    assert (cond["status"], cond["reason"]) == ("False", "VRAMWouldEnforce")
    assert "would have been enforced (dry-run): nothing was signalled" in cond["message"]
    assert "6.00 GiB of its 4.00 GiB limit (150%)" in cond["message"]


@pytest.mark.parametrize("reason", [Reason.ENFORCED, Reason.RECLAIMED])
def test_a_pod_in_dry_run_was_not_enforced_whatever_its_report_says(reason: Reason) -> None:
    """The pod's policy (the webhook's) says dry-run: its sidecar's report (of a release
    that said a would-be enforcement as VRAMEnforced, or a forged one) sets it False."""
    said = as_policy_says(reason, dry_run=True)
    assert said is Reason.WOULD_ENFORCE
    cond = condition(seen(said, pod(), "trainer", [], Action.TERMINATE), AT)
    assert (cond["status"], cond["reason"]) == ("False", "VRAMWouldEnforce")
    assert "with its action" not in cond["message"]


def test_a_would_be_report_on_a_pod_not_in_a_dry_run_sets_nothing() -> None:
    """A sidecar may report VRAMWouldEnforce, so a forged one could write "would have been
    enforced (dry-run): nothing was signalled" on an enforcing pod: the pod's policy, as
    the agent reads it, decides (found by review of issue 43)."""
    assert as_policy_says(Reason.WOULD_ENFORCE, dry_run=False) is None
    assert as_policy_says(Reason.WOULD_ENFORCE, dry_run=True) is Reason.WOULD_ENFORCE
    for reason in (Reason.ENFORCED, Reason.RECLAIMED, Reason.EVICTED):
        assert as_policy_says(reason, dry_run=False) is reason


def test_a_reclaim_says_the_request_and_the_ceiling() -> None:
    e = seen(Reason.RECLAIMED, pod(), "trainer", [series(6 * GiB, 2 * GiB, 8 * GiB)])
    assert (
        "hold 6.00 GiB (300%) of its 2.00 GiB request, ceiling 8.00 GiB"
        in (condition(e, AT)["message"])
    )


def test_a_dra_container_is_held_to_what_its_claims_were_allocated() -> None:
    gpus = (OnGpu("GPU-1", 3 * GiB, None, 2 * GiB), OnGpu("GPU-2", GiB, None, 2 * GiB))
    e = seen(Reason.ENFORCED, pod(), "trainer", [series(4 * GiB, None, None, *gpus)])
    assert (e.used, e.limit) == (4 * GiB, 4 * GiB)


def test_what_the_agent_does_not_know_is_said_so_never_guessed() -> None:
    """The pod not listed yet, no NVML pass, a container it declares nothing for."""
    unknown = condition(seen(Reason.EVICTED, None, "trainer", []), AT)["message"]
    assert "the node agent saw it hold no GPU memory it could see (it declares no VRAM" in unknown
    assert "instance" not in unknown
    whole = condition(seen(Reason.ENFORCED, pod(), None, []), AT)["message"]
    assert whole.startswith("the pod was enforced over its VRAM limit")
    undeclared = seen(Reason.ENFORCED, pod(), "trainer", [series(GiB, None)])
    assert "hold 1.00 GiB (it declares no VRAM limit" in condition(undeclared, AT)["message"]


def test_only_enforcements_set_the_condition() -> None:
    """A warning kills nothing; the agent's lasting facts and silences are not enforcements."""
    assert {str(r) for r in ENFORCING} == {
        "VRAMEnforced",
        "VRAMReclaimed",
        "VRAMEvicted",
        "VRAMWouldEnforce",
    }


def test_the_container_is_read_from_the_events_field_path() -> None:
    assert container_named("spec.containers{trainer}") == "trainer"
    assert container_named("spec.initContainers{setup}") == "setup"
    assert container_named("spec.ephemeralContainers{debug}") == "debug"
    assert container_named("") is None
    assert container_named("metadata.name") is None


def test_the_message_is_bounded() -> None:
    long = Enforced(Reason.ENFORCED, "c" * 2000, CID, 1, GiB, GiB)
    assert len(condition(long, AT)["message"]) == MESSAGE_CHARS


def test_the_patch_merges_by_type_and_names_the_pods_uid() -> None:
    """A strategic-merge patch of `status.conditions` merges by `type`: the kubelet's
    conditions stay; the UID refuses a newcomer of the same name."""
    cond = condition(Enforced(Reason.ENFORCED, "trainer"), AT)
    assert status_patch("uid-1", cond) == {
        "metadata": {"uid": "uid-1"},
        "status": {"conditions": [cond]},
    }
    assert CONDITION_TYPE.startswith("vram-enforcer.io/")  # never one the kubelet owns
