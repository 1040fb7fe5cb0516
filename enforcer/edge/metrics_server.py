"""The /metrics (and /healthz) endpoint of every mode: the agent's, `exec --metrics-port`'s
and the webhook's metrics port.

Whoever reaches the port may connect: Prometheus, the kubelet's probes, and any pod of the
cluster (the agent's pod IP, without a NetworkPolicy). So it is served by
`http_server.HttpServer`: a request whole within `REQUEST_WITHIN` of its first byte, an
answer taken within `ANSWER_WITHIN`, and when it is full the peer holding the most makes
way (issue 42, item 6: eight pods dripping a byte every 4 s took all 32 threads of the
thread-per-connection server before, and the kubelet, its liveness probe starved,
restarted the agents). `/healthz` is answered at once, on the server's own thread; a
render of /metrics (about 76 ms of CPU for a node of 110 pods) at most once per pass of
the loop, and shared by every scrape waiting for the same one, so a probe waits for one
render at most however many scrapes come.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from enforcer.core.fairness import Bounds
from enforcer.core.http_exchange import Answer, Head, Later, Limits, Request
from enforcer.edge.http_connection import listen_tcp
from enforcer.edge.http_server import Counts, HttpServer

log = logging.getLogger(__name__)

CONNECTIONS = 256  # at once, from everyone; each costs a socket, no thread
PER_PEER = 8  # at once, from one address (a scraper, the kubelet's two probes)
REQUEST_WITHIN = 5.0  # a request's head, from its first byte (from accept, for a new one)
ANSWER_WITHIN = 10.0  # a whole /metrics body taken by the scraper
# The kernel's for what a connection sends (it doubles it): a body of 1 MiB leaves without
# waiting on the scraper's delayed ACKs (16 KiB tripled a scrape's time on loopback).
SEND_BUFFER = 64 * 1024
# Bytes of answers not yet taken, at once: each /metrics body of a full node is about 1 MiB.
ANSWERS_IN_FLIGHT = 16 * 1024 * 1024
LIMITS = Limits(
    Bounds(CONNECTIONS, PER_PEER), REQUEST_WITHIN, ANSWER_WITHIN, 0.0, 0, 0, ANSWERS_IN_FLIGHT
)


class MetricsPortError(Exception):
    """`--metrics-port` cannot be served; the message names the flag, the address and why."""


class Served(Counts, Protocol):
    """A mode's telemetry: its registry, and where its servers count."""

    @property
    def registry(self) -> CollectorRegistry: ...


Health = Callable[[], str | None]
"""None when healthy, else what is wrong (served on /healthz with HTTP 503)."""


def serve_metrics(
    telemetry: Served, port: int | None, address: str, health: Health | None = None
) -> HttpServer | None:
    """Start the /metrics endpoint when a port is set (every mode shares this start-up rule);
    its thread is `metrics`."""
    if port is None:
        return None
    try:
        listener = listen_tcp(address, port, SEND_BUFFER)
    except OSError as exc:
        raise MetricsPortError(
            f"--metrics-port {port}: cannot listen on {address}: {exc.strerror}"
        ) from exc
    server = HttpServer(
        listener, LIMITS, _app(telemetry.registry, health), _refusal, telemetry, "metrics"
    )
    server.start()
    log.info("serving metrics on http://%s:%d/metrics", address, server.port)
    return server


def _text(status: HTTPStatus, text: str, fields: tuple[tuple[str, str], ...] = ()) -> Answer:
    return Answer(status, f"{text}\n".encode(), fields=fields)


def _refusal(head: Head | None, status: HTTPStatus, why: str) -> Answer:
    return _text(status, why)


def _encoder(accept: str) -> tuple[Callable[..., bytes], str]:
    """The format the scraper asks for (`Accept`), or the text format, Prometheus' first,
    when it asks for one that cannot be read: prometheus_client raises on a version it
    cannot parse (`text/plain; version=x.y`), and whoever reaches the port chooses it."""
    try:
        return choose_encoder(accept)
    except (TypeError, ValueError):
        return choose_encoder("")


def _app(registry: CollectorRegistry, health: Health | None) -> Callable[[Request], Answer | Later]:
    def app(request: Request) -> Answer | Later:
        if request.method not in ("GET", "HEAD"):
            allowed = (("Allow", "GET, HEAD"),)
            return _text(HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method} is not served", allowed)
        if request.path == "/healthz" and health is not None:
            problem = health()
            return _text(
                HTTPStatus.OK if problem is None else HTTPStatus.SERVICE_UNAVAILABLE,
                problem or "ok",
            )
        if request.path != "/metrics":
            return _text(HTTPStatus.NOT_FOUND, f"no such path {request.path!r}; GET /metrics")
        encoder, content_type = _encoder(request.headers.get("accept", ""))
        gzipped = gzip_accepted(request.headers.get("accept-encoding", ""))
        names = tuple(sorted(parse_qs(request.target.partition("?")[2]).get("name[]", [])))

        def render() -> Answer:
            chosen = registry.restricted_registry(names) if names else registry
            body = encoder(chosen)
            if gzipped:
                return Answer(
                    HTTPStatus.OK,
                    gzip.compress(body),
                    content_type,
                    (("Content-Encoding", "gzip"),),
                )
            return Answer(HTTPStatus.OK, body, content_type)

        return Later(render, (content_type, gzipped, names))

    return app
