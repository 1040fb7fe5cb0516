"""The /metrics (and /healthz) endpoint of every mode, bounded against floods.

Whoever can reach the port may connect: Prometheus, the kubelet's probes, and also the
workload beside a sidecar (on its loopback) or any pod of the cluster (the agent's port,
without a NetworkPolicy). One thread per connection, unbounded and without a timeout, let
500 idle connections make 502 threads: enough to get a sidecar with a 96 MiB limit
OOM-killed by its own workload, or the agent's liveness probe starved until the kubelet
restarted it. So each connection has `TIMEOUT` seconds per read, a peer address holds at
most `PER_PEER` connections at once and the server `CONNECTIONS`; a connection past
either is closed at once, so a flood from one address costs the others nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client import make_wsgi_app as metrics_app

from enforcer.edge.connection_bounds import BoundedConnections

log = logging.getLogger(__name__)

CONNECTIONS = 32  # at once, from everyone: scrapers and probes need a few
PER_PEER = 4  # at once, from one address (a scraper, a probe, or a flood)
TIMEOUT = 5.0  # seconds a connection may stay silent while its request is read or sent


class MetricsPortError(Exception):
    """`--metrics-port` cannot be served; the message names the flag, the address and why."""


Health = Callable[[], str | None]
"""None when healthy, else what is wrong (served on /healthz with HTTP 503)."""


def serve_metrics(
    registry: CollectorRegistry, port: int | None, address: str, health: Health | None = None
) -> MetricsServer | None:
    """Start the /metrics endpoint when a port is set (every mode shares this start-up rule)."""
    if port is None:
        return None
    try:
        server = MetricsServer(registry, port, address, health)
    except OSError as exc:
        raise MetricsPortError(
            f"--metrics-port {port}: cannot listen on {address}: {exc.strerror}"
        ) from exc
    log.info("serving metrics on http://%s:%d/metrics", address, server.port)
    return server


class _QuietHandler(WSGIRequestHandler):
    timeout = TIMEOUT  # set on the connection in setup(): no read or write waits longer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _BoundedServer(BoundedConnections, ThreadingMixIn, WSGIServer):
    """A thread per connection, within CONNECTIONS in all and PER_PEER per address."""

    connections = CONNECTIONS
    per_peer = PER_PEER
    daemon_threads = True
    request_queue_size = 128  # a flood is accepted (and closed) rather than left in the kernel

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("a metrics connection from %s failed", client_address, exc_info=True)


def _app(registry: CollectorRegistry, health: Health | None) -> Callable[..., Iterable[bytes]]:
    metrics = metrics_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if health is not None and environ.get("PATH_INFO") == "/healthz":
            problem = health()
            body = f"{problem or 'ok'}\n".encode()
            status = "200 OK" if problem is None else "503 Service Unavailable"
            start_response(
                status,
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


class MetricsServer:
    """/metrics (and, when given a health check, /healthz), stoppable for a clean shutdown."""

    def __init__(
        self, registry: CollectorRegistry, port: int, address: str, health: Health | None = None
    ) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class Server(_BoundedServer):
            address_family = family

        self._server: _BoundedServer = make_server(
            str(sockaddr[0]), port, _app(registry, health), Server, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def refused(self) -> int:
        """Connections closed at once, past a bound: how hard someone is knocking."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        with contextlib.suppress(OSError):
            self._server.server_close()
        self._thread.join(timeout=5)
