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
        # The choice the hard limiter reads: None until NVML has answered a probe. One made
        # while NVML cannot be read is logged and served, not published: the sampler says
        # that NVML is down, and the limiter, which acts only on a pass of NVML, must not
        # tell each pod "sampling only" for a driver that is starting or re-initialising.
        self.latest: Latest[Choice | None] = Latest(None)
        self._said: Choice | None = None
        self._again()

    def run(self) -> None:
        while not self.stop.wait(self._every):
            self._guard.run(self._again)

    def _again(self) -> None:
        probe = self._probe.probe(self._nvml)
        choice = choose(probe)
        told(choice, self._telemetry, self._said)
        self._said = choice
        if not probe.nvml_error:
            self.latest.set(choice)
