"""`vram-enforcer exec`'s settings: the command line only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from enforcer.core.model import Action, GiB, format_bytes
from enforcer.core.parsing import ConfigError, as_text, parse_bytes
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings import Setting, Values, value, verbosity
from enforcer.core.settings.common import (
    PolicySettings,
    action,
    allocation_gate,
    dry_run,
    grace_period,
    hard_limits,
    interval,
    log_format,
    metrics_address,
    metrics_port,
    over_for,
    reclaim_watermark,
    warn_at,
)

EXEC_ACTIONS = (Action.TERMINATE, Action.KILL, Action.WARN)

LIMIT = value(
    "limit",
    parse_bytes,
    "GPU memory limit as a Kubernetes quantity: 4Gi, 512Mi, 8G (10^9) or bytes",
    flag="--limit",
    metavar="QUANTITY",
    required="give the GPU memory limit, e.g. --limit 4Gi",
    doc="GPU memory limit for CMD and all of its descendants, summed over all GPUs. With "
    "`--request`, the ceiling up to which they may borrow",
)
REQUEST = value(
    "request",
    parse_bytes,
    "the GPU memory CMD is guaranteed; above it, up to --limit, it borrows while its GPU "
    "has room, and is stopped back to it when the GPU's other processes need the memory",
    flag="--request",
    metavar="QUANTITY",
    shown_default="the limit: no borrowing",
    doc="GPU memory that CMD and its descendants are guaranteed, summed over all GPUs. "
    "Above it, up to `--limit`, they borrow: while the GPU keeps `--reclaim-watermark` "
    "free for its other users (other processes, the driver). When it does not, CMD's "
    "largest process on that GPU is stopped (the `--action`), one at a time, until the "
    "GPU is safe again or CMD is back at its request. The request is never the driver's "
    "soft limit (a reservation that outlives its cgroup): hard limits hold `--limit` "
    "alone. Not with `--dry-run` or `--action warn`, which could "
    "not take back what CMD borrowed",
)
RECLAIM_WATERMARK = reclaim_watermark(
    "free GPU memory kept for other processes while CMD borrows above --request",
    "free memory a GPU must keep, while CMD borrows above `--request` on it, for its other "
    "users (other processes, the driver), which may grow",
)
ACTION = action(
    EXEC_ACTIONS,
    "`terminate`: SIGTERM, then SIGKILL after `--grace-period`. "
    "`kill`: SIGKILL at once. `warn`: report only",
)
GRACE_PERIOD = grace_period()
INTERVAL = interval("how often usage is sampled", "how often NVML is sampled (at least `10ms`)")
WARN_AT = warn_at(
    "report once when usage reaches this share of the limit. The report "
    "re-arms when usage falls below 95% of that threshold"
)
OVER_FOR = over_for(
    "how long usage may stay over the limit before the action. A dip back "
    "under the limit restarts the window"
)
DRY_RUN = dry_run(
    "decide as usual, but only report what would be signalled (once per excursion over the "
    "limit), and set no hard limit (the driver would refuse allocations past it)"
)
POLICY = PolicySettings(ACTION, GRACE_PERIOD, WARN_AT, OVER_FOR, DRY_RUN)
NAME = value(
    "name",
    as_text,
    "the unit's name in metrics",
    flag="--name",
    metavar="NAME",
    shown_default="basename of CMD",
    doc="the `container` label of the metrics",
)
METRICS_PORT = metrics_port(
    "serve Prometheus metrics on this port (0 picks a free one)",
    doc="serve Prometheus metrics. `0` picks a free port, which is logged with `-v`",
)
METRICS_ADDRESS = metrics_address("127.0.0.1")
HOST_PROC = value(
    "host_proc",
    as_text,
    "the host's /proc, mounted read-only, when running inside a container "
    "without --pid=host: NVML reports host PIDs, and they are translated through it",
    flag="--host-proc",
    metavar="PATH",
    doc="the host's `/proc`, mounted read-only. Needed when running in a PID namespace "
    "without `--pid=host`",
)
HARD_LIMITS = hard_limits(
    ("auto", "off", "required"),
    "`auto`: put CMD in a cgroup of its own with the limit on every GPU where the driver "
    "can (R615+, cgroup v2, root), else say why once and enforce by sampling alone. A GPU "
    "process of CMD that writes itself into another cgroup is moved back within a second, "
    "and said. `required`: refuse to start without them. `off`: sampling alone. None with "
    "`--dry-run` or `--action warn` (the driver's refusal would enforce what they only report)",
)
ALLOCATION_GATE = allocation_gate(
    "experimental, unverified on any GPU: check the driver's allocation calls before they "
    "run (seccomp user notification), and refuse one past --limit with the driver's own "
    "out-of-memory status, so CMD gets CUDA's out-of-memory error and lives; NVIDIA "
    "535-599, where the driver's limits (R615+) cannot hold",
    "experimental, **unverified on any GPU**: `on` adds the allocation gate as a tier "
    "after the driver's limits. CMD starts under a seccomp filter that hands the NVIDIA "
    "driver's allocation calls to vram-enforcer before they run; a call that would take "
    "the command tree past `--limit` (summed over GPUs: what it held at the last sample "
    "plus what was let through since) gets the driver's out-of-memory status and CMD "
    "lives, with one log line saying the sizes. Cooperative, not a boundary: a thread "
    "that rewrites a call's parameters after the check gets past, and managed memory is "
    "not seen, so sampling stays on as the backstop (security.md). Driver branches "
    "535-599, kernel 5.5+, x86_64 or aarch64, no MIG; elsewhere one line says why and "
    "sampling enforces. Under another seccomp listener (a nested `exec`) it warns and "
    "samples only. `--hard-limits required` is satisfied by it. Not with "
    "`--hard-limits off`, `--dry-run` or `--action warn`",
)
SUMMARY = value(
    "summary",
    as_text,
    "at exit, write a JSON summary of the run to FILE: exit status, wall time, peak GPU "
    "memory, enforcement",
    flag="--summary",
    metavar="FILE",
    doc="at exit, write a JSON summary of the run to this file: the command's exit status "
    "and signal, its wall time from spawn to exit, the peak GPU memory of the command tree "
    "as sampled, and when it went over the limit and what was done. Its directory must "
    "exist. The fields are below the table",
)
LOG_FORMAT = log_format("text")
VERBOSE = verbosity("warnings only")

DECLARED: tuple[Setting[Any], ...] = (
    LIMIT,
    REQUEST,
    RECLAIM_WATERMARK,
    ACTION,
    GRACE_PERIOD,
    INTERVAL,
    WARN_AT,
    OVER_FOR,
    DRY_RUN,
    NAME,
    METRICS_PORT,
    METRICS_ADDRESS,
    HOST_PROC,
    HARD_LIMITS,
    ALLOCATION_GATE,
    SUMMARY,
    LOG_FORMAT,
    VERBOSE,
)


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
    hard_limits: str = "auto"  # auto, off or required
    summary: str | None = None  # where to write the JSON summary at exit
    request_bytes: int | None = None  # None: the limit, no borrowing
    reclaim_watermark: int = 2 * GiB
    allocation_gate: str = "off"  # off or on: the allocation gate is a candidate tier


def exec_settings(values: Values, command: list[str]) -> ExecSettings:
    """`exec`'s settings, with the command to run (after `--`)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(
            "CMD", None, "is missing; put the command after --, e.g. -- python train.py"
        )
    limit, request = values[LIMIT], values[REQUEST]
    if request is not None and request > limit:
        raise ConfigError(
            "--request",
            format_bytes(request),
            f"is above --limit {format_bytes(limit)}: the request is what the command is "
            "guaranteed and the limit the most it may borrow up to; give a request of at "
            "most the limit",
        )
    policy, hard = POLICY.config(values), values[HARD_LIMITS]
    reporting = "--dry-run" if policy.dry_run else "--action warn"
    if policy.reports_only and hard == "required":
        raise ConfigError(
            "--hard-limits",
            hard,
            f"cannot go with {reporting}: under a hard limit the driver refuses allocations "
            "past it, which enforces the limit; leave out one of the two",
        )
    gate = values[ALLOCATION_GATE]
    if gate == "on" and (policy.reports_only or hard == "off"):
        raise ConfigError(
            "--allocation-gate",
            gate,
            f"cannot go with {'--hard-limits off' if hard == 'off' else reporting}: the "
            "gate refuses allocations past the limit, which enforces it; leave out one of "
            "the two",
        )
    if policy.reports_only and request is not None and request < limit:
        raise ConfigError(
            "--request",
            format_bytes(request),
            f"cannot go with {reporting}: a command that is only reported on borrows nothing "
            "above its request, since what it borrowed could not be taken back when its GPU's "
            "other processes need it; leave out --request (the limit is then its request)",
        )
    return ExecSettings(
        command=tuple(command),
        limit_bytes=values[LIMIT],
        policy=policy,
        interval=values[INTERVAL],
        name=values[NAME] or PurePath(command[0]).name,
        metrics_port=values[METRICS_PORT],
        metrics_address=values[METRICS_ADDRESS],
        host_proc=values[HOST_PROC],
        hard_limits="off" if policy.reports_only else hard,  # reporting refuses no allocation
        summary=values[SUMMARY],
        request_bytes=request if request != limit else None,
        reclaim_watermark=values[RECLAIM_WATERMARK],
        allocation_gate=gate,
    )
