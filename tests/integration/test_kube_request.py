"""The API client's edge cases, against real HTTP servers on loopback.

An API server that accepts the connection and never answers must not hold a thread: the
sidecar's pod watcher and event recorder each own one, and before requests had a timeout,
one silent server stopped both for good. A server that asks us to slow down (Retry-After)
is obeyed, within a cap.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import tenacity
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter
from urllib3 import HTTPHeaderDict

from enforcer.edge.kube import (
    MAX_RETRY_AFTER,
    KubeError,
    api_client,
    call,
    retrying,
    server_version,
)
from enforcer.edge.pod_watcher import PodWatcher
from tests.helpers import wait_for


def client_of(port: int) -> client.ApiClient:
    """A client of a server on this port, configured as in production."""
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    config.proxy = None
    return api_client(config)


@contextlib.contextmanager
def silent_server() -> Iterator[client.ApiClient]:
    """A client of a server that accepts every connection and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        yield client_of(silent.getsockname()[1])


def test_a_silent_api_server_is_an_error_not_a_hang() -> None:
    with silent_server() as api:
        errors: list[str] = []

        def get() -> None:
            try:
                call(api, "GET", "/version", "version", timeout=0.2, deadline=0.1)
            except KubeError as exc:
                errors.append(str(exc))

        caller = threading.Thread(target=get, daemon=True)
        caller.start()
        caller.join(30)  # without a timeout: never
        assert not caller.is_alive()
        assert len(errors) == 1 and "the API server is unreachable" in errors[0]


def test_a_deadline_bounds_the_whole_call_against_a_server_that_never_answers() -> None:
    """A 2 s deadline with the default 10 s per try, as production calls it, against a
    server that accepts every connection and never answers: the call gives up after about
    2 s, however many tries fit. Before each try got the rest of the deadline as its
    timeout, and before urllib3 was kept from retrying underneath, this took about 40 s
    (four urllib3 tries of 10 s), past the API server's 5 s timeout for a webhook."""
    with silent_server() as api:
        began = time.monotonic()
        with pytest.raises(KubeError, match="the API server is unreachable"):
            call(api, "GET", "/version", "version", deadline=2.0)
        took = time.monotonic() - began
        assert 1.9 <= took < 3.0, took


class Throttling(http.server.BaseHTTPRequestHandler):
    """Answers each GET with the next canned reply, and notes when each request came."""

    replies: ClassVar[list[tuple[int, dict[str, str]]]] = []
    arrived: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        self.arrived.append(time.monotonic())
        status, headers = self.replies.pop(0) if self.replies else (200, {})
        body = json.dumps(
            {"gitVersion": "v1.36.0"} if status == 200 else {"message": "slow down"}
        ).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json"}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def throttling(*replies: tuple[int, dict[str, str]]) -> Iterator[client.ApiClient]:
    """A client, configured as in production, of a server that answers with `replies` first
    and then with its version."""
    Throttling.replies = list(replies)
    Throttling.arrived = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Throttling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield client_of(server.server_address[1])
    finally:
        server.shutdown()


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured(status: int) -> None:
    """API Priority and Fairness answers 429 with Retry-After; our own backoff would retry
    after at most 0.7 s."""
    with throttling((status, {"Retry-After": "2"})) as api:
        assert server_version(api, deadline=10.0) == "v1.36.0"
    first, second = Throttling.arrived
    assert second - first >= 2.0


