"""The sidecar's helper threads (the pod watcher, the Event recorder) are supervised: one
that stops ends the sidecar with status 1, so that the kubelet restarts it, instead of
leaving it enforcing on frozen container IDs."""

from __future__ import annotations

import http.server
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from enforcer.edge.agent_link import AgentLink
from enforcer.edge.events import EventRecorder
from enforcer.edge.metrics import Telemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Signaller, Terminator
from enforcer.modes import sidecar, sidecar_access
from tests.helpers import configured, write_kubeconfig


class NotFound(http.server.BaseHTTPRequestHandler):
    """An API server that knows of nothing: each call fails at once, and is not retried."""

    def _answer(self) -> None:
        body = b'{"kind": "Status", "message": "not found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_helper_thread_that_stops_ends_the_sidecar_with_status_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", f"http://127.0.0.1:{server.server_address[1]}"
    )
    settings = configured(
        [
            "sidecar",
            "--interval",
            "50ms",
            "--api-access",
            "direct",
            "--kubeconfig",
            str(kubeconfig),
        ],
        {
            "POD_NAME": "p",
            "POD_NAMESPACE": "ns",
            "POD_UID": "u",
            "NODE_NAME": "n",
            "VRAM_ENFORCER_LIMITS": '{"t": 1}',
        },
    )
    telemetry = Telemetry({"namespace": "ns", "pod": "p"})
    access = sidecar_access.direct(settings, telemetry)
    _watcher, recorder = access.helpers
    assert isinstance(recorder, EventRecorder)
    source = AgentLink(str(tmp_path / "absent.sock"), stale_after=2.0)
    procfs = ProcFs()
    terminator = Terminator(Signaller(procfs, protected=frozenset({1})))
    pipeline = sidecar._pipeline(settings, procfs, source, terminator, access, telemetry)
    for helper in access.helpers:
        helper.start()
    threading.Timer(0.3, recorder.close).start()  # the recorder's thread ends, as by a bug
    try:
        with caplog.at_level(logging.ERROR):
            status = sidecar._loop(
                settings, source, pipeline, terminator, procfs, access.pod, access.helpers
            )
    finally:
        access.close()
        source.close()
        server.shutdown()
    assert status == 1
    assert "the event-recorder thread has stopped (a bug); exiting with status 1" in caplog.text
