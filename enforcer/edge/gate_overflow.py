"""The allocation gate's overflow reader: one thread (`gate-overflow`) per pod for its
listener fds served beyond the node's caps (`core/gate_caps.py`), waiting on all of them at
once with epoll. It lets each notified call go on, unjudged (outcome `overflow`): it never
reads a caller's memory nor waits for a pass, so one thread serves any number of fds.
Sampling holds the containers whose calls it lets go on. One per pod, because what holds a
reader (a call its pod's holder took between the look and the read leaves it waiting for
that fd's next call; a container's budget of calls spent) must hold that pod alone.

It reads a copy of each fd (`os.dup`), which only its thread closes, once every task under
the filter has exited or its owner has dropped it: the owner's copy keeps the listener open
(closing the last copy would fail every later gated call with ENOSYS) and is the owner's to
close, and a number this thread still polls is never one the owner has closed and the
process has reused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from enforcer.edge.gate_listener import NOT_OURS_WAIT, STOP_WITHIN, Outcome, let_go_on
from enforcer.edge.guard import ErrorCounter, LoopGuard

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    copy: int  # our copy of the owner's fd
    pod: str | None
    may_read: Callable[[], bool]
    turn: Callable[[], float]  # how long to wait before its next call (its container's budget)


class Overflowed:
    """One fd served by the overflow reader, as its owner holds a `GateListener`: nothing
    to start, never stalled (its calls are answered without a look), dropped by `stop`."""

    stalled = False

    def __init__(self, reader: OverflowReader, entry: _Entry) -> None:
        self._reader = reader
        self._entry = entry

    def start(self) -> None:
        """Served from the moment it was taken."""

    def check(self) -> None:
        self._reader.check()

    def stop(self, within: float = STOP_WITHIN) -> bool:
        """No longer served; the owner may close its fd at once (ours is a copy)."""
        self._reader.drop(self._entry)
        return True


class OverflowReader:
    """`serve(fd, ...)` an fd; `check()` once a tick (a stopped thread restarted); `stop()`.
    `count(outcome, seconds)` is told of each call let go on, `gauge(n)` of the fds served."""

    def __init__(
        self,
        errors: ErrorCounter,
        count: Callable[[Outcome, float], None] = lambda outcome, seconds: None,
        gauge: Callable[[int], None] = lambda served: None,
    ) -> None:
        self._guard = LoopGuard("allocation gate overflow", errors, log)
        self._count = count
        self._gauge = gauge
        self._lock = threading.Lock()
        self._poll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._poll.register(self._wake, select.EPOLLIN)
        self._served: dict[int, _Entry] = {}  # by our copy's number
        self._dropped: list[_Entry] = []  # for the thread to close
        self._said: set[str | None] = set()  # the pods whose overflow was said
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = threading.Event()  # what a wait for a turn wakes on

    def serve(
        self,
        fd: int,
        pod: str | None,
        pid: int,
        may_read: Callable[[], bool],
        turn: Callable[[], float] = lambda: 0.0,
    ) -> Overflowed:
        """Serve `fd` (process `pid` of pod `pod`) from now; `may_read()`: whether a call may
        be read now (a pod's holder with a copy of the fd reads it while its lease lapses);
        `turn()`: how long to wait before its next call is let go on (its container's budget
        of calls, as its listeners keep it: a flood past the caps costs no more)."""
        with self._lock:
            if self._stopping:  # the agent stops: nothing served, its fd kept by its owner
                return Overflowed(self, _Entry(-1, pod, may_read, turn))
            entry = _Entry(os.dup(fd), pod, may_read, turn)
            self._served[entry.copy] = entry
            self._poll.register(entry.copy, select.EPOLLIN)
            first = pod not in self._said
            self._said.add(pod)
            served = len(self._served)
            if self._thread is None:
                self._thread = self._start()
        self._gauge(served)
        if first:
            log.warning(
                "allocation gate: pod %s has more gated processes than the agent serves "
                "with threads of their own (pid %d is one): their allocations go on "
                "unjudged, and sampling holds its containers",
                pod or "(not known)",
                pid,
            )
        return Overflowed(self, entry)

    def drop(self, entry: _Entry) -> None:
        """No longer serve `entry`: its copy is closed by the thread."""
        with self._lock:
            if self._served.get(entry.copy) is not entry:
                return  # closed already: every task under it exited
            self._forget(entry)
            self._dropped.append(entry)
        os.eventfd_write(self._wake, 1)

    def _forget(self, entry: _Entry) -> None:
        """`_lock` held: `entry` out of the served, its pod's overflow said again later."""
        del self._served[entry.copy]
        if all(e.pod != entry.pod for e in self._served.values()):
            self._said.discard(entry.pod)
        self._gauge(len(self._served))

    def idle(self) -> bool:
        """Nothing served, nothing left to close: its owner may stop it."""
        with self._lock:
            return not self._served and not self._dropped

    def check(self) -> None:
        """A thread that stopped (a bug), or never started, is started: its calls wait
        meanwhile, they never fail."""
        with self._lock:
            if self._stopping or not self._served:
                return
            if self._thread is not None and self._thread.is_alive():
                return
            if self._thread is not None:
                log.error("the allocation gate's overflow reader stopped (a bug); restarted")
            self._thread = self._start()

    def _start(self) -> threading.Thread | None:
        """The thread, started; None (said) where none can be had (the thread limit)."""
        thread = threading.Thread(target=self._run, name="gate-overflow", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            log.error("the allocation gate cannot start its overflow reader (%s): tried again", exc)
            return None
        return thread

    def stop(self, within: float = STOP_WITHIN) -> None:
        """Stop serving; our copies closed once the thread has ended (else left with it)."""
        with self._lock:
            if self._stopping:
                return  # stopped before
            self._stopping = True
            thread = self._thread
        self._stopped.set()
        os.eventfd_write(self._wake, 1)
        if thread is not None:
            thread.join(within)
            if thread.is_alive():
                log.warning("the allocation gate's overflow reader is still in a call: left")
                return
        for entry in [*self._served.values(), *self._dropped]:
            os.close(entry.copy)
        self._served.clear()
        self._dropped.clear()
        self._poll.close()
        os.close(self._wake)

    def _run(self) -> None:
        while not self._stopping:
            later = False  # a call a holder's lease keeps from us waits: a breath, then again
            for fd, ev in self._poll.poll():  # a call, a filter's end, or a word: no timeout
                if fd == self._wake:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake)
                    continue
                with self._lock:
                    entry = self._served.get(fd)
                if entry is not None:
                    later |= bool(self._guard.result(functools.partial(self._one, entry, ev)))
            self._close_dropped()
            if later:  # level-triggered: it is reported again at once
                time.sleep(NOT_OURS_WAIT)

    def _one(self, entry: _Entry, events: int) -> bool:
        """Answer the call waiting on `entry`, or close it once its tasks have all exited;
        True where a call waits that this reader may not read now."""
        if events & select.EPOLLIN:
            if not entry.may_read():
                return True
            wait = entry.turn()  # a turn taken: the call after the wait is read whatever
            if wait > 0:
                self._stopped.wait(wait)
            started = time.perf_counter()
            if let_go_on(entry.copy):
                self._count(Outcome.OVERFLOW, time.perf_counter() - started)
        elif events & (select.EPOLLHUP | select.EPOLLERR):  # no task of the filter is left
            with self._lock:
                if self._served.get(entry.copy) is entry:
                    self._forget(entry)
                    self._dropped.append(entry)
        return False

    def _close_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for entry in dropped:
            with contextlib.suppress(OSError):  # not registered: nothing to take out
                self._poll.unregister(entry.copy)
            os.close(entry.copy)
