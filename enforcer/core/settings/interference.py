"""`vram-enforcer interference`'s settings: the command line only.

The workloads themselves come as repeated `--workload NAME:LIMIT:COMMAND` arguments
(read by the command line, as `exec` reads its command) and as `--builtin` names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from enforcer.core.interference.workloads import (
    BUILTINS,
    Workload,
    builtin_workloads,
    check_workloads,
    parse_builtins,
    parse_count,
    parse_gpu,
    parse_scale,
    parse_workload,
)
from enforcer.core.parsing import as_text, choice, parse_percent, positive_duration
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import log_format

BUILTIN = value(
    "builtin",
    parse_builtins,
    f"built-in PyTorch workloads to measure, comma-separated: {','.join(BUILTINS)}",
    flag="--builtin",
    metavar="NAMES",
    doc="built-in PyTorch workloads to measure, comma-separated, next to any `--workload`: "
    + "; ".join(f"`{b.name}` ({b.profile})" for b in BUILTINS.values())
    + ". They need PyTorch in the Python that runs vram-enforcer. See "
    "[interference.md](interference.md#built-in-workloads)",
)
BUILTIN_DEVICE = value(
    "builtin_device",
    choice("cuda", "cpu"),
    "where the built-in workloads compute",
    flag="--builtin-device",
    default="cuda",
    metavar="cuda|cpu",
    doc="where the built-in workloads compute. `cpu` tries the tool with a PyTorch that has "
    "no CUDA (slowly, and with no GPU memory to measure); every run still goes through "
    "`exec`, which needs the NVIDIA driver (NVML)",
)
BUILTIN_SCALE = value(
    "builtin_scale",
    parse_scale,
    "multiply the built-in workloads' steps, and so their length, by this",
    flag="--builtin-scale",
    default="1",
    metavar="FACTOR",
    doc="multiply the built-in workloads' steps (their amount of work) by this: `0.2` for a "
    "quick look, `2` for steadier figures",
)
REPEAT = value(
    "repeat",
    parse_count(1),
    "measured runs of each workload alone and of each pair",
    flag="--repeat",
    default="3",
    metavar="N",
    doc="measured runs of each workload alone and of each pair, interleaved (everything "
    "once, then everything again). With 1, the report cannot say how stable it is",
)
WARMUP = value(
    "warmup",
    parse_count(0),
    "runs of each workload alone before measuring, discarded",
    flag="--warmup",
    default="1",
    metavar="N",
    doc="runs of each workload alone before anything is measured; they are reported as "
    "`warmup` runs and left out of every figure",
)
TIMEOUT = value(
    "timeout",
    positive_duration(1.0),
    "stop a run that is still going after this long",
    flag="--timeout",
    default="30m",
    metavar="DURATION",
    doc="a run still going after this long is sent SIGTERM (through exec, which passes it "
    "on), then SIGKILL 15s later, and reported as `TIMEOUT`",
)
MAX_SPREAD = value(
    "max_spread",
    parse_percent,
    "flag cells whose repetitions spread more than this ((max - min) / median)",
    flag="--max-spread",
    default="10%",
    metavar="PERCENT",
    doc="a cell whose repetitions spread more than this ((max - min) / median) is marked "
    "`*`, and the report says how to make it steadier",
)
OUTPUT = value(
    "output",
    as_text,
    "write report.json, report.md, heatmap.png and each run's logs (runs/) here",
    flag="--output",
    metavar="DIR",
    doc="write `report.json` (everything, each run's raw figures included), `report.md`, "
    "`heatmap.png` and each run's output and exec summary (`runs/`) to this directory, "
    "created if missing. Without it, only the table on stdout",
)
GPU = value(
    "gpu",
    parse_gpu,
    "run every workload on this GPU: its index or UUID",
    flag="--gpu",
    metavar="INDEX",
    doc="run every workload on this GPU (index or UUID), through `CUDA_VISIBLE_DEVICES` and "
    "`NVIDIA_VISIBLE_DEVICES`. Without it, the workloads see whatever GPUs they would",
)
START_GATE = switch(
    "start_gate",
    "--start-gate",
    "the --workload commands wait at the start gate too, as the built-ins do",
    doc="the `--workload` commands of a pair wait at the start gate, as the built-ins always "
    "do: each creates the file `VRAM_ENFORCER_READY_FILE` names once it is set up and waits "
    "until the file `VRAM_ENFORCER_GO_FILE` names exists, so that the two start their work "
    "together. Only for commands that do this (see "
    "[interference.md](interference.md#starting-together)): a command that never creates "
    "its ready file holds its neighbour at the gate until it exits",
)
LOG_FORMAT = log_format("text")
VERBOSE = verbosity("one line per run")

DECLARED: tuple[Setting[Any], ...] = (
    BUILTIN,
    BUILTIN_DEVICE,
    BUILTIN_SCALE,
    REPEAT,
    WARMUP,
    TIMEOUT,
    MAX_SPREAD,
    OUTPUT,
    GPU,
    START_GATE,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class InterferenceSettings:
    """Everything `vram-enforcer interference` needs, validated."""

    workloads: tuple[Workload, ...]
    repeat: int
    warmup: int
    timeout: float
    max_spread: float
    output: str | None = None
    gpu: str | None = None
    builtins: tuple[str, ...] = ()  # the built-ins among the workloads: they need PyTorch


def interference_settings(values: Values, specs: list[str], python: str) -> InterferenceSettings:
    """The settings, with the `--workload` arguments and the Python that runs built-ins."""
    builtins: tuple[str, ...] = values[BUILTIN] or ()
    gated = values[START_GATE]
    workloads = [replace(parse_workload(spec), gated=gated) for spec in specs] + list(
        builtin_workloads(builtins, python, values[BUILTIN_DEVICE], values[BUILTIN_SCALE])
    )
    return InterferenceSettings(
        workloads=check_workloads(workloads),
        repeat=values[REPEAT],
        warmup=values[WARMUP],
        timeout=values[TIMEOUT],
        max_spread=values[MAX_SPREAD],
        output=values[OUTPUT],
        gpu=values[GPU],
        builtins=builtins,
    )
