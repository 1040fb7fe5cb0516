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

# Lookups answered in memory (tmpfs: an emptyDir of medium Memory; ramfs; devtmpfs;
# overlay over them) or from a local block device: none waits on a server. FUSE (and
# virtiofs, which is FUSE), NFS, CIFS, 9p, Ceph and the like are left out: each waits on a
# server, whoever runs it.
LOCAL_FILESYSTEMS = frozenset(
    {
        "tmpfs",
        "ramfs",
        "devtmpfs",
        "overlay",
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
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


def first_of_type(mounts: dict[int, Mount], fstype: str) -> Mount | None:
    """The first mount of that filesystem type, in the order the kernel lists them."""
    return next((m for m in mounts.values() if m.fstype == fstype), None)
