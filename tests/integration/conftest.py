"""Fixtures shared by the integration tests of the agent's socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer

# One registry for the session: its counters are read before and after what a test does.
TELEMETRY = AgentTelemetry()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UsageServer]:
    """The agent's usage server on a socket of the test's own."""
    t = TELEMETRY
    metrics = ServerMetrics(t.requests, t.connections, t.unexpected)
    s = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=60.0)
    s.start()
    yield s
    s.close()
