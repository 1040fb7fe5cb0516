"""PID translation: which of NVML's processes a PID namespace may see, and their pids there.

NVML names processes by their pid in the initial PID namespace. A `PidView` says which of
those processes a caller may see (those in its own PID namespace or below it) and what
they are called there (via `NSpid`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from enforcer.edge.procfs import INITIAL_PID_NS, NsChain, ProcFs

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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
