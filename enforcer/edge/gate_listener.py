"""The allocation gate's listener: reads each notified driver call from the seccomp listener
fd, decodes its parameters from the caller's memory, and lets it go on or refuses it the way
a full GPU does (the driver's NV_ERR_NO_MEMORY written into its status, the ioctl returning 0).

It fails open: a bug, an unreadable parameter, a task that vanished, an unknown call, a full
recheck queue or a missed recheck deadline let the call go on (sampling still holds the
line). It never dies silently: each call runs under a `LoopGuard`, and `check()` (the main
loop's, every tick) restarts a receiver that stopped and says when one stalls. While the fd
is open in this process a gated call waits for an answer; it fails with ENOSYS only once
every copy of the fd is closed (this process killed), which the kernel offers no way around.

A call let through continues after the check, and another thread of the caller can change
its parameters in between (the kernel documents the race): the gate is for workloads that do
not race it, and sampling is the enforcement of record.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import queue
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from enum import StrEnum

from enforcer.core import messages
from enforcer.core.alloc_gate import Verdict, View, decide
from enforcer.core.gate_budget import Budget
from enforcer.core.rm_abi import NV_ERR_NO_MEMORY, Call, Read, ShortRead, decode
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.seccomp_filter import COMPAT_ARCHES, X32_BIT

log = logging.getLogger(__name__)

# include/uapi/linux/seccomp.h: the ioctls on a listener fd, and the one response flag used
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif), 80 bytes
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp), 24 bytes
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102  # _IOW('!', 2, __u64)
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
# struct seccomp_notif: id, pid (the thread), flags, then seccomp_data (nr, arch, ip, args[6]).
# 80 bytes, so fcntl.ioctl copies it and releases the GIL while RECV blocks (it holds the GIL
# for a buffer over 1024 bytes): a bigger buffer would freeze every other thread of ours.
_NOTIF = struct.Struct("<QIIiIQ6Q")
_RESP = struct.Struct("<QqiI")

RECHECK_QUEUE = 64
_USER_END = 1 << 63  # no user address is above; pread's offset is signed
STALL_AFTER = 1.0  # s a call may wait unread, or the receiver over one, before it is stalled
STOP_WITHIN = 2.0  # s stop() waits for a thread held inside a call
# s before a call a second holder's lease keeps from us is looked at again: 20 looks a
# second per fd while a pod's sidecar is stopped (its tenant can stop it), not 100.
NOT_OURS_WAIT = 0.05


class Outcome(StrEnum):
    """What became of one notified call."""

    ALLOWED = "allowed"
    REFUSED = "refused"
    NOT_MEMORY = "not_memory"  # no video-memory allocation (another class, function or form)
    NOT_GPU = "not_gpu"  # the request's number on a file that is no NVIDIA device
    UNPROVEN = "unproven"  # a caller not proven of the container whose limit it is: let go on
    UNSURE = "unsure"  # a recheck that could not be made in time, or a lease lapsed: let go on
    ABANDONED = "abandoned"  # the caller was interrupted before the answer
    OVERFLOW = "overflow"  # a process over the node's caps on listeners: let go on, unjudged
    ERROR = "error"  # a bug, or parameters that cannot be read: let go on


class LineQuota:
    """At most `most` lines in `every` seconds (a flood of refusals must not flood the log);
    the lines held back are counted, and said with the next line let out."""

    def __init__(self, most: int = 5, every: float = 1.0) -> None:
        self._most = most
        self._every = every
        self._start = float("-inf")
        self._said = 0
        self._held = 0

    def take(self, now: float) -> int | None:
        """None: hold this line back; else how many were held back before it."""
        held = 0
        if now - self._start >= self._every:
            held, self._start, self._said, self._held = self._held, now, 0, 0
        if self._said >= self._most:
            self._held += 1
            return None
        self._said += 1
        return held


@dataclass(frozen=True, slots=True)
class Notification:
    id: int
    tid: int
    arch: int
    fd: int
    cmd: int
    argp: int

    @classmethod
    def unpack(cls, raw: bytes | bytearray) -> Notification:
        nid, tid, _flags, nr, arch, _ip, fd, cmd, argp, *_ = _NOTIF.unpack(raw)
        # x32 (x86_64's arch, the number's x32 bit) enters compat_sys_ioctl too: the kernel
        # passes the driver the argument's low 32 bits, whatever the register's upper half
        compat = arch in COMPAT_ARCHES or nr & X32_BIT
        pointer = 0xFFFFFFFF if compat else (1 << 64) - 1
        return cls(nid, tid, arch, fd & 0xFFFFFFFF, cmd & 0xFFFFFFFF, argp & pointer)


class Ledger:
    """The gate's `View` shared by the sampler's thread (`saw`) and the listener's."""

    def __init__(self, limit_bytes: int) -> None:
        self._view = View(limit_bytes)
        self._changed = threading.Condition()

    def view(self) -> View:
        with self._changed:
            return self._view

    def saw(self, used_bytes: int, at: float) -> None:
        """A good pass of the sampler, begun at `at` (monotonic)."""
        with self._changed:
            self._view = self._view.saw(used_bytes, at)
            self._changed.notify_all()

    def tried(self, at: float) -> None:
        """A pass of the sampler, begun at `at`, that could not read the tree's usage."""
        with self._changed:
            self._view = self._view.tried(at)
            self._changed.notify_all()

    def judge(self, ask_bytes: int, arrived: float) -> tuple[Verdict, View, float]:
        """The verdict on one allocation whose call arrived at `arrived`, the view it was
        judged on and when; an allowed one is counted as held from now."""
        with self._changed:
            now, view = time.monotonic(), self._view
            verdict, _ = decide(ask_bytes, view, arrived)
            if verdict == Verdict.ALLOW:
                self._view = view.granted(now, ask_bytes)
            return verdict, view, now

    def ungrant(self, at: float, ask_bytes: int) -> None:
        with self._changed:
            self._view = self._view.ungranted(at, ask_bytes)

    def limit(self, limit_bytes: int) -> None:
        """A new limit (the node agent learns a container's once its pod lists it)."""
        with self._changed:
            self._view = replace(self._view, limit_bytes=limit_bytes)

    def wait_pass(self, after: float, timeout: float) -> bool:
        """Whether a pass (good or not) newer than `after` came within `timeout` seconds."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._view.tried_at is not None and self._view.tried_at > after,
                timeout,
            )


class Turns:
    """A container's `Budget` shared by the receivers of its listeners: `take()` reserves
    the next call's turn, and says how many seconds its receiver waits for it."""

    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self._lock = threading.Lock()

    def take(self) -> float:
        with self._lock:
            self._budget, wait = self._budget.take(time.monotonic())
        return wait


