"""`vram-enforcer agent`'s settings: flags, and NODE_NAME and POD_NAMESPACE from the Downward
API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.dra import DraSettings
from enforcer.core.parsing import (
    ConfigError,
    absolute_path,
    as_text,
    duration_or_off,
    parse_bytes,
    parse_duration,
    parse_names,
    positive_duration,
)
from enforcer.core.pod_resources import GPU_RESOURCES as DEFAULT_GPU_RESOURCES
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import (
    DEFAULT_SOCKET,
    DRA_CAPACITY,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    POD_RESOURCES_SOCKET,
    RESOURCE_NAME,
    allocation_gate,
    dra_settings,
    hard_limits,
    interval,
    kubeconfig,
    log_format,
    metrics_address,
    metrics_port,
    reclaim_watermark,
    resource_unit,
)

NODE_NAME = value(
    "node_name",
    as_text,
    "this node's name",
    flag="--node-name",
    env="NODE_NAME",
    metavar="NAME",
    doc="the Node to advertise on. Set `NODE_NAME` from the Downward API (`spec.nodeName`). "
    "Not needed with `--no-advertise`, `--no-labels`, `--no-serve-pods` and "
    "`--hard-limits off`",
)
POD_NAMESPACE = value(
    "namespace",
    as_text,
    "the agent's own namespace",
    flag="--namespace",
    env="POD_NAMESPACE",
    metavar="NAME",
    doc="the agent's own namespace (the chart's; set `POD_NAMESPACE` from the Downward API, "
    "`metadata.namespace`), which the webhook never mutates: a pod's sidecar environment is "
    "read only on pods of the namespaces labelled `vram-enforcer.io/inject=enabled`, never "
    "this one, whatever its labels. Unset: none is left out by name",
)
SOCKET = value(
    "socket",
    as_text,
    "usage socket",
    flag="--socket",
    default=DEFAULT_SOCKET,
    metavar="PATH",
    doc="the usage socket. The directory is created, and a stale socket is replaced. A live "
    "socket, or a path that is not a socket, stops the agent with status 2",
)
INTERVAL = interval(
    "NVML sampling interval", "one NVML pass per interval, shared by every caller (at least `10ms`)"
)
UTILIZATION_INTERVAL = value(
    "utilization_interval",
    duration_or_off(0.1),
    "how often per-process GPU utilisation is read (0: never)",
    flag="--utilization-interval",
    default="1s",
    metavar="DURATION",
    doc="how often each process's SM and memory-bandwidth utilisation is read from NVML "
    "(at least `100ms`; `0` turns it off). Sidecars get it with the usage and export it per "
    "container and GPU. Between reads the last one stands: the driver samples no faster",
)
RESERVE = value(
    "reserve",
    parse_bytes,
    "VRAM per GPU (or MIG partition) kept out of the advertised capacity",
    flag="--reserve",
    default="0",
    metavar="QUANTITY",
    doc="memory kept out of the capacity, per GPU (or per MIG partition)",
)
ADVERTISE = switch(
    "advertise",
    "--no-advertise",
    "do not write node capacity",
    doc="do not write `status.capacity` / `status.allocatable`",
)
LABELS = switch(
    "labels",
    "--no-labels",
    "do not write node labels",
    doc="do not write the `vram-enforcer.io/gpu.*` labels",
)
SERVE_PODS = switch(
    "serve_pods",
    "--no-serve-pods",
    "do not serve each sidecar its own pod",
    doc="do not serve each sidecar its own pod (and, with DRA, its claims and this node's "
    "slices) from the agent's one watch of this node's pods, and neither connect to the "
    "sidecars that wait for it (`--listen`, as the webhook injects them: they then get no "
    "usage and enforce nothing) nor post any sidecar's Events; a sidecar that connects to "
    "`--socket` itself then enforces its pod's only container, or only checks its total. "
    "Serving needs "
    "`--node-name` and RBAC to list and watch pods (and, with DRA, to get ResourceClaims "
    "and list ResourceSlices)",
)
RESOURCE_UNIT = resource_unit(
    "bytes per unit. With `1Gi`, the agent advertises whole GiB, "
    "rounded down, and a limit of `3` means 3 GiB"
)
RECLAIM_WATERMARK = reclaim_watermark(
    "free GPU memory kept while containers borrow above their requests",
    "free memory each GPU must keep, beyond what its containers' requests are still owed, "
    "while any container borrows above its request there (up to the ceiling of its pod's "
    "`vram-enforcer.io/vram-ceiling`); below it, the agent asks the borrowers' sidecars to "
    "give memory back",
)
RESYNC = value(
    "resync",
    positive_duration(1.0),
    "how often the Node is re-checked",
    flag="--resync",
    default="60s",
    metavar="DURATION",
    doc="how often the Node is read back and corrected. A change in the GPUs triggers a sync "
    "at once",
)
KUBECONFIG = kubeconfig("in-cluster config, then `~/.kube/config`")
METRICS_PORT = metrics_port(
    "serve Prometheus metrics (and /healthz) on this port",
    doc="serve Prometheus metrics, and `/healthz` (503 once no NVML pass has completed for 60 s)",
)
METRICS_ADDRESS = metrics_address("0.0.0.0")  # noqa: S104 - scraped from other pods
PER_PROCESS_METRICS = switch(
    "per_process_metrics",
    "--per-process-metrics",
    "also serve each GPU process's memory (a series per pid)",
    doc="also serve `vram_enforcer_process_used_bytes`, each GPU process's memory on each GPU "
    "(labelled by its host pid). Off by default: the number of series grows with pids, and "
    "each restart of a process leaves a series behind in Prometheus",
)
HOST_PROC = value(
    "host_proc",
    as_text,
    "the host's /proc",
    flag="--host-proc",
    default="/proc",
    metavar="PATH",
    doc="the host's `/proc` (the agent checks that it belongs to the initial PID namespace)",
)
HARD_LIMITS = hard_limits(
    ("auto", "off"),
    "`auto`: hold each pod bound to this node (and each of its containers) to its declared "
    "limit on every GPU, through the driver's per-cgroup limits, where the driver can "
    "(R615+), soft limit 0; one Event per pod says which tier holds each container. A "
    "limit someone else set (NVIDIA's hook, an operator) is left as it is and said "
    "(`VRAMForeignLimit`); a pod that gpu-fractioning serves gets none. A pod only "
    "reported on (`warn`, `dry-run`) gets none: the driver's refusal would enforce it. "
    "`off`: sampling only. Needs "
    "`--node-name`, RBAC to list and watch pods and to create Events, root, and the host's "
    "cgroup v2 mount at `--cgroup-root`",
)
CGROUP_ROOT = value(
    "cgroup_root",
    as_text,
    "the host's cgroup v2 mount",
    flag="--cgroup-root",
    default="/sys/fs/cgroup",
    metavar="PATH",
    doc="where the host's cgroup v2 hierarchy is mounted in this container (on a hybrid "
    "host, its `unified` directory is used); the kubelet's pod cgroups (`kubepods.slice` or "
    "`kubepods`) are found below it. NVML is given these paths",
)
CGROUP_SCAN = value(
    "cgroup_scan",
    positive_duration(0.05),
    "how often the pod cgroups are looked for",
    flag="--cgroup-scan",
    default="1s",
    metavar="DURATION",
    doc="how often the kubelet's pod and container cgroups are scanned for new ones (a pod "
    "change, and a new cgroup that the agent's inotify watch sees, trigger a scan at once). "
    "Where the watch falls back (the agent's log says when), a new cgroup gets its limit "
    "within this long",
)
EVICTION_TIMEOUT = value(
    "eviction_timeout",
    parse_duration,
    "how long a pod's eviction may be refused before it is deleted",
    flag="--eviction-timeout",
    default="1m",
    metavar="DURATION",
    doc="a pod over its limit whose process the kernel will not let the agent signal (a "
    "security module refuses it) is evicted through the API (policy/v1 `Eviction`), which "
    "its PodDisruptionBudgets may refuse, for ever if one allows no disruption. Once the "
    "eviction has been refused this long, the pod is deleted instead, whatever its budgets, "
    "as the kubelet's node-pressure eviction stops a pod (a `VRAMEvicted` Event says so). "
    "Its containers get the grace period of the pod's policy either way. `0`: delete at "
    "once. Needs RBAC to create `pods/eviction` and to delete `pods`",
)
GPU_RESOURCES: Setting[tuple[str, ...]] = value(
    "gpu_resources",
    parse_names,
    "device plugin resources that are GPUs",
    flag="--gpu-resources",
    default=",".join(DEFAULT_GPU_RESOURCES),
    metavar="NAMES",
    doc="the device plugins' resources whose devices are GPUs, comma-separated; by default "
    "the webhook's `--gpu-resources` (time-slicing's renamed `nvidia.com/gpu.shared` "
    "included). NVIDIA's device plugin names a GPU by its UUID, a time-sliced or MPS "
    "replica by `UUID::n`, or by its index: a container whose devices all name one GPU is "
    "owed its request there",
)
ALLOCATION_GATE = allocation_gate(
    "check gated containers' GPU allocations before they run (experimental)",
    "`on`: write the allocation gate's seccomp profile under `--kubelet-root` and serve "
    "its listener socket beside `--socket` (`seccomp.sock`): a container the webhook gave the "
    "profile has each driver allocation checked against its ceiling before it runs, and one "
    "past it gets the driver's out-of-memory status (docs/architecture.md, \"The allocation "
    'gate on Kubernetes"). Experimental, unverified on a GPU. Where the gate cannot run '
    "(no NVIDIA device, another architecture, a kernel before 5.5 or without seccomp's "
    "user notification, `kernel.yama.ptrace_scope=3`) the same file holds RuntimeDefault's "
    "allowlist alone. Needs the pods served (not `--no-serve-pods`), root and the host's "
    "PID namespace",
)
ALLOCATION_GATE_UNPROVEN = switch(
    "allocation_gate_unproven",
    "--allocation-gate-unproven",
    "run the allocation gate on a driver branch no GPU run has proven",
    doc="with `--allocation-gate on`, run the gate even where the driver's branch is not in "
    "`rm_abi.PROVEN_BRANCHES` (the branches on which `tests/gpu/offline.sh gate` showed a "
    "refusal reaching CUDA as out-of-memory; none yet). Without it such a node gets the "
    "plain profile and the label `vram-enforcer.io/allocation-gate=unproven`; with it, the "
    "gating profile and the label `forced` (never `v1`). For trying the gate on a "
    "test node",
)
KUBELET_ROOT = value(
    "kubelet_root",
    absolute_path,
    "the kubelet's root directory",
    flag="--kubelet-root",
    default="/var/lib/kubelet",
    metavar="PATH",
    doc="the kubelet's `--root-dir` as this container sees it (the chart mounts its "
    "`seccomp/vram-enforcer` directory at the same path): the allocation gate's profile is "
    "written to `seccomp/vram-enforcer/gpu-v1.json` below it",
)
LOG_FORMAT = log_format("json")
VERBOSE = verbosity("info")

DECLARED: tuple[Setting[Any], ...] = (
    NODE_NAME,
    POD_NAMESPACE,
    SOCKET,
    INTERVAL,
    UTILIZATION_INTERVAL,
    RESERVE,
    ADVERTISE,
    LABELS,
    SERVE_PODS,
    RESOURCE_NAME,
    RESOURCE_UNIT,
    RECLAIM_WATERMARK,
    RESYNC,
    KUBECONFIG,
    METRICS_PORT,
    METRICS_ADDRESS,
    PER_PROCESS_METRICS,
    HOST_PROC,
    HARD_LIMITS,
    CGROUP_ROOT,
    CGROUP_SCAN,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    DRA_CAPACITY,
    POD_RESOURCES_SOCKET,
    GPU_RESOURCES,
    EVICTION_TIMEOUT,
    ALLOCATION_GATE,
    ALLOCATION_GATE_UNPROVEN,
    KUBELET_ROOT,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything `vram-enforcer agent` needs, validated."""

    node_name: str
    namespace: str  # the agent's own: no pod's sidecar environment there is read ("": unknown)
    socket: str
    interval: float
    utilization_interval: float | None  # None: per-process utilisation is not read
    reserve_bytes: int
    advertise: bool
    labels: bool
    serve_pods: bool  # each sidecar's pod from this agent's watch (sidecars read no API)
    resource_name: str
    resource_unit: int
    reclaim_watermark: int
    resync: float
    kubeconfig: str | None
    metrics_port: int | None
    metrics_address: str
    per_process_metrics: bool
    host_proc: str
    hard_limits: bool
    cgroup_root: str
    cgroup_scan: float
    dra: DraSettings  # hard limits for pods with DRA claims: which allocations are GPUs
    pod_resources_socket: str  # "": the kubelet's assignments are not read
    gpu_resources: tuple[str, ...]
    eviction_timeout: float  # s: how long an eviction may be refused before the pod is deleted
    allocation_gate: str = "off"  # "on": the allocation gate's profile and listener
    allocation_gate_unproven: bool = False  # run it on a driver branch not proven
    kubelet_root: str = "/var/lib/kubelet"

    @property
    def uses_api(self) -> bool:
        return self.advertise or self.labels or self.hard_limits or self.serve_pods

    @property
    def watches_pods(self) -> bool:
        return self.hard_limits or self.serve_pods


