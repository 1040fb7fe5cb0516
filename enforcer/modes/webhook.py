"""`vram-enforcer webhook`: AdmissionReview over HTTPS, with certificate reload.

One thread per connection (the API server keeps a few connections alive and reuses them).
TLS is wrapped per accepted connection with the *current* context, so a rotated certificate
is used for new connections while those in flight finish on the old one: nothing drops.
The handshake happens in the connection's thread, with a timeout, so a slow or broken
client never holds up `accept`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from enforcer.core.admission import (
    AdmissionSettings,
    BadReview,
    decode,
    review,
    sidecar_mode_for,
)
from enforcer.core.parsing import ascii_int
from enforcer.core.settings.webhook import WebhookSettings
from enforcer.edge import logs
from enforcer.edge.connection_bounds import BoundedConnections
from enforcer.edge.metrics import WebhookTelemetry
from enforcer.edge.metrics_server import MetricsPortError, serve_metrics

log = logging.getLogger(__name__)

EXIT_USAGE = 2
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
MAX_BODY = 4 * 1024 * 1024  # the API server's own request limit is 3 MiB
IO_TIMEOUT = 10.0
# How long a kept-alive connection may wait for its next request: longer than the API
# server keeps an idle connection to a webhook (Go's 90 s). Closed sooner, a connection can
# close just as the API server sends a review on it, which then fails with EOF (a POST is
# not retried): found by the creation-storm benchmark.
IDLE_TIMEOUT = 120.0
MAX_CONNECTIONS = 256
PER_PEER = 64
# Request bodies being decoded and reviewed at once, in bytes: a review of 3 MiB takes
# several times that in Python objects while it is answered. Pods as the API server sends
# them are tens of KiB, so hundreds fit; a flood of the largest bodies waits its turn, and
# the webhook stays inside its memory limit (chart: 128 MiB).
BODIES_IN_FLIGHT = 8 * 1024 * 1024


class CertError(Exception):
    """The certificate or key cannot be loaded; the message names the files and why."""


class CertReloader:
    """The TLS context for new connections, rebuilt when the files change on disk.

    Checked at most once a second, on accept. cert-manager and kubelet swap a Secret's
    files through a symlink, so a change is a new (inode, mtime, size) of either file. A
    half-written pair fails to load and is retried; the previous context stays in use.
    """

    def __init__(self, cert_file: str, key_file: str, telemetry: WebhookTelemetry) -> None:
        self._cert, self._key = cert_file, key_file
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._context = self._load()
        self._checked = time.monotonic()

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in (self._cert, self._key):
            try:
                st = os.stat(path)
            except OSError:
                out.append((0, 0, 0))
            else:
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._cert, self._key)
        except (OSError, ssl.SSLError) as exc:
            raise CertError(
                f"--tls-cert-file {self._cert} / --tls-key-file {self._key}: cannot load the "
                f"certificate and key ({exc}); give a PEM certificate and its private key"
            ) from exc
        return context

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= 1.0:
                self._checked = now
                signature = self._stat()
                if signature != self._signature:
                    try:
                        self._context = self._load()
                    except CertError as exc:
                        self._telemetry.cert_reloads.labels("error").inc()
                        log.warning(
                            "certificate changed but does not load yet: %s",
                            exc,
                            exc_info=logs.detail(exc),
                        )
                    else:
                        self._signature = signature
                        self._telemetry.cert_reloads.labels("ok").inc()
                        log.info("certificate reloaded from %s", self._cert)
            return self._context


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses its connections
    server: WebhookServer
    timeout = IO_TIMEOUT
    # Buffered, flushed once per answer: headers and body leave in one TLS record. Written
    # apart, Nagle on our side and delayed ACK on the client's cost 40 ms per review.
    wbufsize = 64 * 1024

    def setup(self) -> None:
        self.handshake_failed = False
        conn: ssl.SSLSocket = self.request
        conn.settimeout(IO_TIMEOUT)
        try:
            conn.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", self.client_address[0], exc)
            self.handshake_failed = True
        super().setup()

    def handle(self) -> None:
        if self.handshake_failed:
            return
        self.server.track(self, busy=False)
        try:
            super().handle()
        except (ssl.SSLError, OSError) as exc:
            log.debug("connection from %s ended: %s", self.client_address[0], exc)
        finally:
            self.server.untrack(self)

    def handle_one_request(self) -> None:
        # Between requests the connection is idle; a shutdown may close it then.
        self.server.track(self, busy=False)
        self.request.settimeout(IDLE_TIMEOUT)
        self.raw_requestline = self.rfile.readline(65537)
        self.request.settimeout(IO_TIMEOUT)
        self.server.track(self, busy=True)
        if not self.raw_requestline:
            self.close_connection = True
            return
        if len(self.raw_requestline) > 65536 or not self.parse_request():
            return
        method = getattr(self, f"do_{self.command}", None)
        if method is None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{self.command} is not supported"})
        else:
            method()
        self.wfile.flush()
        if self.server.stopping.is_set():
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/readyz":
            ready = not self.server.stopping.is_set()
            self._send(
                HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                {"status": "ok" if ready else "shutting down"},
            )
        elif self.path.partition("?")[0] == "/mutate":
            self._send(
                HTTPStatus.METHOD_NOT_ALLOWED, {"error": "POST an AdmissionReview to /mutate"}
            )
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}"})

    def do_POST(self) -> None:
        if self.path.partition("?")[0] != "/mutate":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; POST /mutate"})
            return
        started = time.perf_counter()
        result = self._mutate()
        telemetry = self.server.telemetry
        telemetry.requests.labels(result).inc()
        telemetry.duration.observe(time.perf_counter() - started)

    def _mutate(self) -> str:
        header = self.headers.get("Content-Length")
        length = None if header is None else ascii_int(header.strip(), 20)
        if length is None:
            self.close_connection = True
            self._send(
                HTTPStatus.LENGTH_REQUIRED,
                {"error": "a Content-Length of ASCII digits is required"},
            )
            self._linger()
            return "invalid"
        if length > MAX_BODY:
            self.close_connection = True  # the body is not read: the connection cannot go on
            problem = f"the body is {length} bytes; at most {MAX_BODY} are accepted"
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": problem})
            self._linger()
            return "invalid"
        if not self.server.bodies.acquire(length, IO_TIMEOUT):
            self.close_connection = True  # the body is not read: the connection cannot go on
            self._send(
                HTTPStatus.SERVICE_UNAVAILABLE,
                {"error": ("too many large reviews are being answered at once; retry")},
            )
            self._linger()
            return "invalid"
        try:
            return self._answer(self.rfile.read(length))
        finally:
            self.server.bodies.release(length)

    def _answer(self, body: bytes) -> str:
        try:
            outcome = review(decode(body), self.server.admission)
        except BadReview as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return "invalid"
        except Exception:  # a bug: answer, log it once with its traceback, keep serving
            log.exception("unexpected error while reviewing a pod")
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the webhook's log"}
            )
            return "error"
        self._send(HTTPStatus.OK, outcome.review)
        if outcome.result == "denied":
            log.info("denied: %s", outcome.review["response"]["status"]["message"])
        return outcome.result

    def _linger(self) -> None:
        """Read and drop what the client still sends (for a second at most) before closing:
        closing on unread data resets the connection, and the client loses our answer."""
        self.wfile.flush()
        self.request.settimeout(0.2)
        deadline = time.monotonic() + 1.0
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline and self.rfile.read1(65536):
                pass

    def _send(self, status: HTTPStatus, doc: Mapping[str, object]) -> None:
        payload = json.dumps(doc, separators=(",", ":")).encode()
        if self.server.stopping.is_set():
            self.close_connection = True  # shutting down: this is the connection's last answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.client_address[0], format % args)


class ByteBudget:
    """Bytes that may be held at once; a request past them waits, for a while."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._changed = threading.Condition()

    def acquire(self, size: int, timeout: float) -> bool:
        size = min(size, self._total)  # a body of MAX_BODY still gets its turn, alone
        with self._changed:
            if not self._changed.wait_for(lambda: self._free >= size, timeout):
                return False
            self._free -= size
            return True

    def release(self, size: int) -> None:
        with self._changed:
            self._free += min(size, self._total)
            self._changed.notify_all()


