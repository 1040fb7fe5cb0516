"""The reclaim decision: who gives back memory lent above requests, on one GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.model import (
    Device,
    GiB,
    MiB,
    ProcessKey,
    ProcessTotal,
    ProcessUsage,
    UnitUsage,
)
from enforcer.core.node import allocatable
from enforcer.core.reclaim import (
    DEFAULT_WATERMARK,
    Gpu,
    Plan,
    Share,
    plan,
    rank,
    reclaims,
    shortfall,
    views,
)

TOTAL = 80 * GiB


def gpu(*shares: Share, other: int = 0) -> Gpu:
    """An 80 GiB GPU whose used memory is its containers' plus `other` (processes of none)."""
    return Gpu("GPU-0", TOTAL, sum(s.used for s in shares) + other * GiB, shares)


def share(
    unit: str,
    request: int,
    used: int,
    *,
    ceiling: int | None = None,
    priority: int = 0,
    exiting: bool = False,
) -> Share:
    return Share(unit, request * GiB, (ceiling or 80) * GiB, used * GiB, priority, exiting)


def test_a_borrower_is_left_alone_while_the_gpu_can_honour_every_request() -> None:
    # 20 GiB free: the other container is owed 16 of its 20, plus the watermark.
    borrower, owed = share("ml/a/a", 20, 40), share("ml/b/b", 20, 4)
    assert plan(gpu(borrower, owed)) == Plan()
    # 16 free, exactly what is owed: the watermark is what is short.
    borrower = share("ml/a/a", 20, 60)
    assert shortfall(gpu(borrower, owed), 0) == 0
    assert shortfall(gpu(borrower, owed), DEFAULT_WATERMARK) == DEFAULT_WATERMARK
    assert [r.victim for r in plan(gpu(borrower, owed)).reclaims] == [borrower]


def test_the_borrower_is_reclaimed_when_a_neighbour_grows_within_its_request() -> None:
    borrower, grower = share("ml/a/a", 20, 60), share("ml/b/b", 20, 12)
    # 8 GiB free; the grower is owed 8, plus the watermark: 2 GiB short.
    (reclaim,) = plan(gpu(borrower, grower)).reclaims
    assert reclaim.victim == borrower and reclaim.gpu == "GPU-0"
    assert reclaim.shortfall == 2 * GiB and reclaim.owed_to == ("ml/b/b",)


def test_a_full_gpu_that_nobody_is_owed_memory_on_is_lent_not_short() -> None:
    assert plan(gpu(share("ml/a/a", 20, 60), share("ml/b/b", 20, 20))) == Plan()


def test_lowest_priority_goes_first_then_the_most_lent_then_the_name() -> None:
    shares = [
        share("ml/big/c", 10, 40, priority=100),
        share("ml/small/c", 10, 12),
        share("ml/mid-b/c", 10, 20, priority=100),
        share("ml/mid-a/c", 10, 20, priority=100),
        share("ml/within/c", 10, 10),
        share("ml/gone/c", 10, 30, exiting=True),
    ]
    assert [s.unit for s in rank(shares)] == ["ml/small/c", "ml/big/c", "ml/mid-a/c", "ml/mid-b/c"]


def test_what_an_exiting_victim_holds_is_already_coming_back() -> None:
    borrower, other = share("ml/a/a", 10, 50), share("ml/c/c", 10, 20)
    grower = share("ml/b/b", 20, 8)
    first = plan(gpu(borrower, other, grower))  # 2 free, 12 owed + 2: short by 12
    assert [r.victim.unit for r in first.reclaims] == ["ml/a/a"]
    # The next tick, before it is gone: nobody else is picked for the same shortfall.
    exiting = share("ml/a/a", 10, 50, exiting=True)
    assert plan(gpu(exiting, other, grower)) == Plan()


def test_what_no_lender_can_cover_is_said() -> None:
    # 60 GiB held by processes of no container; the grower is owed 30: 24 short, and the
    # one lender lends 2 (it is held to its request of 10, not stopped whole).
    lender, owed = share("ml/a/a", 10, 12), share("ml/b/b", 30, 0)
    result = plan(gpu(lender, owed, other=60))
    assert [r.victim for r in result.reclaims] == [lender]
    assert result.uncovered == 22 * GiB


def test_victims_are_taken_until_what_they_lent_covers_the_shortfall() -> None:
    # 2 free, the grower owed 8, plus 2: 8 short. The first lends 6, the second 4.
    first, second = share("ml/a/a", 10, 16), share("ml/c/c", 10, 14)
    grower = share("ml/b/b", 20, 12)
    used = Gpu("GPU-0", 44 * GiB, 42 * GiB, (first, second, grower))
    assert [r.victim.unit for r in plan(used).reclaims] == ["ml/a/a", "ml/c/c"]


