"""One shape for the tiers: the factory builds the tier a choice names, and sampling alone
is the null tier, which holds nothing (the sampler enforces under every tier)."""

from typing import cast

from enforcer.core.tier_choice import Choice, TierName
from enforcer.core.tiers import Held, Holds, Want
from enforcer.edge.driver_tier import DriverTier
from enforcer.edge.nvml import Nvml
from enforcer.edge.tiers import SamplingTier, tier_for


class Untouched:
    """An NVML that no call may reach: the null tier writes and reads nothing."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"sampling alone called NVML's {name}")


def test_sampling_alone_is_the_null_tier_and_holds_nothing() -> None:
    tier = tier_for(Choice(TierName.SAMPLING, (), "no cgroup v2"), cast(Nvml, Untouched()))
    assert isinstance(tier, SamplingTier) and tier.name is TierName.SAMPLING
    wants = [Want("/k/pod", "GPU-0", 1 << 30), Want("/k/pod/a", "GPU-0", 1 << 29)]
    assert tier.hold(wants) == [Held(Holds.NONE), Held(Holds.NONE)]


def test_the_driver_limit_choice_builds_the_driver_tier() -> None:
    tier = tier_for(Choice(TierName.DRIVER, ("GPU-0",), ""), cast(Nvml, Untouched()))
    assert isinstance(tier, DriverTier) and tier.name is TierName.DRIVER
    assert tier.hold([]) == []
