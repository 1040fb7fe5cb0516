"""A process's mounts, as `/proc/<pid>/mountinfo` lists them (pure): which filesystem each
mount is, by the mount's ID (the one `/proc/<pid>/fdinfo/<fd>` names as `mnt_id`).

Which filesystems a lookup may enter is decided here too: a path inside a tenant's
filesystem may cross into a mount that never answers (FUSE whose server does not reply, a
hard NFS mount whose server is gone), and a lookup there waits in the kernel for as long.
Only filesystems whose lookups are answered in memory or from a local disk are entered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Filesystems whose lookups and metadata are answered from this machine's memory or its own
# disks: tmpfs (an emptyDir of medium Memory; a container's /dev), devtmpfs, the kernel's
# own (proc, sysfs, cgroup, devpts, mqueue, hugetlbfs), overlay (a container's root) and
# local disks' filesystems. FUSE (a daemon; virtiofs is FUSE too), NFS, CIFS, 9p, Ceph and
# other network filesystems are left out: each waits on another party, which may never
# answer.
LOCAL_FILESYSTEMS = frozenset(
    {
        "tmpfs",
        "ramfs",
        "devtmpfs",
        "devpts",
        "mqueue",
        "hugetlbfs",
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "overlay",
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "vfat",
        "squashfs",
        "erofs",
    }
)

_ESCAPED = re.compile(r"\\([0-7]{3})")  # the kernel writes space, tab, newline, \ as octal


@dataclass(frozen=True, slots=True)
class Mount:
    point: str  # where it is mounted, in that process's mount namespace
    fstype: str  # "tmpfs", "fuse.sshfs", "nfs4", ...

    @property
    def local(self) -> bool:
        """Whether a lookup inside it is answered without a server (`LOCAL_FILESYSTEMS`)."""
        return self.fstype in LOCAL_FILESYSTEMS


def parse_mountinfo(text: str) -> dict[int, Mount]:
    """Mount ID -> the mount, for each well-formed line (proc(5): ID, parent ID,
    major:minor, root, mount point, options, optional fields, "-", fstype, source, ...)."""
    found: dict[int, Mount] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest or not fields[0].isdigit():
            continue
        point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        found[int(fields[0])] = Mount(point, rest[0])
    return found


def local_mounts(mounts: dict[int, Mount]) -> frozenset[int]:
    """The IDs of those of `mounts` that are `local`."""
    return frozenset(ident for ident, mount in mounts.items() if mount.local)


def parse_mount_id(fdinfo: str) -> int | None:
    """From `/proc/<pid>/fdinfo/<fd>`: the ID of the mount the open file is on (`mnt_id`,
    Linux 3.15+), as the kernel keeps it, asking the file's filesystem nothing."""
    for line in fdinfo.splitlines():
        key, _, value = line.partition(":")
        if key == "mnt_id":
            value = value.strip()
            return int(value) if value.isascii() and value.isdigit() else None
    return None


def first_of_type(mounts: dict[int, Mount], fstype: str) -> Mount | None:
    """The first mount of that filesystem type, in the order the kernel lists them."""
    return next((m for m in mounts.values() if m.fstype == fstype), None)