def test_processes_without_a_request_keep_the_watermark_free() -> None:
    """exec: nobody else declared a request, but the processes beside the command may grow:
    it borrows only while the watermark stays free for them."""
    borrower = share("ml/a/a", 20, 70)
    alone = Gpu("GPU-0", TOTAL, 79 * GiB, (borrower,))
    assert plan(alone) == Plan()  # a full GPU that nobody else is on is lent, not short
    beside = Gpu("GPU-0", TOTAL, 79 * GiB, (borrower,), unrequested=9 * GiB)
    (reclaim,) = plan(beside).reclaims
    assert reclaim.for_unrequested and reclaim.owed_to == () and reclaim.free == 1 * GiB
    assert reclaim.shortfall == DEFAULT_WATERMARK - 1 * GiB
    roomy = Gpu("GPU-0", TOTAL, 72 * GiB, (borrower,), unrequested=2 * GiB)
    assert plan(roomy) == Plan()


SIZES = st.integers(min_value=0, max_value=40)
SHARES = st.lists(
    st.builds(
        share,
        st.sampled_from("abcdefgh").map(lambda c: f"ml/{c}/c"),
        SIZES,
        SIZES,
        priority=st.integers(0, 3),
        exiting=st.booleans(),
    ),
    max_size=6,
    unique_by=lambda s: s.unit,
)


@given(SHARES, st.integers(min_value=0, max_value=20))
def test_never_below_request_never_twice_and_no_more_than_needed(
    shares: list[Share], other: int
) -> None:
    view = Gpu("GPU-0", TOTAL, sum(s.used for s in shares) + other * GiB, tuple(shares))
    result = plan(view)
    victims = [r.victim for r in result.reclaims]
    assert all(v.used > v.request and not v.exiting for v in victims)
    assert len({v.unit for v in victims}) == len(victims)
    short = shortfall(view, DEFAULT_WATERMARK) - sum(s.borrowed for s in shares if s.exiting)
    if victims:  # the last one was needed: without it, the GPU would still be short
        assert sum(v.borrowed for v in victims[:-1]) < short
        assert result.uncovered == max(short - sum(v.borrowed for v in victims), 0)
    else:
        assert short <= 0 or not rank(shares)


def device(index: int, used: int | None, *, total: int = 80, parent: str | None = None) -> Device:
    uuid = f"GPU-{index}"
    return Device(index, uuid, "H100", total * GiB, None if used is None else used * GiB, parent)


def process(pid: int, gpu: str, used: int) -> ProcessUsage:
    return ProcessUsage(ProcessKey(pid, pid), gpu, used * GiB)


def unit(name: str, limit: int, *usages: ProcessUsage, on: str | None = None) -> UnitUsage:
    totals = [
        ProcessTotal(u.key, u.used_bytes or 0, ((u.device_uuid, u.used_bytes),)) for u in usages
    ]
    return UnitUsage(name, limit * GiB, tuple(totals), device_uuid=on)


def test_a_request_over_all_gpus_lends_on_each_what_it_holds_above_it() -> None:
    """exec: a request of 10 and 14 held over two GPUs; 4 is lent, on either (the view
    cannot tell which bytes were the borrowed ones), and nothing is owed on either."""
    a, b = process(10, "GPU-0", 8), process(11, "GPU-1", 6)
    cmd = unit("cmd", 40, a, b)
    gpu0, gpu1 = views([device(0, 38), device(1, 6)], [cmd], {"cmd": 10 * GiB})
    assert gpu0.shares == (Share("cmd", 4 * GiB, 40 * GiB, 8 * GiB),)
    assert gpu0.unrequested == 30 * GiB and gpu0.used == 38 * GiB
    assert gpu1.shares == (Share("cmd", 2 * GiB, 40 * GiB, 6 * GiB),)
    assert gpu1.unrequested == 0
    # On one GPU only, its request is there: under it, it lends nothing and is owed the
    # rest (NVML shows where it runs); on a GPU it does not use, it is absent.
    (quiet,) = views([device(0, 38), device(2, 0)], [unit("cmd", 40, a)], {"cmd": 10 * GiB})[:1]
    assert quiet.shares[0].borrowed == 0 and quiet.shares[0].owed == 2 * GiB
    assert views([device(2, 0)], [unit("cmd", 40, a)], {"cmd": GiB})[0].shares == ()


