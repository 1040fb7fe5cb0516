"""A path inside another process's filesystem (a container's), opened so that nothing its
owner put there can send the agent elsewhere or hold it.

A container's filesystem is its author's: any component of a path in it may be a symlink
(to another pod's socket, through `/proc/<pid>/root`), a magic link, or the mount point of
a filesystem that never answers (FUSE whose server does not reply, a hard NFS mount whose
server is gone). The ordinary resolution follows the first two and waits on the last. So:

- The walk starts at the process's root (`/proc/<pid>/root`), opened while the caller holds
  the process by a pidfd: a pid reused meanwhile is caught.
- Each component is opened alone, relative to the one before it: `openat2` with
  RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, so no link of any kind is
  followed and nothing above the root is reached. Where the kernel has no openat2 (before
  5.6), `openat` with O_NOFOLLOW opens a link as itself, and it is refused: for a single
  name, the same rule.
- Before anything is looked up inside a component, its mount (`mnt_id` in this process's
  `/proc/self/fdinfo/<fd>`, which asks the filesystem nothing) is compared with its
  parent's. A component that is the root of another mount is kept only when that mount, as
  the process's own `mountinfo` lists it, is a local filesystem
  (`mounts.LOCAL_FILESYSTEMS`): entering a mount asks nothing of what is mounted there, and
  its name was looked up in the parent, which was local. So a mount that would never
  answer costs nothing, and is said.
- The last component must be of the kind asked for (a socket), on its directory's mount.

The caller then uses the descriptor (`/proc/self/fd/<fd>`), never the name again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass

from enforcer.core.mounts import Mount, parse_mountinfo
from enforcer.edge.pidfd import Pinned
from enforcer.edge.procfs import ProcFs, mount_of

SYS_OPENAT2 = 437  # the same on every architecture (new system calls share one table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_FLAGS = os.O_PATH | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


@dataclass(frozen=True, slots=True)
class Planted:
    """The path leads somewhere its owner chose (a link, another mount, another kind of
    file): someone's doing, not a process still starting."""

    why: str

    def __str__(self) -> str:
        return self.why


def open_in(host_proc: ProcFs, process: Pinned, path: str, kind: int) -> int | Planted | str:
    """An O_PATH descriptor of `path` (absolute, in the filesystem of the process that
    `process` pins, as `host_proc` shows it) when it is a file of `kind` (`stat.S_IFSOCK`)
    reached as the module says; else why not: `Planted`, or a str when it is merely not
    there (yet). The caller closes the descriptor."""
    names = [n for n in path.split("/") if n]
    if path[:1] != "/" or not names or any(n in (".", "..") for n in names):
        raise ValueError(f"not a plain absolute path: {path!r}")  # a bug of ours, not theirs
    pid = process.pid
    try:
        root = os.open(f"{host_proc.root}/{pid}/root", _FLAGS | os.O_DIRECTORY)
    except OSError as exc:
        return f"cannot open the root of process {pid}: {exc.strerror or exc}"
    opened = [root]
    try:
        mountinfo = host_proc.mountinfo(pid)
        if process.exited():  # the root, and the mounts, may be of a process that took the pid
            return f"process {pid} exited"
        if mountinfo is None:
            return f"cannot read the mounts of process {pid}"
        mounts = parse_mountinfo(mountinfo)
        here = mount_of(f"/proc/self/fdinfo/{root}")
        if here is None:
            return f"cannot read which mount the root of process {pid} is on"
        if (problem := _unless_local(mounts, here, "/")) is not None:
            return problem
        walked = ""
        for i, name in enumerate(names):
            walked += f"/{name}"
            last = i == len(names) - 1
            try:
                fd = _open_one(opened[-1], name, directory=not last)
            except OSError as exc:
                return _why(exc, walked)
            opened.append(fd)
            mount = mount_of(f"/proc/self/fdinfo/{fd}")
            if mount is None:
                return f"cannot read which mount {walked} is on"
            if mount != here:
                if last:
                    return Planted(f"{walked} is mounted over (a mount of its own)")
                if (problem := _unless_local(mounts, mount, walked)) is not None:
                    return problem
                here = mount
        found = os.fstat(opened[-1])  # on a local filesystem: asks no server
        if stat.S_IFMT(found.st_mode) != kind:
            return Planted(f"{path} is not a {_KINDS.get(kind, 'file of that kind')}")
        return opened.pop()
    finally:
        for fd in opened:
            os.close(fd)


_KINDS = {stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory", stat.S_IFREG: "regular file"}


def _open_one(dirfd: int, name: str, directory: bool) -> int:
    """One component, no link followed (see the module); raises OSError."""
    flags = _FLAGS | (os.O_DIRECTORY if directory else 0)
    how = _OpenHow(flags, 0, _RESOLVE)
    fd = _syscall(SYS_OPENAT2, dirfd, name.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code != errno.ENOSYS:
        raise OSError(code, os.strerror(code))
    fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dirfd)
    if not directory and stat.S_ISLNK(os.fstat(fd).st_mode):  # a directory link: ENOTDIR
        os.close(fd)
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
    return int(fd)


def _why(exc: OSError, walked: str) -> Planted | str:
    if exc.errno == errno.ELOOP:
        return Planted(f"{walked} is a symbolic link: not followed")
    if exc.errno == errno.ENOTDIR:
        return Planted(f"{walked} is not a directory (a symbolic link?): not followed")
    if exc.errno == errno.EXDEV:
        return Planted(f"{walked} leads out of the container's root: not followed")
    return f"{walked}: {exc.strerror or exc}"


def _unless_local(mounts: dict[int, Mount], mount_id: int, where: str) -> Planted | None:
    """Why a lookup must not enter this mount, or None when it is local."""
    mount = mounts.get(mount_id)
    if mount is None:
        return Planted(f"{where} is on a mount that the process's mountinfo does not list")
    if not mount.local:
        return Planted(f"{where} is on a {mount.fstype} mount, which may never answer: not entered")
    return None
