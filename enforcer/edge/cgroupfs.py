"""cgroup v2 as files: where the hierarchy is mounted, which cgroup a process is in, the few
writes vram-enforcer makes (create a cgroup, move a process into it, remove it), and the
kubelet's pod and container cgroups found under a root.

Every failure is a `CgroupFsError` whose message names the path and says what to do; the
callers fall back to sampling on it, never crash.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from enforcer.core.cgroups import (
    Level,
    container_id_of_dir,
    is_kubepods_dir,
    made_in,
    pod_uid_of_dir,
)
from enforcer.core.mounts import first_of_type, parse_mountinfo

MOUNTINFO = Path("/proc/self/mountinfo")
_CONTROLLERS = "cgroup.controllers"  # a file of cgroup v2 directories only


class CgroupFsError(Exception):
    """A cgroup operation failed; the message says where and what to do."""


def v2_root(mountinfo: Path = MOUNTINFO) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (the first `cgroup2` mount), or None.

    On a pure v2 host that is /sys/fs/cgroup; on a hybrid one often /sys/fs/cgroup/unified.
    """
    try:
        text = mountinfo.read_text()
    except OSError:
        return None
    found = first_of_type(parse_mountinfo(text), "cgroup2")
    return None if found is None else Path(found.point)


def v2_path(pid: int | str = "self", proc: Path = Path("/proc")) -> str | None:
    """A process's cgroup v2 path (the `0::` line of /proc/<pid>/cgroup), relative to the
    root of the reader's cgroup namespace; None when it has none or has exited."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def own_dir(mountinfo: Path = MOUNTINFO) -> Path:
    """This process's own cgroup v2 directory; raises CgroupFsError when there is none."""
    root = v2_root(mountinfo)
    if root is None:
        raise CgroupFsError("cgroup v2 is not mounted here (cgroup v1 only)")
    rel = v2_path()
    if rel is None or rel.startswith("/.."):
        raise CgroupFsError(f"this process's cgroup v2 directory is not visible under {root}")
    found = root / rel.lstrip("/")
    if not (found / _CONTROLLERS).exists():
        raise CgroupFsError(f"{found} is not a cgroup v2 directory")
    return found


def _fail(action: str, path: Path, exc: OSError) -> CgroupFsError:
    fix = {
        errno.EACCES: "run as root, or in a cgroup v2 subtree delegated to this user",
        errno.EPERM: "run as root, or in a cgroup v2 subtree delegated to this user",
        errno.EROFS: "the cgroup hierarchy is mounted read-only here (a container?)",
    }.get(exc.errno or 0, "")
    return CgroupFsError(f"cannot {action} {path}: {exc.strerror}" + (f"; {fix}" if fix else ""))


def create(path: Path) -> None:
    try:
        path.mkdir()
    except OSError as exc:
        raise _fail("create the cgroup", path, exc) from exc


