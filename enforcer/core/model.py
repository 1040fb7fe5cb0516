"""Plain data shared by every stage of the pipeline.

Nothing here does I/O: a `Sample` is what a usage source saw, a `UnitUsage` is what
attribution made of it, and the policy decides over those. Keeping them frozen means a
tick's inputs cannot change under the decision that is being made about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

GiB = 1024**3
MiB = 1024**2


class ProcessKey(NamedTuple):
    """A process identity that survives PID reuse: the pid and its start time.

    `start_time` is field 22 of `/proc/<pid>/stat`, in clock ticks since boot. Two
    processes never share both, so a signal aimed at a key cannot hit a newcomer.
    (A NamedTuple: keys are hashed many times per tick, and tuples hash in C.)
    """

    pid: int
    start_time: int


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU, or one MIG partition of a GPU (then `parent_uuid` names the GPU).

    Byte counts are None when NVML could not tell: unknown is never zero. `used_bytes` is
    what processes and the driver hold beyond `reserved_bytes`, the memory the driver and
    firmware set aside, which nothing can allocate (NVML's memory info v2; None from a
    driver without it, whose `used_bytes` then includes it).
    """

    index: int
    uuid: str
    name: str
    total_bytes: int | None
    used_bytes: int | None
    parent_uuid: str | None = None
    reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Activity:
    """How busy one process kept one GPU in NVML's latest sample period, in percent of the
    GPU's time: its SMs running the process's kernels, and its memory controller reading or
    writing for it (a measure of memory bandwidth). What sharing a GPU costs shows here
    first: memory says whether tenants fit, these say whether they slow each other down."""

    sm_percent: int
    memory_percent: int

    def __add__(self, other: Activity) -> Activity:
        """Two processes' (or one process's on two GPUs) activity together."""
        return Activity(
            self.sm_percent + other.sm_percent, self.memory_percent + other.memory_percent
        )


IDLE = Activity(0, 0)


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """GPU memory held by one process on one device, with pids as the reader sees them."""

    key: ProcessKey
    device_uuid: str
    used_bytes: int | None
    # (PID namespace inode, pid there) from the host's namespace down to the process's own,
    # when the source knows it (the node agent answers each caller from it).
    namespaces: tuple[tuple[int, int], ...] = ()
    # None when NVML cannot tell on this device (MIG, an old driver, or utilisation off).
    activity: Activity | None = None


@dataclass(frozen=True, slots=True)
class Unplaced:
    """GPU memory NVML lists for a live process that the reader cannot place: its `/proc`
    entries that name its PID namespace are refused (a security module: AppArmor lets a
    profile read only its peers). Which pod it is in is not known, so it is charged to no
    unit and never signalled; it is counted, never dropped."""

    pid: int  # as the reader's /proc names it
    device_uuid: str
    used_bytes: int | None
    why: str


@dataclass(frozen=True, slots=True)
class Sample:
    """Everything one NVML pass saw, already filtered to the caller's PID namespace.

    `failed`: the GPUs that could not be read in this pass, with why (UUID, reason): their
    processes are not in `processes`, and nothing is decided about their usage. (Only
    NVML's own reader knows it; the agent's socket does not carry it.) `activity_read_at`:
    when the processes' utilisation (`ProcessUsage.activity`) was read, on the monotonic
    clock; a reading is carried by every pass until the next, so a new value is a new
    reading. None where it is not known. `unplaced`: what NVML lists for processes the
    reader cannot place in a PID namespace (NVML's own reader alone knows it)."""

    sampled_at: float
    devices: tuple[Device, ...]
    processes: tuple[ProcessUsage, ...]
    failed: tuple[tuple[str, str], ...] = ()
    activity_read_at: float | None = None
    unplaced: tuple[Unplaced, ...] = ()


@dataclass(frozen=True, slots=True)
class SourceDown:
    """A usage source could not produce a sample; `reason` is for humans."""

    reason: str


