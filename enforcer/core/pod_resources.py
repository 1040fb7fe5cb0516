"""Which GPU the kubelet gave each container (pure): the reply of its pod-resources API
(`v1.PodResourcesLister/List`, protobuf) in, each container's devices out, and the one
GPU they name.

In node mode the scheduler counts VRAM per node, so which GPU a container will use is
known from NVML only once it uses one. Where a device plugin hands out the GPUs
(`nvidia.com/gpu`, whole or as time-sliced replicas), the kubelet knows before the
container starts, and says so on its pod-resources socket: then the container's request
is owed on that GPU from the start, as a DRA claim's is. The kubelet is the source, not
the pod: nothing a tenant writes changes what it lists.

The reply is decoded here by its wire format, for the few fields read (the field numbers
of `k8s.io/kubelet/pkg/apis/podresources/v1/api.proto`), so that no generated code is
needed; fields not read are skipped, as protobuf's rules say.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from enforcer.core.model import Device

NVIDIA_GPU = "nvidia.com/gpu"
# The extended resources that give a container a GPU, by default: NVIDIA's device plugin's,
# and the name it gives time-sliced replicas with `renameByDefault: true`. One list for the
# webhook (which container asks for a GPU) and the agent (whose devices are GPUs).
GPU_RESOURCES = (NVIDIA_GPU, f"{NVIDIA_GPU}.shared")

# (namespace, pod, container) -> resource name -> the device IDs the kubelet gave it
Assignments = Mapping[tuple[str, str, str], Mapping[str, tuple[str, ...]]]


class WireError(ValueError):
    """A reply that is not the protobuf it should be."""


def decode_list(data: bytes) -> dict[tuple[str, str, str], dict[str, tuple[str, ...]]]:
    """`ListPodResourcesResponse` -> each container's devices, by resource. Containers
    given no device are left out."""
    found: dict[tuple[str, str, str], dict[str, tuple[str, ...]]] = {}
    for number, value in fields(data):
        if number != 1 or not isinstance(value, bytes):  # pod_resources
            continue
        pod = _strings(value, {1: "name", 2: "namespace"})
        for c_number, container in fields(value):
            if c_number != 3 or not isinstance(container, bytes):  # containers
                continue
            name = _strings(container, {1: "name"}).get("name", "")
            devices: dict[str, list[str]] = {}
            for d_number, entry in fields(container):
                if d_number == 2 and isinstance(entry, bytes):  # devices: ContainerDevices
                    resource, ids = _devices(entry)
                    devices.setdefault(resource, []).extend(ids)
            if devices:
                key = (pod.get("namespace", ""), pod.get("name", ""), name)
                found[key] = {r: tuple(ids) for r, ids in devices.items()}
    return found


def gpu_of(ids: Sequence[str], devices: Sequence[Device]) -> str | None:
    """The one whole GPU that device IDs name, as NVML names it; None when they name
    several, none, or one NVML does not show. NVIDIA's device plugin names a GPU by its
    UUID (`GPU-...`), a time-sliced or MPS replica of it by `GPU-...::<n>`, or, with
    `DEVICE_ID_STRATEGY=index`, by its index. MIG devices are not GPUs to owe on."""
    whole = {d.uuid: d for d in devices if d.parent_uuid is None}
    by_index = {str(d.index): d.uuid for d in whole.values()}
    named = {by_index.get(i) or i.split("::", 1)[0] for i in ids}
    if len(named) != 1:
        return None
    (gpu,) = named
    return gpu if gpu in whole else None


def assigned_gpus(
    found: Assignments, resources: Collection[str], devices: Sequence[Device]
) -> dict[tuple[str, str, str], str]:
    """(namespace, pod, container) -> the one GPU the kubelet gave it from `resources`
    (the device plugins' resource names that are GPUs)."""
    gpus: dict[tuple[str, str, str], str] = {}
    for key, by_resource in found.items():
        ids = [i for r in resources for i in by_resource.get(r, ())]
        gpu = gpu_of(ids, devices) if ids else None
        if gpu is not None:
            gpus[key] = gpu
    return gpus


def _devices(data: bytes) -> tuple[str, list[str]]:
    resource, ids = "", []
    for number, value in fields(data):
        if isinstance(value, bytes) and number == 1:  # resource_name
            resource = _text(value)
        elif isinstance(value, bytes) and number == 2:  # device_ids
            ids.append(_text(value))
    return resource, ids


def _strings(data: bytes, wanted: Mapping[int, str]) -> dict[str, str]:
    return {
        wanted[number]: _text(value)
        for number, value in fields(data)
        if number in wanted and isinstance(value, bytes)
    }


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError("a string field is not UTF-8") from None


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a protobuf message: an int for a varint,
    bytes for a length-delimited field (a string, or a message to read the same way);
    fixed-size fields are skipped."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise WireError("a field runs past the end of the message")
            yield number, data[at : at + size]
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise WireError(f"wire type {wire} of field {number} is not one a reply holds")
    if at != len(data):
        raise WireError("the last field runs past the end of the message")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("a varint runs past the end of the message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
