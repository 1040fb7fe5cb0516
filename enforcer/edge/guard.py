"""Keeps a long-running loop going through a bug: no unexpected exception ends enforcement.

Every mode runs one step at a time (a tick, an NVML pass, a socket event) through a
`LoopGuard`. An exception that escapes a step is a bug: it is logged with its traceback
the first time it is seen at that place in the code, counted in
`vram_enforcer_unexpected_errors_total{loop}` every time, and the loop goes on with its
next step. The step's own state is left as the step left it; deciding and signalling only
ever happen on data that a step produced without an error.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

T = TypeVar("T")


class ErrorCounter(Protocol):
    """What a guard counts its loop's bugs in: a Prometheus counter (with its labels)."""

    def inc(self, amount: float = 1) -> None: ...


class LoopGuard:
    def __init__(self, loop: str, errors: ErrorCounter, log: logging.Logger) -> None:
        self._loop = loop
        self._errors = errors
        self._log = log
        self._seen: set[tuple[str, str, int]] = set()

    def run(self, step: Callable[[], object]) -> bool:
        """Run one step; False if it raised (and the error was reported)."""
        try:
            step()
        except Exception as exc:
            self._errors.inc()
            where = _origin(exc)
            if where not in self._seen:
                self._seen.add(where)
                self._log.error(
                    "unexpected error in the %s loop (a bug; it goes on, and repeats of it are "
                    "only counted in vram_enforcer_unexpected_errors_total)",
                    self._loop,
                    exc_info=exc,
                )
            return False
        return True

    def result(self, step: Callable[[], T]) -> T | None:
        """What one step returns; None if it raised (reported as `run` does). For steps
        that return a value, such as one object's read, so that a bug one object trips
        leaves that object out and the loop goes on with the others."""
        found: list[T] = []
        return found[0] if self.run(lambda: found.append(step())) else None


def stopped(threads: Iterable[threading.Thread]) -> list[str]:
    """The names of the helper threads that have stopped. A mode's helpers run for as long
    as the mode does: one that stops anyway (a bug past its guard) must end the mode, so
    that it is restarted, rather than leave it half-working."""
    return [t.name for t in threads if not t.is_alive()]


def _origin(exc: BaseException) -> tuple[str, str, int]:
    """The exception's type and the line it was raised at."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return (type(exc).__name__, last.filename if last else "", (last.lineno or 0) if last else 0)