@dataclass(frozen=True, slots=True)
class ProcessTotal:
    """One process's usage inside one enforcement unit, per device and summed.

    `used_bytes` counts only what NVML reported. A device where NVML listed the process but
    not its usage appears in `by_device` with None: that usage is never guessed as zero for
    choosing a victim, and a process with only unknown usage is never killed.
    """

    key: ProcessKey
    used_bytes: int
    by_device: tuple[tuple[str, int | None], ...]
    cmdline: str = ""

    @property
    def unknown_devices(self) -> tuple[str, ...]:
        return tuple(uuid for uuid, used in self.by_device if used is None)


@dataclass(frozen=True, slots=True)
class UnitUsage:
    """The usage of one unit that carries a limit: a container, or `exec`'s command tree."""

    name: str
    limit_bytes: int
    processes: tuple[ProcessTotal, ...] = ()
    # False when membership is only known for the whole pod: such a unit is reported on,
    # never enforced, since no single process of it is proven to be the culprit.
    enforceable: bool = True
    # The process whose exit restarts the container (action `restart`), when known.
    init_process: ProcessTotal | None = None
    # The one GPU whose usage the unit counts (DRA: a limit per GPU); None: all of them.
    device_uuid: str | None = None
    used_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "used_bytes", sum(p.used_bytes for p in self.processes))

    @property
    def has_unknown(self) -> bool:
        return any(p.unknown_devices for p in self.processes)


@dataclass(frozen=True, slots=True)
class GpuShare:
    """What one unit holds and does on one GPU: its processes' memory there, and their
    utilisation summed (None when NVML cannot tell on that GPU)."""

    unit: str
    gpu: str
    used_bytes: int
    activity: Activity | None


class Action(StrEnum):
    """What to do with a unit over its limit."""

    WARN = "warn"
    TERMINATE = "terminate"
    KILL = "kill"
    RESTART = "restart"


class SignalResult(StrEnum):
    """What became of one attempt to signal a process; only SENT means a signal went out."""

    SENT = "sent"
    GONE = "gone"
    IDENTITY_CHANGED = "identity-changed"
    NOT_MEMBER = "not-member"
    PROTECTED = "protected"
    DENIED = "denied"  # the kernel refused the signal
    UNVERIFIED = "unverified"  # the process could not be pinned or read: not proven
    IN_PROGRESS = "in-progress"  # already being terminated; nothing new was sent


def format_bytes(n: int | None) -> str:
    """Human-readable binary size, as people read it in `kubectl describe` and logs."""
    if n is None:
        return "unknown"
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for suffix in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {suffix}"
        value /= 1024
    return f"{value:.2f} TiB"


class LimitResult(StrEnum):
    """What became of one limit on one GPU (NVML's return codes, in our terms)."""

    SET = "set"
    UNSUPPORTED = "unsupported"  # the driver or the GPU has no per-cgroup limits
    FORBIDDEN = "forbidden"  # NVML's NO_PERMISSION: the caller is not root
    NO_CGROUP = "no-cgroup"  # the driver cannot open the cgroup (gone, or not cgroup v2)
    NO_DMEM = "no-dmem"  # Set's NOT_FOUND: that cgroup has no dmem files (NVIDIA's MPS v3 page)
    REJECTED = "rejected"  # NVML refused the values themselves
    NOT_APPLIED = "not-applied"  # accepted, but a read afterwards does not show it
    FAILED = "failed"  # anything else; worth another try later


@dataclass(frozen=True, slots=True)
class HeldLimit:
    """What the driver holds for one cgroup on one GPU (R615+): its limits, and the memory
    it charges to them now, its own account of what the cgroup's processes hold."""

    hard_bytes: int
    soft_bytes: int
    charged_bytes: int


@dataclass(frozen=True, slots=True)
class LimitOutcome:
    result: LimitResult
    detail: str = ""  # NVML's own words, for the log

    @property
    def final(self) -> bool:
        """Whether this GPU (UNSUPPORTED) or this caller (FORBIDDEN) will never get hard
        limits, so that trying again only repeats the failure until a restart."""
        return self.result in (LimitResult.UNSUPPORTED, LimitResult.FORBIDDEN)
