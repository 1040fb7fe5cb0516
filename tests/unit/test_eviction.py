"""When the node agent evicts a pod instead of signalling it."""

from __future__ import annotations

from enforcer.core.eviction import evicted, refused, to_evict
from enforcer.core.model import GiB, ProcessKey, ProcessTotal, UnitUsage


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
    text = evicted(unit("trainer", 5 * GiB, 4 * GiB), "container 'trainer'")
    assert text.startswith("container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit")
    assert "kernel refused the signal" in text and "pod is evicted instead" in text
    later = refused("a PodDisruptionBudget", 5.0)
    assert "refused for now (a PodDisruptionBudget)" in later and "retrying in 5s" in later
