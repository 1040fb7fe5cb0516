"""The /metrics and /healthz endpoint under what any pod can send it (issue 42, item 6):
slow connections from many addresses, a request that drips past its deadline, a scraper that
does not read, a flood from one address, scrapes that pile up behind a render. /healthz is
answered throughout, and every connection ends within its bound."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from enforcer.edge import metrics_server
from enforcer.edge.http_server import HttpServer
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.metrics_server import CONNECTIONS, PER_PEER, serve_metrics
from tests.helpers import wait_for


def send(port: int, source: str, path: str = "/metrics") -> socket.socket:
    """One request from the local address `source` (loopback holds all of 127/8)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def answer(s: socket.socket) -> bytes:
    """All of its answer, to the server's end of it; generous timeouts for a loaded machine."""
    with s:
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def request(port: int, source: str, path: str = "/metrics") -> bytes:
    return answer(send(port, source, path))


def closed(telemetry: AgentTelemetry, reason: str) -> float:
    value = telemetry.registry.get_sample_value(
        "vram_enforcer_http_connections_closed_total", {"server": "metrics", "reason": reason}
    )
    return value or 0.0


@pytest.fixture
def telemetry() -> AgentTelemetry:
    t = AgentTelemetry()
    Gauge("vram_enforcer_probe", "a series to find", registry=t.registry).set(1)
    return t


