"""The kubelet's pod-resources reply decoded, and the one GPU a container's devices name
(pure)."""

from __future__ import annotations

import pytest

from enforcer.core.model import Device, GiB
from enforcer.core.pod_resources import WireError, assigned_gpus, decode_list, gpu_of
from tests.protowire import field, number_field

H100 = Device(0, "GPU-aaaa", "H100", 80 * GiB, 0)
L4 = Device(1, "GPU-bbbb", "L4", 24 * GiB, 0)
MIG = Device(2, "MIG-cccc", "1g.10gb", 10 * GiB, 0, parent_uuid="GPU-aaaa")


def container(name: str, *devices: tuple[str, list[str]], cpus: tuple[int, ...] = ()) -> bytes:
    body = field(1, name)
    for resource, ids in devices:
        body += field(2, field(1, resource) + b"".join(field(2, i) for i in ids))
    body += b"".join(number_field(3, c) for c in cpus)  # cpu_ids: a field not read
    return body


def pod(namespace: str, name: str, *containers: bytes) -> bytes:
    return field(
        1, field(1, name) + field(2, namespace) + b"".join(field(3, c) for c in containers)
    )


def test_each_containers_devices_are_read_by_resource_and_other_fields_skipped() -> None:
    reply = pod(
        "ml",
        "serve-0",
        container("server", ("nvidia.com/gpu", ["GPU-aaaa::3"]), cpus=(2, 3)),
        container("sidecar"),  # no device: left out
        container("nic", ("example.com/rdma", ["0", "1"])),
    )
    reply += pod("web", "job-1", container("c", ("nvidia.com/gpu", ["GPU-bbbb", "GPU-aaaa"])))
    assert decode_list(reply) == {
        ("ml", "serve-0", "server"): {"nvidia.com/gpu": ("GPU-aaaa::3",)},
        ("ml", "serve-0", "nic"): {"example.com/rdma": ("0", "1")},
        ("web", "job-1", "c"): {"nvidia.com/gpu": ("GPU-bbbb", "GPU-aaaa")},
    }
    assert decode_list(b"") == {}


@pytest.mark.parametrize("garbage", [b"\x0a\x05ab", b"\x0a", b"\x0f", b"\x0a\x02\xff\xfe"])
def test_a_reply_that_is_not_the_message_is_an_error_not_a_guess(garbage: bytes) -> None:
    with pytest.raises(WireError):
        decode_list(garbage)


def test_the_gpu_a_containers_devices_name() -> None:
    devices = [H100, L4, MIG]
    assert gpu_of(["GPU-aaaa"], devices) == "GPU-aaaa"
    assert gpu_of(["GPU-aaaa::0", "GPU-aaaa::5"], devices) == "GPU-aaaa"  # replicas of one
    assert gpu_of(["1"], devices) == "GPU-bbbb"  # DEVICE_ID_STRATEGY=index
    assert gpu_of(["GPU-aaaa", "GPU-bbbb"], devices) is None  # two GPUs: owed where, unknown
    assert gpu_of(["GPU-zzzz"], devices) is None  # one NVML does not show
    assert gpu_of(["MIG-cccc"], devices) is None  # a MIG device: its memory is split already
    found = {
        ("ml", "a", "c"): {"nvidia.com/gpu": ("GPU-bbbb::1",)},
        ("ml", "b", "c"): {"example.com/rdma": ("0",)},
    }
    assert assigned_gpus(found, ("nvidia.com/gpu",), devices) == {("ml", "a", "c"): "GPU-bbbb"}
