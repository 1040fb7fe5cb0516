"""Container IDs from real /proc/<pid>/cgroup contents: containerd, CRI-O and Docker, on
cgroup v1 and v2, with the systemd and cgroupfs drivers, with and without cgroup namespaces."""

import pytest

from enforcer.core.cgroups import (
    Level,
    container_id,
    container_id_of_dir,
    is_kubepods_dir,
    made_in,
    parse_cgroup,
    pod_uid,
    pod_uid_of_dir,
    status_container_id,
    tenant,
)

A = "3f2d6b0c5a1e4d9f8b7a6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f"
B = "a1b2c3d4e5f60718a1b2c3d4e5f60718a1b2c3d4e5f60718a1b2c3d4e5f60718"
UID_SYSTEMD = "6b5ab4a6_3e21_4b5d_9a5f_2b1c9d6e4f7a"
UID = "6b5ab4a6-3e21-4b5d-9a5f-2b1c9d6e4f7a"

CASES = {
    "containerd, systemd, v2": f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/cri-containerd-{A}.scope\n",
    "containerd, systemd, v2, guaranteed": f"0::/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/cri-containerd-{A}.scope\n",
    "containerd, cgroupfs, v1": (
        f"12:pids:/kubepods/burstable/pod{UID}/{A}\n11:memory:/kubepods/burstable/pod{UID}/{A}\n"
        f"4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{A}\n1:name=systemd:/kubepods/burstable/pod{UID}/{A}\n0::/\n"
    ),
    "containerd, cgroupfs, v2": f"0::/kubepods/besteffort/pod{UID}/{A}\n",
    "CRI-O, systemd, v2": f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SYSTEMD}.slice/crio-{A}.scope\n",
    "CRI-O, systemd, v1": (
        f"10:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SYSTEMD}.slice/crio-{A}.scope\n"
        f"1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SYSTEMD}.slice/crio-{A}.scope\n"
    ),
    "Docker (dockershim), cgroupfs, v1": f"11:memory:/kubepods/besteffort/pod{UID}/{A}\n3:cpuset:/kubepods/besteffort/pod{UID}/{A}\n",
    "Docker, systemd, v2": f"0::/system.slice/docker-{A}.scope\n",
    "Docker, cgroupfs, v1": f"12:memory:/docker/{A}\n1:name=systemd:/docker/{A}\n",
    "containerd, cgroup namespace, v2": f"0::/../cri-containerd-{A}.scope\n",
    "cgroupfs, cgroup namespace, v2": f"0::/../{A}\n",
    "v1 with an unrelated host hierarchy": f"4:memory:/process_api/c3654c36554ad2054a4190ead6dd87e8\n1:name=systemd:/docker/{A}\n",
    "nested cgroup below the container": f"0::/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/cri-containerd-{A}.scope/init.scope\n",
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_container_ids(text: str) -> None:
    assert container_id(parse_cgroup(text)) == A


@pytest.mark.parametrize(
    "text",
    [
        "0::/user.slice/user-1000.slice/session-2.scope\n",
        "0::/\n",
        "0::/init.scope\n",
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice\n",  # the pod, no container
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SYSTEMD}.slice/crio-conmon-{A}.scope\n",
        f"11:memory:/docker/{A}\n1:name=systemd:/docker/{B}\n",  # hierarchies disagree
        f"0::/system.slice/docker-{A[:12]}.scope\n",  # a short ID is not an ID
        f"0::/somewhere/{A}\n",  # a bare ID below an unknown directory
    ],
)
def test_no_container_or_no_proof(text: str) -> None:
    assert container_id(parse_cgroup(text)) is None


def test_status_container_ids() -> None:
    assert status_container_id(f"containerd://{A}") == A
    assert status_container_id(f"cri-o://{A}") == A
    assert status_container_id(f"docker://{A}") == A
    assert status_container_id("") is None
    assert status_container_id(None) is None
    assert status_container_id(f"containerd://{A[:20]}") is None
    assert status_container_id(True) is None  # a status of the wrong shape (found by hypothesis)
    assert status_container_id(["x"]) is None


@pytest.mark.parametrize(
    "name",
    [
        f"kubepods-burstable-pod{UID_SYSTEMD}.slice",  # systemd driver, burstable
        f"kubepods-pod{UID_SYSTEMD}.slice",  # systemd driver, guaranteed
        f"pod{UID}",  # cgroupfs driver
    ],
)
def test_a_pod_directory_names_its_pod(name: str) -> None:
    assert pod_uid_of_dir(name) == UID


