"""cgroup v2 through the real files: the mount from mountinfo, a process's own cgroup, the
writes exec makes, and the kubelet's pod and container directories found by a scan."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from enforcer.edge import cgroupfs
from enforcer.edge.cgroupfs import CgroupFsError, PodScanner

A = "a" * 64
B = "b" * 64
UID = "6b5ab4a6-3e21-4b5d-9a5f-2b1c9d6e4f7a"


def test_the_v2_mount_is_read_from_mountinfo(tmp_path: Path) -> None:
    hybrid = tmp_path / "mountinfo"
    hybrid.write_text(
        "25 30 0:22 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755\n"
        "26 25 0:23 / /sys/fs/cgroup/memory rw shared:10 - cgroup cgroup rw,memory\n"
        "27 25 0:24 / /sys/fs/cgroup/unified rw shared:11 - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    assert cgroupfs.v2_root(hybrid) == Path("/sys/fs/cgroup/unified")
    v1_only = tmp_path / "v1"
    v1_only.write_text("26 25 0:23 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert cgroupfs.v2_root(v1_only) is None
    assert cgroupfs.v2_root(tmp_path / "missing") is None
    with pytest.raises(CgroupFsError, match="cgroup v2 is not mounted"):
        cgroupfs.own_dir(v1_only)


def test_create_move_and_remove(cgroup2: Path) -> None:
    unit = cgroup2 / "unit"
    cgroupfs.create(unit)
    with pytest.raises(CgroupFsError, match=f"cannot create the cgroup {unit}: File exists"):
        cgroupfs.create(unit)
    child = subprocess.Popen(["sleep", "60"])
    try:
        cgroupfs.move(child.pid, unit)
        rel = cgroupfs.v2_path(child.pid)
        assert rel is not None and Path(rel).name == "unit"
        assert not cgroupfs.remove(unit)  # still holds a process
    finally:
        child.kill()
        child.wait()
    with pytest.raises(CgroupFsError, match=f"cannot move pid {os.getpid()} into .*gone"):
        cgroupfs.move(os.getpid(), cgroup2 / "gone")
    assert cgroupfs.remove(unit)
    assert cgroupfs.remove(unit)  # already gone counts as removed
    assert cgroupfs.own_dir().exists()


def test_pods_and_containers_are_found_under_either_driver(tmp_path: Path, cgroup2: Path) -> None:
    systemd_uid = UID.replace("-", "_")
    tree = [
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{A}.scope",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/crio-conmon-{B}.scope",
        f"kubepods.slice/kubepods-pod{'1' * 8}_2222_3333_4444_{'5' * 12}.slice/cri-containerd-{B}.scope",
        "system.slice/containerd.service",
    ]
    for path in tree:
        (cgroup2 / path).mkdir(parents=True)
    found = PodScanner(cgroup2).scan()
    pod_dir = (
        cgroup2
        / f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice"
    )
    guaranteed = "11111111-2222-3333-4444-555555555555"
    assert found.pods == {
        UID: str(pod_dir),
        guaranteed: str(
            pod_dir.parent.parent / f"kubepods-pod{'1' * 8}_2222_3333_4444_{'5' * 12}.slice"
        ),
    }
    assert found.containers[UID] == {A: str(pod_dir / f"cri-containerd-{A}.scope")}
    assert set(found.containers[guaranteed]) == {B}
    # the cgroupfs driver, below a kubelet --cgroup-root
    cgroupfs_tree = tmp_path / "root"
    (cgroupfs_tree / f"kubelet/kubepods/besteffort/pod{UID}/{A}").mkdir(parents=True)
    (cgroupfs_tree / "kubelet/kubepods/cgroup.controllers").touch()
    found = PodScanner(cgroupfs_tree).scan()
    assert found.containers == {
        UID: {A: str(cgroupfs_tree / f"kubelet/kubepods/besteffort/pod{UID}/{A}")}
    }
    assert PodScanner(tmp_path / "nothing").scan().pods == {}


def test_a_hybrid_hosts_v2_hierarchy_is_found_below_unified(tmp_path: Path, cgroup2: Path) -> None:
    """The chart mounts the host's /sys/fs/cgroup; on a hybrid host that is a tmpfs of v1
    mounts, and the v2 hierarchy (where the driver's limits live) is its `unified`."""
    (tmp_path / "memory").mkdir()
    (tmp_path / "unified").symlink_to(cgroup2)
    assert cgroupfs.v2_at(tmp_path) == tmp_path / "unified"
    assert cgroupfs.v2_at(cgroup2) == cgroup2  # a pure v2 host: the path itself
    assert cgroupfs.v2_at(tmp_path / "memory") == tmp_path / "memory"  # neither: said later