def test_a_retry_after_longer_than_the_deadline_ends_the_call_instead_of_holding_it() -> None:
    """urllib3 would sleep through any Retry-After, three times, inside one request."""
    errors: list[str] = []

    def ask(api: client.ApiClient) -> None:
        try:
            call(api, "GET", "/version", "version", deadline=5.0)
        except KubeError as exc:
            errors.append(str(exc))

    with throttling(*[(429, {"Retry-After": "3600"})] * 10) as api:
        caller = threading.Thread(target=ask, args=(api,), daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "the call is still asleep"
    assert len(Throttling.arrived) == 1  # asked to wait longer than the deadline: given up
    assert errors == ["get version failed: HTTP 429 Too Many Requests: slow down"]


def throttled(headers: dict[str, str], status: int = 429) -> tenacity.RetryCallState:
    exc = ApiException(status=status, reason="Too Many Requests")
    exc.headers = HTTPHeaderDict(headers)
    state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
    state.set_exception((ApiException, exc, None))
    return state


def test_retry_after_is_capped_and_read_in_both_forms() -> None:
    wait = retrying(deadline=30.0).wait
    assert wait(throttled({"retry-after": "3"})) == 3.0  # header names are case-insensitive
    assert wait(throttled({"Retry-After": "86400"})) == MAX_RETRY_AFTER
    later = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.0 < wait(throttled({"Retry-After": later})) <= 5.0
    # Not asked for, or not understood: our own backoff (0.2 s plus up to 0.5 s of jitter).
    for state in (
        throttled({}),
        throttled({"Retry-After": "soon"}),
        throttled({"Retry-After": "3"}, 500),
    ):
        assert 0.2 <= wait(state) <= 0.7


class Garbled(http.server.BaseHTTPRequestHandler):
    """Answers 200 with the next body of `bodies` (a proxy's error page, a truncated reply,
    JSON that is no object), then with a pod."""

    bodies: ClassVar[list[bytes]] = []
    pod: ClassVar[bytes] = json.dumps({"kind": "Pod", "metadata": {"name": "p"}}).encode()

    def do_GET(self) -> None:
        body = self.bodies.pop(0) if self.bodies else self.pod
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def garbled(*bodies: bytes) -> Iterator[client.ApiClient]:
    Garbled.bodies = list(bodies)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbled)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield client_of(server.server_address[1])
    finally:
        server.shutdown()


def test_a_2xx_reply_that_is_not_a_json_object_is_an_api_error() -> None:
    with garbled(b"<html>upstream proxy</html>", b'{"kind": "Pod", "meta', b"[1, 2]") as api:
        for expected in ("not JSON", "not JSON", "reply is list, not a JSON object"):
            with pytest.raises(KubeError, match=expected) as raised:
                call(api, "GET", "/api/v1/namespaces/ns/pods/p", "pods", deadline=1.0)
            assert str(raised.value).startswith("get pods failed: the API server's reply is")


def test_the_pod_watcher_lives_through_garbled_replies_and_reads_the_pod_after_them() -> None:
    """Before, a 200 that was not JSON ended the watcher's thread for good: container IDs
    froze, and a restarted container was never enforced."""
    unexpected = Counter("unexpected", "test", registry=CollectorRegistry())
    with garbled(b"<html>upstream proxy</html>", b"[]") as api:
        watcher = PodWatcher(api, "ns", "p", min_gap=0.05, unexpected=unexpected)
        watcher.start()
        try:
            wait_for(lambda: watcher.pod is not None, what="the pod, after two garbled replies")
            assert watcher.is_alive() and watcher.error is None
            assert watcher.name == "pod-watcher"  # its log lines name the loop, not the pod
            assert unexpected._value.get() == 0  # API errors, not bugs
        finally:
            watcher.stop.set()
            watcher.refresh()
            watcher.join(5)


def test_an_outage_whose_errors_vary_is_said_once_not_once_per_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that answers garbage gives a different error each time: still one line for
    the outage, and one when it ends."""
    unexpected = Counter("unexpected2", "test", registry=CollectorRegistry())
    with garbled(*[b"<html>a</html>", b"[1]", b'{"x": ', b"<p>b</p>"] * 3) as api:
        watcher = PodWatcher(api, "ns", "p", min_gap=0.02, unexpected=unexpected)
        with caplog.at_level(logging.INFO):
            watcher.start()
            try:
                wait_for(lambda: watcher.pod is not None, what="the pod, after 12 garbled replies")
            finally:
                watcher.stop.set()
                watcher.refresh()
                watcher.join(5)
    assert caplog.text.count("cannot read this pod from the API") == 1
    assert caplog.text.count("reading this pod from the API again") == 1
