"""`vram-enforcer sidecar`'s settings: the environment the webhook sets, flags on top."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from enforcer.core.declaration import (
    CEILINGS_ENV,
    GPUS_ENV,
    LIMITS_ENV,
    LIMITS_FROM_ENV,
    PORTIONS_ENV,
    Declaration,
    Portion,
    encode_portions,
    env_trusted,
    parse_gpus,
    parse_portions,
    sidecar_env,
    spread_over,
)
from enforcer.core.dra import DraSettings
from enforcer.core.model import Action
from enforcer.core.parsing import (
    LIMITS_FORM,
    ConfigError,
    as_text,
    choice,
    parse_limits,
    parse_names,
    positive_duration,
)
from enforcer.core.payloads import Pod
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings import Setting, Values, resolve, value, verbosity
from enforcer.core.settings.common import (
    DEFAULT_SOCKET,
    DRA_CAPACITY,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    PolicySettings,
    action,
    allocation_gate,
    dra_settings,
    dry_run,
    grace_period,
    interval,
    kubeconfig,
    log_format,
    over_for,
    warn_at,
)

SIDECAR_ACTIONS = (Action.TERMINATE, Action.KILL, Action.RESTART, Action.WARN)
_DOWNWARD = "set it from the Downward API (the webhook does)"

POD_NAME = value(
    "pod_name",
    as_text,
    "the sidecar's own pod",
    env="POD_NAME",
    required=_DOWNWARD,
    doc="the sidecar's own pod, from the Downward API (`metadata.name`)",
)
POD_NAMESPACE = value(
    "namespace",
    as_text,
    "the pod's namespace",
    env="POD_NAMESPACE",
    required=_DOWNWARD,
    doc="from the Downward API (`metadata.namespace`)",
)
POD_UID = value(
    "pod_uid",
    as_text,
    "the pod's uid",
    env="POD_UID",
    required=_DOWNWARD,
    doc="from the Downward API (`metadata.uid`)",
)
NODE_NAME = value(
    "node_name",
    as_text,
    "the node",
    env="NODE_NAME",
    default="",
    doc="`spec.nodeName`; the `source.host` of the Events",
)
LIMITS = value(
    "limits",
    parse_limits,
    "container name -> limit in bytes, as JSON",
    flag="--limits",
    env=LIMITS_ENV,
    metavar="JSON",
    shown_default="required unless `--limits-from dra`",
    doc='JSON: container name → limit in bytes, `{"trainer": 12884901888}`. The webhook '
    "writes it from `resources.limits`",
)
PORTIONS = value(
    "portions",
    parse_portions,
    "container name -> its portion of a GPU's memory, and the ceiling above it, as JSON",
    flag="--portions",
    env=PORTIONS_ENV,
    metavar="JSON",
    shown_default="none",
    doc='JSON: container name → `{"request": "0.5", "ceiling": "0.8"}`, portions of one '
    "GPU's memory (the ceiling is optional). The webhook writes it from KAI Scheduler's "
    "`gpu-fraction` annotations (`--kai-annotations`). A portion counts against the memory "
    "of the node's smallest GPU as KAI counts it (whole MiB, floored to a multiple of 100), "
    "and is not checked while NVML shows none. A ceiling needs "
    "`--source agent`, as `--ceilings` does",
)
GPUS = value(
    "gpus",
    parse_gpus,
    "container name -> the number of GPUs its limit is spread over, one share each, as JSON",
    flag="--gpus",
    env=GPUS_ENV,
    metavar="JSON",
    shown_default="none: a limit is a sum over any GPUs",
    doc='JSON: container name → a number of GPUs, `{"trainer": 2}`. The container\'s limit '
    "(in `--limits` or `--portions`), and its ceiling, are cut into that many equal shares, "
    "one held on each of the GPUs where it holds most, and 0 on any other GPU. The webhook "
    "writes it from KAI Scheduler's `gpu-fraction-num-devices`, which puts one share on each "
    "of that many GPUs",
)
CEILINGS = value(
    "ceilings",
    parse_limits,
    "container name -> the ceiling it may borrow up to above its limit, in bytes, as JSON",
    flag="--ceilings",
    env=CEILINGS_ENV,
    metavar="JSON",
    shown_default="none: no borrowing",
    doc='JSON: container name → ceiling in bytes, `{"trainer": 21474836480}`. The webhook '
    "writes it from the pod's `vram-enforcer.io/vram-ceiling` annotation. A container may "
    "hold up to its ceiling while the node agent finds room on its GPU; when the agent "
    "asks for memory back, the sidecar holds it to its limit (`VRAMReclaimed`). With "
    "`--limits-from dra`, a ceiling is on the GPU of the container's one claim, above what "
    "that claim was allocated (a container with claims on several GPUs, or one it shares, "
    "borrows nowhere). Needs `--source agent`",
)
LIMITS_FROM = value(
    "limits_from",
    choice("declared", "dra"),
    "declared (--limits) or dra (the pod's ResourceClaims, per GPU)",
    flag="--limits-from",
    env=LIMITS_FROM_ENV,
    default="declared",
    metavar="declared|dra",
    doc="`declared`: each container's limit is `--limits`, over all GPUs. `dra`: a limit per "
    "container and GPU, what the scheduler allocated to the container's ResourceClaims on that "
    "GPU (`consumedCapacity`); usage on a GPU the container was not given counts against a "
    "limit of 0 (see [install.md](install.md#vram-per-gpu-dra))",
)
ACTION = action(
    SIDECAR_ACTIONS,
    env="VRAM_ENFORCER_ACTION",
    doc="`warn`, `terminate` (SIGTERM, then SIGKILL after the grace period), `kill` (SIGKILL), "
    "`restart` (SIGTERM, then SIGKILL, to the container's init process: kubelet restarts "
    "the container under the pod's `restartPolicy`)",
)
GRACE_PERIOD = grace_period(env="VRAM_ENFORCER_GRACE_PERIOD")
INTERVAL = interval(
    "how often usage is checked, at the latest",
    "the longest time between two checks. With the agent, the sidecar also checks on every "
    "sample the agent pushes",
    env="VRAM_ENFORCER_INTERVAL",
)
WARN_AT = warn_at("one `VRAMNearLimit` per crossing", env="VRAM_ENFORCER_WARN_AT")
OVER_FOR = over_for("how long a container may stay over its limit before it is enforced")
DRY_RUN = dry_run(
    "report what would be signalled, signal nothing. The webhook sets `true` for the action "
    "`dry-run` (with `VRAM_ENFORCER_ACTION` the would-be action, `terminate`)",
    env="VRAM_ENFORCER_DRY_RUN",
)
POLICY = PolicySettings(ACTION, GRACE_PERIOD, WARN_AT, OVER_FOR, DRY_RUN)
UNDECLARED_ALLOWED = value(
    "undeclared_allowed",
    lambda text, field: choice("deny", "allow")(text, field) == "allow",
    "deny: a container that declares no VRAM has a limit of 0; allow: it is not checked",
    flag="--undeclared",
    default="deny",
    metavar="deny|allow",
    doc="`deny`: a container that declares no VRAM has a limit of 0, so any GPU memory it takes "
    "is a violation. `allow`: it is not checked",
)
SOURCE = value(
    "source",
    choice("agent", "nvml"),
    "agent (the node agent's socket) or nvml",
    flag="--source",
    default="agent",
    metavar="agent|nvml",
    doc="where usage comes from (below)",
)
API_ACCESS = value(
    "api_access",
    choice("agent", "direct"),
    "agent (through the node agent) or direct",
    flag="--api-access",
    env="VRAM_ENFORCER_API_ACCESS",
    default="agent",
    metavar="agent|direct",
    doc="how the sidecar reaches the Kubernetes API. `agent`: it does not. The node agent "
    "pushes it its pod (and, with DRA, its claims and this node's slices) with the usage, "
    "from the agent's one watch of the node's pods, and posts its Events; the pod's "
    "ServiceAccount needs no rights and the `kubernetes` client is not loaded. `direct`: "
    "with the pod's ServiceAccount, as sidecars of 0.1.0 did: it reads its pod every 30 s "
    "(2 s in `container` mode) and posts its Events. `agent` needs `--source agent`",
)
AGENT_SOCKET = value(
    "agent_socket",
    as_text,
    "the node agent's socket",
    flag="--agent-socket",
    env="VRAM_ENFORCER_AGENT_SOCKET",
    default=DEFAULT_SOCKET,
    metavar="PATH",
    doc="the node agent's socket, which the sidecar connects to (through a hostPath mount, as "
    "sidecars of 0.1.0 did); not used with `--listen`",
)
LISTEN = value(
    "listen",
    as_text,
    "wait for the node agent to connect to this socket, rather than connecting to it",
    flag="--listen",
    env="VRAM_ENFORCER_LISTEN",
    metavar="PATH",
    shown_default="connect to `--agent-socket`",
    doc="with `--source agent`: listen on this socket, in the sidecar's own filesystem, and "
    "wait for the node agent to connect to it (through `/proc/<pid>/root`), instead of "
    "connecting to `--agent-socket`. The pod then needs no hostPath. Only a process outside "
    "the pod's PID namespace may connect; the webhook sets it to `/run/vram-enforcer/sidecar.sock`",
)
ALLOCATION_GATE = allocation_gate(
    "hold a second copy of the pod's allocation gate fds (the webhook sets it)",
    "`on`: containers of the pod run under the allocation gate's seccomp profile, and the "
    "sidecar also listens on `gate-holder.sock` beside `--listen` (which it needs): the "
    "gate's second holder of the pod's listener fds, so that the node agent's restart never "
    "fails their gated calls with `ENOSYS`. The webhook sets `on` exactly where a container "
    "of the pod names the gate's profile. `off`: no holder, no socket (a sidecar the webhook "
    "injected before the gate existed has no such variable)",
    env="VRAM_ENFORCER_ALLOCATION_GATE",
)
HOST_PROC = value(
    "host_proc",
    as_text,
    "with --source nvml: the host's /proc, mounted read-only",
    flag="--host-proc",
    metavar="PATH",
    shown_default="required with `--source nvml`",
    doc="with `--source nvml`: the host's `/proc`, mounted read-only (e.g. `/host/proc`)",
)
STALE_AFTER = value(
    "stale_after",
    positive_duration(0.1),
    "usage older than this counts as unknown",
    flag="--stale-after",
    default="2s",
    metavar="DURATION",
    doc="usage older than this counts as unknown (measured from when it arrived, on the "
    "monotonic clock)",
)
SIDECAR_MODE = value(
    "sidecar_mode",
    choice("native", "container"),
    "how the webhook injected it",
    flag="--sidecar-mode",
    env="VRAM_ENFORCER_SIDECAR_MODE",
    default="native",
    metavar="native|container",
    doc="`native` (an init container with `restartPolicy: Always`, Kubernetes ≥ 1.29) or "
    "`container` (a regular container, below)",
)
SELF_NAME = value(
    "self_name",
    as_text,
    "the sidecar's own container name",
    env="VRAM_ENFORCER_SELF_NAME",
    default="vram-enforcer",
    doc="the sidecar's own container name, so that it never counts itself",
)
CONTAINERS = value(
    "containers",
    parse_names,
    "the pod's other containers",
    env="VRAM_ENFORCER_CONTAINERS",
    default="",
    doc="the pod's other containers (init and regular), comma-separated, set by the webhook. "
    "Before the API has answered once, the sidecar can only enforce a pod that has exactly "
    "one of them (see [architecture.md](architecture.md#the-sidecar))",
)
KUBECONFIG = kubeconfig("in-cluster")
LOG_FORMAT = log_format("json")
VERBOSE = verbosity("info")

DECLARED: tuple[Setting[Any], ...] = (
    POD_NAME,
    POD_NAMESPACE,
    POD_UID,
    NODE_NAME,
    LIMITS,
    CEILINGS,
    PORTIONS,
    GPUS,
    LIMITS_FROM,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    DRA_CAPACITY,
    ACTION,
    GRACE_PERIOD,
    INTERVAL,
    WARN_AT,
    OVER_FOR,
    DRY_RUN,
    UNDECLARED_ALLOWED,
    SOURCE,
    API_ACCESS,
    AGENT_SOCKET,
    LISTEN,
    ALLOCATION_GATE,
    HOST_PROC,
    STALE_AFTER,
    SIDECAR_MODE,
    SELF_NAME,
    CONTAINERS,
    KUBECONFIG,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """Everything `vram-enforcer sidecar` needs, validated; see docs/configuration.md."""

    pod_name: str
    namespace: str
    pod_uid: str
    node_name: str
    self_name: str
    limits: dict[str, int]
    ceilings: dict[str, int]  # container -> above its limit, up to which it may borrow
    portions: dict[str, Portion]  # container -> its portion of a GPU's memory (KAI)
    gpus: dict[str, int]  # container -> the GPUs its limit is spread over (KAI)
    dra: DraSettings | None  # limits from the pod's ResourceClaims, per GPU; None: `limits`
    containers: tuple[str, ...]  # the pod's other containers, from its spec (may be empty)
    undeclared_allowed: bool
    policy: PolicyConfig
    interval: float
    source: str
    api_access: str  # "agent": the pod comes with the usage and Events go back; "direct"
    agent_socket: str
    listen: str | None  # wait for the agent on this socket, rather than connecting to it
    allocation_gate: bool  # the pod's gate holder beside `listen` (the pod is gated)
    host_proc: str | None
    stale_after: float
    sidecar_mode: str
    kubeconfig: str | None


def sidecar_settings(values: Values) -> SidecarSettings:
    if values[SOURCE] == "nvml" and not values[HOST_PROC]:
        raise ConfigError(
            "--host-proc", None, "is missing; --source nvml needs the host's /proc, e.g. /host/proc"
        )
    if values[SOURCE] == "nvml" and values[API_ACCESS] == "agent":
        raise ConfigError(
            "--api-access",
            "agent",
            "needs --source agent (the pod and the Events go over the agent's socket); with "
            "--source nvml pass --api-access direct",
        )
    if values[SOURCE] == "nvml" and values[LISTEN]:
        raise ConfigError(
            "--listen", values[LISTEN], "needs --source agent (it is where the agent connects)"
        )
    if values[ALLOCATION_GATE] == "on" and not values[LISTEN]:
        raise ConfigError(
            "--allocation-gate",
            "on",
            "needs --listen: the gate's holder listens beside the socket the agent connects to",
        )
    dra = dra_settings(values) if values[LIMITS_FROM] == "dra" else None
    if dra is None and values[LIMITS] is None:
        raise ConfigError(LIMITS_ENV, None, f"is missing; use {LIMITS_FORM} (or --limits-from dra)")
    ceilings = _ceilings(values[CEILINGS] or {}, values[LIMITS] or {}, values[SOURCE])
    portions = _portions(values[PORTIONS] or {}, values[LIMITS] or {}, values[SOURCE], dra)
    policy = POLICY.config(values)
    if policy.reports_only:  # it borrows nothing, as the agent owes it (`owed.pod_owed`)
        held = Declaration(ceilings=ceilings, portions=portions).held_to_requests()
        ceilings, portions = dict(held.ceilings), dict(held.portions)
    return SidecarSettings(
        pod_name=values[POD_NAME],
        namespace=values[POD_NAMESPACE],
        pod_uid=values[POD_UID],
        node_name=values[NODE_NAME],
        self_name=values[SELF_NAME],
        limits=values[LIMITS] or {},
        ceilings=ceilings,
        portions=portions,
        gpus=spread_over(values[GPUS] or {}, {*(values[LIMITS] or {}), *portions}, GPUS_ENV),
        dra=dra,
        containers=values[CONTAINERS],
        undeclared_allowed=values[UNDECLARED_ALLOWED],
        policy=policy,
        interval=values[INTERVAL],
        source=values[SOURCE],
        api_access=values[API_ACCESS],
        agent_socket=values[AGENT_SOCKET],
        listen=values[LISTEN],
        allocation_gate=values[ALLOCATION_GATE] == "on",
        host_proc=values[HOST_PROC],
        stale_after=values[STALE_AFTER],
        sidecar_mode=values[SIDECAR_MODE],
        kubeconfig=values[KUBECONFIG],
    )


def _portions(
    portions: dict[str, Portion], limits: dict[str, int], source: str, dra: DraSettings | None
) -> dict[str, Portion]:
    """Portions of a GPU, for containers whose limit is not given in bytes too."""
    if portions and dra is not None:
        raise ConfigError(
            PORTIONS_ENV,
            encode_portions(portions),
            "needs --limits-from declared: DRA gives each claim bytes",
        )
    for name in portions:
        if name in limits:
            raise ConfigError(
                PORTIONS_ENV,
                encode_portions(portions),
                (
                    f"gives container {name!r} a portion, and {LIMITS.env} a limit in bytes; "
                    "give it one of them"
                ),
            )
    if source != "agent" and any(p.ceiling for p in portions.values()):
        raise ConfigError(
            PORTIONS_ENV,
            encode_portions(portions),
            (
                "gives a ceiling, which needs --source agent: only the node agent sees the whole "
                "GPU, and so only it can say when borrowed memory must be given back"
            ),
        )
    return portions


def _ceilings(ceilings: dict[str, int], limits: dict[str, int], source: str) -> dict[str, int]:
    """The ceilings above the limits (with DRA, the limits are what the containers declared,
    their claims' sizes); borrowing needs the agent, which alone sees the whole GPU and so
    alone can say when to give memory back."""
    if not ceilings:
        return {}
    if source != "agent":
        raise ConfigError(
            CEILINGS_ENV,
            ceilings,
            "needs --source agent: only the node agent sees the whole "
            "GPU, and so only it can say when borrowed memory must be given back",
        )
    for name, ceiling in ceilings.items():
        if name not in limits or ceiling < limits[name]:
            why = "but no limit" if name not in limits else "below its limit"
            raise ConfigError(
                CEILINGS_ENV,
                ceilings,
                f"gives container {name!r} a ceiling {why}; a "
                "ceiling is at least the container's declared limit (its request)",
            )
    return {name: c for name, c in ceilings.items() if c > limits[name]}


def pod_policy(pod: Pod, sidecar: str, opted_in: AbstractSet[str]) -> PolicyConfig:
    """The policy a pod's sidecar runs with, as the agent reads it from the environment the
    webhook gave the sidecar (validated there), in a namespace that opted in (`env_trusted`);
    the sidecar's defaults for anything it cannot read, and in any other namespace (a `warn`
    or a dry run written there is its author's, not the operator's)."""
    env = sidecar_env(pod, sidecar) if env_trusted(pod, opted_in) else {}
    declared = (POLICY.action, POLICY.grace_period, POLICY.warn_at, POLICY.over_for, POLICY.dry_run)
    try:
        return POLICY.config(resolve(declared, {}, env))
    except ConfigError:
        return POLICY.config(resolve(declared, {}, {}))