@dataclass(slots=True)
class _Pending:
    """A call over the limit that waits for a fresh pass, its caller's memory held open;
    `arrived`: when (monotonic) it was received, after its caller's frees before it."""

    notif: Notification
    call: Call
    ask: int
    status_addr: int
    mem: int
    arrived: float


class GateListener:
    """Serves one listener fd (`start`), checked by its owner's loop (`check`).

    `majors`: the device majors of NVIDIA's nodes (the request numbers on another file are
    not the driver's). `count(outcome, seconds)` is told of each call; `want_pass()` asks
    the owner for an early sampler pass when a call waits for one (at most `recheck_wait`
    seconds, then it goes on). `turn()`: how long to wait before reading the next call
    waiting (its container's `Turns` on a node; 0: at once), its caller waiting meanwhile
    in the kernel."""

    def __init__(  # noqa: PLR0913 - each a part of what the listener serves, or says
        self,
        fd: int,
        ledger: Ledger,
        majors: Collection[int],
        errors: ErrorCounter,
        count: Callable[[Outcome, float], None] = lambda outcome, seconds: None,
        want_pass: Callable[[], None] = lambda: None,
        recheck_wait: float = 0.25,
        pid: int = 0,
        who: str = "the command tree",
        vouch: Callable[[int], bool] | None = None,
        may_read: Callable[[], bool] = lambda: True,
        turn: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._fd = fd
        self._ledger = ledger
        self._majors = frozenset(majors)
        self._count = count
        self._want_pass = want_pass
        # Told of each refusal's line (also those the log holds back); set before `start`.
        self.refused: Callable[[str], None] = lambda line: None
        self._recheck_wait = recheck_wait
        self._pid = pid  # the command's, for the lines people read
        self._who = who  # what the limit is of, in those lines
        # Whether a calling thread is of `who` (None: each is, as the fd's source proved);
        # a caller it does not vouch for is let go on, never judged against `who`'s limit.
        # Asked until it vouches for one caller still waiting on the fd after: every task
        # under one filter is of one container (a task cannot leave its container's
        # cgroup), so that proves the fd is `who`'s filter, not one handed over with
        # another's pid and id; the calls after it cost no read.
        self._vouch = vouch
        self._vouched = vouch is None
        # Whether this listener may read now: False while a second holder of the fd reads
        # it (`gate_holder`'s lease); a call read as it lapses is let go on, unjudged.
        self._may_read = may_read
        self._turn = turn
        self._waiting_turn = False  # the receiver waits for its turn: our pace, no stall
        self._guard = LoopGuard("allocation gate", errors, log)
        # None: the worker's word to stop (it blocks on the queue, and wakes for nothing else)
        self._rechecks: queue.Queue[_Pending | None] = queue.Queue(RECHECK_QUEUE)
        self._quota = LineQuota()
        self._stopping = threading.Event()
        # Written by `stop`: the receiver waits on it with the fd, never waking for nothing.
        self._wake: int | None = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._starting = threading.Lock()  # `start` and `check` start the threads
        self._started = False
        self._receiver: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._answered = 0
        self._last_answer: float | None = None
        self._busy_since: float | None = None  # the receiver is over one call since then
        self._ended = False  # every task under the filter has exited: nothing more to serve
        self._seen = (0, time.monotonic())  # (answered, when that count was first seen)
        self.stalled = False

    @property
    def ended(self) -> bool:
        """Every task under the filter has exited: nothing more to serve, nor to stall."""
        return self._ended

    @property
    def answered(self) -> int:
        """Calls answered so far: the progress its owner's stall gauge follows."""
        return self._answered

    @property
    def last_answer(self) -> float | None:
        """When (monotonic) the last call was answered; None before the first."""
        return self._last_answer

    def start(self) -> None:
        """Start serving. A thread that cannot start (the process's thread limit) is said,
        and started by the next `check()`: the callers wait meanwhile, they never fail."""
        with self._starting:
            self._started = True
            self._threads()

    def _threads(self) -> None:
        """Start each thread not running (`_starting` held), unless stopped."""
        if self._stopping.is_set():
            return
        try:
            if self._receiver is None or not self._receiver.is_alive():
                self._receiver = self._thread("allocation-gate", self._receive)
            if self._worker is None or not self._worker.is_alive():
                self._worker = self._thread("allocation-gate-recheck", self._recheck_loop)
        except RuntimeError as exc:  # can't start new thread
            log.error("the allocation gate cannot start a thread (%s); tried again", exc)

    def _thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def check(self) -> None:
        """The owner's check, once a tick: a stopped thread is restarted on the same fd (the
        callers wait meanwhile, they never fail), and a listener that has not answered a
        waiting call, or whose receiver has been over one call, for `STALL_AFTER` is said
        stalled (a workload's memory the receiver reads can keep it waiting)."""
        if self._stopping.is_set():
            return
        stalled = not self._ended and self._stalled_now()
        if stalled and not self.stalled:
            log.error("the allocation gate has not answered for %.0f s", STALL_AFTER)
        elif self.stalled and not stalled:
            log.warning("the allocation gate answers again")
        self.stalled = stalled

    def _stalled_now(self) -> bool:
        """Restarts a stopped thread; whether a call has waited unanswered too long."""
        with self._starting:
            for thread, what in ((self._receiver, "receiver"), (self._worker, "recheck worker")):
                if self._started and thread is not None and not thread.is_alive():
                    log.error("the allocation gate's %s stopped (a bug); it is restarted", what)
            if self._started:  # one that never started (no thread to be had) too
                self._threads()
        now, waiting = time.monotonic(), _readable(self._fd)
        if self._answered != self._seen[0] or not waiting or self._waiting_turn:
            self._seen = (self._answered, now)
        busy = self._busy_since
        return (waiting and now - self._seen[1] > STALL_AFTER) or (
            busy is not None and now - busy > STALL_AFTER
        )

    def stop(self, within: float = STOP_WITHIN) -> bool:
        """Stop serving; calls still waiting for a recheck go on. True once both threads
        have ended: its owner may then close the fd. False (said) where one is still held
        inside a call after `within` seconds (a workload's memory that never
        answers a read, served by a process outside the command): it is left, with the fd."""
        with self._starting:  # no thread (re)started after this
            self._stopping.set()
            wake = self._wake
        if wake is not None:  # None: stopped before
            os.eventfd_write(wake, 1)
        with contextlib.suppress(queue.Full):  # full: the worker takes one without waiting
            self._rechecks.put_nowait(None)
        deadline = time.monotonic() + within
        for thread in (self._receiver, self._worker):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        held = [t.name for t in (self._receiver, self._worker) if t and t.is_alive()]
        if held:
            log.warning(
                "the allocation gate's %s is still held inside a call after %.0f s (the "
                "command's memory does not answer its read): it is left behind",
                " and ".join(held),
                within,
            )
        while not self._rechecks.empty():
            if (p := self._rechecks.get_nowait()) is None:
                continue
            try:
                self._reply(p.notif, Outcome.UNSURE)
            except OSError:
                pass  # nothing more to tell it
            finally:
                os.close(p.mem)
        with self._starting:
            if not held and self._wake is not None:
                os.close(self._wake)
                self._wake = None
        return not held

    def _receive(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if self._wake is not None:  # else stopped: the loop ends at once
            poller.register(self._wake, select.POLLIN)
        buf = bytearray(_NOTIF.size)
        turn_taken = False
        while not self._stopping.is_set():
            events = dict(poller.poll())  # a call, the filter's end or `stop`: no timeout
            if self._stopping.is_set():
                return
            if events.get(self._fd, 0) & select.POLLIN and not self._may_read():
                self._stopping.wait(NOT_OURS_WAIT)  # the other holder's to answer
            elif events.get(self._fd, 0) & select.POLLIN:
                if not turn_taken:
                    turn_taken = True
                    # A bug in the owner's budget is counted, and the call read now.
                    if (wait := self._guard.result(self._turn) or 0.0) > 0:
                        self._wait_turn(wait)
                        continue  # looked at again: its caller may have gone meanwhile
                turn_taken = False
                buf[:] = bytes(_NOTIF.size)  # RECV refuses a struct that is not zeroed
                try:
                    fcntl.ioctl(self._fd, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR):
                        continue  # the caller moved on before we read it
                    raise
                self._one(Notification.unpack(buf))
            elif events.get(self._fd, 0):  # POLLHUP: no task of the filter is left
                self._ended = True
                return

    def _wait_turn(self, wait: float) -> None:
        """Wait `wait` seconds for the next call's turn (or until stopped): the calls
        waiting meanwhile wait in the kernel, and are not a stall."""
        self._waiting_turn = True
        try:
            self._stopping.wait(wait)
        finally:
            self._waiting_turn = False

    def _one(self, notif: Notification) -> None:
        started = time.perf_counter()
        self._busy_since = arrived = time.monotonic()
        served: list[Outcome | None] = []
        try:
            if not self._guard.run(lambda: served.append(self._serve(notif, arrived))):
                served = [self._reply(notif, Outcome.ERROR)]  # a bug: the call goes on
        finally:
            self._busy_since = None
        if served[0] is not None:  # None: handed to the recheck worker
            self._done(served[0], started)

    def _done(self, outcome: Outcome, started: float) -> None:
        self._answered += 1
        self._last_answer = time.monotonic()
        self._count(outcome, time.perf_counter() - started)

    def _serve(self, notif: Notification, arrived: float) -> Outcome | None:
        """Decide one call, received at `arrived`, and answer it; None if it was handed to
        the recheck worker."""
        try:
            if not self._may_read():  # lapsed since it was looked at (this process stopped)
                return self._reply(notif, Outcome.UNSURE)
            if not self._on_gpu(notif):
                return self._reply(notif, Outcome.NOT_GPU)
            if not self._vouched and self._vouch is not None and not self._vouch(notif.tid):
                return self._reply(notif, Outcome.UNPROVEN)
            mem = _memory(notif.tid)
        except PermissionError:  # the ptrace check, on a task of ours: it chose to hide
            return self._unreadable(notif) if self._valid(notif) else Outcome.ABANDONED
        except OSError:
            if self._valid(notif):
                raise  # its task is there: our fault (a bug)
            return Outcome.ABANDONED  # its task ended before it was looked at
        handed = False
        try:
            # The fd names the notifying task's memory only if the call is still pending now.
            if not self._valid(notif):
                return Outcome.ABANDONED
            self._vouched = True  # its caller, read above, is still the one waiting
            try:
                call = decode(notif.cmd, notif.argp, _reader(mem))
            except ShortRead as exc:  # the driver answers it EFAULT: it allocates nothing
                log.debug("gate: unreadable parameters (%s) -> error", exc)
                return self._reply(notif, Outcome.ERROR)
            if call.ask_bytes is None or call.status_addr is None:
                log.debug("gate: %s -> not_memory", call.what)
                return self._reply(notif, Outcome.NOT_MEMORY)
            pending = _Pending(notif, call, call.ask_bytes, call.status_addr, mem, arrived)
            outcome = self._judge(pending)
            if outcome is not None:
                return outcome
            if not self._queue(pending):
                return self._reply(notif, Outcome.UNSURE)
            handed = True
            return None
        finally:
            if not handed:
                os.close(mem)

    def _queue(self, pending: _Pending) -> bool:
        """Hand a call to the recheck worker; False if the queue is full of live calls.
        Calls that signals interrupted are dropped first: each signal makes the kernel
        issue a waiting call again, and a storm of them must not fill the queue so that
        the call goes on past its limit."""
        with contextlib.suppress(queue.Full):
            self._rechecks.put_nowait(pending)
            return True
        with self._rechecks.mutex:  # the worker takes from the left meanwhile, never more
            queued = self._rechecks.queue
            gone = [p for p in queued if p is not None and not self._valid(p.notif)]
            for p in gone:
                queued.remove(p)
        for p in gone:
            os.close(p.mem)
            self._done(Outcome.ABANDONED, time.perf_counter())
        try:
            self._rechecks.put_nowait(pending)
        except queue.Full:
            return False
        return True

    def _judge(self, p: _Pending) -> Outcome | None:
        """Allow or refuse one allocation and answer it; None where a fresh pass may change
        the verdict (nothing answered yet)."""
        verdict, view, at = self._ledger.judge(p.ask, p.arrived)
        if verdict == Verdict.RECHECK:
            return None
        if verdict == Verdict.ALLOW:
            outcome = self._reply(p.notif, Outcome.ALLOWED)
            if outcome == Outcome.ABANDONED:  # it never went on: not held
                self._ledger.ungrant(at, p.ask)
            log.debug("gate: %s %d B -> %s", p.call.what, p.ask, outcome)
            return outcome
        error = 0
        try:
            os.pwrite(p.mem, struct.pack("<I", NV_ERR_NO_MEMORY), p.status_addr)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            # Unmapped since it was read: failed as the driver fails a block it cannot
            # write back, never let go on (it could be mapped again before the driver reads).
            error = errno.EFAULT
        # Written only into the memory of a call still pending (the man page's recipe).
        if not self._valid(p.notif):
            return Outcome.ABANDONED
        outcome = self._reply(p.notif, Outcome.REFUSED, error)
        if outcome != Outcome.REFUSED:
            return outcome
        line = messages.allocation_refused(
            p.call.what, p.ask, self._pid, p.notif.tid, view, at, self._who
        )
        unmapped = "; its block was unmapped before the status was written: it failed EFAULT"
        self._say(line, at, unmapped if error else "")
        return outcome

    def _say(self, line: str, at: float, after: str = "") -> None:
        """One refusal's line: told to the owner, and logged if the quota lets it out."""
        self.refused(line)
        if (held := self._quota.take(at)) is not None:
            more = f" ({held} more refusals were not logged in the second before)" if held else ""
            log.warning("%s%s%s", line, more, after)

    def _unreadable(self, notif: Notification) -> Outcome:
        """A call whose process the kernel will not let us read (it made itself not
        dumpable, or runs a program its user may not read, and we lack CAP_SYS_PTRACE):
        failed EPERM, never let go on unjudged, since one prctl would otherwise take a
        command past every check."""
        outcome = self._reply(notif, Outcome.REFUSED, errno.EPERM)
        if outcome == Outcome.REFUSED:
            self._say(messages.allocation_unreadable(self._pid, notif.tid), time.monotonic())
        return outcome

    def _recheck_loop(self) -> None:
        while not self._stopping.is_set():
            if (p := self._rechecks.get()) is None:  # `stop`'s word
                return
            started = time.perf_counter()
            try:
                outcome = self._guard.result(functools.partial(self._recheck, p))
            finally:
                os.close(p.mem)
            self._done(outcome or self._reply(p.notif, Outcome.ERROR), started)

    def _recheck(self, p: _Pending) -> Outcome:
        """Wait for a pass that shows what the verdict was unsure of (asking the owner for
        one early), then judge again; when the time is up, or the listener stops, the call
        goes on: sampling holds the line. A call abandoned meanwhile is dropped within a
        slice, so that the calls queued behind it do not wait for its whole wait."""
        deadline = time.monotonic() + self._recheck_wait
        while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            if not self._valid(p.notif):  # a signal interrupted it: the kernel asks again
                return Outcome.ABANDONED
            view = self._ledger.view()
            due = view.settled_after(p.arrived)
            if (early := due - time.monotonic()) > 0:
                self._stopping.wait(min(left, early))
                continue
            self._want_pass()
            # A pass newer than the last one judged on: one that could not read left the
            # grants counted, and judging on it again would only spin.
            last = float("-inf") if view.tried_at is None else view.tried_at
            seen = self._ledger.wait_pass(max(due, last), min(left, 0.1))
            if seen and (outcome := self._judge(p)) is not None:
                return outcome
        return self._reply(p.notif, Outcome.UNSURE)

    def _on_gpu(self, notif: Notification) -> bool:
        """Whether the call's fd is an NVIDIA device node: other drivers' requests can share
        the escapes' NR and SIZE bits."""
        try:
            mode, major = _cached_device(f"/proc/{notif.tid}/fd/{notif.fd}")
        except FileNotFoundError:  # no such descriptor (the kernel answers EBADF), or task
            return False
        return stat.S_ISCHR(mode) and major in self._majors

    def _valid(self, notif: Notification) -> bool:
        try:
            fcntl.ioctl(self._fd, SECCOMP_IOCTL_NOTIF_ID_VALID, struct.pack("<Q", notif.id))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def _reply(self, notif: Notification, outcome: Outcome, error: int = 0) -> Outcome:
        """Answer a call: a refusal returns 0 (its status already written) or fails with
        `error`, anything else goes on to the driver. ABANDONED where the caller is no
        longer waiting."""
        refused = outcome == Outcome.REFUSED
        flags = 0 if refused else SECCOMP_USER_NOTIF_FLAG_CONTINUE
        response = _RESP.pack(notif.id, 0, -error, flags)
        try:
            fcntl.ioctl(self._fd, SECCOMP_IOCTL_NOTIF_SEND, response)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return Outcome.ABANDONED
            raise
        return outcome


def let_go_on(fd: int) -> bool:
    """Read the notification waiting on `fd` and let its call go on, unjudged: a second
    holder's answer while the listener is away (`gate_holder`). Whether one waited: it is
    looked for first, since RECV on a listener with none waits for the next call (another
    copy of the same listener, polled with it, may have just answered it)."""
    if not _readable(fd):
        return False
    buf = bytearray(_NOTIF.size)
    try:
        fcntl.ioctl(fd, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
        nid = Notification.unpack(buf).id
        fcntl.ioctl(
            fd, SECCOMP_IOCTL_NOTIF_SEND, _RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
        )
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EINTR):  # the caller moved on
            raise
    return True


def _reader(mem: int) -> Read:
    """A caller's memory (`/proc/<tid>/mem`, open) as `decode` reads it: a range that is
    not there (unmapped, past the end of a mapping, past user space) reads short, where
    the driver's own copy would fail."""

    def read(at: int, n: int) -> bytes:
        if not 0 <= at <= _USER_END - n:
            return b""
        try:
            return os.pread(mem, n, at)
        except OSError as exc:
            if exc.errno != errno.EIO:  # EIO: nothing mapped at `at`
                raise
            return b""

    return read


def _memory(tid: int) -> int:
    """The caller's memory, opened afresh for each call: an open fd pins the memory it was
    opened on, and only a check of the call made after the open proves that memory is the
    caller's. A cached fd could not be proven so: after an exec its old memory lives on
    while a vfork parent (or any task sharing it with CLONE_VM) does, and a tid, freed and
    taken by a thread of another process, would be served from the first process's memory
    while its other threads live; reads through it succeed, so no short read tells."""
    return os.open(f"/proc/{tid}/mem", os.O_RDWR | os.O_CLOEXEC)


_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _AT_STATX_DONT_SYNC, _STATX_TYPE = -100, 0x4000, 0x1
_STATX_SIZE, _STATX_MODE_AT, _STATX_RDEV_MAJOR_AT = 256, 28, 128  # struct statx


def _cached_device(path: str) -> tuple[int, int]:
    """The mode and device major of the file `path` leads to, as the kernel has them
    cached: never asked of its filesystem (AT_STATX_DONT_SYNC), since a workload's file
    can be on a FUSE mount whose daemon never answers. A device node's type and number
    do not change."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    flags = _AT_STATX_DONT_SYNC
    if _libc.statx(_AT_FDCWD, os.fsencode(path), flags, _STATX_TYPE, buf) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    (mode,) = struct.unpack_from("<H", buf.raw, _STATX_MODE_AT)
    (major,) = struct.unpack_from("<I", buf.raw, _STATX_RDEV_MAJOR_AT)
    return mode, major


def _readable(fd: int) -> bool:
    """Whether a notification waits to be read on `fd` now."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(ev & select.POLLIN for _, ev in poller.poll(0))