def move(pid: int, path: Path) -> None:
    """Move the whole process `pid` (all its threads) into the cgroup at `path`."""
    try:
        (path / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        raise _fail(f"move pid {pid} into", path, exc) from exc


def remove(path: Path) -> bool:
    """Remove an empty cgroup; False when it still holds processes or children. A cgroup
    that is already gone counts as removed."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def controllers(path: Path) -> frozenset[str]:
    """The controllers available in the cgroup at `path` (those its parent enabled)."""
    try:
        return frozenset((path / _CONTROLLERS).read_text().split())
    except OSError:
        return frozenset()


def first_without(controller: str, cgroup: Path, root: Path) -> Path | None:
    """The first cgroup from `root` down to `cgroup`'s parent whose `cgroup.subtree_control`
    does not enable `controller` for its children: where it stops reaching `cgroup` (a
    controller's files exist only where every ancestor enables it). None when all do, or
    `cgroup` is not below `root`."""
    try:
        below = cgroup.relative_to(root)
    except ValueError:
        return None
    at = root
    for part in below.parts:
        try:
            enabled = (at / "cgroup.subtree_control").read_text().split()
        except OSError:
            return at
        if controller not in enabled:
            return at
        at = at / part
    return None


def enable(path: Path, controller: str) -> bool:
    """Enable `controller` for the children of `path`; False when the kernel refuses."""
    try:
        (path / "cgroup.subtree_control").write_text(f"+{controller}")
    except OSError:
        return False
    return True


def exists(path: Path) -> bool:
    return (path / _CONTROLLERS).exists()


def v2_at(path: Path) -> Path:
    """The cgroup v2 hierarchy at `path`, or at `path`/unified where `path` is a hybrid
    host's /sys/fs/cgroup (v1 controllers, v2 below `unified`); `path` when neither is."""
    return path / "unified" if not exists(path) and exists(path / "unified") else path


class CommandCgroup:
    """`exec`'s cgroups: `<its own>/vram-enforcer-<pid>/command`, where the command and all
    its descendants live and which carries the hard limits, and `.../enforcer`, where exec
    itself waits. They are apart because a cgroup v2 that hands a controller (`dmem`) to
    its children may hold no processes of its own, and because exec's own NVML session
    must not count against the command's limit.
    """

    def __init__(self, parent: Path, parent_path: str = "") -> None:
        self.parent = parent
        self.top = parent / f"vram-enforcer-{os.getpid()}"
        self.command = self.top / "command"
        self.enforcer = self.top / "enforcer"
        # The command's cgroup as /proc/<pid>/cgroup names it (relative to the hierarchy).
        self.command_path = f"{parent_path.rstrip('/')}/{self.top.name}/command"

    @classmethod
    def create(cls) -> CommandCgroup:
        """Make the cgroups below this process's own; raises CgroupFsError."""
        made = cls(own_dir(), v2_path() or "/")
        made.remove_stale()
        create(made.top)
        try:
            create(made.command)
            create(made.enforcer)
        except CgroupFsError:
            made.close()
            raise
        if "dmem" in controllers(made.top):  # the kernel's device-memory controller, >= 6.14
            enable(made.top, "dmem")
        return made

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """While inside, this process is in `command`, so that a child it spawns starts
        there, under the limits, before its first instruction; afterwards in `enforcer`."""
        move(os.getpid(), self.command)
        try:
            yield
        finally:
            move(os.getpid(), self.enforcer)

    def strays(self, pids: Iterable[int]) -> dict[int, str]:
        """Which of `pids` have left the command's cgroup (and its subtree), and where they
        are now. The command runs as the user who owns its cgroup's parent, so it may write
        itself into any cgroup that user may write: out from under the hard limit."""
        found = {}
        for pid in pids:
            path = v2_path(pid)
            inside = path is not None and (
                path == self.command_path or path.startswith(self.command_path + "/")
            )
            if path is not None and not inside:
                found[pid] = path
        return found

    def remove_stale(self) -> None:
        """Remove what an `exec` that was killed (SIGKILL) left behind, once empty: only
        a removed cgroup releases its limits, and only an empty one can be removed."""
        for old in self.parent.glob("vram-enforcer-*"):
            pid = old.name.rpartition("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                for path in (old / "command", old / "enforcer", old):
                    remove(path)

    def close(self) -> bool:
        """Go back to the original cgroup and remove ours (and with them the limits);
        False when the command's cgroup still holds processes and was left in place."""
        with contextlib.suppress(CgroupFsError):
            move(os.getpid(), self.parent)
        removed = [remove(p) for p in (self.command, self.enforcer, self.top)]
        return all(removed)


@dataclass(slots=True)
class PodDirs:
    """The kubelet's cgroups under a root: each pod's directory by pod UID, and within it,
    each container's directory by container ID (as named by the runtime). Paths are plain
    strings: a scan of a full node makes hundreds, and they go to NVML as strings."""

    pods: dict[str, str] = field(default_factory=dict)
    containers: dict[str, dict[str, str]] = field(default_factory=dict)

    def paths(self) -> set[str]:
        found = set(self.pods.values())
        for by_id in self.containers.values():
            found.update(by_id.values())
        return found


def kubepods_dirs(root: Path, depth: int = 4) -> list[str]:
    """The kubelet's `kubepods` (or `kubepods.slice`) directories, up to `depth` below `root`."""
    return [path for _, path in _find(str(root), is_kubepods_dir, depth)]


class PodScanner:
    """Finds the kubelet's pod and container cgroups below `root` (the host's cgroup v2
    mount, as this process sees it).

    Pods live below a `kubepods` or `kubepods.slice` directory, at a depth that depends on
    the cgroup driver (systemd or cgroupfs) and the kubelet's `--cgroup-root`: it is
    looked for up to `depth` levels down, once, and again only while none is found or
    when one found before is gone. Each scan then reads just those subtrees.
    """

    def __init__(self, root: Path, depth: int = 4) -> None:
        self.root = root
        self._depth = depth
        self._kubepods: list[str] = []

    def scan(self) -> PodDirs:
        found = PodDirs()
        for kubepods in self._found():
            for name, pod_dir in _find(kubepods, _is_pod_dir, 2):  # below a QoS class, or not
                uid = pod_uid_of_dir(name)
                assert uid is not None  # noqa: S101 - _is_pod_dir matched it
                found.pods[uid] = pod_dir
                found.containers[uid] = {
                    cid: path
                    for child, path in _subdirs(pod_dir)
                    if (cid := container_id_of_dir(child)) is not None
                }
        return found

    def levels(self) -> dict[str, Level]:
        """The kubelet's directories down to the pods' (none below), each with its level:
        where its new pods and containers are made, for `cgroup_watch` to watch."""
        found = dict.fromkeys(self._found(), Level.KUBEPODS)
        above = list(found.items())
        while above:
            directory, at = above.pop()
            for name, path in _subdirs(directory):
                if (deeper := made_in(at, name)[0]) is not None:
                    found[path] = deeper
                    if deeper is not Level.POD:
                        above.append((path, deeper))
        return found

    def _found(self) -> list[str]:
        if not self._kubepods or not all(exists(Path(k)) for k in self._kubepods):
            self._kubepods = kubepods_dirs(self.root, self._depth)
        return self._kubepods


def _is_pod_dir(name: str) -> bool:
    return pod_uid_of_dir(name) is not None


def _subdirs(path: str) -> list[tuple[str, str]]:
    """(name, path) of each directory in `path`; none when it has gone."""
    try:
        with os.scandir(path) as entries:
            return [(e.name, e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _find(root: str, matches: Callable[[str], bool], depth: int) -> Iterator[tuple[str, str]]:
    """(name, path) of the directories below `root` (not `root` itself), breadth first,
    whose name `matches`; a match is not descended into."""
    level = [root]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            for name, path in _subdirs(directory):
                if matches(name):
                    yield name, path
                else:
                    below.append(path)
        level = below


class ContainerCgroups:
    """Each container's processes, from its own cgroup directory under the host's cgroupfs
    at `root`, as the agent mounts it: the v2 hierarchy (a hybrid host's `unified`), then
    the v1 ones (`pids`, `memory`, `systemd`). The directory is found by the container's ID
    in its name (`PodScanner`), not by the path in a process's `/proc/<pid>/cgroup`: in the
    agent's own cgroup namespace that path is relative (`/../..`). Finding it costs a look
    at each pod's directory, and only when one asked for is not known yet (or has gone);
    reading it, the container's own size."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._scanners: list[PodScanner] | None = None
        self._dirs: dict[str, str] = {}  # container ID -> its directory, as last scanned

    def _hierarchies(self) -> list[PodScanner]:
        if self._scanners is None:
            v2 = v2_at(self.root)
            v1 = [p for n in ("pids", "memory", "systemd") if (p := self.root / n).is_dir()]
            self._scanners = [PodScanner(p) for p in ([v2] if exists(v2) else []) + v1]
        return self._scanners

    def dirs(self, ids: Iterable[str]) -> dict[str, str]:
        """The directory of each of these containers that is found."""
        wanted = set(ids)
        known = self._dirs  # threads share this object: each scan replaces it whole
        if not all(os.path.isdir(known.get(cid, "")) for cid in wanted):
            known = {}
            for scanner in self._hierarchies():
                for by_id in scanner.scan().containers.values():
                    for cid, path in by_id.items():
                        known.setdefault(cid, path)
                if wanted <= known.keys():
                    break
            self._dirs = known
        return {cid: known[cid] for cid in wanted if cid in known}

    @staticmethod
    def procs(path: str, most: int | None = None) -> list[int] | None:
        """The pids in the cgroup at `path` and in every cgroup below it (a container may
        make its own); None when one cannot be read, or when there are more than `most`
        (directories and pids together). A cgroup below that goes meanwhile held none."""
        found: list[int] = []
        level, seen = [path], 0
        while level:
            below: list[str] = []
            for directory in level:
                try:
                    with open(f"{directory}/cgroup.procs", "rb") as f:
                        found.extend(int(p) for p in f.read().split())
                    with os.scandir(directory) as entries:
                        below.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
                except FileNotFoundError:
                    if directory == path:
                        return None
                except (OSError, ValueError):
                    return None
                seen += 1
                if most is not None and seen + len(found) > most:
                    return None
            level = below
        return found
