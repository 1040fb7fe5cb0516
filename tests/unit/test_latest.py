"""`Latest`: what one thread publishes and others read, and the wake-up of the one that waits."""

from __future__ import annotations

import threading
import time

from enforcer.edge.latest import Latest


def test_a_reader_gets_the_value_as_last_set_without_waiting() -> None:
    latest: Latest[tuple[int, ...]] = Latest(())
    assert latest.get() == ()
    latest.set((1, 2))
    latest.set((3,))
    assert latest.get() == (3,)


def test_a_waiter_wakes_on_a_change_and_takes_the_wake_up() -> None:
    latest = Latest(0)
    latest.set(1)
    started = time.monotonic()
    assert latest.wait(5.0) == 1  # the change was already there: no wait
    assert time.monotonic() - started < 1.0
    assert latest.wait(0.05) == 1  # taken: the next wait lasts its timeout
    assert time.monotonic() - started >= 0.05


def test_a_change_made_by_another_thread_ends_the_wait_at_once() -> None:
    latest = Latest("before")
    setter = threading.Timer(0.05, latest.set, ("after",))
    setter.start()
    try:
        started = time.monotonic()
        assert latest.wait(10.0) == "after"
        assert time.monotonic() - started < 5.0
    finally:
        setter.join()


def test_wake_ends_the_wait_without_a_change() -> None:
    latest = Latest(7)
    threading.Timer(0.05, latest.wake).start()
    started = time.monotonic()
    assert latest.wait(10.0) == 7
    assert time.monotonic() - started < 5.0
