"""`vram-enforcer doctor`'s settings: which checks, against what."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.dra import DraSettings
from enforcer.core.parsing import as_text, choice
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import (
    DEFAULT_SOCKET,
    DRA_CAPACITY,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    POD_RESOURCES_SOCKET,
    dra_settings,
    kubeconfig,
    log_format,
)

NVML = switch("nvml", "--no-nvml", "skip the NVML check")
AGENT = switch("agent", "--no-agent", "skip the socket check")
API = switch("api", "--no-api", "skip the API checks")
AGENT_SOCKET = value(
    "agent_socket",
    as_text,
    "the agent's socket, asked as a sidecar of 0.1.0 asks it",
    flag="--agent-socket",
    env="VRAM_ENFORCER_AGENT_SOCKET",
    default=DEFAULT_SOCKET,
    metavar="PATH",
)
LISTEN = value(
    "listen",
    as_text,
    "in a sidecar that the agent connects to: its socket (set by the webhook)",
    env="VRAM_ENFORCER_LISTEN",
    shown_default="unset",
    doc="set in the sidecars of 0.2.0 (the agent connects to them): there is no agent socket "
    "to try from there, so the socket check reads whether the sidecar listens on this one and "
    "whether the node agent is connected to it",
)
API_ACCESS = value(
    "api_access",
    choice("agent", "direct"),
    "the sidecar's --api-access: agent (no API access, no RBAC) or direct",
    flag="--api-access",
    env="VRAM_ENFORCER_API_ACCESS",
    default="agent",
    metavar="agent|direct",
    doc="the `--api-access` of the sidecar that doctor runs in, or is run for. `agent`: it "
    "makes no API request (the node agent reads its pod and posts its Events), so it needs no "
    "RBAC and none is checked for it; in a sidecar (`VRAM_ENFORCER_LISTEN` set) the API is "
    "not asked at all, unless `--kubeconfig` is given. `direct` (as sidecars of 0.1.0): "
    "checks the Role of `deploy/rbac/sidecar.yaml` in `--namespace`",
)
KUBECONFIG = kubeconfig("in-cluster config, then `~/.kube/config`")
NAMESPACE = value(
    "namespace",
    as_text,
    "with --api-access direct: the namespace whose sidecar RBAC is checked",
    flag="--namespace",
    env="POD_NAMESPACE",
    default="default",
    metavar="NAMESPACE",
)
JSON = switch("json", "--json", "print the checks as JSON: a list of {name, status, detail, fix}")
LOG_FORMAT = log_format("text")
VERBOSE = verbosity("warnings only")

DECLARED: tuple[Setting[Any], ...] = (
    NVML,
    AGENT,
    API,
    AGENT_SOCKET,
    LISTEN,
    API_ACCESS,
    KUBECONFIG,
    NAMESPACE,
    DRA_DRIVERS,
    DRA_UUID_ATTRIBUTE,
    DRA_CAPACITY,
    POD_RESOURCES_SOCKET,
    JSON,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class DoctorSettings:
    """Which checks `vram-enforcer doctor` runs, and against what."""

    nvml: bool
    agent: bool
    api: bool
    agent_socket: str
    listen: str | None  # run in a sidecar that the agent connects to
    api_access: str  # the sidecar's: "agent" (needs no API access) or "direct" (the Role)
    kubeconfig: str | None
    namespace: str
    dra: DraSettings  # what counts as a GPU that DRA can place by memory
    pod_resources_socket: str  # "": not asked
    json: bool


def doctor_settings(values: Values) -> DoctorSettings:
    return DoctorSettings(
        nvml=values[NVML],
        agent=values[AGENT],
        api=values[API],
        agent_socket=values[AGENT_SOCKET],
        listen=values[LISTEN],
        api_access=values[API_ACCESS],
        kubeconfig=values[KUBECONFIG],
        namespace=values[NAMESPACE],
        dra=dra_settings(values),
        pod_resources_socket=values[POD_RESOURCES_SOCKET],
        json=values[JSON],
    )