@pytest.fixture
def serve(telemetry: AgentTelemetry) -> Iterator[Any]:
    """Start the endpoint, with `within` (request_within, answer_within, answers_in_flight)
    changed where a test needs it."""
    servers: list[HttpServer] = []

    def start(monkeypatch: pytest.MonkeyPatch, **within: float) -> HttpServer:
        monkeypatch.setattr(
            metrics_server, "LIMITS", dataclasses.replace(metrics_server.LIMITS, **within)
        )
        server = serve_metrics(telemetry, 0, "127.0.0.1", lambda: None)
        assert server is not None
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def test_slow_connections_from_many_addresses_holding_every_place_leave_healthz_answered(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight pods dripping a byte every 4 s held all 32 threads of the server before, and
    the kubelet's probe was closed unanswered. Now the pod holding the most makes way."""
    server = serve(monkeypatch, request_within=600.0)  # the drips outlast the test
    addresses = CONNECTIONS // PER_PEER + 1
    drips = []
    try:
        for i in range(addresses):
            for _ in range(PER_PEER):
                s = socket.create_connection(
                    ("127.0.0.1", server.port), timeout=30, source_address=(f"127.0.2.{i}", 0)
                )
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Drip: ")  # and then a byte now and then
                drips.append(s)
        over = addresses * PER_PEER - CONNECTIONS
        wait_for(lambda: closed(telemetry, "made-way") == over, what="every place to be held")
        probed = request(server.port, "127.0.0.3", "/healthz")  # the kubelet's liveness probe
        assert probed.startswith(b"HTTP/1.1 200 OK") and probed.endswith(b"\r\n\r\nok\n")
        assert closed(telemetry, "made-way") == over + 1  # one drip made way for it
        assert b"vram_enforcer_probe 1.0" in request(server.port, "127.0.0.4")  # Prometheus
    finally:
        for s in drips:
            s.close()


def test_a_request_that_drips_past_its_deadline_is_answered_408_and_closed(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every 0.2 s kept a 5 s timeout per read from ever firing: the deadline is the
    whole request's, from its first byte."""
    server = serve(monkeypatch, request_within=1.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Drip: ")
        s.settimeout(0.2)
        got = b""
        for _ in range(150):  # 30 s of dripping at most: 30 deadlines
            try:
                s.sendall(b"x")
            except OSError:  # reset: the server closed it after answering
                break
            try:
                if not (chunk := s.recv(65536)):
                    break
                got += chunk
            except TimeoutError:
                continue
        s.settimeout(30)
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                got += chunk
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert b"Connection: close" in got
    assert got.endswith(b"the request did not arrive whole within 1s\n")
    assert closed(telemetry, "deadline") == 1


def test_a_flood_of_idle_connections_from_one_address_costs_no_thread(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(monkeypatch, request_within=600.0)
    before = threading.active_count()
    flood = []
    try:
        for _ in range(500):  # what one pod can open
            flood.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        wait_for(lambda: closed(telemetry, "made-way") == 500 - PER_PEER, what="the flood")
        assert threading.active_count() == before  # not a thread per connection
        assert b"vram_enforcer_probe 1.0" in request(server.port, "127.0.0.2")  # Prometheus
        assert request(server.port, "127.0.0.3", "/healthz").endswith(b"ok\n")  # the kubelet
    finally:
        for s in flood:
            s.close()


class Gated(Collector):
    """A collector whose every collect waits to be let through: a render that takes as
    long as the test likes."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Semaphore(0)
        self.gates = [threading.Event() for _ in range(3)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gate = self.gates[self.calls]
        self.calls += 1
        self.called.release()
        assert gate.wait(timeout=60)
        yield GaugeMetricFamily("vram_enforcer_gated", "rendered when let through", value=1)


def test_healthz_is_answered_while_a_render_is_made_and_waiting_scrapes_share_the_next(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A render of a full node's series is about 76 ms of CPU: scrapes that come while one is
    made wait for the next, all of them for the same one, and a probe waits for none."""
    gated = Gated()
    telemetry.registry.register(gated)
    server = serve(monkeypatch)
    answers: dict[str, bytes] = {}

    def ask(name: str, source: str, path: str = "/metrics") -> threading.Thread:
        sent = send(server.port, source, path)  # in the kernel's queue while the loop renders
        t = threading.Thread(target=lambda: answers.setdefault(name, answer(sent)))
        t.start()
        return t

    first = ask("first", "127.0.0.2")
    assert gated.called.acquire(timeout=30)  # the first render is being made
    waiting = [ask(f"scrape-{i}", f"127.0.3.{i}") for i in range(10)]
    probe = ask("probe", "127.0.0.5", "/healthz")
    gated.gates[0].set()
    first.join(timeout=30)
    assert gated.called.acquire(timeout=30)  # the next render, for the ten that waited
    probe.join(timeout=30)
    assert answers["probe"].endswith(b"ok\n")  # answered while that render is being made
    assert not any(name.startswith("scrape") for name in answers)
    gated.gates[1].set()
    for t in waiting:
        t.join(timeout=30)
    assert all(b"vram_enforcer_gated 1.0" in answers[f"scrape-{i}"] for i in range(10))
    assert gated.calls == 2  # one render for all ten


def big_body(telemetry: AgentTelemetry) -> None:
    family = Gauge("vram_enforcer_padding", "many series", ["n"], registry=telemetry.registry)
    for n in range(40_000):  # about 2 MiB of text: more than the sockets' buffers hold
        family.labels(str(n)).set(n)


def unread_scrape(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def test_an_answer_its_scraper_does_not_take_is_dropped_at_its_deadline(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    big_body(telemetry)
    server = serve(monkeypatch, answer_within=1.0)
    with unread_scrape(server.port) as s:
        wait_for(lambda: closed(telemetry, "unread") == 1, what="the unread answer dropped")
        # Reset, not closed: what the kernel still held of the answer is freed at once.
        with pytest.raises(ConnectionResetError):
            answer(s)
    assert request(server.port, "127.0.0.3", "/healthz").endswith(b"ok\n")


def test_answers_not_taken_are_held_up_to_a_bound_the_longest_waiting_dropped_first(
    serve: Any, telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every unread answer is memory: a pod that scrapes and never reads, on every place,
    would hold a render on each. Past the bound, the oldest go."""
    big_body(telemetry)
    server = serve(monkeypatch, answer_within=600.0, answers_in_flight=1024 * 1024)
    with unread_scrape(server.port) as first:
        assert first.recv(1, socket.MSG_PEEK)  # its answer is being sent, and not taken
        with unread_scrape(server.port) as second:
            wait_for(lambda: closed(telemetry, "unread") == 1, what="the first to be dropped")
            first.settimeout(30)
            with contextlib.suppress(OSError):
                while first.recv(65536):
                    pass  # ends: closed by the server
            second.setblocking(False)
            assert second.recv(1)  # still being answered
    assert closed(telemetry, "unread") == 1


def test_a_client_that_closes_its_side_after_its_request_is_still_answered(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`printf 'GET /healthz ...' | nc`: the request, then the end of what it sends."""
    server = serve(monkeypatch)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        assert answer(s).endswith(b"\r\n\r\nok\n")


@pytest.mark.parametrize(
    "accept", ["text/plain; version=x.y", "application/openmetrics-text; version=garbage"]
)
def test_a_format_that_cannot_be_read_gets_the_text_format_not_a_500(
    serve: Any, monkeypatch: pytest.MonkeyPatch, telemetry: AgentTelemetry, accept: str
) -> None:
    """Whoever reaches the port chooses its `Accept`: prometheus_client raised on a version it
    could not parse, the scraper got a 500 and the agent counted a bug in its `metrics` loop,
    which operators alert on (issue 42's review)."""
    server = serve(monkeypatch)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n\r\n".encode())
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 200 ") and b"vram_enforcer_probe 1.0" in got, got[:200]
    bugs = telemetry.registry.get_sample_value(
        "vram_enforcer_unexpected_errors_total", {"loop": "metrics"}
    )
    assert not bugs
