"""The reclaim decision: who gives back memory lent above requests, on one GPU."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.model import GiB
from enforcer.core.reclaim import DEFAULT_WATERMARK, Gpu, Plan, Share, plan, rank, shortfall

TOTAL = 80 * GiB


def gpu(*shares: Share, other: int = 0) -> Gpu:
    """An 80 GiB GPU whose used memory is its containers' plus `other` (processes of none)."""
    return Gpu("GPU-0", TOTAL, sum(s.used for s in shares) + other * GiB, shares)


def share(unit: str, request: int, used: int, *, ceiling: int | None = None, priority: int = 0,
          exiting: bool = False) -> Share:  # fmt: skip
    return Share(unit, request * GiB, (ceiling or 80) * GiB, used * GiB, priority, exiting)


def test_a_burster_is_left_alone_while_the_gpu_can_honour_every_request() -> None:
    # 20 GiB free: the other container is owed 16 of its 20, plus the watermark.
    burster, owed = share("ml/a/a", 20, 40), share("ml/b/b", 20, 4)
    assert plan(gpu(burster, owed)) == Plan()
    # 16 free, exactly what is owed: the watermark is what is short.
    burster = share("ml/a/a", 20, 60)
    assert shortfall(gpu(burster, owed), 0) == 0
    assert shortfall(gpu(burster, owed), DEFAULT_WATERMARK) == DEFAULT_WATERMARK
    assert [r.victim for r in plan(gpu(burster, owed)).reclaims] == [burster]


def test_the_burster_is_reclaimed_when_a_neighbour_grows_within_its_request() -> None:
    burster, grower = share("ml/a/a", 20, 60), share("ml/b/b", 20, 12)
    # 8 GiB free; the grower is owed 8, plus the watermark: 2 GiB short.
    (reclaim,) = plan(gpu(burster, grower)).reclaims
    assert reclaim.victim == burster and reclaim.gpu == "GPU-0"
    assert reclaim.shortfall == 2 * GiB and reclaim.owed_to == ("ml/b/b",)


def test_a_full_gpu_that_nobody_is_owed_memory_on_is_lent_not_short() -> None:
    assert plan(gpu(share("ml/a/a", 20, 60), share("ml/b/b", 20, 20))) == Plan()


def test_lowest_priority_goes_first_then_the_most_lent_then_the_name() -> None:
    shares = [share("ml/big/c", 10, 40, priority=100), share("ml/small/c", 10, 12),
              share("ml/mid-b/c", 10, 20, priority=100), share("ml/mid-a/c", 10, 20, priority=100),
              share("ml/within/c", 10, 10), share("ml/gone/c", 10, 30, exiting=True)]  # fmt: skip
    assert [s.unit for s in rank(shares)] == ["ml/small/c", "ml/big/c", "ml/mid-a/c", "ml/mid-b/c"]


def test_what_an_exiting_victim_holds_is_already_coming_back() -> None:
    burster, other = share("ml/a/a", 10, 50), share("ml/c/c", 10, 20)
    grower = share("ml/b/b", 20, 8)
    first = plan(gpu(burster, other, grower))  # 2 free, 12 owed + 2: short by 12
    assert [r.victim.unit for r in first.reclaims] == ["ml/a/a"]
    # The next tick, before it is gone: nobody else is picked for the same shortfall.
    exiting = share("ml/a/a", 10, 50, exiting=True)
    assert plan(gpu(exiting, other, grower)) == Plan()


def test_what_no_lender_can_cover_is_said() -> None:
    # 60 GiB held by processes of no container; the grower is owed 30: 24 short, and the
    # one lender holds 12.
    lender, owed = share("ml/a/a", 10, 12), share("ml/b/b", 30, 0)
    result = plan(gpu(lender, owed, other=60))
    assert [r.victim for r in result.reclaims] == [lender]
    assert result.uncovered == 12 * GiB


SIZES = st.integers(min_value=0, max_value=40)
SHARES = st.lists(st.builds(share, st.sampled_from("abcdefgh").map(lambda c: f"ml/{c}/c"), SIZES, SIZES,
                            priority=st.integers(0, 3), exiting=st.booleans()),
                  max_size=6, unique_by=lambda s: s.unit)  # fmt: skip


@given(SHARES, st.integers(min_value=0, max_value=20))
def test_never_below_request_never_twice_and_no_more_than_needed(
    shares: list[Share], other: int
) -> None:
    view = Gpu("GPU-0", TOTAL, sum(s.used for s in shares) + other * GiB, tuple(shares))
    result = plan(view)
    victims = [r.victim for r in result.reclaims]
    assert all(v.used > v.request and not v.exiting for v in victims)
    assert len({v.unit for v in victims}) == len(victims)
    short = shortfall(view, DEFAULT_WATERMARK) - sum(s.used for s in shares if s.exiting)
    if victims:  # the last one was needed: without it, the GPU would still be short
        assert sum(v.used for v in victims[:-1]) < short
        assert result.uncovered == max(short - sum(v.used for v in victims), 0)
    else:
        assert short <= 0 or not rank(shares)
