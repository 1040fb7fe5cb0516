"""The benchmarks' in-process parts still call the code they measure as it is today: a
bench that no longer runs measures nothing (reclaim_bench called `lending.tenants` without
its GPU-memory argument for a whole release, unnoticed)."""

from __future__ import annotations

from bench import reclaim_bench


def test_the_lending_bench_builds_the_tenants_it_claims_to_measure() -> None:
    found = reclaim_bench.lending_cost(0.01, pods=10, gpus=2)
    # Its own assertions check the tenants of each case: 10, half of them borrowing.
    assert set(found) >= {"no_ceilings", "half_bursting", "dra_half_bursting"}
    assert all(found[case]["pass_us"] > 0 for case in ("half_bursting", "dra_half_bursting"))
