"""The node agent's enforcement tier: its node's `tier_choice.choose` over the tier probe of
the kubelet's `kubepods` cgroup, made at start and again every `PROBE_EVERY`, logged once
and whenever it changes, served as `vram_enforcer_node_tier{tier}`, and read by the hard
limiter for why no pod here gets a hard limit (`HardLimiter._node_reason`)."""

from __future__ import annotations

import logging
import threading

from enforcer.core.tier_choice import Choice, TierName, choose
from enforcer.edge.guard import LoopGuard
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.tier_probe import TierProbe

log = logging.getLogger(__name__)

# The driver, the cgroup tree and the CDI specs change rarely (an upgrade, a reboot, an
# operator's `+dmem`): a probe is a few NVML reads and file reads, once a minute.
PROBE_EVERY = 60.0


def told(choice: Choice, telemetry: AgentTelemetry, before: Choice | None = None) -> None:
    """Log the node's choice where it is new, and serve it: 1 for its tier, 0 for others."""
    if choice != before:
        log.info("this node's enforcement %s", choice.said())
    for tier in TierName:
        telemetry.node_tier.labels(str(tier)).set(1 if tier is choice.tier else 0)


class TierWatch(threading.Thread):
    """Probes this node's tier every `every` seconds, the first time before it starts."""

    def __init__(
        self, nvml: Nvml, probe: TierProbe, telemetry: AgentTelemetry, every: float = PROBE_EVERY
    ) -> None:
        """`nvml`: a session of its own (NVML counts initialisations)."""
        super().__init__(name="tier-watch", daemon=True)
        self._nvml = nvml
        self._probe = probe
        self._telemetry = telemetry
        self._every = every
        self.stop = threading.Event()
        self._guard = LoopGuard("tier-watch", telemetry.unexpected.labels("tier-watch"), log)
        # The choice the hard limiter reads: None until a probe was conclusive. One made
        # while NVML cannot be read, a file does not answer or a Get failed for a reason
        # that may pass (`Probe.conclusive`) is logged and served, not published: the
        # limiter keeps the last conclusive one, and must not tell each pod "sampling only"
        # for a driver that is re-initialising or a mount that hung for a moment.
        self.latest: Latest[Choice | None] = Latest(None)
        self._said: Choice | None = None
        self._said_inconclusive: Choice | None = None
        self._again()

    def run(self) -> None:
        while not self.stop.wait(self._every):
            self._guard.run(self._again)

    def _again(self) -> None:
        probe = self._probe.probe(self._nvml)
        choice = choose(probe)
        told(choice, self._telemetry, self._said)
        self._said = choice
        if probe.conclusive:
            self.latest.set(choice)
        elif choice != self._said_inconclusive:
            log.warning(
                "this node's tier probe was inconclusive; the hard limiter keeps %s",
                "its last choice" if self.latest.get() is not None else "to sampling until one",
            )
        self._said_inconclusive = None if probe.conclusive else choice