class WebhookServer(BoundedConnections, ThreadingHTTPServer):
    """HTTPS with a per-connection, current TLS context, and a shutdown that drains.

    Anyone who reaches the Service may connect (unless a NetworkPolicy says otherwise), and
    each connection is a thread: at most MAX_CONNECTIONS at once, PER_PEER from one address
    (the API server keeps a pool of connections, from a few addresses)."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True
    connections = MAX_CONNECTIONS
    per_peer = PER_PEER
    request_queue_size = 128

    def __init__(
        self,
        settings: WebhookSettings,
        admission: AdmissionSettings,
        tls: CertReloader,
        telemetry: WebhookTelemetry,
    ) -> None:
        self.admission = admission
        self.bodies = ByteBudget(BODIES_IN_FLIGHT)
        self.tls = tls
        self.telemetry = telemetry
        self.stopping = threading.Event()
        self._connections: dict[_Handler, bool] = {}
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in settings.address else socket.AF_INET
        self.address_family = family
        super().__init__((settings.address, settings.port), _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = self.socket.accept()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wrapped = self.tls.context().wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        except (ssl.SSLError, OSError):
            conn.close()
            raise
        return wrapped, addr

    def track(self, handler: _Handler, busy: bool) -> None:
        with self._lock:
            self._connections[handler] = busy
            idle_while_stopping = self.stopping.is_set() and not busy
        if idle_while_stopping:
            _shut(handler)

    def untrack(self, handler: _Handler) -> None:
        with self._lock:
            self._connections.pop(handler, None)

    def drain(self) -> None:
        """Stop accepting; idle keep-alive connections close, busy ones finish first."""
        self.stopping.set()
        self.shutdown()
        with self._lock:
            idle = [h for h, busy in self._connections.items() if not busy]
        for handler in idle:
            _shut(handler)
        self.server_close()  # joins the connection threads (block_on_close)


def _shut(handler: _Handler) -> None:
    with contextlib.suppress(OSError):
        handler.request.shutdown(socket.SHUT_RDWR)


def run(settings: WebhookSettings) -> int:
    # Blocked before any thread starts, so every thread inherits the mask and only the
    # sigwait() below takes the signals. (A handler setting an Event lost a SIGTERM that
    # the kernel delivered to a connection's thread: the main thread slept on.)
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    admission = settings.admission
    if admission.sidecar_mode == "auto":
        # The kubernetes client (about 40 MiB) is loaded only for this one question.
        from enforcer.edge.kube import KubeError, connect, server_version  # noqa: PLC0415

        try:
            version = server_version(connect(settings.kubeconfig))
        except KubeError as exc:
            log.error(
                "--sidecar-mode auto: cannot read the API server's version (%s); "
                "set --sidecar-mode native or container",
                exc,
                exc_info=logs.detail(exc),
            )
            return EXIT_USAGE
        admission = dataclasses.replace(admission, sidecar_mode=sidecar_mode_for(version))
        log.info(
            "the API server is %s: sidecars are injected as %s", version, admission.sidecar_mode
        )
    telemetry = WebhookTelemetry()
    templates = None
    if admission.dra_class is not None:
        # The client and the template maker are loaded only in DRA mode.
        from enforcer.edge.kube import KubeError, connect  # noqa: PLC0415
        from enforcer.modes.claim_templates import TemplateMaker  # noqa: PLC0415

        try:
            api = connect(settings.kubeconfig)
        except KubeError as exc:
            log.error(
                "--dra-device-class: the webhook makes claim templates, and cannot reach "
                "the API server (%s)",
                exc,
                exc_info=logs.detail(exc),
            )
            return EXIT_USAGE
        templates = TemplateMaker(api, admission, telemetry.unexpected.labels("claim-templates"))
        log.info("DRA mode: declared VRAM becomes claims on DeviceClass %s", admission.dra_class)
    try:
        tls = CertReloader(settings.tls_cert_file, settings.tls_key_file, telemetry)
        server = WebhookServer(settings, admission, tls, telemetry)
    except CertError as exc:
        log.error("%s", exc, exc_info=logs.detail(exc))
        return EXIT_USAGE
    except OSError as exc:
        log.error(
            "--port %d: cannot listen on %s: %s", settings.port, settings.address, exc.strerror
        )
        return EXIT_USAGE
    try:
        metrics = serve_metrics(telemetry.registry, settings.metrics_port, settings.metrics_address)
    except MetricsPortError as exc:
        log.error("%s", exc, exc_info=logs.detail(exc))
        server.server_close()
        return EXIT_USAGE
    serving = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    serving.start()
    log.info(
        "serving admission reviews on https://%s:%d/mutate (sidecar %s, %s mode)",
        settings.address,
        server.server_address[1],
        admission.sidecar_image,
        admission.sidecar_mode,
    )
    if templates is not None:
        templates.start()
    received = signal.sigwait(_STOP_SIGNALS)
    log.info("%s: shutting down, finishing requests in flight", signal.Signals(received).name)
    server.drain()
    if templates is not None:
        templates.close()
    if metrics is not None:
        metrics.close()
    log.info("stopped")
    return 0
