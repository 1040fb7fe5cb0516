"""Parsing of the values people type: quantities, durations and percentages.

Every parser names the field it is parsing, the value it got and the form it accepts, so
that a typo gives one line a person can act on instead of a traceback or a silent guess.

Quantities follow the Kubernetes grammar (apimachinery's `resource.Quantity`), so a limit
means the same thing on the command line as in a pod spec. We do not import
`kubernetes.utils.parse_quantity` for it: importing that module loads the whole client
(0.45 s and 36 MiB of RSS, measured), which `exec` and the sidecar cannot afford. The
tests check this parser against `parse_quantity` instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import PurePath

from enforcer.core.model import Action
from enforcer.core.policy import PolicyConfig

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

QUANTITY_FORM = "a Kubernetes quantity such as 4Gi, 512Mi, 8G or 4294967296 (bytes)"
DURATION_FORM = "a duration with a unit, such as 100ms, 5s, 1m30s or 2h"
PERCENT_FORM = "a percentage above 0% and at most 100%, such as 90%"


class ConfigError(ValueError):
    """A value that cannot be used, with the field it came from and how to fix it."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        shown = f"{field}: {value!r}" if value is not None else field
        super().__init__(f"{shown} {problem}")


def parse_quantity(text: str, *, field: str) -> Decimal:
    """Parse a Kubernetes quantity exactly, as the API server would."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or text != text.strip():
        raise ConfigError(field, text, f"is not a quantity; use {QUANTITY_FORM}{_hint(text)}")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal digits
        raise ConfigError(field, text, f"is not a quantity; use {QUANTITY_FORM}") from None
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    if suffix:
        return number.scaleb(int(suffix[1:]))
    return number


def _hint(text: object) -> str:
    """Suggest the right suffix for the usual mistakes: `4GB`, `4gb`, `4GiB`, `4 Gi`."""
    m = (
        re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\W*", text)
        if isinstance(text, str)
        else None
    )
    if m is None:
        return ""
    prefix = m[2].lower().removesuffix("b").removesuffix("i")
    if prefix not in ("k", "m", "g", "t", "p", "e"):
        return ""
    binary, decimal = prefix.upper() + "i", "k" if prefix == "k" else prefix.upper()
    return f" (did you mean {m[1]}{binary}, or {m[1]}{decimal} for powers of 1000?)"


def parse_bytes(text: str, *, field: str, unit: int = 1) -> int:
    """A non-negative whole number of bytes; `unit` scales a bare count (`--resource-unit`)."""
    value = parse_quantity(text, field=field) * unit
    if value < 0:
        raise ConfigError(field, text, "is negative; a memory size must be 0 or more")
    if value != value.to_integral_value():
        milli = "; 'm' means milli (1/1000), write Mi for mebibytes" if text.endswith("m") else ""
        raise ConfigError(field, text, f"is not a whole number of bytes{milli}")
    return int(value)


def parse_duration(text: str, *, field: str) -> float:
    """A Go-style duration (`100ms`, `1m30s`) in seconds; a bare number is refused."""
    stripped = text.strip() if isinstance(text, str) else ""
    if stripped == "0":
        return 0.0
    pos, total = 0, 0.0
    while stripped and pos < len(stripped):
        m = _DURATION_PART.match(stripped, pos)
        if m is None:
            break
        total += float(m[1]) * _DURATION_UNITS[m[2]]
        pos = m.end()
    if not stripped or pos != len(stripped):
        bare = re.fullmatch(r"[0-9]+(?:\.[0-9]*)?", stripped)
        hint = f" (did you mean {stripped}s?)" if bare else ""
        raise ConfigError(field, text, f"is not a duration; use {DURATION_FORM}{hint}")
    return total


def parse_percent(text: str, *, field: str) -> float:
    """A percentage in (0%, 100%], returned as a fraction."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)%", text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(field, text, f"is not a percentage; use {PERCENT_FORM}")
    value = float(m[1])
    if not 0 < value <= 100:
        raise ConfigError(field, text, f"is out of range; use {PERCENT_FORM}")
    return value / 100


def parse_positive_duration(text: str, *, field: str, minimum: float = 0.001) -> float:
    """A duration that must be at least `minimum` seconds (for intervals and periods)."""
    value = parse_duration(text, field=field)
    if value < minimum:
        raise ConfigError(field, text, f"is too short; use at least {format_duration(minimum)}")
    return value


def format_duration(seconds: float) -> str:
    """The inverse of `parse_duration` for the values we print (`5s`, `100ms`)."""
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


@dataclass(frozen=True, slots=True)
class ExecSettings:
    """Everything `vram-enforcer exec` needs, validated."""

    command: tuple[str, ...]
    limit_bytes: int
    policy: PolicyConfig
    interval: float
    name: str
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    host_proc: str | None = None


