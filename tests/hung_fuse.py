"""A FUSE mount whose daemon stops answering: a hung filesystem a tenant's pod may hold
files on (a FUSE CSI volume whose daemon is stuck; a hard NFS mount whose server is gone
blocks the same way). Root only: it speaks the kernel's protocol on /dev/fuse itself, no
libfuse. While it answers, it serves one regular file, `file`, whose attributes are never
cached (`attr_valid` 0), so that every `stat` of it asks the daemon; once `hang()` is
called, every request is read and left unanswered, and the caller's `stat` waits in the
kernel until the mount goes (`close()` aborts the connection: whatever waits gets ENOTCONN).

`hung_fuse_at` is the other kind: a mount that never answered at all (its daemon never reads
/dev/fuse), in the mount namespace of a process of its own, where a sidecar's socket would
be: whatever looks inside waits from its first lookup.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import stat
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import POD_NAMESPACES, children, end_namespace, wait_for

_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ...
_OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr: ino ... flags
_LOOKUP, _FORGET, _GETATTR, _OPEN, _INIT, _OPENDIR = 1, 2, 3, 14, 26, 27
_INTERRUPT, _BATCH_FORGET = 36, 42
_NO_REPLY = {_FORGET, _INTERRUPT, _BATCH_FORGET}
_ROOT, _FILE = 1, 2


def _attr(node: int) -> bytes:
    mode = (stat.S_IFDIR | 0o755) if node == _ROOT else (stat.S_IFREG | 0o644)
    return _ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class HungFuse:
    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.file = mountpoint / "file"
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._hung = threading.Event()
        self._stop = threading.Event()
        self._withheld: list[int] = []  # requests left unanswered, by their unique id
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"hung", bytes(mountpoint), b"fuse.hung", 0, options.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, os.strerror(err), str(mountpoint))
        self._thread = threading.Thread(target=self._serve, name="hung-fuse", daemon=True)
        self._thread.start()

    def hang(self) -> None:
        """From now on, no request is answered."""
        self._hung.set()

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                request = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                continue
            except OSError:  # ENODEV: unmounted
                return
            _, opcode, unique, node, *_ = _IN_HEADER.unpack_from(request)
            if opcode in _NO_REPLY:
                continue
            if self._hung.is_set():
                self._withheld.append(unique)
                continue
            body, error = self._answer(opcode, node, request[_IN_HEADER.size :])
            self._reply(unique, body, error)

    def _reply(self, unique: int, body: bytes, error: int) -> None:
        with contextlib.suppress(OSError):  # the caller gave up (interrupted, killed)
            os.write(
                self._fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(body), -error, unique) + body
            )

    @staticmethod
    def _answer(opcode: int, node: int, arg: bytes) -> tuple[bytes, int]:
        if opcode == _INIT:  # fuse_init_out of 7.31, no features asked for
            init = struct.pack("<IIIIHHIIHHII", 7, 31, 0, 0, 0, 0, 4096, 1, 0, 0, 0, 0)
            return init + bytes(24), 0
        if opcode == _GETATTR:
            return struct.pack("<QII", 0, 0, 0) + _attr(node), 0
        if opcode == _LOOKUP and node == _ROOT and arg.rstrip(b"\0") == b"file":
            return struct.pack("<QQQQII", _FILE, 0, 60, 0, 0, 0) + _attr(_FILE), 0
        if opcode in (_OPEN, _OPENDIR):
            return struct.pack("<QII", 0, 0, 0), 0
        if opcode == _LOOKUP:
            return b"", errno.ENOENT
        return b"", errno.ENOSYS

    def close(self) -> None:
        """Answer what was withheld with EIO (whoever waits on it returns), then go."""
        self._stop.set()
        self._thread.join(5)
        for unique in self._withheld:
            self._reply(unique, b"", errno.EIO)
        os.close(self._fd)  # the last device file: the connection is aborted
        ctypes.CDLL(None).umount2(bytes(self.mountpoint), 2)  # MNT_DETACH


@contextmanager
def hung_fuse(mountpoint: Path) -> Iterator[HungFuse]:
    mountpoint.mkdir(exist_ok=True)
    fuse = HungFuse(mountpoint)
    try:
        yield fuse
    finally:
        fuse.close()


# A FUSE filesystem whose server never answers: /dev/fuse opened, mounted, and never read.
# Every lookup in it waits in the kernel (for the INIT reply) until the server's descriptor
# is closed: a hard NFS mount whose server is gone, as a pod of `baseline` may mount one.
HUNG_FUSE = textwrap.dedent(
    """
    import ctypes, os, sys, time
    fd = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"hung", sys.argv[1].encode(), b"fuse", 0, options) != 0:
        sys.exit(f"mount: {os.strerror(ctypes.get_errno())}")
    print("ready", flush=True)
    time.sleep(600)
    """
)


@contextmanager
def hung_fuse_at(where: str) -> Iterator[int]:
    """A process in namespaces of its own (as `in_its_own_namespaces`) with a FUSE mount
    that never answers at `where`; yields its pid. Ending it unblocks every lookup."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here")
    command = [*POD_NAMESPACES, sys.executable, "-c", HUNG_FUSE, where]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        pid = wait_for(lambda: children(proc.pid), what="the pod's first process")[0]
        yield pid
    finally:
        end_namespace(proc, pid)
