"""Which enforcement tier holds a limit on this machine, and why (pure): the one choice that
`doctor`, `exec` and the node agent make from what a probe found, and report alike.

A tier is one way of holding a unit to its limit. Sampling is the floor and the backstop
everywhere: it sees usage one interval late and stops the offender. Tiers above it refuse
the allocation itself, so the offender gets an out-of-memory error it can handle and its
neighbours never see the overshoot: the driver's per-cgroup limits (NVIDIA R615+).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from enforcer.core.model import LimitOutcome


class TierName(StrEnum):
    """The tiers, as logs, Events, series and docs name them."""

    DRIVER = "driver-limit"  # the driver refuses an allocation past the cgroup's limit
    SAMPLING = "sampling"  # usage read each interval, the offender stopped


@dataclass(frozen=True, slots=True)
class Probe:
    """What a probe found on this machine, as far as the choice depends on it."""

    driver_version: str  # "" where NVML could not be read
    nvml_error: str  # why NVML could not be read ("" where it could)
    cgroup_v2: str  # the cgroup v2 hierarchy's path, "" where there is none
    dmem: bool  # the kernel's dmem controller is in that hierarchy
    root: bool  # may set limits: NVML's Set needs root
    whole_gpus: tuple[str, ...]  # GPUs that can take a per-cgroup limit (not in MIG mode)
    mig_gpus: tuple[str, ...]  # GPUs in MIG mode: NVML takes no MIG handle
    # The driver's answer to a Get on the probed cgroup, per whole GPU: None where it
    # answered (a limit, or none), else why it could not.
    answers: tuple[tuple[str, LimitOutcome | None], ...] = ()
    toolkit_hook: bool = False  # NVIDIA's apply-cuda-memory-limits hook sets leaves here


@dataclass(frozen=True, slots=True)
class Choice:
    """The tier that holds limits here, on which GPUs, and why (one sentence a person reads:
    why this tier, and why not a better one on the GPUs it does not cover)."""

    tier: TierName
    gpus: tuple[str, ...]  # where the tier holds limits; sampling covers every GPU
    why: str

    @property
    def refuses(self) -> bool:
        """Whether an allocation past a limit is refused on some GPU, not only stopped."""
        return self.tier is not TierName.SAMPLING and bool(self.gpus)


def choose(probe: Probe) -> Choice:
    """The best tier the probe allows, with its reasons."""
    if probe.nvml_error:
        return Choice(TierName.SAMPLING, (), f"NVML cannot be read ({probe.nvml_error})")
    if not probe.cgroup_v2:
        return Choice(TierName.SAMPLING, (), "no cgroup v2 hierarchy: the driver's limits need one")
    able = tuple(gpu for gpu, answer in probe.answers if answer is None)
    why = [f"{gpu}: {answer.result.value}" for gpu, answer in probe.answers if answer is not None]
    if probe.mig_gpus:
        why.append(f"{', '.join(probe.mig_gpus)} in MIG mode: NVML takes no MIG handle")
    if not able:
        return Choice(TierName.SAMPLING, (), "; ".join(why) or "no GPU to limit")
    return Choice(TierName.DRIVER, able, "; ".join([f"driver {probe.driver_version}", *why]))
