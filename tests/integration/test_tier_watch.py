"""The agent's tier watch over a real cgroup laid out as the kubelet's, the fake NVML and
its real registry: the node's choice logged once at start and again only when it changes,
and served as vram_enforcer_node_tier{tier}."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from enforcer.core.tier_choice import Probe, TierName
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.tier_probe import TierProbe, pods_cgroup
from enforcer.modes.tier_watch import TierWatch
from tests.helpers import scratch_cgroup, wait_for

GPU = "GPU-00000000-fake-4000-8000-000000000000"


@pytest.fixture
def kubelet_root() -> Iterator[Path]:
    with scratch_cgroup() as root:
        (root / "kubepods.slice").mkdir()
        yield root


def tiers(telemetry: AgentTelemetry) -> dict[str, float]:
    text = generate_latest(telemetry.registry).decode()
    found = {}
    for tier in TierName:
        line = f'vram_enforcer_node_tier{{tier="{tier}"}} '
        (value,) = [ln.removeprefix(line) for ln in text.splitlines() if ln.startswith(line)]
        found[str(tier)] = float(value)
    return found


@contextlib.contextmanager
def watching(kubelet_root: Path, host: Path, telemetry: AgentTelemetry) -> Iterator[TierWatch]:
    """A tier watch of the kubelet's cgroups probing every 50 ms (made, so probed once, not
    started: the caller starts it), stopped and its NVML session shut down afterwards."""
    nvml = Nvml()
    watch = TierWatch(nvml, TierProbe(pods_cgroup(kubelet_root), host), telemetry, every=0.05)
    try:
        yield watch
    finally:
        watch.stop.set()
        if watch.is_alive():
            watch.join(5)
        nvml.shutdown()


def _tier(watch: TierWatch) -> TierName | None:
    choice = watch.latest.get()
    return None if choice is None else choice.tier


def test_the_nodes_choice_is_logged_once_served_and_said_again_when_it_changes(
    fake_nvml: Any, kubelet_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    caplog.set_level(logging.INFO, logger="enforcer.modes.tier_watch")
    telemetry = AgentTelemetry()
    nvml = Nvml()
    probe = TierProbe(pods_cgroup(kubelet_root), tmp_path)
    probes: list[Probe] = []
    probing = probe.probe
    probe.probe = lambda nvml: probes.append(probing(nvml)) or probes[-1]  # type: ignore[method-assign]
    watch = TierWatch(nvml, probe, telemetry, every=0.05)
    try:
        assert _tier(watch) is TierName.DRIVER
        assert tiers(telemetry) == {"driver-limit": 1.0, "allocation-gate": 0.0, "sampling": 0.0}
        watch.start()
        wait_for(lambda: len(caplog.records) >= 1, what="the choice at start")
        # The kubepods cgroup no longer answers: the driver says Not Supported for it.
        fake_nvml.state.inject_error("nvmlDeviceGetMemoryLimits_v1", "NOT_SUPPORTED")
        fake_nvml.write()
        wait_for(lambda: _tier(watch) is TierName.SAMPLING, what="the new choice")
        wait_for(lambda: tiers(telemetry)["sampling"] == 1.0, what="the series")
        assert tiers(telemetry)["driver-limit"] == 0.0
        later = len(probes) + 10
        wait_for(lambda: len(probes) >= later, what="10 probes more")
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2, said  # once at start, once on the change: not on every probe
        assert said[0].startswith(
            f"this node's enforcement tier driver-limit on {GPU}, sampling as the backstop: "
            "driver 615.43.02"
        )
        assert said[1].startswith(
            f"this node's enforcement tier sampling on {GPU}: cgroup "
            f"{kubelet_root / 'kubepods.slice'} has no dmem files (Not Supported)"
        )
    finally:
        watch.stop.set()
        watch.join(5)
        nvml.shutdown()


def test_a_choice_made_while_nvml_cannot_be_read_is_said_but_not_given_to_the_limiter(
    fake_nvml: Any, kubelet_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver is not loaded yet as the agent starts: the hard limiter gets no choice
    (it would tell each pod "sampling only", a lasting Event), the log and the series say
    sampling; once NVML answers, the driver's tier is chosen and given."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.data["init_error"] = "DRIVER_NOT_LOADED"
    fake_nvml.write()
    caplog.set_level(logging.INFO, logger="enforcer.modes.tier_watch")
    telemetry = AgentTelemetry()
    with watching(kubelet_root, tmp_path, telemetry) as watch:
        assert watch.latest.get() is None
        assert tiers(telemetry) == {"driver-limit": 0.0, "allocation-gate": 0.0, "sampling": 1.0}
        assert (
            caplog.records[0]
            .getMessage()
            .startswith("this node's enforcement tier sampling: NVML cannot be read (")
        )
        watch.start()
        fake_nvml.state.data["init_error"] = None
        fake_nvml.write()
        wait_for(lambda: _tier(watch) is TierName.DRIVER, what="the driver's tier, given")
        assert tiers(telemetry) == {"driver-limit": 1.0, "allocation-gate": 0.0, "sampling": 0.0}


def test_an_inconclusive_probe_is_said_but_the_limiter_keeps_the_last_conclusive_choice(
    fake_nvml: Any, kubelet_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Get on kubepods that fails for a reason that may pass (NVML's Unknown Error): the
    node's choice is said and served as sampling, but the hard limiter keeps the driver's
    tier, and does not tell each new pod "sampling only", a lasting Event."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    caplog.set_level(logging.INFO, logger="enforcer.modes.tier_watch")
    telemetry = AgentTelemetry()
    with watching(kubelet_root, tmp_path, telemetry) as watch:
        assert _tier(watch) is TierName.DRIVER
        watch.start()
        fake_nvml.state.inject_error("nvmlDeviceGetMemoryLimits_v1", "UNKNOWN")
        fake_nvml.write()
        wait_for(lambda: tiers(telemetry)["sampling"] == 1.0, what="the inconclusive choice, said")
        wait_for(
            lambda: any("inconclusive" in r.getMessage() for r in caplog.records),
            what="the warning",
        )
        assert _tier(watch) is TierName.DRIVER
