"""A stand-in for the API server's list and watch of pods (or of namespaces), on loopback:
the list in the pages that the client asks for, and the watch's events as the test queues
them."""

from __future__ import annotations

import json
import queue
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class PodsApi(ThreadingHTTPServer):
    """Lists `listed` (JSON pods), or `namespaces` (JSON Namespaces), and streams `events`
    to a watch of pods (`namespace_events` to one of namespaces), until a None; takes
    Events, and lists those posted to a namespace."""

    daemon_threads = True

    def __init__(self, listed: list[bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.listed = listed
        self.namespaces: list[bytes] = []
        self.queries: list[tuple[str, dict[str, str]]] = []  # each GET's path and query
        self.events: queue.Queue[bytes | None] = queue.Queue()  # the pods' watch events
        self.namespace_events: queue.Queue[bytes | None] = queue.Queue()  # the namespaces'
        self.pages: list[int] = []  # the number of pods each list request asked for
        self.watching = threading.Event()
        self.posts: list[tuple[str, Any]] = []  # each POST's path and JSON body, in order
        self.deletes: list[tuple[str, Any]] = []  # each DELETE's path and JSON body, in order
        # each PATCH's path, Content-Type and JSON body, in order (pods' status: conditions)
        self.patches: list[tuple[str, str, Any]] = []
        self.patch_status = 200  # what a PATCH is answered (403: RBAC, 404: the pod is gone)
        # Evictions answered as a PodDisruptionBudget that allows no disruption answers them
        # (429), with a Retry-After past any caller's deadline, so that each is one request.
        self.refuse_evictions = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def send(self, kind: str, obj: dict[str, Any]) -> None:
        """A watch event: to the pods' watch, or, for a Namespace (cluster-scoped: no
        `metadata.namespace`), to the namespaces'."""
        watch = self.events if "namespace" in obj.get("metadata", {}) else self.namespace_events
        watch.put(json.dumps({"type": kind, "object": obj}).encode())


@contextmanager
def serving(listed: list[bytes]) -> Iterator[PodsApi]:
    api = PodsApi(listed)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    try:
        yield api
    finally:
        api.events.put(None)
        api.namespace_events.put(None)
        api.shutdown()
        api.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: PodsApi
    protocol_version = "HTTP/1.1"  # the watch's events in chunks, as the API server sends them

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        self.server.queries.append((url.path, query))
        listed = {
            "/api/v1/pods": self.server.listed,
            "/api/v1/namespaces": self.server.namespaces,
        }.get(url.path)
        if listed is None and url.path.endswith("/events"):  # those posted there, as listed
            posted = [body for path, body in self.server.posts if path == url.path]
            self._send(200, json.dumps({"kind": "EventList", "items": posted}).encode())
        elif listed is None:
            self._send(404, b'{"kind":"Status","code":404}')
        elif query.get("watch") == "true":
            pods = url.path == "/api/v1/pods"
            self._watch(self.server.events if pods else self.server.namespace_events)
        else:
            limit = int(query.get("limit") or len(listed))
            self.server.pages.append(limit)
            start = int(query.get("continue") or 0)
            more = f',"continue":"{start + limit}"' if start + limit < len(listed) else ""
            head = f'{{"kind":"List","metadata":{{"resourceVersion":"1"{more}}},"items":['
            self._send(200, head.encode() + b",".join(listed[start : start + limit]) + b"]}")

    def do_POST(self) -> None:  # Events, evictions
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts.append((self.path, json.loads(body) if body else None))
        if self.server.refuse_evictions and self.path.endswith("/eviction"):
            refusal = b'{"kind":"Status","code":429,"reason":"TooManyRequests","message":'
            refusal += b'"Cannot evict pod as it would violate the pod\'s disruption budget."}'
            self._send(429, refusal, {"Retry-After": "3600"})
        else:
            self._send(201, b"{}")

    def do_PATCH(self) -> None:  # pods' status (an Event is not: a repeat is posted anew)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self.path.endswith("/status"):
            self._send(404, b'{"kind":"Status","code":404}')
            return
        kind = self.headers.get("Content-Type") or ""
        self.server.patches.append((self.path, kind, json.loads(body) if body else None))
        code = self.server.patch_status
        if code == 200:
            self._send(200, b'{"kind":"Pod","apiVersion":"v1","metadata":{}}')
        else:
            self._send(code, b'{"kind":"Status","code":%d,"message":"refused"}' % code)

    def do_DELETE(self) -> None:  # pods
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.deletes.append((self.path, json.loads(body) if body else None))
        self._send(200, b'{"kind":"Pod","apiVersion":"v1","metadata":{}}')

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _watch(self, events: queue.Queue[bytes | None]) -> None:
        """`events`, a chunk each."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.server.watching.set()
        while (event := events.get()) is not None:
            self.wfile.write(b"%x\r\n%s\n\r\n" % (len(event) + 1, event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True
