"""A process chooses its own command line, and a pod's tenant can forge its sidecar's
reports: such text reaches `exec`'s stderr, the logs and Events as one line of bounded
length, its control characters escaped, and a command line is never read whole."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from enforcer.core import messages
from enforcer.core.model import GiB, ProcessKey, ProcessTotal
from enforcer.edge import events, logs
from enforcer.edge.procfs import CMDLINE_BYTES, ProcFs

FORGED = "a\nvram-enforcer: error: forged\r\x1b[2J"  # a second line, a carriage return, ANSI


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        pytest.param(
            b"python\0train.py\0--name\0a\nvram-enforcer: error: forged\0",
            "python train.py --name a\\nvram-enforcer: error: forged",
            id="newline",
        ),
        pytest.param(
            b"python\0train.py\rpython harmless.py\0",
            "python train.py\\rpython harmless.py",
            id="carriage-return",
        ),
        pytest.param(
            b"\x1b[31mpython\x1b[0m\0train.py\0", "\\x1b[31mpython\\x1b[0m train.py", id="ansi"
        ),
        pytest.param(
            b"python\0\0-c\0import os;\tos.kill(1, 9)\0\0",
            "python -c import os;\\tos.kill(1, 9)",
            id="nul-separated-argv",
        ),
        pytest.param(
            b"python\0caf\xc3\xa9\0\xff\xfe.py\0", "python caf\u00e9 \\xff\\xfe.py", id="not-utf-8"
        ),
        pytest.param(
            b"python\0" + b"A" * 6_000_000, "python " + "A" * 110 + "...", id="6-MB-argument"
        ),
    ],
)
def test_a_command_line_reaches_a_message_as_one_bounded_line_with_visible_escapes(
    raw: bytes, shown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cmdline").write_bytes(raw)
    read: list[int] = []
    real_read = os.read

    def counted(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counted)
    cmdline = ProcFs(tmp_path).cmdline(4242)
    monkeypatch.undo()
    assert cmdline is not None
    assert sum(read) <= CMDLINE_BYTES  # never the 6 MB, to be cut later
    text = messages.process(ProcessTotal(ProcessKey(4242, 1), GiB, (("GPU-0", GiB),), cmdline))
    assert text == f"pid 4242 ({shown}), which holds 1.00 GiB"
    assert len(shown) <= messages.COMMAND_CHARS


def test_a_log_line_is_one_bounded_line_whatever_its_arguments_carry() -> None:
    """Text logged raw (a leftover's command line, an API's answer) is escaped there."""
    record = logging.makeLogRecord(
        {"msg": "still running: %d (%s)", "args": (7, FORGED), "levelname": "WARNING"}
    )
    escaped = "still running: 7 (a\\nvram-enforcer: error: forged\\r\\x1b[2J)"
    assert logs.TextFormatter().format(record) == f"vram-enforcer: warning: {escaped}"
    assert json.loads(logs.JsonFormatter().format(record))["msg"] == escaped
    huge = logging.makeLogRecord({"msg": "%s", "args": ("x" * 6_000_000,), "levelname": "INFO"})
    assert len(logs.TextFormatter().format(huge)) == len("vram-enforcer: info: ") + logs.LINE_CHARS


def test_an_events_message_is_one_bounded_line_and_ours_pass_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent posts what a sidecar reports, and anyone in the pod can report."""
    posted: list[str] = []

    def call(api: object, method: str, path: str, resource: str, **kw: Any) -> dict[str, Any]:
        posted.append(kw["body"]["message"])
        return {"metadata": {"name": f"e{len(posted)}"}}

    monkeypatch.setattr(events, "call", call)
    failures = Counter("failures", "", ["reason"], registry=CollectorRegistry())
    recorder = events.EventRecorder(object(), "node", "node", failures)  # type: ignore[arg-type]
    recorder.start()
    ours = "sent SIGTERM to pid 7 (python a\\nb), which holds 1.00 GiB"  # `shown` already
    for i, message in enumerate((FORGED, FORGED * 1000, ours)):
        recorder.record({"kind": "Pod", "name": "p", "uid": str(i)}, "VRAMEnforced", message, True)
    recorder.close(timeout=5)
    assert sum(s.value for s in failures.collect()[0].samples if s.name.endswith("_total")) == 0
    forged, flood, kept = posted
    assert forged == "a\\nvram-enforcer: error: forged\\r\\x1b[2J"
    assert "\n" not in flood and len(flood) == events.MESSAGE_CHARS
    assert kept == ours
