"""Fixtures shared by the integration tests of the agent's socket."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sidecar_dialer import Dialer, dial_container
from enforcer.edge.usage_server import ServerHooks, ServerMetrics, UsageServer
from enforcer.modes.sidecar_watch import SidecarWatch
from tests.helpers import wait_for

# One registry for the session: its counters are read before and after what a test does.
TELEMETRY = AgentTelemetry()


@contextlib.contextmanager
def serving(path: Path, hooks: ServerHooks | None = None) -> Iterator[UsageServer]:
    """The agent's usage server on `path`, started, with `hooks` (as an agent that serves
    pods builds it)."""
    t = TELEMETRY
    metrics = ServerMetrics(t.requests, t.connections, t.unexpected)
    s = UsageServer(path, ProcFs(), metrics, stale_after=60.0, hooks=hooks)
    s.start()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UsageServer]:
    """The agent's usage server on a socket of the test's own."""
    with serving(tmp_path / "agent.sock") as s:
        yield s


def dialer() -> Dialer:
    """The agent's dials of sidecars, as it makes them (each on a thread of its own)."""
    return Dialer(
        functools.partial(dial_container, ProcFs()),
        lambda: None,
        TELEMETRY.unexpected.labels("sidecar-dial"),
    )


def check_and_dial(watch: SidecarWatch, dials: Dialer) -> None:
    """One check of the watch, the dials it started to their end, and the check that takes
    what they found: as the watch's thread runs when a dial that ended wakes it."""
    watch.check()
    wait_for(lambda: not dials.in_flight, what="the dials to end")
    watch.check()
