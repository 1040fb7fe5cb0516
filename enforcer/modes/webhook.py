"""`vram-enforcer webhook`: AdmissionReview over HTTPS, with certificate reload.

Served by `http_server.HttpServer` on one thread: the API server keeps a few connections
alive and reuses them, and whoever else reaches the Service may connect too, so each request
has a whole-request deadline (TLS handshake, head and body within `REQUEST_WITHIN`), each
answer `ANSWER_WITHIN`, and when the server is full the peer holding the most makes way:
the API server and the kubelet's probes are served through a flood of slow connections
(issue 42, item 6). TLS is wrapped per accepted connection with the *current* context, so a
rotated certificate is used for new connections while those in flight finish on the old one:
nothing drops. Reviews are made one at a time between the loop's reads and writes; /healthz
and /readyz at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import ssl
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus

from enforcer.core.admission import (
    AdmissionSettings,
    BadReview,
    decode,
    review,
    sidecar_mode_for,
)
from enforcer.core.fairness import Bounds
from enforcer.core.http_exchange import Answer, Head, Later, Limits, Request
from enforcer.core.settings.webhook import WebhookSettings
from enforcer.edge import logs
from enforcer.edge.http_connection import listen_tcp
from enforcer.edge.http_server import HttpServer
from enforcer.edge.metrics import WebhookTelemetry
from enforcer.edge.metrics_server import MetricsPortError, serve_metrics

log = logging.getLogger(__name__)

EXIT_USAGE = 2
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
MAX_BODY = 4 * 1024 * 1024  # the API server's own request limit is 3 MiB
# A request, its TLS handshake (on a new connection), head and body, from its first byte;
# the API server waits at most 30 s for a review (10 s by default).
REQUEST_WITHIN = 10.0
ANSWER_WITHIN = 10.0  # from a request's last byte to its answer's, taken by the client
# How long a kept-alive connection may wait for its next request: longer than the API
# server keeps an idle connection to a webhook (Go's 90 s). Closed sooner, a connection can
# close just as the API server sends a review on it, which then fails with EOF (a POST is
# not retried): found by the creation-storm benchmark.
IDLE_TIMEOUT = 120.0
# At once: each connection costs a socket, its TLS state (about 17 KiB), its head (16 KiB at
# most) and 32 KiB of the kernel's each way, no thread: at most about 25 MiB for all of
# them, with 16 MiB of bodies and answers beside, within the 128 MiB limit. The API server
# opens up to PER_PEER from one address at the height of a creation storm.
MAX_CONNECTIONS = 256
PER_PEER = 64
SEND_BUFFER = 16 * 1024  # the kernel's for what a connection sends: an answer is a few KiB
# Request bodies held at once, in bytes: a review of 3 MiB takes several times that in
# Python objects while it is answered. Pods as the API server sends them are tens of KiB,
# so hundreds fit; a flood of the largest bodies waits its turn, and the webhook stays
# inside its memory limit (chart: 128 MiB).
BODIES_IN_FLIGHT = 8 * 1024 * 1024
LIMITS = Limits(
    Bounds(MAX_CONNECTIONS, PER_PEER),
    REQUEST_WITHIN,
    ANSWER_WITHIN,
    IDLE_TIMEOUT,
    MAX_BODY,
    BODIES_IN_FLIGHT,
    BODIES_IN_FLIGHT,  # answers: a review's is its uid and a patch, a few KiB
)


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


def _json(status: HTTPStatus, doc: Mapping[str, object], close: bool = False) -> Answer:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return Answer(status, body, "application/json", close=close)


class Reviews:
    """The webhook's answers: a review on POST /mutate, /healthz, /readyz; and the server's
    own refusals as JSON, counted as `invalid` reviews when they answer one."""

    def __init__(self, admission: AdmissionSettings, telemetry: WebhookTelemetry) -> None:
        self.admission = admission
        self.telemetry = telemetry
        self.stopping = threading.Event()

    def __call__(self, request: Request) -> Answer | Later:
        path = request.path
        if request.method == "POST":
            if path != "/mutate":
                return _json(
                    HTTPStatus.NOT_FOUND, {"error": f"no such path {path!r}; POST /mutate"}
                )
            if "content-length" not in request.headers:
                self.telemetry.requests.labels("invalid").inc()
                problem = {"error": "a Content-Length of ASCII digits is required"}
                return _json(HTTPStatus.LENGTH_REQUIRED, problem, close=True)
            return Later(lambda: self._review(request))
        if request.method != "GET":
            return _json(
                HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{request.method} is not supported"}
            )
        if path == "/healthz":
            return _json(HTTPStatus.OK, {"status": "ok"})
        if path == "/readyz":
            ready = not self.stopping.is_set()
            return _json(
                HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                {"status": "ok" if ready else "shutting down"},
            )
        if path == "/mutate":
            return _json(
                HTTPStatus.METHOD_NOT_ALLOWED, {"error": "POST an AdmissionReview to /mutate"}
            )
        return _json(HTTPStatus.NOT_FOUND, {"error": f"no such path {request.target!r}"})

    def refuse(self, head: Head | None, status: HTTPStatus, why: str) -> Answer:
        if head is not None and head.method == "POST" and head.path == "/mutate":
            self.telemetry.requests.labels("invalid").inc()
        return _json(status, {"error": why}, close=True)

    def _review(self, request: Request) -> Answer:
        result, answer = self._answer(request.body)
        self.telemetry.requests.labels(result).inc()
        self.telemetry.duration.observe(time.monotonic() - request.started)
        return answer

    def _answer(self, body: bytes) -> tuple[str, Answer]:
        try:
            outcome = review(decode(body), self.admission)
        except BadReview as exc:
            return "invalid", _json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except Exception:  # a bug: answer, log it once with its traceback, keep serving
            log.exception("unexpected error while reviewing a pod")
            problem = {"error": "internal error; see the webhook's log"}
            return "error", _json(HTTPStatus.INTERNAL_SERVER_ERROR, problem)
        if outcome.result == "denied":
            log.info("denied: %s", outcome.review["response"]["status"]["message"])
        return outcome.result, _json(HTTPStatus.OK, outcome.review)


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
    reviews = Reviews(admission, telemetry)
    try:
        tls = CertReloader(settings.tls_cert_file, settings.tls_key_file, telemetry)
        listener = listen_tcp(settings.address, settings.port, SEND_BUFFER)
    except CertError as exc:
        log.error("%s", exc, exc_info=logs.detail(exc))
        return EXIT_USAGE
    except OSError as exc:
        log.error(
            "--port %d: cannot listen on %s: %s", settings.port, settings.address, exc.strerror
        )
        return EXIT_USAGE
    server = HttpServer(
        listener, LIMITS, reviews, reviews.refuse, telemetry, "webhook", tls.context
    )
    try:
        metrics = serve_metrics(telemetry, settings.metrics_port, settings.metrics_address)
    except MetricsPortError as exc:
        log.error("%s", exc, exc_info=logs.detail(exc))
        server.close()
        return EXIT_USAGE
    server.start()
    log.info(
        "serving admission reviews on https://%s:%d/mutate (sidecar %s, %s mode)",
        settings.address,
        server.port,
        admission.sidecar_image,
        admission.sidecar_mode,
    )
    if templates is not None:
        templates.start()
    received = signal.sigwait(_STOP_SIGNALS)
    log.info("%s: shutting down, finishing requests in flight", signal.Signals(received).name)
    reviews.stopping.set()
    server.drain()
    if templates is not None:
        templates.close()
    if metrics is not None:
        metrics.close()
    log.info("stopped")
    return 0
