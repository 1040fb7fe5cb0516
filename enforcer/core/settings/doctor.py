"""`vram-enforcer doctor`'s settings: which checks, against what."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.parsing import as_text
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import DEFAULT_SOCKET, kubeconfig, log_format

NVML = switch("nvml", "--no-nvml", "skip the NVML check")
AGENT = switch("agent", "--no-agent", "skip the socket check")
API = switch("api", "--no-api", "skip the API checks")
AGENT_SOCKET = value(
    "agent_socket",
    as_text,
    "the agent's socket, asked as the sidecar asks it",
    flag="--agent-socket",
    env="VRAM_ENFORCER_AGENT_SOCKET",
    default=DEFAULT_SOCKET,
    metavar="PATH",
)
KUBECONFIG = kubeconfig("in-cluster config, then `~/.kube/config`")
NAMESPACE = value(
    "namespace",
    as_text,
    "the namespace whose sidecar RBAC is checked",
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
    KUBECONFIG,
    NAMESPACE,
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
    kubeconfig: str | None
    namespace: str
    json: bool


def doctor_settings(values: Values) -> DoctorSettings:
    return DoctorSettings(
        nvml=values[NVML],
        agent=values[AGENT],
        api=values[API],
        agent_socket=values[AGENT_SOCKET],
        kubeconfig=values[KUBECONFIG],
        namespace=values[NAMESPACE],
        json=values[JSON],
    )
