"""How old a sample is, judged on the monotonic clock, between the agent's socket and the
sidecar's source: a step of the wall clock (NTP, a VM resumed, a person with `date -s`) must
neither make a frozen sample look fresh nor a fresh one stale."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import INITIAL_PID_NS, ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from tests.helpers import wait_for

HOST = ProcFs()
HOUR = 3600.0


def sample_stamped(wall: float) -> Sample:
    """This process's usage, stamped with the wall-clock time `wall`."""
    me = ProcessKey(os.getpid(), HOST.start_time(os.getpid()) or 0)
    gpu = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, GiB)
    return Sample(wall, (gpu,), (ProcessUsage(me, "GPU-0", GiB, ((INITIAL_PID_NS, me.pid),)),))


def serve(path: Path, stale_after: float) -> UsageServer:
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(path, HOST, metrics, stale_after=stale_after)
    server.start()
    return server


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "agent.sock"


def test_a_frozen_sample_goes_stale_however_the_wall_clock_stepped(socket_path: Path) -> None:
    """The agent's last sample carries a wall-clock time an hour ahead (the sidecar's clock
    stepped back): it is still stale once it stops being renewed."""
    server = serve(socket_path, stale_after=60.0)
    source = AgentLink(str(socket_path), stale_after=0.5)
    try:
        server.publish(sample_stamped(time.time() + HOUR))
        first = wait_for(lambda: isinstance(s := source.sample(), Sample) and s, what="a sample")
        assert [p.used_bytes for p in first.processes] == [GiB]  # it was seen, and fresh
        down = wait_for(
            lambda: isinstance(s := source.sample(), SourceDown) and s,
            what="the frozen sample to go stale",
        )
        assert "the node agent's last sample arrived" in down.reason
    finally:
        source.close()
        server.close()


def test_the_agent_judges_its_own_samples_by_when_it_published_them(socket_path: Path) -> None:
    """A sample stamped an hour ago (the agent's clock stepped forward) is fresh when just
    published; one published longer ago than the limit is stale whatever it is stamped."""
    server = serve(socket_path, stale_after=0.5)
    source = AgentLink(str(socket_path), stale_after=60.0)
    try:
        server.publish(sample_stamped(time.time() - HOUR))
        fresh = wait_for(lambda: isinstance(s := source.sample(), Sample) and s, what="a sample")
        assert [p.used_bytes for p in fresh.processes] == [GiB]
        source.close()
        server.publish(sample_stamped(time.time() + HOUR))
        time.sleep(0.6)
        late = AgentLink(str(socket_path), stale_after=60.0)
        try:

            def stale() -> str | None:
                s = late.sample()
                return s.reason if isinstance(s, SourceDown) and "stale" in s.reason else None

            assert "the last NVML sample is" in wait_for(stale, what="the agent to call it stale")
        finally:
            late.close()
    finally:
        source.close()
        server.close()
