"""`vram-enforcer webhook` as a process, over real HTTPS: answers, errors, TLS, certificate
rotation without a dropped request, and a graceful shutdown."""

from __future__ import annotations

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

from enforcer.modes.webhook import (
    ANSWER_WITHIN,
    BODIES_IN_FLIGHT,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    PER_PEER,
    REQUEST_WITHIN,
)
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

    def connection(self, source: str = "127.0.0.1") -> http.client.HTTPSConnection:
        """From the local address `source` (loopback holds all of 127/8)."""
        return http.client.HTTPSConnection(
            "127.0.0.1",
            self.port,
            context=self.context(),
            timeout=30,
            source_address=(source, 0),
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
    time.sleep(REQUEST_WITHIN + 1)
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


def closed(webhook: Webhook, reason: str) -> float:
    line = f'vram_enforcer_http_connections_closed_total{{reason="{reason}",server="webhook"}} '
    (value,) = [x for x in webhook.metrics().splitlines() if x.startswith(line)]
    return float(value.split()[-1])


def test_slow_connections_from_many_addresses_leave_reviews_and_probes_served(
    webhook: Webhook,
) -> None:
    """Any pod can reach the webhook's Service. Pods that fill every place with handshakes
    and requests they never finish (four addresses held all 256 threads before, and the API
    server's reviews waited) cost no thread, and make way for the API server and the
    kubelet, who hold fewer."""

    def threads() -> int:
        return len(os.listdir(f"/proc/{webhook.proc.pid}/task"))

    before = threads()
    addresses = MAX_CONNECTIONS // PER_PEER + 1
    flood = []
    try:
        for i in range(addresses):
            for n in range(PER_PEER):
                s = socket.create_connection(
                    ("127.0.0.1", webhook.port), timeout=30, source_address=(f"127.0.2.{i}", 0)
                )
                if n % 2:
                    s.sendall(b"\x16\x03\x01")  # a handshake begun, never finished
                flood.append(s)
        over = addresses * PER_PEER - MAX_CONNECTIONS
        wait_for(lambda: closed(webhook, "made-way") >= over, what="every place to be held")
        assert threads() == before  # not a thread per connection
        api_server = webhook.connection("127.0.0.2")
        status, doc = webhook.post(review_body("other"), api_server)
        assert status == 200 and doc["response"]["uid"] == "other"
        kubelet = webhook.connection("127.0.0.3")
        kubelet.request("GET", "/healthz")
        assert kubelet.getresponse().status == 200
        status, doc = webhook.post(review_body("again"), api_server)  # kept alive
        assert status == 200 and doc["response"]["uid"] == "again"
    finally:
        for s in flood:
            s.close()


def test_a_request_that_drips_past_its_deadline_gets_408_and_a_stalled_handshake_is_closed(
    webhook: Webhook,
) -> None:
    """A byte every half second kept the read of a request line (10 s per read, 120 s on a
    kept-alive connection) from ever timing out: the deadline is the whole request's, from
    accept (the handshake included) or from a kept-alive request's first byte."""
    stalled = socket.create_connection(("127.0.0.1", webhook.port), timeout=60)
    stalled.sendall(b"\x16\x03\x01\x02")  # a ClientHello that never ends
    drip = webhook.context().wrap_socket(
        socket.create_connection(("127.0.0.1", webhook.port), timeout=60),
        server_hostname="127.0.0.1",
    )
    drip.sendall(b"POST /mutate HTTP/1.1\r\nX-Drip: ")
    drip.settimeout(0.5)
    got = b""
    with drip, stalled:
        for _ in range(8 * int(REQUEST_WITHIN)):  # four deadlines' worth of dripping
            try:
                drip.sendall(b"x")
                if not (chunk := drip.recv(65536)):
                    break
                got += chunk
            except TimeoutError:
                continue
            except OSError:  # closed by the server after its answer
                break
        stalled.settimeout(60)
        assert stalled.recv(1024) == b""  # closed, without a word: it speaks no HTTP yet
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1]) == {
        "error": f"the request did not arrive whole within {REQUEST_WITHIN:g}s"
    }
    assert closed(webhook, "deadline") == 2
    assert webhook.post(review_body())[0] == 200


def test_an_answer_taken_too_slowly_is_dropped_at_its_deadline(webhook: Webhook) -> None:
    """A client that reads a byte now and then kept a thread writing its answer for as long
    as it liked (each write had its own timeout). An answer has ANSWER_WITHIN to be taken."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(60)
    raw.connect(("127.0.0.1", webhook.port))
    conn = webhook.context().wrap_socket(raw, server_hostname="127.0.0.1")
    body = review_body("u" * (3 << 20))  # its uid comes back in the answer: 3 MiB of it
    conn.sendall(b"POST /mutate HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    taken, ended = 0, False
    with conn:
        for _ in range(int(8 * ANSWER_WITHIN)):  # four deadlines' worth of trickling
            time.sleep(0.5)
            try:
                chunk = socket.socket.recv(conn, 1024)  # the TLS records, undecoded
            except OSError:
                ended = True
                break
            if not chunk:
                ended = True
                break
            taken += len(chunk)
    assert ended and taken < len(body)
    assert closed(webhook, "unread") == 1


def test_a_body_waits_its_turn_past_the_bytes_in_flight_and_a_wait_ends(
    webhook: Webhook,
) -> None:
    """Bodies of 4 MiB from many connections at once were decoded at once, and the webhook
    neared its memory limit: past BODIES_IN_FLIGHT a body waits, within its deadline."""

    def begin(length: int) -> ssl.SSLSocket:
        c = webhook.context().wrap_socket(
            socket.create_connection(("127.0.0.1", webhook.port), timeout=60),
            server_hostname="127.0.0.1",
        )
        c.sendall(b"POST /mutate HTTP/1.1\r\nContent-Length: %d\r\n\r\n{" % length)
        return c

    half = BODIES_IN_FLIGHT // 2
    first, second = begin(half), begin(half)  # all of the bytes in flight
    body = review_body("waits")
    small = begin(len(body))  # its turn comes after theirs
    small.sendall(body[1:])
    small.settimeout(1.0)
    with pytest.raises(TimeoutError):
        small.recv(1)  # not answered while it waits
    first.sendall(b"x" * (half - 1))  # answered (not JSON): its bytes are free again
    assert first.recv(65536).startswith(b"HTTP/1.1 400 ")
    small.settimeout(60)
    assert json.loads(small.recv(65536).split(b"\r\n\r\n", 1)[1])["response"]["uid"] == "waits"
    # The second never sends its body: answered 408 at its deadline, its bytes free again.
    second.settimeout(60)
    assert second.recv(65536).startswith(b"HTTP/1.1 408 ")
    for c in (first, second, small):
        c.close()


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
