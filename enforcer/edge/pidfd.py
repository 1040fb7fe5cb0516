"""A process held by a pidfd: while it is open, the pid cannot name anyone else.

Pinning is how every identity check in the enforcer becomes a proof: read `/proc` after
pinning, then check that the pinned process is still alive, and the reads were of it.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal

from enforcer.core.model import SignalResult

log = logging.getLogger(__name__)


class Pinned:
    """A process held by a pidfd, which this object alone owns and closes."""

    __slots__ = ("_fd", "pid")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd

    @classmethod
    def open(cls, pid: int) -> Pinned | SignalResult:
        """Pin `pid`, or say why not: GONE when no such process, UNVERIFIED on any other
        error (a thread id, out of file descriptors, ...)."""
        try:
            return cls(pid, os.pidfd_open(pid))
        except ProcessLookupError:
            return SignalResult.GONE
        except (OSError, OverflowError) as exc:  # Overflow: a garbage pid (NVML's is unsigned)
            log.debug("cannot open a pidfd for pid %d: %s", pid, exc)
            return SignalResult.UNVERIFIED

    def fileno(self) -> int:
        return self._fd

    def exited(self) -> bool:
        """A pidfd polls readable once its process has exited (a zombie has exited)."""
        if self._fd < 0:
            return True
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, sig: signal.Signals) -> SignalResult:
        if self._fd < 0:
            return SignalResult.GONE
        try:
            signal.pidfd_send_signal(self._fd, sig)
        except ProcessLookupError:
            return SignalResult.GONE
        except OSError as exc:
            if exc.errno != errno.EPERM:
                log.warning("the kernel refused %s for pid %d: %s", sig.name, self.pid, exc)
            return SignalResult.DENIED
        return SignalResult.SENT

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
