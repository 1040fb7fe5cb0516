"""`vram-enforcer agent`'s settings: flags, and NODE_NAME from the Downward API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.parsing import ConfigError, as_text, parse_bytes, positive_duration
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import (
    DEFAULT_SOCKET,
    RESOURCE_NAME,
    interval,
    kubeconfig,
    log_format,
    metrics_address,
    metrics_port,
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
    "Not needed with both `--no-advertise` and `--no-labels`",
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
RESOURCE_UNIT = resource_unit(
    "bytes per unit. With `1Gi`, the agent advertises whole GiB, "
    "rounded down, and a limit of `3` means 3 GiB"
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
HOST_PROC = value(
    "host_proc",
    as_text,
    "the host's /proc",
    flag="--host-proc",
    default="/proc",
    metavar="PATH",
    doc="the host's `/proc` (the agent checks that it belongs to the initial PID namespace)",
)
LOG_FORMAT = log_format("json")
VERBOSE = verbosity("info")

DECLARED: tuple[Setting[Any], ...] = (
    NODE_NAME,
    SOCKET,
    INTERVAL,
    RESERVE,
    ADVERTISE,
    LABELS,
    RESOURCE_NAME,
    RESOURCE_UNIT,
    RESYNC,
    KUBECONFIG,
    METRICS_PORT,
    METRICS_ADDRESS,
    HOST_PROC,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything `vram-enforcer agent` needs, validated."""

    node_name: str
    socket: str
    interval: float
    reserve_bytes: int
    advertise: bool
    labels: bool
    resource_name: str
    resource_unit: int
    resync: float
    kubeconfig: str | None
    metrics_port: int | None
    metrics_address: str
    host_proc: str

    @property
    def uses_api(self) -> bool:
        return self.advertise or self.labels


def agent_settings(values: Values) -> AgentSettings:
    advertise, labels, node_name = values[ADVERTISE], values[LABELS], values[NODE_NAME]
    if (advertise or labels) and not node_name:
        raise ConfigError(
            "--node-name",
            None,
            "is missing; set it, or NODE_NAME from the Downward API (spec.nodeName), "
            "or pass both --no-advertise and --no-labels",
        )
    return AgentSettings(
        node_name=node_name or "",
        socket=values[SOCKET],
        interval=values[INTERVAL],
        reserve_bytes=values[RESERVE],
        advertise=advertise,
        labels=labels,
        resource_name=values[RESOURCE_NAME],
        resource_unit=values[RESOURCE_UNIT],
        resync=values[RESYNC],
        kubeconfig=values[KUBECONFIG],
        metrics_port=values[METRICS_PORT],
        metrics_address=values[METRICS_ADDRESS],
        host_proc=values[HOST_PROC],
    )
