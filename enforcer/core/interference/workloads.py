"""The workloads to measure: `--workload NAME:LIMIT:COMMAND`, the built-ins, and the
variables a run is given (its timed section, the start gate)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from enforcer.core.model import GiB
from enforcer.core.parsing import ConfigError, ascii_int, parse_bytes

# Set for every run: where the workload may write the section it timed itself, as
# {"start_monotonic": S, "end_monotonic": E} on CLOCK_MONOTONIC (Python's time.monotonic()).
# The built-in workloads do (enforcer.workloads keeps its own copy of the name).
TIMING_ENV = "VRAM_ENFORCER_TIMING_FILE"
TIMING_FORM = '{"start_monotonic": S, "end_monotonic": E}, on CLOCK_MONOTONIC'

# The start gate, for the runs of a pair that wait at it (the built-ins; commands of one's
# own with --start-gate): once set up, a workload creates the file READY_ENV names and waits
# until the file GO_ENV names exists; the mode creates it once every such run of the pair is
# ready or gone. The two timed sections then start together, however long each start-up
# took, instead of the shorter one being over before the longer one has begun.
READY_ENV = "VRAM_ENFORCER_READY_FILE"
GO_ENV = "VRAM_ENFORCER_GO_FILE"


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
WORKLOAD_FORM = "NAME:LIMIT:COMMAND, e.g. trainer:4Gi:python train.py --epochs 1"


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload: its name in the report, the GPU memory it declares, its command, and
    whether it waits at the start gate (READY_ENV, GO_ENV) when it runs in a pair."""

    name: str
    limit_bytes: int
    command: tuple[str, ...]
    gated: bool = False


@dataclass(frozen=True, slots=True)
class Builtin:
    """A built-in workload (`python -m enforcer.workloads NAME`) and its declared limit."""

    name: str
    limit_bytes: int
    profile: str


BUILTINS: Mapping[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("matmul", 2 * GiB, "compute-bound: 8192x8192 bf16 matrix multiplications"),
        Builtin("copy", 4 * GiB, "memory-bandwidth-bound: copies between two 1 GiB tensors"),
        Builtin("cnn", 4 * GiB, "training steps of a small ResNet: batch 256, 32x32, SGD"),
        Builtin("infer", 2 * GiB, "latency-bound: a 6-layer transformer answering batches of 1-8"),
    )
}


def parse_workload(text: str, field: str = "--workload") -> Workload:
    """`NAME:LIMIT:COMMAND`; only the first two colons split, and the command is split as
    a shell would (`shlex`), so a command may hold colons and quoted spaces."""
    name, _, rest = text.partition(":")
    limit, colon, command = rest.partition(":")
    if not colon:
        raise ConfigError(field, text, f"is not NAME:LIMIT:COMMAND; use {WORKLOAD_FORM}")
    if not _NAME.fullmatch(name):
        raise ConfigError(
            field,
            text,
            f"has the name {name!r}; a name is 1 to 32 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, e.g. trainer",
        )
    limit_bytes = parse_bytes(limit, f"{field} {name}: LIMIT")
    if limit_bytes == 0:
        raise ConfigError(
            f"{field} {name}: LIMIT", limit, "is 0; declare the GPU memory it needs, e.g. 4Gi"
        )
    try:
        argv = tuple(shlex.split(command))
    except ValueError as exc:
        raise ConfigError(
            field, text, f"has a COMMAND that cannot be split ({exc}); quote it as in a shell"
        ) from None
    if not argv:
        raise ConfigError(field, text, f"has no COMMAND; use {WORKLOAD_FORM}")
    return Workload(name, limit_bytes, argv)


def parse_builtins(text: str, field: str) -> tuple[str, ...]:
    """Names of built-in workloads, comma-separated, each once."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = ", ".join(BUILTINS)
    for name in names:
        if name not in BUILTINS:
            raise ConfigError(field, text, f"names {name!r}, which is not built in; use {known}")
    if not names:
        raise ConfigError(field, text, f"names no workload; use some of {known}")
    if len(set(names)) != len(names):
        raise ConfigError(field, text, "names a workload twice; name each once")
    return names


def builtin_workloads(
    names: Iterable[str], python: str, device: str, scale: float
) -> tuple[Workload, ...]:
    """The built-ins, each run by `python` with its declared limit."""
    extra = ("--scale", f"{scale:g}") if scale != 1 else ()
    return tuple(
        Workload(
            name,
            BUILTINS[name].limit_bytes,
            (python, "-m", "enforcer.workloads", name, "--device", device, *extra),
            gated=True,
        )
        for name in names
    )


def check_workloads(workloads: Sequence[Workload]) -> tuple[Workload, ...]:
    """At least two workloads, each with a name of its own."""
    seen: set[str] = set()
    for w in workloads:
        if w.name in seen:
            raise ConfigError(
                "--workload", w.name, "is the name of two workloads; give each its own name"
            )
        seen.add(w.name)
    if len(workloads) < 2:
        raise ConfigError(
            "--workload",
            None,
            f"gives {len(workloads)} workload(s), and a pair needs two; add --workload "
            f"{WORKLOAD_FORM}, or --builtin {','.join(BUILTINS)}",
        )
    return tuple(workloads)


def parse_count(minimum: int) -> Callable[[str, str], int]:
    """A parser of whole numbers of at least `minimum` (repetitions, warm-ups)."""

    def parse(text: str, field: str) -> int:
        count = ascii_int(text, 9)
        if count is None or count < minimum:
            raise ConfigError(field, text, f"is not a whole number of at least {minimum}")
        return count

    return parse


def parse_scale(text: str, field: str) -> float:
    """A positive factor (`0.2`, `2`)."""
    try:
        factor = float(text)
    except ValueError:
        factor = -1.0
    if not 0 < factor <= 1000:
        raise ConfigError(field, text, "is not a factor; use a number above 0, e.g. 0.5 or 2")
    return factor


def parse_gpu(text: str, field: str) -> str:
    """A GPU as CUDA_VISIBLE_DEVICES names one: its index, or its UUID (`GPU-...`, `MIG-...`)."""
    if (text.isascii() and text.isdigit()) or re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", text):
        return text
    raise ConfigError(
        field,
        text,
        "is not a GPU; use its index (0, 1, ...) or its UUID (GPU-...), as "
        "nvidia-smi -L lists them",
    )
