"""NVML as a usage source: its host pids pinned by pidfds and named as a `PidView` sees them.

Apart from `sources.py` so that a sidecar reading from the node agent never loads pynvml.
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass

from enforcer.model import ProcessKey, ProcessUsage, Sample, SourceDown
from enforcer.nvml import Nvml, NvmlError
from enforcer.procfs import NsChain
from enforcer.sources import PidView, boot_ticks


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