def exec_settings(
    *,
    command: list[str],
    limit: str,
    action: str,
    grace_period: str,
    interval: str,
    warn_at: str,
    over_for: str,
    dry_run: bool,
    name: str | None,
    metrics_port: int | None,
    metrics_address: str,
    host_proc: str | None,
) -> ExecSettings:
    """Validate `exec`'s flags; the first bad one raises a ConfigError naming it."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(
            "CMD", None, "is missing; put the command after --, e.g. -- python train.py"
        )
    policy = PolicyConfig(
        action=parse_action(action, field="--action", allowed=EXEC_ACTIONS),
        warn_at=parse_percent(warn_at, field="--warn-at"),
        over_for=parse_duration(over_for, field="--over-for"),
        grace_period=parse_duration(grace_period, field="--grace-period"),
        dry_run=dry_run,
    )
    return ExecSettings(
        command=tuple(command),
        limit_bytes=parse_bytes(limit, field="--limit"),
        policy=policy,
        interval=parse_positive_duration(interval, field="--interval", minimum=0.01),
        name=name or PurePath(command[0]).name,
        metrics_port=parse_port(metrics_port, field="--metrics-port"),
        metrics_address=metrics_address,
        host_proc=host_proc,
    )


EXEC_ACTIONS = (Action.TERMINATE, Action.KILL, Action.WARN)


def parse_action(text: str, *, field: str, allowed: tuple[Action, ...]) -> Action:
    choices = ", ".join(a.value for a in allowed)
    try:
        action = Action(text.strip().lower())
    except ValueError:
        raise ConfigError(field, text, f"is not an action; use one of: {choices}") from None
    if action not in allowed:
        raise ConfigError(field, text, f"is not available here; use one of: {choices}")
    return action


DEFAULT_RESOURCE = "vram-enforcer.io/vram"
DEFAULT_SOCKET = "/run/vram-enforcer/agent.sock"
SIDECAR_METRICS_PORT = 9477  # the webhook moves it when a container declares it


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


_RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def parse_resource_name(text: str, *, field: str) -> str:
    """An extended resource name: `<domain>/<name>`, outside kubernetes.io."""
    if not _RESOURCE_NAME.fullmatch(text) or len(text) > 253:
        raise ConfigError(
            field,
            text,
            "is not an extended resource name; use domain/name, e.g. vram-enforcer.io/vram",
        )
    if text.split("/", maxsplit=1)[0].endswith("kubernetes.io"):
        raise ConfigError(
            field,
            text,
            "is in the reserved kubernetes.io domain; use your own, e.g. vram-enforcer.io/vram",
        )
    return text


def parse_port(value: int | str | None, *, field: str) -> int | None:
    """A port from a flag (int) or an environment variable (text)."""
    if value is None:
        return None
    port = int(value) if isinstance(value, int) or value.isdigit() else -1
    if not 0 <= port <= 65535:
        raise ConfigError(field, value, "is not a TCP port; use 1-65535 (0 picks a free one)")
    return port


def agent_settings(
    *,
    node_name: str | None,
    socket: str,
    interval: str,
    reserve: str,
    advertise: bool,
    labels: bool,
    resource_name: str,
    resource_unit: str,
    resync: str,
    kubeconfig: str | None,
    metrics_port: int | None,
    metrics_address: str,
    host_proc: str,
) -> AgentSettings:
    """Validate `agent`'s flags (and NODE_NAME); the first bad one raises a ConfigError."""
    if (advertise or labels) and not node_name:
        raise ConfigError(
            "--node-name", None,
            "is missing; set it, or NODE_NAME from the Downward API (spec.nodeName), "
            "or pass both --no-advertise and --no-labels",
        )  # fmt: skip
    unit = parse_bytes(resource_unit, field="--resource-unit")
    if unit < 1:
        raise ConfigError(
            "--resource-unit", resource_unit, "must be at least 1 byte, e.g. 1 or 1Gi"
        )
    return AgentSettings(
        node_name=node_name or "",
        socket=socket,
        interval=parse_positive_duration(interval, field="--interval", minimum=0.01),
        reserve_bytes=parse_bytes(reserve, field="--reserve"),
        advertise=advertise,
        labels=labels,
        resource_name=parse_resource_name(resource_name, field="--resource-name"),
        resource_unit=unit,
        resync=parse_positive_duration(resync, field="--resync", minimum=1.0),
        kubeconfig=kubeconfig,
        metrics_port=parse_port(metrics_port, field="--metrics-port"),
        metrics_address=metrics_address,
        host_proc=host_proc,
    )


