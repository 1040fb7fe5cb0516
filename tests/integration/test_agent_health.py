"""The agent never half-works silently: a stopped thread ends it, and /healthz tells kubelet
when NVML passes stop completing."""

from __future__ import annotations

import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.metrics_server import serve_metrics
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import NvmlSource
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs
from enforcer.edge.tenants import TenantCache
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from enforcer.modes.agent import EXIT_THREAD_DIED, Passes, Sampler, health, watch
from tests.helpers import wait_for


@pytest.fixture
def blocked() -> Iterator[None]:
    """As in the agent's main thread: SIGTERM and SIGINT are only taken by sigtimedwait."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_a_thread_that_stops_ends_the_agent_with_status_1(
    blocked: None, caplog: pytest.LogCaptureFixture
) -> None:
    short = threading.Thread(target=lambda: None, name="nvml-sampler")
    waiting = threading.Event()
    long = threading.Thread(target=waiting.wait, name="usage-socket")
    short.start()
    long.start()
    try:
        assert watch([short, long], poll=0.05) == EXIT_THREAD_DIED
    finally:
        waiting.set()
    assert "the nvml-sampler thread has stopped" in caplog.text


def test_sigterm_ends_the_watch_with_status_0(blocked: None) -> None:
    waiting = threading.Event()
    alive = threading.Thread(target=waiting.wait)
    alive.start()
    try:
        # To this thread, which blocks it: other threads of the test run may not (the agent's
        # threads all inherit the block), and one of them would take a process-wide signal.
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        assert watch([alive], poll=0.05) == 0
    finally:
        waiting.set()


@pytest.fixture
def sampler(fake_nvml: Any, tmp_path: Path) -> Iterator[Sampler]:
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=2.0)
    nvml = Nvml()
    nvml.init()
    source = NvmlSource(nvml, PidView.host(ProcFs()))
    s = Sampler(source, server, telemetry, 0.02, Passes(), TenantCache(ProcFs()))
    yield s
    s.stop.set()
    if s.is_alive():
        s.join(timeout=30)
    source.close()


def test_healthz_fails_once_nvml_passes_stop_completing(sampler: Sampler, fake_nvml: Any) -> None:
    assert health(sampler, after=1.0) is not None  # not started: not healthy
    sampler.start()
    wait_for(lambda: health(sampler, after=1.0) is None, what="a healthy sampler")
    fake_nvml.state.data["query_delay_ms"] = 4_000  # the driver hangs inside a pass
    fake_nvml.write()
    problem = wait_for(lambda: health(sampler, after=1.0), what="the hang to be noticed")
    assert "no NVML pass has completed for" in problem and "the limit is 1s" in problem
    fake_nvml.state.data["query_delay_ms"] = 0
    fake_nvml.write()


def test_healthz_is_served_next_to_the_metrics(sampler: Sampler) -> None:
    problem: list[str | None] = [None]
    server = serve_metrics(AgentTelemetry(), 0, "127.0.0.1", lambda: problem[0])
    assert server is not None
    url = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
            assert (r.status, r.read()) == (200, b"ok\n")
        problem[0] = "no NVML pass has completed for 90s"
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url + "/healthz", timeout=5)
        assert failed.value.code == 503
        assert failed.value.read() == b"no NVML pass has completed for 90s\n"
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            assert b"vram_enforcer_source_up" in r.read()
    finally:
        server.close()
