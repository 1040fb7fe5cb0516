"""A process's mounts read from its mountinfo, and which filesystems a lookup may enter."""

from __future__ import annotations

from enforcer.core.mounts import (
    Mount,
    first_of_type,
    local_mounts,
    parse_mount_id,
    parse_mountinfo,
)

# As the kernel writes it (proc(5)): optional fields before " - ", a space in a mount
# point escaped as \\040, and a line that is not one (ignored).
MOUNTINFO = """\
2069 1810 0:354 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/l,upperdir=/u
2070 2069 0:356 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
2091 2069 0:28 /pods/x/volumes/kubernetes.io~empty-dir/s /run/vram-enforcer rw - tmpfs tmpfs rw
2092 2069 0:61 / /data\\040set rw,relatime shared:9 - fuse.sshfs host:/d rw,user_id=0
2093 2069 0:62 / /models rw - nfs4 10.0.0.9:/models rw,hard
2094 2069 0:63 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw
garbage
"""


def test_each_mount_is_read_by_its_id_with_its_point_and_filesystem() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[2069] == Mount("/", "overlay")
    assert mounts[2091] == Mount("/run/vram-enforcer", "tmpfs")
    assert mounts[2092] == Mount("/data set", "fuse.sshfs")
    assert len(mounts) == 6
    assert first_of_type(mounts, "cgroup2") == Mount("/sys/fs/cgroup", "cgroup2")
    assert first_of_type(mounts, "btrfs") is None


def test_only_filesystems_that_answer_without_a_server_are_entered() -> None:
    """A FUSE mount whose server stops answering, or a hard NFS mount whose server is gone,
    holds every lookup inside it for as long: never entered (issue 42, item 7)."""
    mounts = parse_mountinfo(MOUNTINFO)
    assert {m.point for m in mounts.values() if not m.local} == {"/data set", "/models"}
    assert local_mounts(mounts) == {2069, 2070, 2091, 2094}


def test_an_open_files_mount_is_read_from_its_fdinfo() -> None:
    assert parse_mount_id("pos:\t0\nflags:\t012000000\nmnt_id:\t2091\nino:\t7\n") == 2091
    assert parse_mount_id("pos:\t0\nflags:\t02\n") is None  # before Linux 3.15
    assert parse_mount_id("mnt_id:\t²\n") is None