SIDECAR_ACTIONS = (Action.TERMINATE, Action.KILL, Action.RESTART, Action.WARN)
LIMITS_FORM = 'a JSON object of container name to bytes, e.g. {"trainer": 12884901888}'


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """Everything `vram-enforcer sidecar` needs, validated; see docs/configuration.md."""

    pod_name: str
    namespace: str
    pod_uid: str
    node_name: str
    self_name: str
    limits: dict[str, int]
    containers: tuple[str, ...]  # the pod's other containers, from its spec (may be empty)
    undeclared_allowed: bool
    policy: PolicyConfig
    interval: float
    source: str
    agent_socket: str
    host_proc: str | None
    stale_after: float
    sidecar_mode: str
    kubeconfig: str | None
    metrics_port: int | None
    metrics_address: str


def parse_limits(text: str, *, field: str) -> dict[str, int]:
    try:
        doc = json.loads(text)
    except ValueError:
        raise ConfigError(field, text, f"is not valid JSON; use {LIMITS_FORM}") from None
    if not isinstance(doc, dict):
        raise ConfigError(field, text, f"is not a JSON object; use {LIMITS_FORM}")
    limits: dict[str, int] = {}
    for name, value in doc.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                field,
                text,
                f"gives container {name!r} the limit {value!r}; limits are whole bytes >= 0",
            )
        limits[name] = value
    return limits


def _pick(
    flag: object, environ: Mapping[str, str], var: str, flag_name: str
) -> tuple[str | None, str]:
    """A flag wins over its environment variable; the field named in errors says which."""
    if flag is not None:
        return str(flag), flag_name
    return environ.get(var), var


def _required(value: str | None, field: str, what: str) -> str:
    if not value:
        raise ConfigError(field, None, f"is missing; {what}")
    return value


def sidecar_settings(
    *,
    environ: Mapping[str, str],
    limits: str | None,
    action: str | None,
    grace_period: str | None,
    interval: str | None,
    warn_at: str | None,
    over_for: str | None,
    dry_run: bool,
    undeclared: str,
    source: str,
    agent_socket: str | None,
    host_proc: str | None,
    stale_after: str,
    sidecar_mode: str | None,
    kubeconfig: str | None,
    metrics_port: int | None,
    metrics_address: str,
) -> SidecarSettings:
    """Validate the sidecar's environment (set by the webhook) and the flags that override it."""
    downward = "set it from the Downward API (the webhook does)"
    identity = {
        var: _required(environ.get(var), var, downward)
        for var in ("POD_NAME", "POD_NAMESPACE", "POD_UID")
    }
    raw_limits, limits_field = _pick(limits, environ, "VRAM_ENFORCER_LIMITS", "--limits")
    raw_action, action_field = _pick(action, environ, "VRAM_ENFORCER_ACTION", "--action")
    raw_grace, grace_field = _pick(
        grace_period, environ, "VRAM_ENFORCER_GRACE_PERIOD", "--grace-period"
    )
    raw_interval, interval_field = _pick(interval, environ, "VRAM_ENFORCER_INTERVAL", "--interval")
    raw_warn, warn_field = _pick(warn_at, environ, "VRAM_ENFORCER_WARN_AT", "--warn-at")
    raw_socket, _ = _pick(agent_socket, environ, "VRAM_ENFORCER_AGENT_SOCKET", "--agent-socket")
    raw_mode, mode_field = _pick(
        sidecar_mode, environ, "VRAM_ENFORCER_SIDECAR_MODE", "--sidecar-mode"
    )
    raw_port, port_field = _pick(
        metrics_port, environ, "VRAM_ENFORCER_METRICS_PORT", "--metrics-port"
    )
    if source not in ("agent", "nvml"):
        raise ConfigError("--source", source, "is not a source; use agent or nvml")
    if source == "nvml" and not host_proc:
        raise ConfigError(
            "--host-proc", None, "is missing; --source nvml needs the host's /proc, e.g. /host/proc"
        )
    if undeclared not in ("deny", "allow"):
        raise ConfigError("--undeclared", undeclared, "is not a choice; use deny or allow")
    mode = raw_mode or "native"
    if mode not in ("native", "container"):
        raise ConfigError(mode_field, mode, "is not a sidecar mode; use native or container")
    policy = PolicyConfig(
        action=parse_action(raw_action or "terminate", field=action_field, allowed=SIDECAR_ACTIONS),
        warn_at=parse_percent(raw_warn or "90%", field=warn_field),
        over_for=parse_duration(over_for or "0s", field="--over-for"),
        grace_period=parse_duration(raw_grace or "5s", field=grace_field),
        dry_run=dry_run,
    )
    return SidecarSettings(
        pod_name=identity["POD_NAME"],
        namespace=identity["POD_NAMESPACE"],
        pod_uid=identity["POD_UID"],
        node_name=environ.get("NODE_NAME", ""),
        self_name=environ.get("VRAM_ENFORCER_SELF_NAME", "vram-enforcer"),
        containers=tuple(c for c in environ.get("VRAM_ENFORCER_CONTAINERS", "").split(",") if c),
        limits=parse_limits(
            _required(raw_limits, limits_field, f"use {LIMITS_FORM}"), field=limits_field
        ),
        undeclared_allowed=undeclared == "allow",
        policy=policy,
        interval=parse_positive_duration(
            raw_interval or "100ms", field=interval_field, minimum=0.01
        ),
        source=source,
        agent_socket=raw_socket or DEFAULT_SOCKET,
        host_proc=host_proc,
        stale_after=parse_positive_duration(stale_after, field="--stale-after", minimum=0.1),
        sidecar_mode=mode,
        kubeconfig=kubeconfig,
        metrics_port=parse_port(raw_port or str(SIDECAR_METRICS_PORT), field=port_field),
        metrics_address=metrics_address,
    )


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """Everything `vram-enforcer webhook` needs, validated; see docs/configuration.md."""

    tls_cert_file: str
    tls_key_file: str
    port: int
    address: str
    sidecar_image: str
    sidecar_mode: str  # native, container or auto
    resource_name: str
    resource_unit: int
    framework_env: bool
    shm_default: str
    gpu_exposure: str
    runtime_class: str | None
    sidecar_cpu: str
    sidecar_memory: str
    agent_socket: str
    kubeconfig: str | None
    metrics_port: int | None
    metrics_address: str


