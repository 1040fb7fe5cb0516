"""The enforcement tiers at the edge, built from one choice (`tier_for`): the driver's
per-cgroup limits (`driver_tier.DriverTier`), or sampling alone (`SamplingTier`, the null
tier: it holds nothing, and the sampler enforces as it does under every tier)."""

from __future__ import annotations

from collections.abc import Sequence

from enforcer.core.tier_choice import Choice, TierName
from enforcer.core.tiers import Held, Holds, Tier, Want
from enforcer.edge.driver_tier import DriverTier
from enforcer.edge.nvml import Nvml


class SamplingTier:
    """Sampling alone: no limit is written, none is said to hold."""

    name = TierName.SAMPLING

    def hold(self, wants: Sequence[Want]) -> list[Held]:
        return [Held(Holds.NONE) for _ in wants]


def tier_for(choice: Choice, nvml: Nvml) -> Tier:
    """The tier that `choice` names, holding limits through `nvml`."""
    if choice.tier is TierName.DRIVER:
        return DriverTier(nvml)
    return SamplingTier()
