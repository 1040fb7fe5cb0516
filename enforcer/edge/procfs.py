"""Readers for `/proc`, rooted anywhere so that tests can point them at fixture trees.

A process can exit between any two reads. Every reader therefore returns None for a
process that is gone, that we may not inspect, or that the kernel would not let us read
(out of file descriptors, a thread id, EIO) instead of raising: callers treat None as
"not proven", never act on a process they could not read, and never cache a failure.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISCHR

from enforcer.core.attribution import oldest
from enforcer.core.cgroups import CgroupEntry, container_id, parse_cgroup
from enforcer.core.model import ProcessKey, ProcessTotal
from enforcer.core.mounts import local_mounts, parse_mount_id, parse_mountinfo
from enforcer.edge.cgroupfs import ContainerCgroups

# The inode of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
INITIAL_PID_NS = 4026531836

# ioctl(2) request that returns an fd for the parent of a namespace: _IO(0xb7, 0x2).
_NS_GET_PARENT = 0xB702

_NS_LINK = re.compile(r"pid:\[(\d+)\]")

NsChain = tuple[tuple[int, int], ...]
"""(PID namespace inode, pid in it) for each level, from the host's namespace down."""
_MAX_DEPTH = 4096  # ppid chains longer than this are corrupt or a loop in a fixture
_MAX_TASKS = 1024  # threads looked at for a device; past this, the answer is "cannot tell"
CMDLINE_BYTES = 4096  # of a command line read; a tenant's may be megabytes long
MOUNTINFO_BYTES = 1 << 20  # of a mountinfo read: a container lists tens of mounts, not thousands


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of `/proc/<pid>/stat` that we use."""

    pid: int
    comm: str
    state: str
    ppid: int
    start_time: int  # field 22: clock ticks after boot
    threads: int = 1  # field 20

    @property
    def exited(self) -> bool:
        """Whether the whole process has exited. A leader that ended its own thread
        (`SYS_exit`) reads `Z` while its other threads run on, holding its memory and its
        GPU context: it has exited only when no thread is left but the leader."""
        return self.state in ("Z", "X") and self.threads <= 1


def parse_stat(text: str) -> ProcStat:
    """Parse `/proc/<pid>/stat`; `comm` may hold spaces and ')', so split at the last ')'."""
    head, _, tail = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = tail.split()
    # After the comm, fields[0] is field 3 (state); field N is fields[N - 3].
    return ProcStat(
        pid=int(pid_text),
        comm=comm,
        state=fields[0],
        ppid=int(fields[1]),
        start_time=int(fields[19]),
        threads=int(fields[17]),
    )


def parse_char_majors(text: str, driver_prefix: str) -> frozenset[int]:
    """From `/proc/devices`: the character majors whose driver's name starts with the prefix
    (NVIDIA's: `nvidia-frontend` or `nvidia` at 195, and dynamic ones such as `nvidia-uvm`)."""
    majors = set()
    in_char = False
    for line in text.splitlines():
        if line.endswith(":"):
            in_char = line == "Character devices:"
            continue
        major, _, name = line.strip().partition(" ")
        if in_char and major.isascii() and major.isdigit() and name.startswith(driver_prefix):
            majors.add(int(major))
    return frozenset(majors)


def mount_of(fdinfo_path: str) -> int | None:
    """The ID of the mount an open file is on, from its fdinfo (`mounts.parse_mount_id`)."""
    fd = os.open(fdinfo_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return parse_mount_id(os.read(fd, 256).decode("ascii", errors="replace"))
    finally:
        os.close(fd)


def _device_major(fd_path: str, fdinfo_path: str, local: frozenset[int]) -> int | None:
    """The major of the character device that the descriptor `fd_path` (a
    `/proc/<pid>/task/<tid>/fd/<n>` link to a path: `readlink` wrote it from memory, and
    a socket, a pipe or an anonymous inode, `socket:[…]`, `pipe:[…]`, `anon_inode:…`, has
    none) holds open, if it holds one on a mount in `local`; None for anything else, or
    for a file elsewhere, which is not followed.

    - Its mount first (`mnt_id` in its fdinfo): only a file on a local mount is followed.
    - The walk to it takes the file itself, pinned (`O_PATH`: neither the filesystem nor a
      driver opens anything, and closing it flushes nothing), and the pinned file's own
      mount is checked again before its metadata is read: a descriptor replaced meanwhile
      by a file elsewhere is not judged.
    """
    if mount_of(fdinfo_path) not in local:
        return None
    fd = os.open(fd_path, os.O_PATH | os.O_CLOEXEC)
    try:
        if mount_of(f"/proc/self/fdinfo/{fd}") not in local:
            return None
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return os.major(st.st_rdev) if S_ISCHR(st.st_mode) else None


def parse_nspid(status: str) -> tuple[int, ...] | None:
    """The pid of the process in each nested PID namespace, outermost first."""
    found: dict[str, tuple[int, ...]] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("NStgid", "NSpid"):
            found[key] = tuple(int(v) for v in value.split())
    return found.get("NStgid") or found.get("NSpid")


class ProcFs:
    """`/proc` (or a copy of it) with every read tolerant of processes that vanish."""

    def __init__(
        self, root: str | os.PathLike[str] = "/proc", cgroups: ContainerCgroups | None = None
    ) -> None:
        """`cgroups`: the host's cgroupfs, where a container's processes are listed (its
        pids there must be pids here); without it, they are found by a scan of `root`."""
        self.root = Path(root)
        self.cgroups = cgroups
        self._prefix = os.fspath(root).rstrip("/") + "/"

    def _read(self, pid: int | str, name: str) -> str | None:
        data = self._read_bytes(pid, name)
        return None if data is None else data.decode("utf-8", errors="replace")

    def _read_bytes(self, pid: int | str, name: str, most: int = sys.maxsize) -> bytes | None:
        # os.open/os.read on a formatted path: this runs for every GPU process on every
        # tick, and pathlib plus text I/O cost more than the kernel's work here.
        try:
            fd = os.open(f"{self._prefix}{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            chunks = []
            while most > 0 and (chunk := os.read(fd, min(most, 65536))):
                chunks.append(chunk)
                most -= len(chunk)
        except OSError:
            return None
        finally:
            os.close(fd)
        return b"".join(chunks)

    def stat(self, pid: int | str) -> ProcStat | None:
        text = self._read(pid, "stat")
        if not text:
            return None
        try:
            return parse_stat(text)
        except (ValueError, IndexError):
            return None

    def start_time(self, pid: int) -> int | None:
        st = self.stat(pid)
        return None if st is None else st.start_time

    def nspid(self, pid: int | str) -> tuple[int, ...] | None:
        text = self._read(pid, "status")
        return None if text is None else parse_nspid(text)

    def cgroup(self, pid: int | str) -> tuple[CgroupEntry, ...] | None:
        text = self._read(pid, "cgroup")
        if text is None:
            return None
        try:
            return parse_cgroup(text)
        except ValueError:
            return None

    def container_id(self, pid: int | str) -> str | None:
        """The ID of the container the process runs in, from its cgroup; None when it runs
        in none, or its cgroup cannot be read."""
        entries = self.cgroup(pid)
        return None if entries is None else container_id(entries)

    def mountinfo(self, pid: int | str) -> str | None:
        """The process's mounts (`core.mounts.parse_mountinfo` reads them): the runtime's
        doing, and read without asking any filesystem. At most MOUNTINFO_BYTES."""
        data = self._read_bytes(pid, "mountinfo", MOUNTINFO_BYTES)
        return None if data is None else data.decode("utf-8", errors="replace")

    def cmdline(self, pid: int) -> str | None:
        """The command line joined by spaces; `[comm]` when empty (zombies, kernel threads).

        The process chose it: only its first CMDLINE_BYTES are read (a page: far more than
        a message shows), and bytes that are not UTF-8 are kept (surrogateescape) for
        `messages.shown` to show as they are."""
        data = self._read_bytes(pid, "cmdline", CMDLINE_BYTES)
        if data is None:
            return None
        args = [a for a in data.split(b"\0") if a]
        if args:
            return b" ".join(args).decode("utf-8", errors="surrogateescape")
        st = self.stat(pid)
        return None if st is None else f"[{st.comm}]"

    def comm(self, pid: int) -> str | None:
        """The process's name (`comm`, at most 15 characters, its own to choose), from
        `stat`: read without the process's memory, where `cmdline` and `environ` take its
        memory map's lock, which its own threads can hold while they wait on a hung mount."""
        st = self.stat(pid)
        return None if st is None else st.comm

    def holds_device(self, pid: int, majors: frozenset[int]) -> bool | None:
        """Whether a thread of the process has a character device of one of `majors` open;
        None when its descriptors cannot be read.

        Judged by the device number the kernel reports for the open file (`st_rdev`), never
        by its name: a node made with `mknod` under another name, or a renamed one, is the
        same device. Every thread's table is looked at: a leader that ended its own thread
        has none, and a thread may hold a table of its own (`unshare(CLONE_FILES)`).

        The process chose what it holds open, and following a descriptor to its file asks
        the file's filesystem (a FUSE daemon, an NFS server) about it, which may never
        answer. So only files on the process's mounts of `mounts.LOCAL_FILESYSTEMS` are followed
        (`_device_major`); one elsewhere is not judged, and cannot prove anything. That
        leaves a race (the descriptor replaced between the checks and the walk to its
        file), which is why the caller looks from a thread of its own (`DeviceProofs`).
        """
        try:
            tasks = os.listdir(f"{self._prefix}{pid}/task")
        except OSError:
            return None
        # A thread's own view (a leader that ended its thread has none to read: EINVAL):
        # the threads of a process share one mount namespace.
        views = (self.local_mounts(f"{pid}/task/{tid}") for tid in tasks[:_MAX_TASKS])
        local = next((found for found in views if found is not None), None)
        if local is None:
            return None
        unreadable = False
        for tid in tasks[:_MAX_TASKS]:
            found = self._table_holds(f"{self._prefix}{pid}/task/{tid}", majors, local)
            if found:
                return True
            unreadable = unreadable or found is None
        return None if unreadable or len(tasks) > _MAX_TASKS else False

    @staticmethod
    def _table_holds(task: str, majors: frozenset[int], local: frozenset[int]) -> bool | None:
        """One thread's table: every descriptor's link read first (a socket, a pipe or an
        anonymous inode is never a device node, and is not followed); those whose path is
        under /dev are judged first, as that is where device nodes are made (a name only
        orders the looks, it proves nothing: the others are judged too)."""
        unreadable = False
        paths = []
        try:
            with os.scandir(f"{task}/fd") as entries:
                for entry in entries:
                    try:
                        link = os.readlink(entry.path)
                    except FileNotFoundError:
                        continue  # closed meanwhile
                    except OSError:
                        unreadable = True
                        continue
                    if link.startswith("/"):
                        paths.append((not link.startswith("/dev/"), entry.name))
        except FileNotFoundError:
            return False  # the thread has exited: it holds nothing
        except OSError:
            return None
        for _, fd in sorted(paths):
            try:
                major = _device_major(f"{task}/fd/{fd}", f"{task}/fdinfo/{fd}", local)
            except FileNotFoundError:
                continue
            except OSError:
                unreadable = True
                continue
            if major in majors:
                return True
        return None if unreadable else False

    def local_mounts(self, pid: int | str) -> frozenset[int] | None:
        """The IDs of the process's mounts of `mounts.LOCAL_FILESYSTEMS`, from its
        `mountinfo` (which the kernel writes from memory, asking no filesystem)."""
        text = self.mountinfo(pid)
        return None if text is None else local_mounts(parse_mountinfo(text))

    def char_majors(self, driver_prefix: str) -> frozenset[int]:
        """The majors of the character devices whose driver's name starts with
        `driver_prefix`, from `devices` (the kernel's list is the same in every namespace)."""
        try:
            with open(f"{self._prefix}devices", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return frozenset()
        return parse_char_majors(text, driver_prefix)

    def pid_ns(self, pid: int | str = "self") -> int | None:
        """The inode of the process's PID namespace, from the `ns/pid` link."""
        try:
            link = os.readlink(f"{self._prefix}{pid}/ns/pid")
        except OSError:
            return None
        m = _NS_LINK.fullmatch(link)
        return int(m[1]) if m else None

    def pid_ns_ancestor(self, pid: int, levels_up: int) -> int | None:
        """The inode of the PID namespace `levels_up` above the process's own.

        Needs a real procfs: it walks parents with the NS_GET_PARENT ioctl.
        """
        if levels_up == 0:
            return self.pid_ns(pid)
        try:
            fd = os.open(f"{self._prefix}{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            for _ in range(levels_up):
                parent = fcntl.ioctl(fd, _NS_GET_PARENT)
                os.close(fd)
                fd = parent
            return os.fstat(fd).st_ino
        except OSError:
            return None
        finally:
            os.close(fd)

    def names_our_pids(self) -> bool:
        """Whether pids here are pids we can open: the live /proc of our own PID namespace."""
        try:
            return os.readlink(f"{self._prefix}self") == str(os.getpid())
        except OSError:
            return False

    def ns_chain(self, pid: int) -> NsChain | None:
        """(PID namespace inode, pid there) from this procfs's namespace down to the process's.

        The first level is taken to be the initial namespace (the caller checks that this
        is the host's /proc); deeper levels are read from `ns/pid` and its parents.
        """
        nspid = self.nspid(pid)
        if not nspid:
            return None
        depth = len(nspid) - 1
        inodes = [INITIAL_PID_NS]
        for level in range(1, depth + 1):
            inode = self.pid_ns_ancestor(pid, depth - level)
            if inode is None:
                return None
            inodes.append(inode)
        return tuple(zip(inodes, nspid, strict=True))

    def refusal(self, pid: int) -> str:
        """Why `ns_chain` (or `stat`) cannot read the process, for a person: the first of
        its entries that the kernel refuses, with the error (`ns/pid` needs ptrace access,
        which a security module may deny); "" when they read now."""
        for name in ("stat", "status", "ns/pid"):
            path = f"{self._prefix}{pid}/{name}"
            try:
                if name == "ns/pid":
                    os.readlink(path)
                else:
                    os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                return f"{path}: {exc.strerror or exc}"
        return ""

    def pids(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [int(n) for n in names if n.isdigit()]

    def is_descendant(self, pid: int, ancestor: int) -> bool | None:
        """Whether `ancestor` is on the ppid chain of `pid` (never true for `pid` itself);
        None when a link of the chain could not be read (an ancestor exiting meanwhile)."""
        current = pid
        for _ in range(_MAX_DEPTH):
            st = self.stat(current)
            if st is None:
                return None
            if st.ppid == ancestor:
                return True
            if st.ppid <= 0:
                return False
            current = st.ppid
        return None

    def descendants(self, ancestor: int) -> set[int]:
        """Every process below `ancestor` in the process tree, from one pass over `/proc`."""
        children: dict[int, list[int]] = {}
        for pid in self.pids():
            st = self.stat(pid)
            if st is not None:
                children.setdefault(st.ppid, []).append(pid)
        found: set[int] = set()
        stack = list(children.get(ancestor, ()))
        while stack:
            pid = stack.pop()
            if pid not in found:
                found.add(pid)
                stack.extend(children.get(pid, ()))
        return found

    def container_inits(self, ids: Collection[str]) -> dict[str, ProcessKey | str]:
        """The init of each of these containers (by ID), or why none is named: the oldest
        of its roots (`container_roots`); two of the same clock tick prove none. Each from
        its own cgroup (`cgroup_inits`), or, where that cannot be read, from one pass over
        every process: that costs the whole node, so a thread that must not wait on it
        calls `cgroup_inits` and scans elsewhere."""
        found = self.cgroup_inits(ids)
        rest = {cid for cid in ids if cid not in found}
        return found | (self._inits(self.container_roots(rest), rest) if rest else {})

    def cgroup_inits(
        self, ids: Collection[str], most: int | None = None
    ) -> dict[str, ProcessKey | str]:
        """`container_inits` for each of these containers whose cgroup directory (and those
        below it) can be read, with at most `most` directories and processes: from the
        processes listed there, each proven as the scan proves it, and no other process
        read. The others are left out."""
        dirs = self.cgroups.dirs(ids) if self.cgroups is not None else {}
        roots: dict[str, list[ProcessKey]] = {}
        for cid, path in dirs.items():
            pids = ContainerCgroups.procs(path, most)
            if pids is not None:
                roots[cid] = self._roots_among(cid, pids)
        return self._inits({cid: keys for cid, keys in roots.items() if keys}, roots.keys())

    def _roots_among(self, cid: str, pids: list[int]) -> list[ProcessKey]:
        """The container's processes among `pids` (its cgroups') whose parent is not in it.
        A process whose parent is listed there too is no root; any other is proven one as
        the scan proves it: its cgroup names the container, read between two reads of its
        start time (a pid reused meanwhile is not taken), and its parent's does not."""
        listed = set(pids)
        found = []
        for pid in pids:
            st = self.stat(pid)
            if st is None or st.ppid in listed or self.container_id(pid) != cid:
                continue
            if self.start_time(pid) == st.start_time and self.container_id(st.ppid) != cid:
                found.append(ProcessKey(pid, st.start_time))
        return found

    @staticmethod
    def _inits(
        roots: dict[str, list[ProcessKey]], ids: Collection[str]
    ) -> dict[str, ProcessKey | str]:
        found: dict[str, ProcessKey | str] = {}
        for cid in ids:
            init = oldest(ProcessTotal(key, 0, ()) for key in roots.get(cid, ()))
            if init is not None:
                found[cid] = init.key
            elif cid in roots:
                found[cid] = (
                    "its first process is not proven: two of its processes whose "
                    "parent is outside it started in the same clock tick"
                )
            else:
                found[cid] = "no process of it runs on this node"
        return found

    def container_roots(self, ids: Collection[str]) -> dict[str, list[ProcessKey]]:
        """For each of these containers (by ID), its processes whose parent is not in it,
        from one pass over `/proc`. Its init is one (the runtime's shim started it); so is
        a process exec'd into it, or one orphaned there (its parent is then the pod's
        pause), but those started later: the oldest is the init (`attribution.oldest`)."""
        found: dict[str, list[ProcessKey]] = {}
        for pid in self.pids():
            cid = self.container_id(pid)
            st = self.stat(pid) if cid is not None and cid in ids else None
            if cid is None or st is None or self.container_id(st.ppid) == cid:
                continue
            found.setdefault(cid, []).append(ProcessKey(pid, st.start_time))
        return found
