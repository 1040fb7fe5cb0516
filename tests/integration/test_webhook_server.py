"""`vram-enforcer webhook` as a process, over real HTTPS: answers, errors, TLS, certificate
rotation without a dropped request, and a graceful shutdown."""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import json
import operator
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.modes.webhook import IDLE_TIMEOUT, IO_TIMEOUT, PER_PEER, ByteBudget
from tests.e2e.cluster import make_ca, make_serving_cert
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def review_body(uid: str = "u-1", vram: str = "4Gi", **container: Any) -> bytes:
    pod = {
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": {
            "containers": [
                {
                    "name": "t",
                    "image": "x",
                    "resources": {"limits": {"vram-enforcer.io/vram": vram}},
                    **container,
                }
            ]
        },
    }
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "operation": "CREATE",
                "object": pod,
            },
        }
    ).encode()


class Webhook:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.ca = make_ca(tmp)
        self.cert, self.key = make_serving_cert(tmp, self.ca, "webhook")
        self.port, self.metrics_port = free_port(), free_port()
        self.log = tmp / "webhook.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "enforcer",
                "webhook",
                "--tls-cert-file",
                str(self.cert),
                "--tls-key-file",
                str(self.key),
                "--port",
                str(self.port),
                "--address",
                "127.0.0.1",
                "--sidecar-image",
                "img:1",
                "--sidecar-mode",
                "container",
                "--metrics-port",
                str(self.metrics_port),
                "--metrics-address",
                "127.0.0.1",
                "--log-format",
                "text",
            ],
            stderr=self.log.open("w"),
        )
        wait_for(lambda: "serving admission reviews" in self.log.read_text(), what="the webhook")

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca[0]))

    def connection(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self.context(), timeout=10
        )

    def post(
        self,
        body: bytes,
        conn: http.client.HTTPSConnection | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        c = conn or self.connection()
        c.request(
            "POST",
            "/mutate",
            body=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            return str(r.read().decode())

    def rotate(self, name: str) -> bytes:
        """A new certificate from the same CA, swapped in atomically; returns its DER."""
        cert, key = make_serving_cert(self.dir, self.ca, name)
        os.replace(key, self.key)
        os.replace(cert, self.cert)
        return ssl.PEM_cert_to_DER_cert(self.cert.read_text())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[Webhook]:
    w = Webhook(tmp_path)
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


def test_a_review_is_patched_over_a_kept_alive_tls_connection(webhook: Webhook) -> None:
    conn = webhook.connection()
    status, doc = webhook.post(review_body("a"), conn)
    assert (
        status == 200
        and doc["response"]["uid"] == "a"
        and doc["response"]["patchType"] == "JSONPatch"
    )
    status, doc = webhook.post(review_body("b", vram="1.5"), conn)  # same connection
    assert status == 200 and doc["response"]["allowed"] is False
    assert "is not a whole number of bytes" in doc["response"]["status"]["message"]
    assert conn.sock is not None and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
    body = webhook.metrics()
    assert 'vram_enforcer_admission_requests_total{result="patched"} 1.0' in body
    assert 'vram_enforcer_admission_requests_total{result="denied"} 1.0' in body
    # Every result from the start, at 0: the first of a kind shows in rate().
    assert 'vram_enforcer_admission_requests_total{result="skipped"} 0.0' in body
    assert 'vram_enforcer_webhook_certificate_reloads_total{result="error"} 0.0' in body
    assert "vram_enforcer_admission_duration_seconds_count 2.0" in body


def test_a_kept_alive_connection_idle_past_the_io_timeout_still_serves(webhook: Webhook) -> None:
    """The API server keeps an idle connection to a webhook for 90 s and then sends on it:
    closed sooner by the webhook, a review sent just then failed with EOF (the creation-storm
    benchmark saw it). A request in progress still has IO_TIMEOUT."""
    conn = webhook.connection()
    assert webhook.post(review_body("a"), conn)[0] == 200
    time.sleep(IO_TIMEOUT + 1)
    status, doc = webhook.post(review_body("b"), conn)  # the same connection, not a new one
    assert status == 200 and doc["response"]["uid"] == "b"
    assert IDLE_TIMEOUT > 90


def test_bad_requests_get_clear_errors_never_a_500(webhook: Webhook) -> None:
    assert webhook.post(b"{not json") == (
        400,
        {
            "error": "the body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
        },
    )
    assert webhook.post(b'{"kind": "AdmissionReview"}') == (
        400,
        {"error": "not an AdmissionReview: request.uid is missing"},
    )
    assert webhook.post(b"\xff\xfe")[0] == 400
    status, doc = webhook.post(
        json.dumps({"apiVersion": "v1", "kind": "Pod", "request": {"uid": "x"}}).encode()
    )
    assert status == 200 and doc["response"] == {
        "uid": "x",
        "allowed": False,
        "status": {
            "code": 400,
            "message": "unsupported review: expected apiVersion admission.k8s.io/v1, kind AdmissionReview",
        },
    }
    c = webhook.connection()
    c.request("GET", "/mutate")
    assert c.getresponse().status == 405
    c = webhook.connection()
    c.request("GET", "/nope")
    assert c.getresponse().status == 404
    # Too big: refused from its Content-Length, without reading it.
    c = webhook.connection()
    c.putrequest("POST", "/mutate")
    c.putheader("Content-Length", str(64 * 1024 * 1024))
    c.endheaders()
    r = c.getresponse()
    assert r.status == 413 and "at most 4194304" in json.loads(r.read())["error"]
    # No Content-Length (chunked).
    c = webhook.connection()
    c.request("POST", "/mutate", body=iter([b"{}"]), encode_chunked=True)
    assert c.getresponse().status == 411
    assert "Traceback" not in webhook.log.read_text()
    assert webhook.proc.poll() is None


def test_nulls_and_wrong_shapes_get_a_patch_or_a_denial_never_a_500(webhook: Webhook) -> None:
    """With failurePolicy Ignore, a 500 would admit the pod unenforced."""
    status, doc = webhook.post(review_body(env=None, volumeMounts=None, ports=None))
    assert status == 200 and doc["response"]["allowed"] and doc["response"]["patch"]
    status, doc = webhook.post(review_body(env="A=1"))
    assert status == 200 and not doc["response"]["allowed"]
    assert doc["response"]["status"]["message"].startswith(
        "spec.containers['t'].env: 'A=1' is a string, where a list belongs"
    )
    assert 'vram_enforcer_admission_requests_total{result="error"} 0.0' in webhook.metrics()


def _annotated(annotations: dict[str, str], ports: int = 0) -> bytes:
    doc = json.loads(review_body(ports=[{"containerPort": p} for p in range(9477, 9477 + ports)]))
    doc["request"]["object"]["metadata"]["annotations"] = annotations
    return json.dumps(doc).encode()


def test_hostile_values_get_a_denial_naming_the_field_never_a_500(webhook: Webhook) -> None:
    """The reproductions of the webhook's 500s and dropped connections: each now gets a
    well-formed answer that names the field, and the webhook serves on."""
    shm, port = "vram-enforcer.io/shm-size", "vram-enforcer.io/metrics-port"
    denied = {
        _annotated({shm: "1e1000000"}): f"metadata.annotations['{shm}']: '1e1000000' is too large",
        _annotated({shm: "9" * 5000}): f"metadata.annotations['{shm}']: '9999",
        _annotated({"vram-enforcer.io/grace-period": "9" * 400 + "s"}): "is too long",
    }
    for body, fragment in denied.items():
        status, doc = webhook.post(body)
        assert status == 200 and doc["response"]["allowed"] is False, doc
        assert fragment in doc["response"]["status"]["message"], doc
        assert len(doc["response"]["status"]["message"]) < 400
    # A pod that declares every port, and 0.1.0's metrics port as anything: admitted, the
    # sidecar taking none (the agent serves the pod's metrics), with a warning for the latter.
    for body in (_annotated({}, ports=65536 - 9477), _annotated({port: "\u00b2"})):
        status, doc = webhook.post(body)
        assert status == 200 and doc["response"]["allowed"] is True, doc
    status, doc = webhook.post(_annotated({port: "\u0661"}))
    assert doc["response"]["warnings"][0].startswith(f"metadata.annotations['{port}'] is ignored")
    status, doc = webhook.post(b"[" * 200_000)
    assert (status, doc) == (400, {"error": "the body nests deeper than 64 levels; no Pod does"})
    status, doc = webhook.post(b'{"a": ' + b"9" * 5000 + b"}")
    assert status == 400 and doc["error"].startswith("the body is not JSON: ")
    for length in ("\u00b2", "9" * 5000):
        c = webhook.connection()
        c.putrequest("POST", "/mutate")
        c.putheader("Content-Length", length)
        c.endheaders()
        assert c.getresponse().status == 411
    assert webhook.post(review_body("after"))[0] == 200
    assert 'vram_enforcer_admission_requests_total{result="error"} 0.0' in webhook.metrics()
    assert "Traceback" not in webhook.log.read_text()


def test_a_flood_of_idle_connections_from_one_address_leaves_the_api_server_served(
    webhook: Webhook,
) -> None:
    """Any pod can reach the webhook's Service: idle connections from one address hold at
    most PER_PEER threads, and a review from another address is answered meanwhile."""

    def threads() -> int:
        return len(os.listdir(f"/proc/{webhook.proc.pid}/task"))

    before, peak, done = threads(), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], threads())

    sampler = threading.Thread(target=watch)
    sampler.start()
    with concurrent.futures.ThreadPoolExecutor(200) as pool:  # all at once, as a flood comes
        flood = list(
            pool.map(
                lambda _: socket.create_connection(("127.0.0.1", webhook.port), timeout=20),
                range(200),
            )
        )
    try:
        time.sleep(1.0)
        c = http.client.HTTPSConnection(
            "127.0.0.1",
            webhook.port,
            context=webhook.context(),
            timeout=10,
            source_address=("127.0.0.2", 0),
        )
        status, doc = webhook.post(review_body("other"), c)
        assert status == 200 and doc["response"]["uid"] == "other"
    finally:
        done.set()
        sampler.join()
        for s in flood:
            s.close()
    assert peak[0] - before <= PER_PEER + 1, peak[0] - before  # + the other address's


