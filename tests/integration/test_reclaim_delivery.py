"""A reclaim the agent decided travels with the sample it was decided on, to the victim's
own pod only: the agent's real socket server and the sidecar's real client."""

from __future__ import annotations

import os
import time
from pathlib import Path

from enforcer.core.lending import Lending
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.reclaim import Reclaim, Share
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from tests.helpers import wait_for

HOST = ProcFs()
# Two pods' PID namespaces (inodes), each process seen from the host (level 0) and its pod.
POD_A, POD_B, HOST_NS = 4026531001, 4026531002, 4026531836
VICTIM, NEIGHBOUR = "a" * 64, "b" * 64


def test_only_the_victims_namespaces_hear_of_its_reclaim(tmp_path: Path) -> None:
    borrower = ProcessUsage(ProcessKey(100, 1), "GPU-0", 6 * GiB, ((HOST_NS, 100), (POD_A, 7)))
    neighbour = ProcessUsage(ProcessKey(200, 2), "GPU-0", 2 * GiB, ((HOST_NS, 200), (POD_B, 7)))
    gpu = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, 68 * GiB)
    sample = Sample(time.time(), (gpu,), (borrower, neighbour))
    asked = Reclaim(
        "GPU-0", Share("ml/a/c", 2 * GiB, 8 * GiB, 6 * GiB), 4 * GiB, ("ml/b/c",), 12 * GiB
    )
    lending = Lending((), {VICTIM: asked}, {VICTIM: frozenset({borrower.key})})
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(tmp_path / "agent.sock", HOST, metrics, stale_after=60.0)
    server.publish(sample, lending)
    try:
        own, other = PidView(HOST, POD_A, 1), PidView(HOST, POD_B, 1)
        assert b'"reclaims":[{"container_id":"' + VICTIM.encode() in server.reply(own)
        assert server.reply(other).endswith(b'"lending":true,"lending_dra":true,"reclaims":[]}\n')
        # The next sample without it takes it back: a reclaim is never older than its sample.
        server.publish(sample, Lending())
        assert server.reply(own).endswith(b'"lending":true,"lending_dra":true,"reclaims":[]}\n')
        server.publish(sample)  # an agent that decides no reclaims says nothing of them
        assert b"lending" not in server.reply(own)
    finally:
        server.close()


def test_the_sidecars_client_keeps_the_latest_and_forgets_it_with_the_agent(
    tmp_path: Path,
) -> None:
    """From the sidecar's side: what the last sample asked, and nothing once the agent is
    gone (no stale ask is acted on after a reconnect)."""
    path = tmp_path / "agent.sock"
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(path, HOST, metrics, stale_after=60.0)
    server.start()
    source = AgentLink(str(path), stale_after=5.0)
    try:
        pid = os.getpid()
        me = ProcessKey(pid, HOST.start_time(pid) or 0)
        mine = ProcessUsage(me, "GPU-0", GiB, ((HOST.pid_ns(pid) or 0, pid),))
        gpu = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, GiB)
        asked = Reclaim("GPU-0", Share("ml/a/c", 0, 8 * GiB, GiB), GiB, (), 0, True)
        server.publish(
            Sample(time.time(), (gpu,), (mine,)),
            Lending((), {VICTIM: asked}, {VICTIM: frozenset({me})}),
        )
        wait_for(lambda: source.sample() and source.reclaims, what="the ask to arrive")
        assert source.reclaims == {VICTIM: asked} and source.lending
    finally:
        server.close()
    wait_for(lambda: not isinstance(source.sample(), Sample), what="the agent to be gone")
    assert source.reclaims == {}
    source.close()
