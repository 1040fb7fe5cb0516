"""Usage sources: where a tick's `Sample` comes from.

NVML names processes by their pid in the initial PID namespace. A `PidView` says which of
those processes a caller may see (those in its own PID namespace or below it) and what
they are called there (via `NSpid`). Every source returns a `SourceDown` value instead of
raising, so that a tick without data is an ordinary, reportable state.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from enforcer.backoff import Backoff
from enforcer.model import ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.nvml import Nvml, NvmlError
from enforcer.procfs import INITIAL_PID_NS, NsChain, ProcFs
from enforcer.protocol import ProtocolError, decode_reply, encode_request

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class UsageSource(Protocol):
    def sample(self) -> Sample | SourceDown: ...

    def fileno(self) -> int | None:
        """A descriptor that turns readable when a new sample is waiting, if the source pushes."""

    def close(self) -> None: ...


class PidViewError(Exception):
    """The caller's PID namespace cannot be placed in the host's `/proc`."""


def boot_ticks() -> int:
    """Now, in the unit of `/proc/<pid>/stat` start times: clock ticks since boot."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLOCK_TICKS)


@dataclass(frozen=True, slots=True)
class PidView:
    """The processes one PID namespace may see, read through the host's `/proc`.

    `level` is how deep the namespace sits below the initial one (0 for the host).
    """

    procfs: ProcFs
    ns_inode: int
    level: int

    @classmethod
    def host(cls, procfs: ProcFs) -> PidView:
        return cls(procfs, INITIAL_PID_NS, 0)

    @classmethod
    def of_process(cls, host_proc: ProcFs, pid: int | str) -> PidView:
        """The view of the namespace that `pid` (a pid in `host_proc`, or "self") lives in."""
        if not _is_initial_procfs(host_proc, pid):
            raise PidViewError(
                f"{host_proc.root} is not the host's /proc (or its processes' namespaces "
                "cannot be read): NVML's PIDs could not be translated. Mount the host's "
                "/proc there (hostPath /proc, read-only) and run as root"
            )
        ns = host_proc.pid_ns(pid)
        nspid = host_proc.nspid(pid)
        if ns is None or not nspid:
            raise PidViewError(f"cannot read the PID namespace of {pid} in {host_proc.root}")
        return cls(host_proc, ns, len(nspid) - 1)

    def sees(self, chain: NsChain) -> int | None:
        """The pid, in this namespace, of a process with this namespace chain; None when the
        process lives outside this namespace and its descendants."""
        if len(chain) > self.level and chain[self.level][0] == self.ns_inode:
            return chain[self.level][1]
        return None

    def translate(self, host_pid: int) -> int | None:
        chain = self.procfs.ns_chain(host_pid)
        return None if chain is None else self.sees(chain)


def _is_initial_procfs(procfs: ProcFs, pid: int | str) -> bool:
    """Whether `procfs` belongs to the initial PID namespace, judged from `pid`'s ancestors.

    The first ancestor with a single `NSpid` entry lives in the procfs's own namespace;
    that namespace must be the initial one, or NVML's PIDs mean other processes there.
    Ancestors whose namespace link we may not read are skipped.
    """
    current: int | str = pid
    for _ in range(64):
        st, nspid = procfs.stat(current), procfs.nspid(current)
        if st is None or nspid is None:
            return False
        if len(nspid) == 1:
            ns = procfs.pid_ns(current)
            if ns is not None:
                return ns == INITIAL_PID_NS
        if st.ppid <= 0:
            return False
        current = st.ppid
    return False


@dataclass(slots=True)
class _Tracked:
    start_time: int
    pidfd: int  # -1 when no fd could be spared: then the process is re-read every tick
    chain: NsChain
    pid: int | None  # as the view's namespace names it; None if it cannot see it