def agent_settings(values: Values) -> AgentSettings:
    advertise, labels, node_name = values[ADVERTISE], values[LABELS], values[NODE_NAME]
    hard = values[HARD_LIMITS] == "auto"
    if (advertise or labels or hard or values[SERVE_PODS]) and not node_name:
        raise ConfigError(
            "--node-name",
            None,
            "is missing; set it, or NODE_NAME from the Downward API (spec.nodeName), "
            "or pass --no-advertise, --no-labels, --no-serve-pods and --hard-limits off",
        )
    if values[ALLOCATION_GATE] == "on" and not values[SERVE_PODS]:
        raise ConfigError(
            "--allocation-gate",
            "on",
            "needs the pods served (each container's ceiling comes from them); "
            "drop --no-serve-pods, or set --allocation-gate off",
        )
    return AgentSettings(
        node_name=node_name or "",
        namespace=values[POD_NAMESPACE] or "",
        socket=values[SOCKET],
        interval=values[INTERVAL],
        utilization_interval=values[UTILIZATION_INTERVAL],
        reserve_bytes=values[RESERVE],
        advertise=advertise,
        labels=labels,
        serve_pods=values[SERVE_PODS],
        resource_name=values[RESOURCE_NAME],
        resource_unit=values[RESOURCE_UNIT],
        reclaim_watermark=values[RECLAIM_WATERMARK],
        resync=values[RESYNC],
        kubeconfig=values[KUBECONFIG],
        metrics_port=values[METRICS_PORT],
        metrics_address=values[METRICS_ADDRESS],
        per_process_metrics=values[PER_PROCESS_METRICS],
        host_proc=values[HOST_PROC],
        hard_limits=hard,
        cgroup_root=values[CGROUP_ROOT],
        cgroup_scan=values[CGROUP_SCAN],
        dra=dra_settings(values),
        pod_resources_socket=values[POD_RESOURCES_SOCKET],
        gpu_resources=values[GPU_RESOURCES],
        eviction_timeout=values[EVICTION_TIMEOUT],
        allocation_gate=values[ALLOCATION_GATE],
        allocation_gate_unproven=values[ALLOCATION_GATE_UNPROVEN],
        kubelet_root=values[KUBELET_ROOT],
    )
