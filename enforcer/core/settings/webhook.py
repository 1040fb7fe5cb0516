"""`vram-enforcer webhook`'s settings: the command line only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.admission import AdmissionSettings
from enforcer.core.parsing import (
    ConfigError,
    as_text,
    choice,
    parse_bytes,
    parse_duration,
    parse_names,
    parse_port,
    parse_quantity,
    parse_resource_name,
)
from enforcer.core.pod_resources import GPU_RESOURCES as DEFAULT_GPU_RESOURCES
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import (
    DRA_CAPACITY,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    RESOURCE_NAME,
    allocation_gate,
    kubeconfig,
    log_format,
    metrics_address,
    metrics_port,
    resource_unit,
)
from enforcer.core.tenancy import (
    DENY,
    UNDECLARED_GPU,
    Bounds,
    Tenancy,
    check_defaults,
    parse_action_name,
    parse_namespace_bounds,
)


def _image(text: str, field: str) -> str:
    if not text.strip():
        raise ConfigError(field, text, "is empty; give the enforcer's image")
    return text.strip()


def _shm_default(text: str, field: str) -> str:
    if text not in ("auto", "off"):
        parse_bytes(text, field)
    return text


def _cpu(text: str, field: str) -> str:
    """A CPU request the API server takes: with a negative one, it would refuse every pod
    given the sidecar."""
    if parse_quantity(text, field) < 0:
        raise ConfigError(field, text, "is negative; a CPU request is 0 or more, such as 10m")
    return text


def _memory(text: str, field: str) -> str:
    parse_bytes(text, field)
    return text


def _tenant_actions(text: str, field: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(
            field, text, "is empty; list the actions pods may choose, e.g. terminate,kill,restart"
        )
    return tuple(dict.fromkeys(parse_action_name(name, field) for name in names))


def _gpu_resources(text: str, field: str) -> tuple[str, ...]:
    names = parse_names(text.replace(" ", ""), field)
    if not names:
        example = ",".join(DEFAULT_GPU_RESOURCES)
        raise ConfigError(field, text, f"is empty; list the GPU resources, e.g. {example}")
    return tuple(dict.fromkeys(parse_resource_name(name, field) for name in names))


def _namespace_bounds(text: str, field: str) -> str:
    parse_namespace_bounds(text, field, Bounds())  # checked here; built with the defaults below
    return text


TLS_CERT_FILE = value(
    "tls_cert_file",
    as_text,
    "PEM serving certificate (reloaded on change)",
    flag="--tls-cert-file",
    metavar="FILE",
    required="give the serving certificate (PEM)",
    doc="PEM serving certificate. Re-read within a second of a change on disk (a cert-manager "
    "rotation swaps a Secret's files); new connections get the new certificate, "
    "connections in flight finish on the old one. A pair that does not load yet (half "
    "written) is retried, and the last good one stays in use",
)
TLS_KEY_FILE = value(
    "tls_key_file",
    as_text,
    "PEM private key (reloaded on change)",
    flag="--tls-key-file",
    metavar="FILE",
    required="give the certificate's private key (PEM)",
)
PORT = value(
    "port",
    parse_port,
    "HTTPS port",
    flag="--port",
    default="8443",
    metavar="PORT",
    doc="HTTPS, TLS 1.2 or later",
)
ADDRESS = value(
    "address",
    as_text,
    "the address to listen on",
    flag="--address",
    default="0.0.0.0",  # noqa: S104 - the API server calls it from outside the pod
    metavar="ADDR",
)
SIDECAR_IMAGE = value(
    "sidecar_image",
    _image,
    "the enforcer image to inject",
    flag="--sidecar-image",
    metavar="IMAGE",
    required="give the enforcer's image",
)
SIDECAR_MODE = value(
    "sidecar_mode",
    choice("native", "container", "auto"),
    "native (Kubernetes >= 1.29), container, or auto (by the API server's version)",
    flag="--sidecar-mode",
    default="auto",
    metavar="native|container|auto",
    doc="`native`: first of `initContainers` with `restartPolicy: Always` (Kubernetes ≥ 1.29), "
    "so Jobs complete and the enforcer starts before the workload. `container`: appended "
    "to `containers` (the sidecar then exits by itself when the others finish). `auto`: "
    "read the API server's version once at start-up (`GET /version`, needs no RBAC) and "
    "choose. The chart resolves `auto` itself, so that the webhook needs no API access",
)
RESOURCE_UNIT = resource_unit(
    "bytes per unit, as for the agent. A limit must be a whole number of units"
)
FRAMEWORK_ENV = switch(
    "framework_env",
    "--no-framework-env",
    "do not set XLA_PYTHON_CLIENT_PREALLOCATE=false and TF_FORCE_GPU_ALLOW_GROWTH=true",
    doc="do not add `XLA_PYTHON_CLIENT_PREALLOCATE=false` and `TF_FORCE_GPU_ALLOW_GROWTH=true`",
)
ALLOCATION_GATE = allocation_gate(
    "give declaring containers the allocation gate's seccomp profile (experimental)",
    "`on`: each declaring container of a pod that is enforced (not `warn` or `dry-run`) "
    "whose seccomp profile is unset or `RuntimeDefault` gets `Localhost` "
    "`vram-enforcer/gpu-v1.json`, the profile the node agent writes with its own "
    "`--allocation-gate on`: RuntimeDefault's allowlist, and its driver allocations checked "
    'against its ceiling before they run (docs/architecture.md, "The allocation gate on '
    'Kubernetes"). Never the sidecar, a privileged container, one that adds a capability '
    "outside the runtime's default set (those `baseline` allows are in it) or one with a "
    "profile of its own: each such container is said in a warning, and sampling "
    "holds it. Every node the pods may run on needs the agent with the gate on (its file "
    "missing, a container fails to start with `CreateContainerError`). The sidecar of a pod "
    "with a container under the profile (given here, or its own) gets "
    "`VRAM_ENFORCER_ALLOCATION_GATE=on`: it holds a second copy of the pod's listener fds. "
    "Experimental, unverified on a GPU",
)
TOOLKIT_LIMITS = switch(
    "toolkit_limits",
    "--toolkit-memory-limits",
    "also set NVIDIA_GPU_MEMORY_LIMIT (MiB) for the NVIDIA container toolkit's hook",
    doc="also set `NVIDIA_GPU_MEMORY_LIMIT` on each "
    "declaring container: what it is owed on each of its GPUs (its ceiling; a share spread "
    "over N GPUs, one share), in whole MiB, rounded down. The NVIDIA container toolkit's "
    "`apply-cuda-memory-limits` CDI hook (toolkit v1.20.1+) then sets that hard limit, with "
    "soft limit 0, on the container's cgroup on each GPU it was given, as the container is "
    "created. On or off, the webhook removes every copy of these variables a pod wrote in "
    "`env` and gives every container of the pods it mutates (init, regular, ephemeral) "
    "exactly one `NVIDIA_GPU_MEMORY_REQUEST=0`, declaring or not: a container's `env` wins "
    "over `envFrom` and the image, so no soft limit (a reservation that outlives the "
    "container's cgroup) reaches the hook from either; a `NVIDIA_GPU_MEMORY_LIMIT` from "
    "them still does where the webhook writes none, a limit the container puts on itself "
    "that the agent leaves as a foreign limit and sampling still holds (security.md). Off by "
    "default: where that hook runs, a driver before R615, cgroup v1, or a limit above a "
    "GPU's memory makes it fail the container's creation. The node agent's "
    "`--hard-limits auto` does the same without those failures",
)
SHM_DEFAULT = value(
    "shm_default",
    _shm_default,
    "the shared memory of pods without the shm-size annotation: auto, off, or a quantity",
    flag="--shm-default",
    default="auto",
    metavar="auto|off|QUANTITY",
    doc="`/dev/shm` for pods without the `shm-size` annotation (below)",
)
GPU_EXPOSURE = value(
    "gpu_exposure",
    choice("none", "env"),
    "none, or env: NVIDIA_VISIBLE_DEVICES=all on declaring containers (see docs/security.md)",
    flag="--gpu-exposure",
    default="none",
    metavar="none|env",
    doc="`env`: set `NVIDIA_VISIBLE_DEVICES=all` and `NVIDIA_DRIVER_CAPABILITIES=compute,utility` "
    "on declaring containers (unless set), for clusters where pods request only VRAM and "
    "not `nvidia.com/gpu`. Read [security.md](security.md) first",
)
DRA_DEVICE_CLASS = value(
    "dra_device_class",
    as_text,
    "DRA mode: declared VRAM becomes a claim on this DeviceClass, placed per GPU",
    flag="--dra-device-class",
    env="VRAM_ENFORCER_DRA_DEVICE_CLASS",
    metavar="NAME",
    doc="DRA mode (Kubernetes 1.36+, a DRA driver with consumable capacity): a container's "
    "`limits: {vram-enforcer.io/vram: 16Gi}` becomes a ResourceClaim of 16Gi of this "
    "DeviceClass's memory (`gpu.nvidia.com` for NVIDIA's driver), made from the template "
    "`vram-enforcer-16gi` of the pod's namespace, and the extended resource is removed, so "
    "the scheduler places the pod by GPU. Admission writes nothing: the webhook makes a "
    "missing template from the pending pods it marked, in namespaces that opted in, at most "
    "32 sizes per namespace (the pod waits for it a moment). Pods with claims of their "
    "own get the sidecar too. The sidecars take their limits from the claims (`--limits-from "
    "dra`). Unset: per-node counting by the extended resource "
    "(see [install.md](install.md#vram-per-gpu-dra))",
)
RUNTIME_CLASS = value(
    "runtime_class",
    as_text,
    "with --gpu-exposure env: set this runtimeClassName",
    flag="--runtime-class",
    metavar="NAME",
    doc="with `--gpu-exposure env`: set `runtimeClassName` (unless set), e.g. `nvidia`",
)
SIDECAR_CPU = value(
    "sidecar_cpu",
    _cpu,
    "the sidecar's CPU request",
    flag="--sidecar-cpu",
    default="10m",
    metavar="QUANTITY",
)
SIDECAR_MEMORY = value(
    "sidecar_memory",
    _memory,
    "the sidecar's memory request and limit",
    flag="--sidecar-memory",
    default="48Mi",
    metavar="QUANTITY",
    doc="the sidecar's memory request and limit (what it uses, measured: "
    "[performance.md](performance.md#sidecar))",
)
TENANT_ACTIONS = value(
    "tenant_actions",
    _tenant_actions,
    "the actions a pod may choose with vram-enforcer.io/action (comma-separated)",
    flag="--tenant-actions",
    default="terminate,kill,restart",
    metavar="ACTIONS",
    doc="the actions a pod may choose with the `vram-enforcer.io/action` annotation; a pod "
    "that asks for another is denied. `warn` is left out by default: it only reports, so a "
    "tenant allowed it may stay over its limit",
)
MAX_GRACE_PERIOD = value(
    "max_grace_period",
    parse_duration,
    "the longest grace period a pod may ask for with vram-enforcer.io/grace-period",
    flag="--max-grace-period",
    default="30s",
    metavar="DURATION",
    doc="the longest grace period (SIGTERM to SIGKILL) a pod may ask for with the "
    "`vram-enforcer.io/grace-period` annotation; a pod that asks for more is denied",
)
ALLOW_OPT_OUT = switch(
    "allow_opt_out",
    "--allow-opt-out",
    'honour vram-enforcer.io/inject: "false" on pods that declare VRAM',
    doc='honour `vram-enforcer.io/inject: "false"` on a pod that declares VRAM (it then runs '
    "unenforced). Off by default: such a pod is denied, since it is scheduled for VRAM it "
    "would not be held to",
)
MAX_VRAM_CEILING = value(
    "max_vram_ceiling",
    parse_bytes,
    "the highest ceiling a container may borrow up to with vram-enforcer.io/vram-ceiling "
    "(0: no borrowing above requests)",
    flag="--max-vram-ceiling",
    default="0",
    metavar="QUANTITY",
    doc="the highest ceiling a container may borrow GPU memory up to, above its request, "
    "with the `vram-enforcer.io/vram-ceiling` annotation; a pod that asks for more is "
    "denied. `0` (the default) allows no borrowing. Set it to your GPUs' memory (e.g. "
    "`80Gi`) to let tenants burst into free memory: the node agent takes it back when a "
    "neighbour needs it",
)
KAI_ANNOTATIONS = switch(
    "kai_annotations",
    "--kai-annotations",
    "also enforce what KAI Scheduler's annotations declare (gpu-memory, gpu-fraction, ...)",
    doc="also enforce the GPU share that KAI Scheduler's annotations declare: `gpu-memory` "
    "(MiB) or `gpu-fraction`, on each of `gpu-fraction-num-devices` GPUs, on the container "
    "`gpu-fraction-container-name` names (the first container by default), and the NvFractions "
    "form `nvidia.com/container.<name>.gpu-memory.request`. Their limits above the request "
    "(`gpu-memory.limit`, `gpu-fraction.limit`, "
    "`kai.scheduler/container.<name>.gpu-memory.portion.limit`, "
    "`nvidia.com/container.<name>.gpu-memory.limit`) are ceilings, within "
    "`--max-vram-ceiling`. Read at admission only; a fraction counts against the memory of the "
    "node's smallest GPU as KAI counts it (whole MiB, floored to a multiple of 100). Node mode "
    "only (not with `--dra-device-class`)",
)
DEFAULT_ACTION = value(
    "default_action",
    parse_action_name,
    "the action of a pod without vram-enforcer.io/action: terminate, kill, restart, warn or "
    "dry-run",
    flag="--default-action",
    default="terminate",
    metavar="ACTION",
    doc="the action of a pod without the `vram-enforcer.io/action` annotation. `dry-run`: the "
    "sidecar and the node agent decide as they would for `terminate` and signal nothing, "
    "only report what they would have done (the sidecar's `VRAM_ENFORCER_DRY_RUN`); `warn` "
    "reports the excursion. A pod's annotation may still choose another action within "
    "`--tenant-actions` (by default only enforcing ones: a pod can be stricter than a "
    "report-only default, never laxer). How to roll a namespace out with it: "
    "[install.md](install.md#rolling-out-observe-then-enforce)",
)
GPU_RESOURCES = value(
    "gpu_resources",
    _gpu_resources,
    "the extended resources that give a container a GPU (comma-separated)",
    flag="--gpu-resources",
    default=",".join(DEFAULT_GPU_RESOURCES),
    metavar="NAMES",
    doc="the extended resources that give a container a GPU, comma-separated: NVIDIA's device "
    "plugin's, and the name it gives time-sliced replicas with `renameByDefault` "
    "(`nvidia.com/gpu.shared`). Add your MIG profiles' `.shared` names where MIG slices are "
    "time-sliced. A container that asks for one of them and declares no VRAM is handled as "
    "`--undeclared-gpu` says",
)
UNDECLARED = value(
    "undeclared_gpu",
    choice(*UNDECLARED_GPU),
    "a container that asks for a GPU (--gpu-resources) and declares no VRAM: deny, observe, "
    "or default (declared with --default-vram)",
    flag="--undeclared-gpu",
    default=DENY,
    metavar="|".join(UNDECLARED_GPU),
    doc="what becomes of a container (init containers too) that asks for one of "
    "`--gpu-resources` and declares no VRAM. `deny`: the pod is denied, the message names the "
    "container and the fix. `default`: it is declared with `--default-vram`, written into its "
    "`resources.limits` as a LimitRange writes a default (so the scheduler counts it), and "
    "enforced as any declaring container. `observe`: admitted as it is (as before 0.3): the "
    "node agent accounts for the memory it holds. `deny` is the default: on a shared GPU such "
    "a container would run unlimited beside pods that are held to their limits. Admission "
    "sees pods when they are created: running pods are not touched. See "
    "[install.md](install.md#upgrading) before upgrading",
)
DEFAULT_VRAM = value(
    "default_vram",
    parse_bytes,
    "with --undeclared-gpu default: the VRAM a container that asks for a GPU is declared "
    "with (0: none)",
    flag="--default-vram",
    default="0",
    metavar="QUANTITY",
    doc="with `--undeclared-gpu default` (cluster-wide or in a namespace's bounds): the VRAM "
    "each container that asks for a GPU and declares none is declared with, e.g. `8Gi`; a "
    "whole number of `--resource-unit`s. `0`: none (then `default` cannot be chosen)",
)
NAMESPACE_BOUNDS = value(
    "namespace_bounds",
    _namespace_bounds,
    "per-namespace settings, JSON: {NAMESPACE: {actions, maxGracePeriod, allowOptOut, "
    "maxCeiling, defaultAction, undeclaredGpu, defaultVram}}",
    flag="--namespace-bounds",
    default="{}",
    metavar="JSON",
    doc='per-namespace settings that replace the cluster-wide ones, e.g. `{"research": '
    '{"actions": ["warn", "terminate"], "maxGracePeriod": "2m", "allowOptOut": true, '
    '"maxCeiling": "40Gi", "defaultAction": "dry-run", "undeclaredGpu": "default", '
    '"defaultVram": "8Gi"}}`; the keys stand for `--tenant-actions`, `--max-grace-period`, '
    "`--allow-opt-out`, `--max-vram-ceiling`, `--default-action`, `--undeclared-gpu` and "
    "`--default-vram`, and a key left out keeps the cluster-wide value",
)
KUBECONFIG = kubeconfig("in-cluster", doc="for `--sidecar-mode auto` and `--dra-device-class`")
METRICS_PORT = metrics_port(
    "serve Prometheus metrics on this port",
    doc="`vram_enforcer_admission_requests_total{result}`, "
    "`vram_enforcer_admission_duration_seconds`, "
    "`vram_enforcer_webhook_certificate_reloads_total{result}`",
)
METRICS_ADDRESS = metrics_address("0.0.0.0")  # noqa: S104 - scraped from other pods
LOG_FORMAT = log_format("json")
VERBOSE = verbosity("info")

DECLARED: tuple[Setting[Any], ...] = (
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    PORT,
    ADDRESS,
    SIDECAR_IMAGE,
    SIDECAR_MODE,
    RESOURCE_NAME,
    RESOURCE_UNIT,
    FRAMEWORK_ENV,
    TOOLKIT_LIMITS,
    ALLOCATION_GATE,
    SHM_DEFAULT,
    GPU_EXPOSURE,
    DRA_DEVICE_CLASS,
    DRA_CAPACITY,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    RUNTIME_CLASS,
    SIDECAR_CPU,
    SIDECAR_MEMORY,
    TENANT_ACTIONS,
    MAX_GRACE_PERIOD,
    ALLOW_OPT_OUT,
    MAX_VRAM_CEILING,
    KAI_ANNOTATIONS,
    DEFAULT_ACTION,
    GPU_RESOURCES,
    UNDECLARED,
    DEFAULT_VRAM,
    NAMESPACE_BOUNDS,
    KUBECONFIG,
    METRICS_PORT,
    METRICS_ADDRESS,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """Everything `vram-enforcer webhook` needs, validated; see docs/configuration.md."""

    tls_cert_file: str
    tls_key_file: str
    port: int
    address: str
    admission: AdmissionSettings  # its sidecar_mode may still be "auto"
    kubeconfig: str | None
    metrics_port: int | None
    metrics_address: str


def webhook_settings(values: Values) -> WebhookSettings:
    runtime_class = values[RUNTIME_CLASS]
    if values[GPU_EXPOSURE] == "none" and runtime_class:
        raise ConfigError("--runtime-class", runtime_class, "needs --gpu-exposure env")
    if values[DRA_DEVICE_CLASS] and values[GPU_EXPOSURE] == "env":
        raise ConfigError(
            "--gpu-exposure",
            "env",
            (
                "cannot be combined with --dra-device-class: in DRA mode the DRA driver gives each "
                "container the GPU it was allocated; use --gpu-exposure none"
            ),
        )
    if values[DRA_DEVICE_CLASS] and values[KAI_ANNOTATIONS]:
        raise ConfigError(
            "--kai-annotations",
            None,
            (
                "cannot be combined with --dra-device-class: a KAI share is counted per node, not "
                "allocated on one GPU by a claim; leave out one of them"
            ),
        )
    default = Bounds(
        values[TENANT_ACTIONS],
        values[MAX_GRACE_PERIOD],
        values[ALLOW_OPT_OUT],
        values[MAX_VRAM_CEILING],
        values[DEFAULT_ACTION],
        values[UNDECLARED],
        values[DEFAULT_VRAM],
    )
    namespaces = parse_namespace_bounds(values[NAMESPACE_BOUNDS], "--namespace-bounds", default)
    check_defaults(default, None, values[RESOURCE_UNIT])
    for namespace, bounds in namespaces.items():
        check_defaults(bounds, namespace, values[RESOURCE_UNIT])
    return WebhookSettings(
        tls_cert_file=values[TLS_CERT_FILE],
        tls_key_file=values[TLS_KEY_FILE],
        port=values[PORT],
        address=values[ADDRESS],
        admission=AdmissionSettings(
            sidecar_image=values[SIDECAR_IMAGE],
            sidecar_mode=values[SIDECAR_MODE],
            resource_name=values[RESOURCE_NAME],
            resource_unit=values[RESOURCE_UNIT],
            framework_env=values[FRAMEWORK_ENV],
            toolkit_limits=values[TOOLKIT_LIMITS],
            allocation_gate=values[ALLOCATION_GATE] == "on",
            shm_default=values[SHM_DEFAULT],
            gpu_exposure=values[GPU_EXPOSURE],
            runtime_class=runtime_class,
            sidecar_cpu=values[SIDECAR_CPU],
            sidecar_memory=values[SIDECAR_MEMORY],
            dra_class=values[DRA_DEVICE_CLASS] or None,
            dra_capacity=values[DRA_CAPACITY],
            dra_drivers=values[DRA_DRIVERS],
            dra_uuid_attribute=values[DRA_UUID_ATTRIBUTE],
            tenancy=Tenancy(default, namespaces),
            kai_annotations=values[KAI_ANNOTATIONS],
            gpu_resources=values[GPU_RESOURCES],
        ),
        kubeconfig=values[KUBECONFIG],
        metrics_port=values[METRICS_PORT],
        metrics_address=values[METRICS_ADDRESS],
    )
