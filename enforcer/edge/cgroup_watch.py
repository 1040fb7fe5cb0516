"""Wakes the hard limiter when the kubelet makes a pod's cgroup or the runtime a container's
(Linux inotify), rather than on the limiter's next `--cgroup-scan` poll.

A container's own limit can only be set once its cgroup exists, and runc starts the
container's process right after making it: until the limit lands, the process sees the
whole GPU (`cudaMemGetInfo`) and may allocate past its limit. The watch shortens that to
one pass of the limiter; nothing here can close it (only a hook that the runtime runs
between the two can: NVIDIA's `createRuntime` CDI hook).

Watched: each kubepods directory, its QoS classes' and each pod's, one watch each and at
most `most` together; never below a pod's directory, where a container with a cgroup
namespace of its own may make directories without bound. The poll stays as it was:
wherever the watch cannot see (no inotify, a watch limit reached, the queue overflowed, a
hierarchy gone or moved) the limiter finds new cgroups on its next scan. The log says
when the watch falls back and when it sees everything again; overflows are counted.

inotify is called through libc (ctypes): three calls and one struct, which the standard
library lacks and which a dependency (inotify_simple, watchdog) would only wrap the same
way, or, for watchdog, with recursive watches that a tenant could inflate.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from enforcer.core.cgroups import Level, made_in
from enforcer.edge import cgroupfs
from enforcer.edge.guard import ErrorCounter, LoopGuard

log = logging.getLogger(__name__)

MOST = 4096  # watches: the kubepods, QoS and pod directories (a node runs a few hundred pods)
RESYNC_EVERY = 60.0  # s: the watches made whole again from a scan, should one have been missed

# <sys/inotify.h>
IN_CREATE = 0x100
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_ISDIR = 0x40000000
_WATCHED = IN_CREATE | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class Event:
    """One inotify event: the watch it came from (-1 for the queue's own), what happened,
    and the name of the entry it happened to (empty for the watched directory itself)."""

    wd: int
    mask: int
    name: str


def events(data: bytes) -> list[Event]:
    """The events in what one read of an inotify descriptor returned (whole events only:
    the kernel never splits one across reads)."""
    found = []
    at = 0
    while at + _HEADER.size <= len(data):
        wd, mask, _, size = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        name = data[at : at + size].split(b"\0", 1)[0]
        at += size
        found.append(Event(wd, mask, os.fsdecode(name)))
    return found


class Inotify:
    """One inotify instance; raises OSError where the kernel refuses one (the user's
    `fs.inotify.max_user_instances`)."""

    def __init__(self) -> None:
        self.fd = _checked(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")

    def add(self, path: str, mask: int) -> int:
        """The watch of the directory at `path`; raises OSError (ENOSPC: the user's
        `fs.inotify.max_user_watches` is reached; ENOENT: it has gone)."""
        return _checked(_libc.inotify_add_watch(self.fd, os.fsencode(path), mask), path)

    def remove(self, wd: int) -> None:
        _libc.inotify_rm_watch(self.fd, wd)  # EINVAL: its directory went first, nothing to do

    def read(self) -> list[Event]:
        try:
            return events(os.read(self.fd, 64 * 1024))
        except BlockingIOError:
            return []

    def close(self) -> None:
        os.close(self.fd)


def _checked(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), what)
    return result


class _Stop(threading.Event):
    """The thread's stop, which also ends its wait in poll(2): once set, `fd` is readable."""

    def __init__(self) -> None:
        super().__init__()
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            super().set()
            if self.fd >= 0:
                os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        with self._lock:
            os.close(self.fd)
            self.fd = -1


class CgroupWatch(threading.Thread):
    """Sets `woken` (the hard limiter's) when a pod's or a container's cgroup is made below
    the cgroup v2 hierarchy at `root` (a hybrid host's `unified`, as the limiter finds it)."""

    def __init__(
        self,
        root: Path,
        woken: threading.Event,
        overflows: ErrorCounter,
        errors: ErrorCounter,
        *,
        most: int = MOST,
        resync: float = RESYNC_EVERY,
    ) -> None:
        super().__init__(name="cgroup-watch", daemon=True)
        self.stop = _Stop()
        self._root = cgroupfs.v2_at(root)
        self._scanner = cgroupfs.PodScanner(self._root)
        self._woken = woken
        self._overflows = overflows
        self._most = most
        self._resync = resync
        self._guard = LoopGuard("cgroup-watch", errors, log)
        self._inotify: Inotify | None = None
        self._watched: dict[int, tuple[str, Level]] = {}  # watch -> its directory, level
        self._watches: dict[str, int] = {}  # directory -> its watch
        self._due = 0.0  # when the watches are next made whole from a scan (monotonic)
        self._short: str | None = None  # why the watch does not see every pod, as last said

    @property
    def watching(self) -> int:
        """How many directories are watched."""
        return len(self._watches)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self._guard.run(self._step):
                    self.stop.wait(self._resync)  # a bug: not again at once
        finally:
            if self._inotify is not None:
                self._inotify.close()
            self.stop.close()

    def _step(self) -> None:
        """Make the watches whole when due, then wait for events (or the stop) until then,
        and take those that came."""
        if time.monotonic() >= self._due:
            self._due = time.monotonic() + self._resync
            self._sync()
        waiting = select.poll()
        waiting.register(self.stop.fd, select.POLLIN)
        if self._inotify is not None:
            waiting.register(self._inotify.fd, select.POLLIN)
        waiting.poll(max(0.0, self._due - time.monotonic()) * 1000)
        if not self.stop.is_set():
            self._read()

    def _read(self) -> None:
        """Take every event queued (at most the queue's length, then its overflow)."""
        while self._inotify is not None and (taken := self._inotify.read()):
            for event in taken:
                self._take(event)

    def _sync(self) -> None:
        """Watch the kubelet's directories as a scan finds them now, and no others; a
        directory newly watched wakes the limiter, for what was made in it unseen."""
        if self._inotify is None:
            try:
                self._inotify = Inotify()
            except OSError as exc:
                self._say(f"inotify is not available here ({exc.strerror})")
                return
        found = self._scanner.levels()
        for path in [p for p in self._watches if p not in found]:  # gone, or moved
            self._inotify.remove(self._forget(self._watches[path]))
        short = None if found else f"no kubepods directory is below {self._root} yet"
        added = False
        for path, level in found.items():
            if path not in self._watches:
                why = self._add(path, level)
                short = short or why
                added = added or why is None
        self._say(short)
        if added:
            self._woken.set()

    def _take(self, event: Event) -> None:
        if event.mask & IN_Q_OVERFLOW:
            self._overflows.inc()
            self._say("the inotify queue overflowed (fs.inotify.max_queued_events)")
            self._due = 0.0  # events were lost: made whole again at once
            self._woken.set()
            return
        watched = self._watched.get(event.wd)
        if watched is None:
            return
        path, level = watched
        if event.mask & IN_IGNORED:  # the directory has gone (or was unmounted)
            self._forget(event.wd)
            if level is Level.KUBEPODS:
                self._due = 0.0
        elif event.mask & (IN_MOVE_SELF | IN_UNMOUNT):  # the paths known are wrong now
            self._due = 0.0
        elif event.mask & IN_CREATE and event.mask & IN_ISDIR:
            deeper, work = made_in(level, event.name)
            if deeper is Level.POD:
                why = self._add(f"{path}/{event.name}", deeper)
                if why:
                    self._say(why)
            elif deeper is not None:
                self._due = 0.0  # a new QoS class: its pods are found by a scan
            if work:  # after the pod's watch: what the limiter finds then is all there is
                self._woken.set()

    def _add(self, path: str, level: Level) -> str | None:
        """Watch `path`; why not, where it could not be (the pods below are the poll's)."""
        assert self._inotify is not None  # noqa: S101 - made before any watch is added
        if len(self._watches) >= self._most:
            return f"more than {self._most} of the kubelet's directories to watch"
        try:
            wd = self._inotify.add(path, _WATCHED)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return None  # gone meanwhile: nothing to watch
            if exc.errno == errno.ENOSPC:
                return "the node's inotify watches are all taken (fs.inotify.max_user_watches)"
            return f"{path} cannot be watched ({exc.strerror})"
        self._watched[wd] = (path, level)
        self._watches[path] = wd
        return None

    def _forget(self, wd: int) -> int:
        path, _ = self._watched.pop(wd, ("", Level.POD))
        self._watches.pop(path, None)
        return wd

    def _say(self, short: str | None) -> None:
        """Say in the log when the watch starts or stops seeing every pod's new cgroups."""
        if short and short != self._short:
            log.warning(
                "new pods' and containers' cgroups are found by the --cgroup-scan poll "
                "(each container's limit lands up to a scan later): %s",
                short,
            )
        elif short is None and self._short is not None:
            log.info("new pods' and containers' cgroups wake the hard limiter again (inotify)")
        self._short = short
