"""Small helpers shared by the tests and the benchmarks."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `predicate` returns something truthy, and return it; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(parent: int) -> list[int]:
    """The direct children of `parent`, from /proc."""
    from enforcer.procfs import ProcFs

    proc = ProcFs()
    return [
        p
        for p in proc.descendants(parent)
        if (st := proc.stat(p)) is not None and st.ppid == parent
    ]
