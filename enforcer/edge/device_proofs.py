"""Whether listed processes hold a GPU device, looked at off the sampler's thread.

A listing of unknown age is proven by the device files its process holds open
(`ProcFs.holds_device`). The process chose those files, and reading one can wait in the
kernel on a filesystem that never answers (a hung FUSE daemon, a hard NFS mount whose
server is gone). `holds_device` follows only files on local mounts, but a descriptor
replaced between its checks and the walk to its file can still land elsewhere. So the
looks run on threads of their own: the sampler asks and never waits, and takes the answers
of the looks that have come back. A process a look did not prove is looked at again a
second later. A look that has not come back after `stuck_after` keeps its thread, and a
new thread takes the others: a hang costs the process looked at (its usage stays unknown,
never free), not the node. At most `most_stuck` threads are left behind at once; past
that, no look starts until one comes back, and the log says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection

from enforcer.core import messages
from enforcer.core.model import ProcessKey

log = logging.getLogger(__name__)

STUCK_AFTER = 1.0  # s: a look that has not come back by then is left to its thread
MOST_STUCK = 4  # threads left in looks that have not come back, at most
AGAIN_AFTER = 1.0  # s: a process a look did not prove is looked at again no sooner

Look = Callable[[ProcessKey], bool]
"""Whether the process holds a GPU device, proven by a look at its open files."""


class DeviceProofs:
    """The sampler's looks at processes' open files, each on a `device-proof` thread."""

    def __init__(
        self,
        look: Look,
        stuck_after: float = STUCK_AFTER,
        most_stuck: int = MOST_STUCK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._look = look
        self._stuck_after = stuck_after
        self._most_stuck = most_stuck
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: deque[ProcessKey] = deque()
        self._answers: dict[ProcessKey, bool] = {}  # looks come back, not yet taken
        self._not_before: dict[ProcessKey, float] = {}  # not proven: when to look again
        self._looking: dict[int, tuple[ProcessKey, float]] = {}  # thread -> its look, since
        self._threads = 0
        self._said: set[ProcessKey] = set()  # looks said to be stuck
        self._said_full = False

    def proven(self, wanted: Collection[ProcessKey]) -> set[ProcessKey]:
        """Of `wanted` (listings not proven yet), those that a look that has come back saw
        holding a GPU device. Each of the others is looked at again, unless a look at it is
        under way, or one proved nothing less than `AGAIN_AFTER` ago (a process that holds
        no device is not read over and over). Never waits; what is no longer wanted is
        forgotten."""
        wanted = set(wanted)
        now = self._clock()
        with self._lock:
            proven = {key for key, held in self._answers.items() if held and key in wanted}
            looking = {key for key, _ in self._looking.values()}
            self._queue = deque(key for key in self._queue if key in wanted)
            self._not_before = {k: t for k, t in self._not_before.items() if k in wanted}
            again = wanted - proven - looking - set(self._queue)
            self._queue.extend(k for k in sorted(again) if self._not_before.get(k, now) <= now)
            self._answers.clear()
            self._said &= looking
            self._start_if_needed()
        return proven

    def _start_if_needed(self) -> None:
        """A thread for the queue, unless one can take it: one that is idle, or in a look
        not stuck yet. Called with the lock held."""
        now = self._clock()
        stuck = {k: now - t for k, t in self._looking.values() if now - t >= self._stuck_after}
        for key, after in stuck.items():
            if key not in self._said:
                self._said.add(key)
                log.warning("%s", messages.device_look_stuck(key.pid, after))
        if not self._queue or self._threads > len(stuck):
            return
        if len(stuck) >= self._most_stuck:
            if not self._said_full:
                self._said_full = True
                log.error("%s", messages.device_looks_wait(len(stuck)))
            return
        self._said_full = False
        self._threads += 1
        threading.Thread(target=self._run, name="device-proof", daemon=True).start()

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            with self._lock:
                if not self._queue:
                    self._threads -= 1
                    return
                key = self._queue.popleft()
                self._looking[me] = (key, self._clock())
            held = False
            try:
                held = self._look(key)
            except Exception:  # a bug: this look proves nothing, the next pass asks again
                log.exception("looking at pid %d's open files failed", key.pid)
            with self._lock:
                del self._looking[me]
                self._answers[key] = held
                if not held:
                    self._not_before[key] = self._clock() + AGAIN_AFTER