def _choice(value: str, field: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(field, value, f"is not a choice; use one of: {', '.join(choices)}")
    return value


def webhook_settings(
    tls_cert_file: str,
    tls_key_file: str,
    port: int,
    address: str,
    sidecar_image: str,
    sidecar_mode: str,
    resource_name: str,
    resource_unit: str,
    framework_env: bool,
    shm_default: str,
    gpu_exposure: str,
    runtime_class: str | None,
    sidecar_cpu: str,
    sidecar_memory: str,
    agent_socket: str,
    kubeconfig: str | None,
    metrics_port: int | None,
    metrics_address: str,
) -> WebhookSettings:
    """Validate `webhook`'s flags; the first bad one raises a ConfigError."""
    if not sidecar_image.strip():
        raise ConfigError("--sidecar-image", sidecar_image, "is empty; give the enforcer's image")
    unit = parse_bytes(resource_unit, field="--resource-unit")
    if unit < 1:
        raise ConfigError(
            "--resource-unit", resource_unit, "must be at least 1 byte, e.g. 1 or 1Gi"
        )
    if shm_default not in ("auto", "off"):
        parse_bytes(shm_default, field="--shm-default")
    parse_quantity(sidecar_cpu, field="--sidecar-cpu")
    parse_bytes(sidecar_memory, field="--sidecar-memory")
    if gpu_exposure == "none" and runtime_class:
        raise ConfigError("--runtime-class", runtime_class, "needs --gpu-exposure env")
    if not agent_socket.startswith("/run/vram-enforcer/"):
        raise ConfigError(
            "--agent-socket", agent_socket,
            "must lie in /run/vram-enforcer/, the directory mounted into the sidecar",
        )  # fmt: skip
    return WebhookSettings(
        tls_cert_file=tls_cert_file,
        tls_key_file=tls_key_file,
        port=8443 if (checked := parse_port(port, field="--port")) is None else checked,
        address=address,
        sidecar_image=sidecar_image.strip(),
        sidecar_mode=_choice(sidecar_mode, "--sidecar-mode", ("native", "container", "auto")),
        resource_name=parse_resource_name(resource_name, field="--resource-name"),
        resource_unit=unit,
        framework_env=framework_env,
        shm_default=shm_default,
        gpu_exposure=_choice(gpu_exposure, "--gpu-exposure", ("none", "env")),
        runtime_class=runtime_class,
        sidecar_cpu=sidecar_cpu,
        sidecar_memory=sidecar_memory,
        agent_socket=agent_socket,
        kubeconfig=kubeconfig,
        metrics_port=parse_port(metrics_port, field="--metrics-port"),
        metrics_address=metrics_address,
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


def doctor_settings(
    nvml: bool,
    agent: bool,
    api: bool,
    agent_socket: str | None,
    kubeconfig: str | None,
    namespace: str | None,
    json: bool,
    environ: Mapping[str, str],
) -> DoctorSettings:
    """The checks to run; the socket and namespace default to what the sidecar would use."""
    return DoctorSettings(
        nvml=nvml,
        agent=agent,
        api=api,
        agent_socket=agent_socket or environ.get("VRAM_ENFORCER_AGENT_SOCKET") or DEFAULT_SOCKET,
        kubeconfig=kubeconfig,
        namespace=namespace or environ.get("POD_NAMESPACE") or "default",
        json=json,
    )
