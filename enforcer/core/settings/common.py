"""Settings that several modes share, each a factory for the mode's own declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.dra import NVIDIA_DRIVER, DraSettings
from enforcer.core.model import Action
from enforcer.core.parsing import (
    actions,
    as_text,
    choice,
    parse_bytes,
    parse_duration,
    parse_names,
    parse_percent,
    parse_port,
    parse_resource_name,
    parse_unit,
    positive_duration,
)
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings import Setting, Values, switch, value

DEFAULT_RESOURCE = "vram-enforcer.io/vram"
DEFAULT_SOCKET = "/run/vram-enforcer/agent.sock"


def interval(help: str, doc: str, **options: Any) -> Setting[float]:
    return value(
        "interval",
        positive_duration(0.01),
        help,
        flag="--interval",
        default="100ms",
        metavar="DURATION",
        doc=doc,
        **options,
    )


def metrics_port(help: str, **options: Any) -> Setting[int | None]:
    if "default" not in options:
        options["shown_default"] = "off"
    return value("metrics_port", parse_port, help, flag="--metrics-port", metavar="PORT", **options)


def metrics_address(default: str) -> Setting[str]:
    return value(
        "metrics_address",
        as_text,
        "the address that --metrics-port listens on",
        flag="--metrics-address",
        default=default,
        metavar="ADDR",
        doc="the address that `--metrics-port` listens on",
    )


def log_format(default: str) -> Setting[str]:
    return value(
        "log_format",
        choice("text", "json"),
        "how log lines are written",
        flag="--log-format",
        default=default,
        metavar="text|json",
        doc="`json` gives one JSON object per line, with `reason`, `unit` and `pid` "
        "fields where they apply",
    )


def kubeconfig(shown_default: str, doc: str = "how to reach the API server") -> Setting[str | None]:
    return value(
        "kubeconfig",
        as_text,
        "kubeconfig file",
        flag="--kubeconfig",
        metavar="FILE",
        shown_default=shown_default,
        doc=doc,
    )


RESOURCE_NAME = value(
    "resource_name",
    parse_resource_name,
    "the extended resource that counts VRAM",
    flag="--resource-name",
    default=DEFAULT_RESOURCE,
    metavar="NAME",
    doc="the extended resource. It must be `domain/name`, outside `kubernetes.io`",
)


def resource_unit(doc: str) -> Setting[int]:
    return value(
        "resource_unit",
        parse_unit,
        "bytes per unit of the resource: with 1Gi, a limit of 3 means 3 GiB",
        flag="--resource-unit",
        default="1",
        metavar="QUANTITY",
        doc=doc,
    )


def reclaim_watermark(help: str, doc: str) -> Setting[int]:
    """Free GPU memory kept while anyone borrows above a request: what may be allocated
    before a reclaim is seen (see core/reclaim.py for the default's reasoning)."""
    return value(
        "reclaim_watermark",
        parse_bytes,
        help,
        flag="--reclaim-watermark",
        metavar="QUANTITY",
        default="2Gi",
        doc=doc + ". The default is what a workload allocating 10 GiB/s takes in twice the "
        "p99 time a 100 ms interval needs to see it",
    )


# The policy: what happens over a limit. The sidecar also reads them from the environment.


def action(allowed: tuple[Action, ...], doc: str, **options: Any) -> Setting[Action]:
    names = [a.value for a in allowed]
    return value(
        "action",
        actions(*allowed),
        f"what to do over the limit: {', '.join(names)}",
        flag="--action",
        default="terminate",
        metavar="|".join(names),
        doc=doc,
        **options,
    )


def grace_period(**options: Any) -> Setting[float]:
    return value(
        "grace_period",
        parse_duration,
        "time between SIGTERM and SIGKILL",
        flag="--grace-period",
        default="5s",
        metavar="DURATION",
        **options,
    )


def warn_at(doc: str, **options: Any) -> Setting[float]:
    return value(
        "warn_at",
        parse_percent,
        "warn once usage reaches this share of the limit",
        flag="--warn-at",
        default="90%",
        metavar="PERCENT",
        doc=doc,
        **options,
    )


def over_for(doc: str) -> Setting[float]:
    return value(
        "over_for",
        parse_duration,
        "how long usage may stay over the limit before the action",
        flag="--over-for",
        default="0s",
        metavar="DURATION",
        doc=doc,
    )


def dry_run(doc: str, **options: Any) -> Setting[bool]:
    return switch(
        "dry_run",
        "--dry-run",
        "decide as usual but only report what would be signalled",
        doc=doc,
        **options,
    )


def hard_limits(choices: tuple[str, ...], doc: str) -> Setting[str]:
    return value(
        "hard_limits",
        choice(*choices),
        "per-cgroup GPU memory limits, so that the driver refuses allocations past the "
        "limit (NVIDIA R615+, cgroup v2, root); sampling stays on as the backstop",
        flag="--hard-limits",
        default="auto",
        metavar="|".join(choices),
        doc=doc,
    )


def allocation_gate(help: str, doc: str, env: str | None = None) -> Setting[str]:
    """`--allocation-gate off|on` (issue 45's gate), off by default, for each mode that
    takes it (`env`: the variable the webhook writes, for the sidecar's)."""
    return value(
        "allocation_gate",
        choice("off", "on"),
        help,
        flag="--allocation-gate",
        env=env,
        default="off",
        metavar="off|on",
        doc=doc,
    )


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """A mode's own declarations of the policy settings (their help and variables differ
    between exec and the sidecar), read into one `PolicyConfig`."""

    action: Setting[Action]
    grace_period: Setting[float]
    warn_at: Setting[float]
    over_for: Setting[float]
    dry_run: Setting[bool]

    def config(self, values: Values) -> PolicyConfig:
        return PolicyConfig(
            action=values[self.action],
            warn_at=values[self.warn_at],
            over_for=values[self.over_for],
            grace_period=values[self.grace_period],
            dry_run=values[self.dry_run],
        )


DRA_DRIVERS: Setting[tuple[str, ...]] = value(
    "dra_drivers",
    parse_names,
    "DRA drivers whose allocations are GPUs",
    flag="--dra-drivers",
    env="VRAM_ENFORCER_DRA_DRIVERS",
    default=NVIDIA_DRIVER,
    metavar="NAMES",
    doc="the DRA drivers whose allocations are GPUs, comma-separated (NVIDIA's by default); "
    "allocations of other drivers are left alone",
)
DRA_UUID_ATTRIBUTE = value(
    "dra_uuid_attribute",
    as_text,
    "the ResourceSlice attribute that holds a GPU's UUID",
    flag="--dra-uuid-attribute",
    env="VRAM_ENFORCER_DRA_UUID_ATTRIBUTE",
    default="uuid",
    metavar="NAME",
    doc="the device attribute, in the driver's ResourceSlices, that holds the GPU's UUID as "
    "NVML names it (`uuid` for NVIDIA's driver; a name without a domain is in the driver's)",
)
DRA_CAPACITY = value(
    "dra_capacity",
    as_text,
    "the device capacity that is GPU memory",
    flag="--dra-capacity",
    env="VRAM_ENFORCER_DRA_CAPACITY",
    default="memory",
    metavar="NAME",
    doc="the device capacity that is GPU memory: its `consumedCapacity` in an allocation is "
    "the limit on that GPU",
)


def dra_settings(values: Values) -> DraSettings:
    drivers: tuple[str, ...] = values[DRA_DRIVERS]
    return DraSettings(frozenset(drivers), values[DRA_UUID_ATTRIBUTE], values[DRA_CAPACITY])


POD_RESOURCES_SOCKET = value(
    "pod_resources_socket",
    as_text,
    "the kubelet's pod-resources socket",
    flag="--pod-resources-socket",
    default="/var/lib/kubelet/pod-resources/kubelet.sock",
    metavar="PATH",
    doc="the kubelet's pod-resources API (gRPC): which GPU a device plugin gave each "
    "container (`--gpu-resources`). The agent reads it on every change of the node's pods, "
    "and every 30 s (unless `--no-serve-pods`), and owes a container's request on that GPU from "
    "before it starts, not only once NVML shows it there; `doctor` asks it once. Empty: not "
    "read. The chart mounts the kubelet's directory read-only",
)
