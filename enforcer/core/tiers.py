"""One shape for every enforcement tier (pure): what a caller wants held, what holds after
one call, and the `Tier` protocol that the agent's hard limiter and `exec` both call,
modelled on NVIDIA's device plugin (`internal/plugin/manager/factory.go`: one interface,
a factory, a null implementation). `tier_choice.choose` picks the tier; `edge.tiers.tier_for`
builds it; sampling is the null tier, and the backstop under every other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from enforcer.core.model import LimitOutcome
from enforcer.core.tier_choice import TierName


@dataclass(frozen=True, slots=True)
class Want:
    """One cgroup to hold to `hard_bytes` on one GPU. `first`: the caller has not written
    there yet, so what is there is read before anything is written; `inherited`: the limit
    the caller holds the cgroup's parent to there (what a cgroup without dmem files reads
    as its own), None where it holds none; `adopt`: whether a limit equal to this one found
    there may be the caller's own (a restarted agent's)."""

    cgroup: str
    gpu: str
    hard_bytes: int
    first: bool = True
    inherited: int | None = None
    adopt: bool = True  # `hard_limits.first_read`: False where another writer sets it


class Holds(StrEnum):
    """What holds a wanted cgroup after one call."""

    SET = "set"  # written by us, and read back as written
    ADOPTED = "adopted"  # found as we would have set it: ours already
    FOREIGN = "foreign"  # someone else's limit: left as it is
    FAILED = "failed"  # nothing of ours: `outcome` says why
    NONE = "none"  # this tier holds nothing (sampling alone)


@dataclass(frozen=True, slots=True)
class Held:
    """The answer for one `Want`: what holds, the limit found or set (bytes), and the
    outcome of the tier's write or read."""

    holds: Holds
    hard_bytes: int = 0
    outcome: LimitOutcome | None = None  # why it FAILED; a write's outcome
    wrote: bool = False  # the tier wrote (NVML's Set), whatever came of it


class Tier(Protocol):
    """An enforcement tier: its name, and one call that makes the wanted limits hold."""

    @property
    def name(self) -> TierName: ...

    def hold(self, wants: Sequence[Want]) -> list[Held]:
        """What holds each of `wants`, in their order, after making them hold where this
        tier can."""
        ...
