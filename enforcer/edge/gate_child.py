"""The allocation gate's trampoline: a child that installs the seccomp filter on itself,
hands the filter's listener fd to its parent, and execs the command once the parent says go.

The child side runs as `python -I -S gate_child.py FD PROGRAM -- PATH ARGV...`, so it
imports only the standard library (nothing of `enforcer`) and starts fast; the parent side
(`spawn`) is here too, so the two ends of the conversation live in one file. The filter is
installed before exec and is inherited by everything the command starts; the listener fd is
closed in the child before exec, so the workload never holds it (and cannot answer its own
calls). The conversation, over a SOCK_SEQPACKET pair:

    child -> parent   b"ok" with the listener fd (SCM_RIGHTS), or b"error ERRNO"
    parent -> child   b"g" (exec the command) or b"a" (abort: exit 126)
    child -> parent   nothing: the socket closes at exec; or b"exec ERRNO" if exec failed
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import socket
import sys
from dataclasses import dataclass

EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND = 126, 127  # as a shell's
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38
_CAP_SYS_ADMIN = 21


class TrampolineError(Exception):
    """The trampoline could not be started, or ended before it ran the command: what and why."""


@dataclass(frozen=True, slots=True)
class Spawned:
    """A trampoline started: its pid (the command's, once it execs), the socket to it, and
    the listener fd, or why there is none (an errno's name and text)."""

    pid: int
    sock: socket.socket
    listener: int | None
    why_not: str = ""

    def go(self) -> int:
        """Let the child exec the command; 0 once it has, or the errno its exec failed with;
        TrampolineError (it reaped) where it has gone."""
        try:
            self.sock.send(b"g")
            answer = self.sock.recv(64)
        except OSError:  # it has gone: killed, as nothing else ends it before "g"
            why = f"it ended before it ran the command ({_reap(self.pid)})"
            raise TrampolineError(why) from None
        finally:
            self.sock.close()
        return int(answer.split()[1]) if answer.startswith(b"exec ") else 0

    def abort(self) -> None:
        """The command is not to run: the child exits 126 without exec."""
        try:
            self.sock.send(b"a")
        except OSError:
            pass  # it has gone already
        finally:
            self.sock.close()


def spawn(path: str, argv: list[str], program: bytes) -> Spawned:
    """Start the trampoline for `path` (already resolved: the parent says what is not found)
    and wait for its filter; the command does not run until `go()`. Where it cannot be
    started or ends before it answers, TrampolineError, with nothing left open or running
    (it ends when its socket closes)."""
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError as exc:
        raise TrampolineError(f"socketpair: {exc.strerror}") from None
    try:
        with theirs:
            os.set_inheritable(theirs.fileno(), True)
            pid = os.posix_spawn(
                sys.executable,
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    str(theirs.fileno()),
                    program.hex(),
                    "--",
                    path,
                    *argv,
                ],
                os.environ,
                setsigmask=(),
            )
    except OSError as exc:
        ours.close()
        raise TrampolineError(f"posix_spawn {sys.executable}: {exc.strerror}") from None
    try:
        message, fds, _, _ = socket.recv_fds(ours, 64, 1)
    except OSError as exc:
        message, fds = f"recv: {exc.strerror}".encode(), []
    if message == b"ok" and len(fds) == 1:
        os.set_inheritable(fds[0], False)  # SCM_RIGHTS gives it inheritable: no later child
        return Spawned(pid, ours, fds[0])
    for fd in fds:
        os.close(fd)
    if not message.startswith(b"error "):  # gone, or the fd lost
        ours.close()  # it ends (exit 126) if it still waits
        ended = _reap(pid)
        if message == b"ok":  # the kernel drops an fd it has no free number for (MSG_CTRUNC)
            raise TrampolineError("its listener fd did not arrive: no fd was free for it")
        raise TrampolineError(message.decode() or f"it ended before it answered ({ended})")
    code = int(message.split()[1])
    return Spawned(pid, ours, None, f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")


def _reap(pid: int) -> str:
    """How the trampoline ended, once it has: `killed by SIGKILL`, `exit status 126`."""
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _has_sys_admin() -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


def _install(program: bytes) -> int:
    """The filter installed on this process; the listener fd. Without CAP_SYS_ADMIN the
    kernel requires no_new_privs (setuid programs in the command then gain nothing). Not
    dumpable first, as its parent, while it holds the fd: a process of its user could
    otherwise take it (pidfd_getfd, ptrace); the command's exec makes it dumpable again."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    if not _has_sys_admin() and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    code = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.addressof(code))
    number = _SYS_SECCOMP.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"no allocation gate for {platform.machine()}")
    fd = libc.syscall(
        ctypes.c_long(number),
        ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(_SECCOMP_FILTER_FLAG_NEW_LISTENER),
        ctypes.byref(prog),
    )
    if fd < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")
    return int(fd)


def main(args: list[str]) -> int:
    sock = socket.socket(fileno=int(args[0]))
    program, path, argv = bytes.fromhex(args[1]), args[3], args[4:]
    try:
        fd = _install(program)
    except OSError as exc:
        sock.send(f"error {exc.errno or errno.EIO}".encode())
        return EXIT_NOT_EXECUTABLE
    try:
        socket.send_fds(sock, [b"ok"], [fd])
    except OSError:  # the parent has gone, or given up on us
        return EXIT_NOT_EXECUTABLE
    os.close(fd)
    if sock.recv(1) != b"g":
        return EXIT_NOT_EXECUTABLE
    # Python ignores these at start; an ignored disposition survives exec.
    for number in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(number, signal.SIG_DFL)
    os.set_inheritable(sock.fileno(), False)  # closed at exec: the parent reads its end
    try:
        os.execv(path, argv or [path])  # noqa: S606 (the user's command, run without a shell)
    except OSError as exc:
        sock.send(f"exec {exc.errno or errno.EIO}".encode())
        return EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_NOT_EXECUTABLE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
