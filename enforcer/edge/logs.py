"""Logging set-up: one line per event, as text for people or JSON for log pipelines.

Structured fields are passed with `extra=`; the JSON formatter emits every such field, so
a log pipeline can filter on `unit`, `pid` or `reason` without parsing sentences. Text
lines carry the level (`vram-enforcer: warning: ...`) so that `kubectl logs | grep error`
finds the failures.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from enforcer.core import messages

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
LINE_CHARS = 4096  # of a message; our longest sentences take a few hundred


def _message(record: logging.LogRecord) -> str:
    """The record's message as one bounded line, whatever text its arguments carried (a
    command line, an API's answer)."""
    return messages.one_line(record.getMessage(), LINE_CHARS)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
        }
        payload.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"vram-enforcer: {record.levelname.lower()}: {_message(record)}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def detail(exc: BaseException) -> BaseException | None:
    """`exc_info` for a handled error that is logged as one line: at debug verbosity the
    line is followed by the traceback and its chain of causes (the API's response, the
    socket error, the NVML call); otherwise nothing is added."""
    return exc if logging.getLogger().isEnabledFor(logging.DEBUG) else None


def setup(fmt: str = "text", verbosity: int = 0, *, default_level: int = logging.WARNING) -> None:
    """Configure the root logger; each `-v` lowers the threshold one level."""
    level = max(logging.DEBUG, default_level - 10 * verbosity)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Outage:
    """An outage said once, not once per failure: the first failure is logged, a failure
    that goes on is said again at most every `every` seconds (with how many there were),
    and the end of it once. Error messages that vary from one try to the next (a server
    that answers garbage) would otherwise log a line per try."""

    def __init__(
        self, logger: logging.Logger, every: float = 300.0, clock: Any = time.monotonic
    ) -> None:
        self._log = logger
        self._every = every
        self._clock = clock
        self._since: float | None = None
        self._said_at = 0.0
        self._count = 0
        self.error: str | None = None  # the latest failure, while it lasts

    def failed(self, what: str, exc: BaseException) -> None:
        now = self._clock()
        self.error = str(exc)
        self._count += 1
        if self._since is None:
            self._since, self._said_at = now, now
            self._log.warning("%s (%s)", what, exc, exc_info=detail(exc))
        elif now - self._said_at >= self._every:
            self._said_at = now
            since = now - self._since
            self._log.warning(
                "%s, still (%d failures in %.0fs; the latest: %s)",
                what,
                self._count,
                since,
                exc,
                exc_info=detail(exc),
            )

    def ended(self, what: str) -> None:
        if self._since is not None:
            self._log.info("%s", what)
        self._since, self._count, self.error = None, 0, None
