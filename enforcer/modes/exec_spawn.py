"""How `exec` starts its command: `posix_spawnp`, or through the allocation gate's trampoline
(`gate_child`), which installs the gate's seccomp filter on the child before it execs.
Either way the child's pid is the command's (the subreaper, the tree's membership and the
cgroup are unchanged), and a command that is not found or cannot be run is said as a shell
says it (127, 126)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal

from enforcer.core import messages
from enforcer.edge import gate_child
from enforcer.edge.dumpable import forbid_inspection
from enforcer.edge.seccomp_filter import program

log = logging.getLogger(__name__)

EXIT_NOT_EXECUTABLE = gate_child.EXIT_NOT_EXECUTABLE
EXIT_NOT_FOUND = gate_child.EXIT_NOT_FOUND


class StartupError(Exception):
    """Why the command was not started; printed as one line, exit status 2."""


class SpawnError(Exception):
    """The command could not be run: the shell's status and line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def spawn(command: tuple[str, ...]) -> int:
    """The command started; its pid."""
    try:
        return os.posix_spawnp(
            command[0],
            list(command),
            os.environ,
            setsigmask=(),
            # Python ignores SIGPIPE and SIGXFSZ; an ignored disposition survives exec.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except OSError as exc:
        raise _failed(command[0], exc.errno or errno.EIO) from None


def spawn_gated(
    command: tuple[str, ...], required: bool, interval: float
) -> tuple[int, int | None]:
    """The command started under the allocation gate's filter: its pid, and the filter's
    listener fd (this process made not dumpable before that fd exists). Where the filter
    cannot be installed (EBUSY: the command would already run under a seccomp listener, as
    in a nested `exec`), the command runs without it (None) after one line that says so, or
    not at all under `--hard-limits required`."""
    path = command[0] if "/" in command[0] else shutil.which(command[0])
    if path is None:
        raise _failed(command[0], errno.ENOENT)
    # Not dumpable before the listener fd exists here: a process of our user could otherwise
    # take it from us (pidfd_getfd, ptrace) and answer the command's calls.
    if (refused := forbid_inspection()) is not None:
        log.warning(
            "could not make vram-enforcer not dumpable (%s): a process of its user "
            "may take the allocation gate's fd from it",
            refused,
        )
    try:
        spawned = gate_child.spawn(path, list(command), program())
    except gate_child.TrampolineError as exc:
        raise _unstarted(command[0], str(exc)) from None
    if spawned.listener is None:  # the trampoline has given up: it exits
        spawned.abort()
        os.waitpid(spawned.pid, 0)
        why = f"the allocation gate could not be installed: {spawned.why_not}"
        if required:
            raise StartupError(f"--hard-limits required, but there is no hard limit: {why}")
        log.warning("%s", messages.sampling_only(why, interval))
        return spawn(command), None
    try:
        failed = spawned.go()
    except gate_child.TrampolineError as exc:
        os.close(spawned.listener)
        raise _unstarted(command[0], str(exc)) from None
    if failed:
        os.waitpid(spawned.pid, 0)
        os.close(spawned.listener)
        raise _failed(command[0], failed)
    return spawned.pid, spawned.listener


def _unstarted(name: str, why: str) -> SpawnError:
    return SpawnError(
        EXIT_NOT_EXECUTABLE, f"{name}: not started, the allocation gate's trampoline failed: {why}"
    )


def _failed(name: str, code: int) -> SpawnError:
    if code == errno.ENOENT:
        return SpawnError(EXIT_NOT_FOUND, f"{name}: command not found")
    if code in (errno.EACCES, errno.EPERM):
        return SpawnError(EXIT_NOT_EXECUTABLE, f"{name}: permission denied")
    return SpawnError(EXIT_NOT_EXECUTABLE, f"{name}: {os.strerror(code)}")