@pytest.mark.parametrize(
    "name",
    [
        "kubepods-burstable.slice",
        "kubepods.slice",
        f"cri-containerd-{A}.scope",
        f"pod{UID}x",
        f"xpod{UID}",
        "pod",
        f"kubepods-burstable-pod{UID_SYSTEMD}.scope",
    ],
)
def test_other_directories_name_no_pod(name: str) -> None:
    assert pod_uid_of_dir(name) is None


def test_the_pod_of_a_process_from_its_cgroup_lines() -> None:
    """What the gate's caps count a process's listener fd by (its pod's directory)."""
    systemd = f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/cri-containerd-{A}.scope"
    assert pod_uid(parse_cgroup(systemd)) == UID
    assert pod_uid(parse_cgroup(f"0::/kubepods/besteffort/pod{UID}/{A}")) == UID
    v1 = f"12:memory:/kubepods/pod{UID}/{A}\n11:cpu:/kubepods/pod{UID}/{A}"
    assert pod_uid(parse_cgroup(v1)) == UID
    other = "0c6a1b2e-5d1f-4b7e-9a51-3f0d2c7e8a90"
    assert (
        pod_uid(parse_cgroup(f"12:memory:/kubepods/pod{UID}/{A}\n11:cpu:/kubepods/pod{other}/{A}"))
        is None
    )
    assert pod_uid(parse_cgroup(f"0::/system.slice/docker-{A}.scope")) is None
    assert pod_uid(parse_cgroup(f"0::/../cri-containerd-{A}.scope")) is None  # a namespace


def test_container_directories() -> None:
    assert container_id_of_dir(f"cri-containerd-{A}.scope") == A
    assert container_id_of_dir(f"crio-{A}.scope") == A
    assert container_id_of_dir(f"docker-{A}.scope") == A
    assert container_id_of_dir(A) == A  # cgroupfs
    assert container_id_of_dir(f"crio-conmon-{A}.scope") is None  # CRI-O's monitor
    assert container_id_of_dir(f"cri-containerd-{A}.scope.old") is None
    assert container_id_of_dir(A[:-1]) is None
    assert is_kubepods_dir("kubepods.slice") and is_kubepods_dir("kubepods")
    assert not is_kubepods_dir("kubepods-burstable.slice")


def test_a_tenant_is_a_container_or_else_a_cgroup() -> None:
    cid = "a" * 64
    pod = f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{cid}.scope\n"
    assert tenant(parse_cgroup(pod)) == f"container:{cid}"
    hybrid = "12:memory:/system.slice/ollama.service\n0::/system.slice/ollama.service\n"
    assert tenant(parse_cgroup(hybrid)) == "cgroup:/system.slice/ollama.service"
    assert tenant(parse_cgroup("4:cpu,cpuacct:/user.slice\n")) == "cgroup:/user.slice"
    assert tenant(()) is None


@pytest.mark.parametrize(
    ("level", "name", "means"),
    [
        # systemd driver: a QoS class's slice, then a pod's, then a container's scope
        (Level.KUBEPODS, "kubepods-burstable.slice", (Level.QOS, False)),
        (Level.QOS, f"kubepods-burstable-pod{UID_SYSTEMD}.slice", (Level.POD, True)),
        (Level.KUBEPODS, f"kubepods-pod{UID_SYSTEMD}.slice", (Level.POD, True)),  # guaranteed
        (Level.POD, f"cri-containerd-{A}.scope", (None, True)),
        (Level.POD, f"crio-{A}.scope", (None, True)),
        # cgroupfs driver
        (Level.KUBEPODS, "besteffort", (Level.QOS, False)),
        (Level.QOS, f"pod{UID}", (Level.POD, True)),
        (Level.POD, A, (None, True)),
        # what is not the kubelet's or the runtime's: neither watched nor work
        (Level.QOS, "besteffort", (None, False)),  # no QoS class below a QoS class
        (Level.POD, f"crio-conmon-{A}.scope", (None, False)),
        (Level.POD, "tenant-made", (None, False)),
        (Level.POD, f"pod{UID}", (None, False)),  # a pod's name below a pod: not a pod
    ],
)
def test_what_a_directory_made_in_the_kubelets_cgroups_is(
    level: Level, name: str, means: tuple[Level | None, bool]
) -> None:
    """Only the kubelet's levels are watched, never below a pod: what a container makes
    below its own cgroup (its own cgroup namespace) adds no watch."""
    assert made_in(level, name) == means
