"""The latest value of something one thread makes and others read, and that it changed.

The agent's threads share state this way: the sampler's devices, its last pass and each
container's usage, read by the advertiser, the hard limiter and the scrape. A value is
replaced whole, never changed in place, so a reader needs no lock: it reads one reference.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Latest(Generic[T]):
    """The value as last set. `set` also wakes the one reader that waits for a change
    (`wait`, which takes the wake-up); the others only read (`get`), and never wait."""

    __slots__ = ("_changed", "_value")

    def __init__(self, value: T) -> None:
        self._value = value
        self._changed = threading.Event()

    def get(self) -> T:
        return self._value

    def set(self, value: T) -> None:
        self._value = value
        self._changed.set()

    def wait(self, timeout: float) -> T:
        """The value once it changed, or `timeout` seconds passed, or `wake` was called."""
        self._changed.wait(timeout)
        self._changed.clear()
        return self._value

    def wake(self) -> None:
        """End the waiter's `wait` without a change (on shutdown: it looks at its stop)."""
        self._changed.set()
