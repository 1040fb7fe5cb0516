"""The sidecar's process closed to the workload beside it.

The workload shares the sidecar's PID namespace and, run as root, the sidecar's uid, with
capabilities that cover the sidecar's: the kernel would let it ptrace the sidecar, read its
memory, or walk into its filesystem through `/proc/<pid>/root` and reach the socket that
the agent connects to. A process that is not dumpable lets only holders of CAP_SYS_PTRACE
do any of that, which no pod below the `privileged` Pod Security level can add (the agent
has it). Until this runs, at each start, the webhook keeps the workload out another way:
it holds none of the sidecar's capabilities (`core/admission/isolation.py`). A signal is
another matter: see the agent's `sidecar_presence`.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def forbid_inspection() -> str | None:
    """Make this process not dumpable; the reason it failed, or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None
