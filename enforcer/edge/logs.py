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

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"vram-enforcer: {record.levelname.lower()}: {record.getMessage()}"
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
