"""NVML as a usage source: its host pids pinned by pidfds and named as a `PidView` sees them.

Apart from `sources.py` so that a sidecar reading from the node agent never loads pynvml.
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass

from enforcer.core.model import (
    ProcessKey,
    ProcessUsage,
    Sample,
    SignalResult,
    SourceDown,
    Unplaced,
)
from enforcer.edge.device_proofs import DeviceProofs
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.pid_view import PidView, boot_ticks
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import NsChain, ProcFs

NVIDIA_DRIVER_PREFIX = "nvidia"  # /proc/devices: nvidia-frontend (195), nvidia-uvm, nvidia-caps


def gpu_device_majors(procfs: ProcFs | None = None) -> frozenset[int] | None:
    """The character majors of NVIDIA's devices, when this machine's kernel has them."""
    return (procfs or ProcFs()).char_majors(NVIDIA_DRIVER_PREFIX) or None


@dataclass(slots=True)
class _Tracked:
    start_time: int
    process: Pinned | None  # None when no pidfd could be had: identity is re-read every tick
    chain: NsChain
    pid: int | None  # as the view names it; None when it is not charged (invisible, rejected)
    proven: bool  # False: its usage is unknown until it is seen holding a GPU device


class _ProcessTable:
    """Which process each pid that NVML lists really is, from one tick to the next.

    NVML can go on listing a pid after its process has exited: the driver lags, or a child
    that inherited the device files keeps the context alive. If that pid then names a
    newcomer, the newcomer must not inherit the usage. So:

    - The pass in which NVML first listed a pid is remembered for as long as NVML keeps
      listing it. A process that started at or after that pass is not the one NVML meant
      (at: start times count clock ticks, and a start in the same tick is not proven older).
    - A process has exited when no thread of it is left, as its pidfd says (or, unpinned,
      `/proc`'s thread count). A leader that ended its own thread reads `Z` while its other
      threads hold the memory: it is charged.
    - The listings of the first pass have no known age: a pid may have been reused before
      we looked. Where this machine has NVIDIA's devices, such a process is charged once
      it is seen holding one (by device number, whatever the node's name). Until then its
      usage counts as unknown, never as free, and it is looked at again on every pass: a
      process can hide its descriptors for a moment (in flight in an `SCM_RIGHTS`
      message), not for ever. The looks run off this thread (`DeviceProofs`): a file on a
      hung mount costs that process its proof, not the pass; a pass takes the answers of
      the looks that came back since the one before.
    - A process that its pidfd shows alive but whose PID namespace cannot be read (a
      security module refuses `ns/pid`) is unplaced, not dropped: what NVML lists for it is
      carried as `Unplaced` (counted, charged to nobody, never signalled), and it is read
      again on the next pass. Only an exit drops a listing.

    Once proven, a process is pinned by a pidfd: while the pidfd has not polled readable
    (exited), its pid cannot be reused, so nothing needs reading again. One `poll()` over
    all pidfds per tick replaces a `stat` read per process. Reading another namespace's
    `/proc` (`--host-proc`), pids cannot be opened; then each process's start time is
    re-read every tick instead.
    """

    def __init__(self, view: PidView, gpu_majors: frozenset[int] | None) -> None:
        self._view = view
        self._gpu_majors = gpu_majors
        self._pin = view.procfs.names_our_pids()
        self._first_pass: int | None = None
        self._first_seen: dict[int, int] = {}
        self._entries: dict[int, _Tracked] = {}
        self._by_fd: dict[int, int] = {}
        self._poller = select.poll()
        self._proofs = DeviceProofs(self._holds_gpu) if gpu_majors is not None else None

    def resolve(self, host_pids: set[int], looked_at: int) -> dict[int, _Tracked | str]:
        """Host pid -> what we know of it, for every listed process the view may see; or,
        for a live one that cannot be placed in a PID namespace, why (`Unplaced`).

        `looked_at` is when this NVML pass began, in clock ticks since boot.
        """
        if self._first_pass is None:
            self._first_pass = looked_at
        for fd, _ in self._poller.poll(0):
            self._forget(self._by_fd[fd])
        for pid in [p for p in self._first_seen if p not in host_pids]:
            del self._first_seen[pid]
            self._forget(pid)
        found: dict[int, _Tracked | str] = {}
        for pid in host_pids:
            first_seen = self._first_seen.setdefault(pid, looked_at)
            entry = self._entries.get(pid)
            if entry is not None and entry.process is None and not self._unchanged(pid, entry):
                self._forget(pid)
                entry = None
            tracked = entry or self._track(pid, first_seen)
            if isinstance(tracked, str):
                found[pid] = tracked  # not remembered: it is read again on the next pass
            elif tracked is not None and tracked.pid is not None:
                found[pid] = tracked
        if self._proofs is not None:  # the looks that came back, since the last pass
            unproven = {
                ProcessKey(pid, t.start_time): t
                for pid, t in found.items()
                if isinstance(t, _Tracked) and not t.proven
            }
            for key in self._proofs.proven(unproven.keys()):
                unproven[key].proven = True
        return found

    def _unchanged(self, pid: int, entry: _Tracked) -> bool:
        st = self._view.procfs.stat(pid)
        return st is not None and st.start_time == entry.start_time and not st.exited

    def _track(self, pid: int, first_seen: int) -> _Tracked | str | None:
        """Prove what `pid` is now; None (and nothing remembered) when it has exited, or
        cannot be read and is not pinned (it may have exited); why not, for a process that
        its pidfd shows alive but whose PID namespace cannot be read (unplaced)."""
        opened = Pinned.open(pid) if self._pin else SignalResult.UNVERIFIED
        if opened is SignalResult.GONE:
            return None
        process = opened if isinstance(opened, Pinned) else None  # out of fds: unpinned
        procfs = self._view.procfs
        st = procfs.stat(pid)
        chain = None if st is None else procfs.ns_chain(pid)
        if st is None or chain is None or (process.exited() if process else st.exited):
            # Alive as its pidfd says, unless proven a newcomer on the listed pid.
            alive = process is not None and not process.exited()
            listed = alive and (st is None or st.start_time < first_seen)
            why = procfs.refusal(pid) if listed else ""
            if process is not None:
                process.close()  # gone, unreadable, or the reads may be of a newcomer
            return why or None
        seen_as = self._view.sees(chain)
        if st.start_time >= first_seen:
            seen_as = None  # proven not to be the process NVML listed: remembered as such
        # Only a listing of the first pass has no known age (see the class).
        proven = self._gpu_majors is None or first_seen != self._first_pass
        entry = _Tracked(st.start_time, process, chain, seen_as, proven)
        self._entries[pid] = entry
        if process is not None:
            self._by_fd[process.fileno()] = pid
            self._poller.register(process.fileno(), select.POLLIN)
        return entry

    def _holds_gpu(self, key: ProcessKey) -> bool:
        """Seen holding a GPU device (on a `device-proof` thread); a process whose
        descriptors cannot be read is not held to it (an agent without CAP_SYS_PTRACE over
        it would otherwise charge nobody). The pid still names the process after the look:
        its start time reads the same."""
        assert self._gpu_majors is not None  # noqa: S101 - entries are proven without them
        procfs = self._view.procfs
        held = procfs.holds_device(key.pid, self._gpu_majors)
        return held is not False and procfs.start_time(key.pid) == key.start_time

    def _forget(self, pid: int) -> None:
        entry = self._entries.pop(pid, None)
        if entry is not None and entry.process is not None:
            del self._by_fd[entry.process.fileno()]
            self._poller.unregister(entry.process.fileno())
            entry.process.close()

    def close(self) -> None:
        for pid in list(self._entries):
            self._forget(pid)


class NvmlSource:
    """Samples NVML directly and keeps the processes that `view` may see.

    `gpu_majors` (see `gpu_device_majors()`): the devices a process NVML listed before we
    first looked must be seen holding before its usage is known; None turns that check off.
    """

    def __init__(self, nvml: Nvml, view: PidView, gpu_majors: frozenset[int] | None = None) -> None:
        self._nvml = nvml
        self._table = _ProcessTable(view, gpu_majors)

    def sample(self) -> Sample | SourceDown:
        looked_at = boot_ticks()
        try:
            snap = self._nvml.snapshot()
        except NvmlError as exc:
            return SourceDown(str(exc))
        known = self._table.resolve({p.pid for p in snap.processes}, looked_at)
        processes, unplaced = [], []
        for p in snap.processes:
            entry = known.get(p.pid)
            if isinstance(entry, str):
                unplaced.append(Unplaced(p.pid, p.device_uuid, p.used_bytes, entry))
            elif entry is not None and entry.pid is not None:
                key = ProcessKey(entry.pid, entry.start_time)
                used, activity = (p.used_bytes, p.activity) if entry.proven else (None, None)
                processes.append(ProcessUsage(key, p.device_uuid, used, entry.chain, activity))
        return Sample(
            time.time(),
            snap.devices,
            tuple(processes),
            snap.failed,
            snap.activity_read_at,
            tuple(unplaced),
        )

    def fileno(self) -> int | None:
        return None  # sampled on demand: the loop ticks on its interval

    def close(self) -> None:
        self._table.close()
        self._nvml.shutdown()
