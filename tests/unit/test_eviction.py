"""When the node agent evicts a pod instead of signalling it."""

from __future__ import annotations

from enforcer.core.eviction import cause, deleted, evicted, grace_seconds, refused, to_evict
from enforcer.core.model import Action, GiB, ProcessKey, ProcessTotal, UnitUsage
from enforcer.core.policy import PolicyConfig


def unit(name: str, used: int, limit: int) -> UnitUsage:
    return UnitUsage(name, limit, (ProcessTotal(ProcessKey(4242, 1), used, (), "python"),))


def test_a_pod_is_evicted_for_a_unit_whose_signal_was_refused_while_it_is_still_over() -> None:
    trainer = unit("trainer", 5 * GiB, 4 * GiB)
    helper = unit("helper", 9 * GiB, 4 * GiB)  # over, but its signal went
    assert to_evict({"trainer"}, (trainer, helper)) == trainer


def test_no_eviction_without_a_refused_signal_or_once_the_unit_is_back_under() -> None:
    over = unit("trainer", 5 * GiB, 4 * GiB)
    assert to_evict(set(), (over,)) is None  # signals work: the pipeline does the rest
    back = unit("trainer", 3 * GiB, 4 * GiB)
    assert to_evict({"trainer"}, (back,)) is None  # it gave the memory back meanwhile
    assert to_evict({"trainer"}, ()) is None  # its processes are gone


def test_of_several_refused_units_the_one_most_over_is_named() -> None:
    a = unit("a", 5 * GiB, 4 * GiB)
    b = unit("b", 8 * GiB, 4 * GiB)
    assert to_evict(["a", "b"], (a, b)) == b


def test_the_events_say_which_container_its_usage_and_limit_and_why() -> None:
    why = cause(unit("trainer", 5 * GiB, 4 * GiB), "container 'trainer'")
    assert why.startswith("container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit")
    assert "kernel refused the signal" in why
    assert evicted(why, 30).endswith("so the pod is evicted instead, with a grace period of 30s")
    later = refused("a PodDisruptionBudget", 5.0, 55.2)
    assert "refused for now (a PodDisruptionBudget)" in later and "retrying in 5s" in later
    assert "still refused in 55s, the pod is deleted whatever its PodDisruptionBudgets" in later
    gone = deleted(why, "HTTP 429", 60.3, 30)
    assert gone.startswith(why) and "refused for 60s (HTTP 429)" in gone
    assert "as the kubelet's node-pressure eviction stops a pod" in gone
    assert gone.endswith("with a grace period of 30s")


def test_the_pod_gets_its_policys_grace_period_never_its_own_nor_0() -> None:
    """Not the pod's `terminationGracePeriodSeconds`, which its author chose (unbounded);
    `kill` gets the kubelet's 1 s of a hard eviction; 0 would be a force delete."""
    assert grace_seconds(PolicyConfig(grace_period=30.0)) == 30
    assert grace_seconds(PolicyConfig(grace_period=2.5)) == 3
    assert grace_seconds(PolicyConfig(grace_period=0.0)) == 1
    assert grace_seconds(PolicyConfig(Action.RESTART, grace_period=10.0)) == 10
    assert grace_seconds(PolicyConfig(Action.KILL, grace_period=30.0)) == 1