def test_health_ready_and_tls_versions(webhook: Webhook) -> None:
    for path in ("/healthz", "/readyz"):
        c = webhook.connection()
        c.request("GET", path)
        assert c.getresponse().status == 200
    old = webhook.context()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.1 is: that is the point
        old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    with pytest.raises(ssl.SSLError), socket.create_connection(("127.0.0.1", webhook.port)) as raw:
        old.wrap_socket(raw, server_hostname="127.0.0.1")
    v12 = webhook.context()
    v12.maximum_version = ssl.TLSVersion.TLSv1_2
    with (
        socket.create_connection(("127.0.0.1", webhook.port)) as raw,
        v12.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        assert s.version() == "TLSv1.2"
    # A client that never finishes its handshake does not block anyone else.
    with socket.create_connection(("127.0.0.1", webhook.port)):
        assert webhook.post(review_body())[0] == 200


def test_a_rotated_certificate_is_used_without_dropping_a_request(webhook: Webhook) -> None:
    failures: list[BaseException] = []
    served: set[bytes] = set()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                conn = webhook.connection()  # a new connection each time: a new handshake
                status, doc = webhook.post(review_body(), conn)
                assert status == 200 and doc["response"]["allowed"] is True
                assert conn.sock is not None
                served.add(conn.sock.getpeercert(binary_form=True) or b"")
                conn.close()
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        new = webhook.rotate("webhook-2")
        wait_for(lambda: new in served, timeout=10, what="the new certificate to be served")
        # A half-written pair does not load: the last good certificate stays in use.
        webhook.cert.write_text("-----BEGIN CERTIFICATE-----\ntruncated")
        wait_for(
            lambda: 'webhook_certificate_reloads_total{result="error"}' in webhook.metrics(),
            what="a failed reload",
        )
        time.sleep(0.3)
        newer = webhook.rotate("webhook-3")
        wait_for(lambda: newer in served, timeout=10, what="the third certificate")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == []
    assert 'vram_enforcer_webhook_certificate_reloads_total{result="ok"} 2.0' in webhook.metrics()


def blocked_by_every_other_thread(pid: int) -> set[signal.Signals]:
    """The signals that all of a process's threads but the main one block (SigBlk in /proc;
    the main thread's shows none while it waits in sigwait(), which unblocks them there)."""
    others = [t for t in Path(f"/proc/{pid}/task").iterdir() if t.name != str(pid)]
    assert len(others) >= 2  # the HTTPS server's, the metrics', a connection's
    masks = []
    for task in others:
        (line,) = [x for x in (task / "status").read_text().splitlines() if x.startswith("SigBlk:")]
        masks.append(int(line.split()[1], 16))
    common = functools.reduce(operator.and_, masks)
    return {s for s in signal.Signals if s < 64 and common >> (s - 1) & 1}


def test_sigterm_finishes_the_request_in_flight_then_exits(webhook: Webhook) -> None:
    idle = webhook.connection()
    assert webhook.post(review_body(), idle)[0] == 200  # an idle keep-alive connection
    body = review_body("in-flight")
    busy = webhook.connection()
    busy.putrequest("POST", "/mutate")
    busy.putheader("Content-Type", "application/json")
    busy.putheader("Content-Length", str(len(body)))
    busy.endheaders()
    busy.send(body[:20])
    time.sleep(0.2)  # for the server to read the request line: the request is in flight
    # The other threads block the stop signals, so the kernel cannot hand one to a
    # connection's thread while the main thread sleeps on: the main thread's sigwait() takes it.
    assert blocked_by_every_other_thread(webhook.proc.pid) >= {signal.SIGTERM, signal.SIGINT}
    webhook.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", webhook.port), timeout=2).close()
        except (ConnectionRefusedError, ConnectionResetError):  # reset: closed in the backlog
            return True
        return False

    wait_for(refused, what="the webhook to stop accepting")
    assert webhook.proc.poll() is None  # waiting for the request in flight
    busy.send(body[20:])
    r = busy.getresponse()
    assert r.status == 200 and json.loads(r.read())["response"]["uid"] == "in-flight"
    assert r.getheader("Connection") == "close"
    assert webhook.proc.wait(timeout=10) == 0
    assert "stopped" in webhook.log.read_text()


def test_bad_certificate_files_and_a_busy_port_are_clear_errors(tmp_path: Path) -> None:
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "webhook",
            "--tls-cert-file",
            str(tmp_path / "no.crt"),
            "--tls-key-file",
            str(tmp_path / "no.key"),
            "--sidecar-image",
            "img",
            "--sidecar-mode",
            "native",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2
    assert (
        f"--tls-cert-file {tmp_path / 'no.crt'} / --tls-key-file {tmp_path / 'no.key'}: cannot load"
        in missing.stderr
    )
    assert "Traceback" not in missing.stderr
    text = [
        sys.executable,
        "-m",
        "enforcer",
        "webhook",
        "--tls-cert-file",
        str(tmp_path / "no.crt"),
        "--tls-key-file",
        str(tmp_path / "no.key"),
        "--sidecar-image",
        "img",
        "--sidecar-mode",
        "native",
        "--port",
        "0",
        "--log-format",
        "text",
    ]
    plain = subprocess.run(text, capture_output=True, text=True, timeout=30)
    assert plain.stderr.startswith("vram-enforcer: error: --tls-cert-file "), plain.stderr
    assert "Traceback" not in plain.stderr
    debug = subprocess.run([*text, "-v"], capture_output=True, text=True, timeout=30)
    assert debug.returncode == 2
    assert debug.stderr.startswith("vram-enforcer: error: --tls-cert-file "), debug.stderr
    assert "FileNotFoundError" in debug.stderr  # the cause, shown at debug verbosity
    assert "direct cause of the following exception" in debug.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "webhook",
            "--tls-cert-file",
            "c",
            "--tls-key-file",
            "k",
            "--sidecar-image",
            "img",
            "--sidecar-mode",
            "sometimes",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2
    assert (
        "--sidecar-mode: 'sometimes' is not a choice; use one of: native, container, auto"
        in bad.stderr
    )


def test_the_bytes_of_bodies_in_flight_are_bounded_and_a_wait_ends() -> None:
    """A flood of the largest bodies waits its turn instead of being decoded all at once."""
    budget = ByteBudget(8)
    assert budget.acquire(5, timeout=0.1)
    started = time.monotonic()
    assert not budget.acquire(5, timeout=0.2)  # 3 free: it waits, then gives up
    assert time.monotonic() - started >= 0.2
    threading.Timer(0.1, budget.release, (5,)).start()
    assert budget.acquire(5, timeout=5)  # let in once the first is answered
    budget.release(5)
    assert budget.acquire(100, timeout=0.1)  # larger than all of it: its turn comes, alone
    assert not budget.acquire(1, timeout=0.1)
