"""The /metrics and /healthz endpoint under a flood: idle connections from one address hold
at most a few threads, each for a bounded time, and a scraper or probe from another address
is served throughout."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from enforcer.edge import metrics_server
from enforcer.edge.metrics_server import PER_PEER, TIMEOUT, serve_metrics
from tests.helpers import wait_for


def scrape(port: int, source: str, path: str = "/metrics") -> bytes:
    """One request from the local address `source` (loopback holds all of 127/8)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_flood_of_idle_connections_holds_a_few_threads_and_others_are_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_server._QuietHandler, "timeout", 60.0)
    registry = CollectorRegistry()
    Gauge("vram_enforcer_probe", "a series to find", registry=registry).set(1)
    server = serve_metrics(registry, 0, "127.0.0.1", lambda: None)
    assert server is not None
    before = threading.active_count()
    flood = []
    try:
        for _ in range(500):  # what the workload beside a sidecar could open on its loopback
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        wait_for(lambda: server.refused == 500 - PER_PEER, what="the flood to be refused")
        assert threading.active_count() - before == PER_PEER  # not 500
        assert b"vram_enforcer_probe 1.0" in scrape(server.port, "127.0.0.2")  # Prometheus
        assert scrape(server.port, "127.0.0.3", "/healthz").endswith(b"ok\n")  # the kubelet
    finally:
        for s in flood:
            s.close()
        server.close()


def test_a_silent_connection_is_closed_after_the_timeout() -> None:
    server = serve_metrics(CollectorRegistry(), 0, "127.0.0.1")
    assert server is not None
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as silent:
            started = time.monotonic()
            assert silent.recv(1024) == b""  # the server hung up on it
            assert time.monotonic() - started < TIMEOUT + 5
    finally:
        server.close()
