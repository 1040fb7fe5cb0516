"""What every part of the webhook's mutation shares: its settings, the denial, and how a
pod's containers are walked (pure)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from enforcer.core import shapes
from enforcer.core.declaration import SIDECAR
from enforcer.core.dra import NVIDIA_DRIVER
from enforcer.core.payloads import (
    Container,
    PodSpec,
)
from enforcer.core.pod_resources import GPU_RESOURCES
from enforcer.core.tenancy import (
    Tenancy,
)

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What the mutation depends on (the webhook's flags, validated)."""

    sidecar_image: str
    sidecar_mode: str  # native or container ("auto" is resolved at start-up)
    resource_name: str
    resource_unit: int
    framework_env: bool = True
    shm_default: str = "auto"  # auto, off, or a quantity
    gpu_exposure: str = "none"  # none or env
    toolkit_limits: bool = False  # also set TOOLKIT_ENV for the toolkit's CDI hook
    runtime_class: str | None = None
    sidecar_cpu: str = "10m"
    sidecar_memory: str = "48Mi"
    # DRA: the DeviceClass that a declaration becomes a claim on (None: per-node counting by
    # the extended resource), and the device capacity that is GPU memory.
    dra_class: str | None = None
    dra_capacity: str = "memory"
    # ...and how the sidecars tell a GPU allocation (passed on to them in DRA mode).
    dra_drivers: tuple[str, ...] = (NVIDIA_DRIVER,)
    dra_uuid_attribute: str = "uuid"
    # What a pod's annotations may loosen, cluster-wide and per namespace.
    tenancy: Tenancy = dataclasses.field(default_factory=Tenancy)
    # Whether KAI Scheduler's annotations (gpu-memory, gpu-fraction, ...) declare VRAM too.
    kai_annotations: bool = False
    # The extended resources that give a container a GPU (`undeclared` reads them).
    gpu_resources: tuple[str, ...] = GPU_RESOURCES
    # Whether each declaring container gets the allocation gate's seccomp profile.
    allocation_gate: bool = False


class Denied(Exception):
    """The pod cannot be admitted; the message tells the user what to change."""


def deny_sidecar_name(spec: Mapping[str, object], pod_that: str) -> None:
    """Deny a container under the sidecar's name in a pod that the webhook admits without
    injecting it (one that `pod_that` says why): the node agent reads the sidecar's
    environment, in an opted-in namespace, as the webhook wrote it. Read before the pod's
    shape is checked: such a pod is not ours to judge otherwise."""
    for spec_field in shapes.CONTAINER_FIELDS:
        if any(as_map(c).get("name") == SIDECAR for c in as_list(spec.get(spec_field))):
            raise Denied(
                f"spec.{spec_field}: a container is named {SIDECAR!r}, the name of the "
                f"enforcer's sidecar, in a pod that {pod_that}; rename it"
            )


def containers(spec: PodSpec) -> Iterator[Container]:
    """Init containers, then containers: every one that the sidecar may have to enforce."""
    for _, c in containers_at(spec):
        yield c


def containers_at(spec: PodSpec) -> Iterator[tuple[Path, Container]]:
    """Each container with its path in the pod: `("spec", "containers", 0)`."""
    for i, c in enumerate(spec.get("initContainers") or ()):
        yield ("spec", "initContainers", i), c
    for i, c in enumerate(spec.get("containers") or ()):
        yield ("spec", "containers", i), c


def as_map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def capability(added: object) -> str:
    """A capability a container adds, as the runtimes read it (any case, `CAP_` or not):
    its name without the prefix."""
    return str(added).upper().removeprefix("CAP_")


Path = tuple[str | int, ...]  # map keys and list indexes, from the pod down

# The annotations of ours that a pod may carry.
INJECT = "vram-enforcer.io/inject"
INJECTED = "vram-enforcer.io/injected"
SHM_SIZE = "vram-enforcer.io/shm-size"
METRICS_PORT_ANNOTATION = "vram-enforcer.io/metrics-port"
CEILING = "vram-enforcer.io/vram-ceiling"
