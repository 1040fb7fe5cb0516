"""LoopGuard: a bug in one step is reported once per place, counted every time, survived."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from enforcer.edge.guard import LoopGuard


def counter() -> Counter:
    return Counter("errors", "test", ["loop"], registry=CollectorRegistry())


def boom() -> None:
    raise KeyError("the bug")


def other() -> None:
    raise ValueError("another bug")


def test_a_bug_is_logged_once_with_its_traceback_and_counted_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors = counter()
    guard = LoopGuard("tick", errors.labels("tick"), logging.getLogger("test"))
    with caplog.at_level(logging.ERROR):
        assert guard.run(boom) is False
        assert guard.run(boom) is False
        assert guard.run(lambda: None) is True
        assert guard.run(other) is False
    assert errors.labels("tick")._value.get() == 3
    logged = [r for r in caplog.records if "unexpected error in the tick loop" in r.getMessage()]
    assert len(logged) == 2  # one per place in the code, not one per occurrence
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is KeyError
    assert logged[1].exc_info is not None and logged[1].exc_info[0] is ValueError


def test_keyboard_interrupt_is_not_swallowed() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    guard = LoopGuard("tick", counter().labels("tick"), logging.getLogger("test"))
    with pytest.raises(KeyboardInterrupt):
        guard.run(interrupted)