class _ProcessTable:
    """NVML's processes from one tick to the next, each pinned by a pidfd.

    A live process keeps its pid, so while its pidfd has not polled readable (exited), the
    start time and translation read when it first appeared still hold, and no `/proc` read
    is needed. One `poll()` over all pidfds per tick replaces a `stat` read per process.
    Pinning needs pids we can open; reading another namespace's `/proc` (`--host-proc`),
    every process is re-read on every tick instead.
    """

    def __init__(self, view: PidView) -> None:
        self._view = view
        self._pin = view.procfs.names_our_pids()
        self._entries: dict[int, _Tracked] = {}
        self._by_fd: dict[int, int] = {}
        self._poller = select.poll()

    def resolve(self, host_pids: set[int], before: int) -> dict[int, _Tracked]:
        """Host pid -> what we know of it, for every process the view may see."""
        for fd, _ in self._poller.poll(0):
            self._forget(self._by_fd[fd])
        for pid in [p for p in self._entries if p not in host_pids]:
            self._forget(pid)
        keys = {}
        for pid in host_pids:
            entry = self._entries.get(pid)
            if entry is None or entry.pidfd < 0:
                entry = self._track(pid, before)
            if entry is not None and entry.pid is not None:
                keys[pid] = entry
        return keys

    def _track(self, pid: int, before: int) -> _Tracked | None:
        self._forget(pid)
        pidfd = -1  # without a pidfd: still correct, only slower
        if self._pin:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:
                pass  # out of file descriptors
        st = self._view.procfs.stat(pid)
        # A process born after NVML looked cannot be the one NVML reported: its pid was
        # reused in between. A zombie has already released its memory. Neither is used.
        chain = self._view.procfs.ns_chain(pid)
        exited = pidfd >= 0 and bool(select.select([pidfd], [], [], 0)[0])
        if st is None or chain is None or st.start_time > before or st.state == "Z" or exited:
            if pidfd >= 0:
                os.close(pidfd)
            return None
        entry = _Tracked(st.start_time, pidfd, chain, self._view.sees(chain))
        if pidfd >= 0:
            self._entries[pid] = entry
            self._by_fd[pidfd] = pid
            self._poller.register(pidfd, select.POLLIN)
        return entry

    def _forget(self, pid: int) -> None:
        entry = self._entries.pop(pid, None)
        if entry is not None and entry.pidfd >= 0:
            del self._by_fd[entry.pidfd]
            self._poller.unregister(entry.pidfd)
            os.close(entry.pidfd)

    def close(self) -> None:
        for pid in list(self._entries):
            self._forget(pid)


class NvmlSource:
    """Samples NVML directly and keeps the processes that `view` may see."""

    def __init__(self, nvml: Nvml, view: PidView) -> None:
        self._nvml = nvml
        self._table = _ProcessTable(view)

    def sample(self) -> Sample | SourceDown:
        before = boot_ticks()
        try:
            snap = self._nvml.snapshot()
        except NvmlError as exc:
            return SourceDown(str(exc))
        known = self._table.resolve({p.pid for p in snap.processes}, before)
        processes = []
        for p in snap.processes:
            entry = known.get(p.pid)
            if entry is not None and entry.pid is not None:
                key = ProcessKey(entry.pid, entry.start_time)
                processes.append(ProcessUsage(key, p.device_uuid, p.used_bytes, entry.chain))
        return Sample(time.time(), snap.devices, tuple(processes))

    def fileno(self) -> int | None:
        return None  # sampled on demand: the loop ticks on its interval

    def close(self) -> None:
        self._table.close()
        self._nvml.shutdown()


class AgentSource:
    """Usage from the node agent's socket, subscribed: each sample arrives once it is taken.

    Never blocks a tick: the socket is read without waiting, the newest complete reply
    wins, and a lost agent is reconnected on a backoff schedule while every tick reports
    the source down. `fileno()` lets a loop wake up as soon as a sample arrives.
    """

    def __init__(
        self,
        path: str,
        stale_after: float,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._stale_after = stale_after
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._latest: Sample | SourceDown = SourceDown(
            "waiting for the first sample from the node agent"
        )

    def fileno(self) -> int | None:
        return None if self._sock is None else self._sock.fileno()

    def sample(self) -> Sample | SourceDown:
        if self._sock is None and not self._connect():
            return self._latest
        self._drain()
        latest = self._latest
        if isinstance(latest, Sample):
            age = time.time() - latest.sampled_at
            if age > self._stale_after:
                return SourceDown(f"the node agent's last sample is {age:.1f}s old")
        return latest

    def _connect(self) -> bool:
        now = self._clock()
        if not self._backoff.ready(now):
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(1.0)
            sock.connect(self._path)
            sock.sendall(encode_request("subscribe"))
            select.select([sock], [], [], 1.0)  # the agent answers a subscription at once
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self._backoff.failed(now)
            self._latest = SourceDown(
                f"cannot reach the node agent at {self._path}: {exc.strerror or exc}"
            )
            return False
        self._backoff.succeeded()
        self._sock, self._buffer = sock, b""
        return True

    def _drain(self) -> None:
        assert self._sock is not None  # noqa: S101 - only called when connected
        while True:
            try:
                chunk = self._sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._lost(f"the connection to the node agent failed: {exc.strerror or exc}")
                return
            if not chunk:
                self._lost("the node agent closed the connection")
                return
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        if lines:
            try:
                self._latest = decode_reply(lines[-1])
            except ProtocolError as exc:
                self._lost(str(exc))

    def _lost(self, reason: str) -> None:
        self.close()
        self._backoff.failed(self._clock())
        self._latest = SourceDown(reason)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