def test_nothing_is_lent_of_what_the_driver_or_the_operator_reserves() -> None:
    """A GPU's memory in a view is what can be allocated on it, as the node advertises it:
    its total less NVML's `reserved` and `--reserve`. Pods hold 72 GiB, so 4 GiB is free
    of 80 less 1 less 3, while b is owed 2 more."""
    a, b = process(10, "GPU-0", 30), process(11, "GPU-0", 42)
    gpu = replace(device(0, 72), reserved_bytes=GiB)
    units = [unit("a", 40, a), unit("b", 44, b)]
    (seen,) = views([gpu], units, {"a": 10 * GiB, "b": 44 * GiB}, reserve_bytes=3 * GiB)
    assert (seen.total, seen.free) == (76 * GiB, 4 * GiB)
    assert plan(seen, watermark=5 * GiB).reclaims  # short by 3: the borrower gives back


@pytest.mark.parametrize("reserved", [450 * MiB, None])
def test_what_the_nodes_other_processes_use_of_the_reserve_is_counted_once(
    reserved: int | None,
) -> None:
    """`--reserve` keeps memory out of the capacity for the node's processes that are not
    pods (and, on a driver without memory info v2, for the driver's reserve, which v1 counts
    in `used`). NVML counts what they use in `used`: lending must not subtract it from the
    total as well, or borrowers are reclaimed that much early. A T4 (16 GiB) with a 450 MiB
    reserve held by them, and 10 GiB used by pods: the lender sees what the node advertises,
    less what the pods use, and sees anything they use beyond the reserve."""
    pods = process(10, "GPU-0", 10)
    held_by_others = 450 * MiB
    gpu = replace(device(0, 0, total=16), reserved_bytes=reserved)
    gpu = replace(gpu, used_bytes=10 * GiB + held_by_others)
    (seen,) = views([gpu], [unit("a", 12, pods)], {"a": 8 * GiB}, reserve_bytes=held_by_others)
    advertised = allocatable(gpu, held_by_others)
    assert seen.free == advertised - 10 * GiB
    assert seen.unrequested == held_by_others  # still there, to grow into the watermark
    more = replace(gpu, used_bytes=11 * GiB + held_by_others)  # they grow 1 GiB past it
    (seen,) = views([more], [unit("a", 12, pods)], {"a": 8 * GiB}, reserve_bytes=held_by_others)
    assert seen.free == advertised - 11 * GiB


def test_a_unit_of_one_gpu_has_its_request_there_and_is_owed_the_rest() -> None:
    """DRA: a request per GPU, so what a container does not use yet is owed to it."""
    a, b = process(10, "GPU-0", 30), process(11, "GPU-0", 4)
    borrower, grower = unit("a@GPU-0", 40, a, on="GPU-0"), unit("b@GPU-0", 20, b, on="GPU-0")
    (gpu,) = views([device(0, 34)], [borrower, grower], {"a@GPU-0": 10 * GiB, "b@GPU-0": 20 * GiB})
    assert gpu.shares == (
        Share("a@GPU-0", 10 * GiB, 40 * GiB, 30 * GiB),
        Share("b@GPU-0", 20 * GiB, 20 * GiB, 4 * GiB),
    )
    assert gpu.unrequested == 0


def test_all_else_the_gpu_holds_declared_no_request() -> None:
    """Other units' processes, processes nobody could attribute, the driver's own: unknown
    is not free, so it all may grow, and the watermark is kept for it."""
    a, b = process(10, "GPU-0", 30), process(11, "GPU-0", 4)
    (gpu,) = views(
        [device(0, 35)],
        [unit("a", 40, a), unit("(pod)", 0, b)],
        {"a": 10 * GiB},
        exiting=frozenset({"a"}),
    )
    assert gpu.unrequested == 5 * GiB and gpu.shares[0].exiting


def test_gpus_of_unknown_or_split_memory_are_left_out() -> None:
    """Unknown is not free; MIG's memory is split already."""
    a = process(10, "GPU-0", 30)
    devices = [device(0, None), device(1, 10), device(2, 1, parent="GPU-1")]
    assert views(devices, [unit("a", 40, a)], {"a": GiB}) == ()


def test_a_unit_reclaimed_on_two_gpus_is_explained_by_the_first() -> None:
    borrower = share("cmd", 0, 70)
    gpus = [Gpu(f"GPU-{i}", TOTAL, 79 * GiB, (borrower,), unrequested=GiB) for i in (1, 0)]
    chosen = reclaims(gpus)
    assert list(chosen) == ["cmd"] and chosen["cmd"].gpu == "GPU-0"
    assert reclaims([Gpu("GPU-0", TOTAL, 10 * GiB, (borrower,), GiB)]) == {}
