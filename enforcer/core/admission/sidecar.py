"""What the webhook puts into a pod that declares VRAM: the sidecar (its environment, read
back by its own settings parser, its socket and its securityContext), a real `/dev/shm`,
and each declaring container's environment (pure)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from enforcer.core.admission.common import (
    SHM_SIZE,
    AdmissionSettings,
    Denied,
    MiB,
    Path,
    containers,
    containers_at,
)
from enforcer.core.admission.patch import Patch, put
from enforcer.core.declaration import (
    LIMITS_ENV,
    LIMITS_FROM_ENV,
    SIDECAR,
)
from enforcer.core.model import Action
from enforcer.core.parsing import (
    ConfigError,
    format_quantity,
    parse_bytes,
)
from enforcer.core.payloads import (
    Container,
    EnvVar,
    PodSpec,
    VolumeMount,
)
from enforcer.core.protocol import SIDECAR_SOCKET, SIDECAR_SOCKET_DIR
from enforcer.core.settings import resolve
from enforcer.core.settings import sidecar as declared
from enforcer.core.settings.common import DRA_CAPACITY, DRA_DRIVERS, DRA_UUID_ATTRIBUTE
from enforcer.core.settings.sidecar import DECLARED as SIDECAR_SETTINGS
from enforcer.core.settings.sidecar import sidecar_settings
from enforcer.core.tenancy import DRY_RUN

SOCKET_VOLUME = "vram-enforcer-socket"


SHM_VOLUME = "vram-enforcer-shm"


NO_TOKEN_VOLUME = "vram-enforcer-no-token"  # noqa: S105 - a volume name, not a secret


TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # noqa: S105 - a path


SHM_DIR = "/dev/shm"  # noqa: S108 - the mount point we provide, not a file we write


# Set on declaring containers unless the user set them: frameworks that grab all of a GPU
# at start-up would otherwise be over their limit before they allocate anything.
FRAMEWORK_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}


# Read by the NVIDIA container toolkit's `apply-cuda-memory-limits` CDI hook (toolkit
# v1.20.1+) from the container's OCI environment, in whole MiB: with both present it sets
# them as the soft and the hard limit of the container's cgroup, one value on each GPU the
# container was given; with either absent it sets nothing. The soft limit is the cgroup's
# `dmem.min`, a reservation the driver adds to every ancestor and that outlives the
# container's cgroup (NVIDIA's MPS v3 page): ours is 0, and the agent lends and reclaims.
TOOLKIT_ENV = ("NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT")


def shm_size_limit(value: str, spec: PodSpec) -> int | None:
    """The /dev/shm sizeLimit in bytes (None: no limit) for `auto` or a quantity."""
    if value == "auto":
        # The largest container memory limit: tmpfs pages count against the container's
        # memory, so more than that could never be used anyway.
        known = [
            m
            for c in spec.get("containers") or ()
            if c["name"] != SIDECAR and (m := _memory_limit(c)) is not None
        ]
        return max(known) if known else None
    try:
        return parse_bytes(value, field=f"metadata.annotations[{SHM_SIZE!r}]")
    except ConfigError as exc:
        raise Denied(f"{exc}; or use auto or off") from None


def _memory_limit(c: Container) -> int | None:
    memory = ((c.get("resources") or {}).get("limits") or {}).get("memory")
    if memory is None:
        return None
    try:
        return parse_bytes(str(memory), field="memory")
    except ConfigError:
        return None  # the API server's own validation will say so


def workload_env(
    patch: Patch,
    where: Path,
    limit: int,
    ceiling: int | None,
    settings: AdmissionSettings,
) -> None:
    """What the workload is told: the most it may use (its ceiling, when it may borrow)
    and what it is guaranteed."""
    env = (*where, "env")
    names = {e.get("name") for e in patch.get(env) or ()}
    most = limit if ceiling is None else ceiling
    ours = {"VRAM_LIMIT_BYTES": str(most)}
    if ceiling is not None:
        ours["VRAM_REQUEST_BYTES"] = str(limit)
    for name, value in ours.items():
        only(patch, env, name, value)
    extra = {**(FRAMEWORK_ENV if settings.framework_env else {})}
    if settings.gpu_exposure == "env" and not _requests_gpus(patch.get(where)):
        extra.update(GPU_ENV)  # a container given GPUs by the device plugin keeps those
    for k, v in extra.items():
        if k not in names:
            patch.append(env, {"name": k, "value": v})


def toolkit_env(patch: Patch, where: Path, per_gpu: int | None) -> None:
    """The toolkit hook's variables on one container, which are the webhook's alone: soft 0
    always, and with `per_gpu` (what the container is owed on each of its GPUs, in bytes)
    that hard limit in whole MiB, rounded down (never above what is owed); without, no hard
    limit in `env`. Every copy the pod's own `env` gives is dropped (the kubelet keeps the
    last of a name). Soft 0 is written even where we set no hard limit: a container's `env`
    wins over `envFrom` and the image's ENV, so a soft limit from either never reaches the
    hook, whose soft limit is a reservation that outlives the container's cgroup."""
    values = ("0", None if per_gpu is None else str(per_gpu // MiB))
    for name, value in zip(TOOLKIT_ENV, values, strict=True):
        only(patch, (*where, "env"), name, value)


def only(patch: Patch, env: Path, name: str, value: str | None) -> None:
    """One entry `name` = `value` in the list of variables at `env` (None: no entry), in
    place of the first the container lists and with every other copy gone: the kubelet
    gives a container the last of a name, so a second copy would win over ours."""
    copies = [i for i, e in enumerate(patch.get(env) or ()) if e.get("name") == name]
    kept = copies[:1] if value is not None else []
    for i in reversed(copies[len(kept) :]):
        patch.remove((*env, i))
    if value is not None:
        put(patch, env, {"name": name, "value": value})


def _requests_gpus(c: Container) -> bool:
    resources = c.get("resources") or {}
    return any(
        key.startswith("nvidia.com/")
        for part in (resources.get("limits") or {}, resources.get("requests") or {})
        for key in part
    )


def add_shm(patch: Patch, size: int | None) -> None:
    spec: PodSpec = patch.get(("spec",))
    missing = [
        where
        for where, c in containers_at(spec)
        if where[1] == "containers"
        and c["name"] != SIDECAR
        and not any(
            str(m.get("mountPath", "")).rstrip("/") == SHM_DIR for m in c.get("volumeMounts") or ()
        )
    ]
    ours = any(v.get("name") == SHM_VOLUME for v in spec.get("volumes") or ())
    if not missing and not ours:
        return
    empty_dir = {"medium": "Memory"}
    if size is not None:
        empty_dir["sizeLimit"] = format_quantity(size)
    put(patch, ("spec", "volumes"), {"name": SHM_VOLUME, "emptyDir": empty_dir})
    for where in missing:
        patch.append((*where, "volumeMounts"), {"name": SHM_VOLUME, "mountPath": SHM_DIR})


def sidecar_variables(
    spec: PodSpec,
    limits: Mapping[str, int],
    settings_env: Mapping[str, str],
    settings: AdmissionSettings,
) -> list[EnvVar]:
    return [
        _field_env(declared.POD_NAME.variable, "metadata.name"),
        _field_env(declared.POD_NAMESPACE.variable, "metadata.namespace"),
        _field_env(declared.POD_UID.variable, "metadata.uid"),
        _field_env(declared.NODE_NAME.variable, "spec.nodeName"),
        {"name": LIMITS_ENV, "value": json.dumps(dict(limits), separators=(",", ":"))},
        {
            "name": declared.CONTAINERS.variable,
            "value": ",".join(c["name"] for c in containers(spec) if c["name"] != SIDECAR),
        },
        *[EnvVar(name=k, value=v) for k, v in {**settings_env, **dra_env(settings)}.items()],
        {"name": declared.LISTEN.variable, "value": SIDECAR_SOCKET},
        {"name": declared.SIDECAR_MODE.variable, "value": settings.sidecar_mode},
    ]


def action_env(action: str) -> dict[str, str]:
    """The sidecar's variables for one of the webhook's actions: `dry-run` is the sidecar's
    dry run of `terminate`, so that it and the node agent decide as they would for it."""
    if action == DRY_RUN:
        return {declared.ACTION.variable: Action.TERMINATE.value, declared.DRY_RUN.variable: "true"}
    return {declared.ACTION.variable: action}


def dra_env(settings: AdmissionSettings) -> dict[str, str]:
    """DRA mode: the sidecar takes its limits from the pod's claims, and tells an
    allocation of a GPU as the webhook's settings say."""
    if settings.dra_class is None:
        return {}
    return {
        LIMITS_FROM_ENV: "dra",
        DRA_DRIVERS.variable: ",".join(settings.dra_drivers),
        DRA_UUID_ATTRIBUTE.variable: settings.dra_uuid_attribute,
        DRA_CAPACITY.variable: settings.dra_capacity,
    }


def check_sidecar_env(env: list[EnvVar]) -> None:
    """Read the sidecar's environment with the sidecar's own settings parser (the agent
    reads it with the same parsers, `declaration.of_pod`), so that the two cannot disagree:
    a value it refuses would leave the pod never started (a native sidecar) or unenforced.
    The Downward API's values stand in as their field paths."""
    environ = {
        e["name"]: e["value"] if "value" in e else e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in env
    }
    try:
        sidecar_settings(resolve(SIDECAR_SETTINGS, {}, environ))
    except ConfigError as exc:
        raise Denied(
            "the sidecar would refuse its settings as this pod's metadata.annotations and spec "
            f"make them: {exc}; change the value it comes from"
        ) from None


def add_sidecar(patch: Patch, env: list[EnvVar], settings: AdmissionSettings) -> None:
    # The sidecar's own socket, which the agent connects to through /proc/<pid>/root: an
    # emptyDir (which every Pod Security level allows) that no other container mounts. (A
    # pod copied from one that 0.1.0 injected may carry the hostPath of the agent's socket
    # under this name: it is replaced.)
    # No API token: the sidecar never calls the API (the agent brings its pod and posts its
    # Events). ServiceAccount admission mounts the pod's token into every container that
    # has nothing mounted at its path, so an empty one is: and since it then finds nothing
    # to add after this webhook, the API server does not call the webhook a second time.
    mounts: list[VolumeMount] = [
        {"name": SOCKET_VOLUME, "mountPath": SIDECAR_SOCKET_DIR},
        {"name": NO_TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    for volume, size in ((SOCKET_VOLUME, "1Mi"), (NO_TOKEN_VOLUME, "1Ki")):
        empty_dir = {"medium": "Memory", "sizeLimit": size}
        put(patch, ("spec", "volumes"), {"name": volume, "emptyDir": empty_dir})
    sidecar: Container = {
        "name": SIDECAR,
        "image": settings.sidecar_image,
        "command": ["vram-enforcer", "sidecar"],
        "env": env,
        "resources": {
            "requests": {"cpu": settings.sidecar_cpu, "memory": settings.sidecar_memory},
            "limits": {"memory": settings.sidecar_memory},
        },
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["KILL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Started once its socket is there, which it makes after closing itself to the
        # workload (not dumpable): a native sidecar's workload starts only then, so it
        # never finds the sidecar open to ptrace in its first second, nor unenforced.
        "startupProbe": {
            "exec": {"command": ["python", "-c", _LISTENING]},
            "periodSeconds": 1,
            "timeoutSeconds": 5,
            "failureThreshold": 120,
        },
    }
    # An earlier pass's sidecar (or a forgery of it) is replaced in place, and leaves the
    # list it does not belong in. A native sidecar goes first: it starts before the workload.
    if settings.sidecar_mode == "native":
        sidecar["restartPolicy"] = "Always"
        _drop_sidecar(patch, "containers")
        put(patch, ("spec", "initContainers"), sidecar, at=0)
    else:
        _drop_sidecar(patch, "initContainers")
        put(patch, ("spec", "containers"), sidecar)


_LISTENING = f"import os, sys; sys.exit(not os.path.exists({SIDECAR_SOCKET!r}))"


def _drop_sidecar(patch: Patch, field: str) -> None:
    listed = patch.get(("spec",)).get(field) or []
    for i in reversed(range(len(listed))):
        if listed[i]["name"] == SIDECAR:
            patch.remove(("spec", field, i))


def _field_env(name: str, path: str) -> EnvVar:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
