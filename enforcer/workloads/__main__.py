"""`python -m enforcer.workloads NAME`: run one built-in workload (see the package)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from enforcer.workloads import (
    EXIT_NO_DEVICE,
    EXIT_NO_TORCH,
    EXIT_OUT_OF_MEMORY,
    GO_ENV,
    PROFILES,
    READY_ENV,
    TIMING_ENV,
    kernels,
)

PROG = "python -m enforcer.workloads"
# How long a workload set up in a pair waits for its neighbour before it starts alone:
# longer than any start-up (seconds), and it is what lets a workload whose interference
# was killed end by itself.
GATE_PATIENCE = 600.0
GATE_POLL = 0.001  # the pair's two sections start within about this of each other

STEPS = "\n".join(
    f"  {p.name:<8}cuda {p.steps['cuda']:>6}   cpu {p.steps['cpu']:>4}" for p in PROFILES.values()
)
EPILOG = f"""\
default steps (estimated: about 10 s on an H100-class GPU, 5-10 s on a CPU):
{STEPS}

timing: the steps are timed after the start-up; run by `vram-enforcer interference`, the
section is written to the file $VRAM_ENFORCER_TIMING_FILE names, and the report uses it.
In a pair, once set up it creates $VRAM_ENFORCER_READY_FILE and starts its steps when
$VRAM_ENFORCER_GO_FILE exists, so that both workloads are timed side by side.

exit status:
  0 done; 2 bad arguments; {EXIT_OUT_OF_MEMORY} out of memory (one line on stderr says so);
  {EXIT_NO_TORCH} PyTorch is not installed; {EXIT_NO_DEVICE} --device cuda, but PyTorch sees no GPU.
"""


def _steps(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps, 1 or more")
    return int(text)


def _scale(text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = -1.0
    if not 0 < factor <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a factor above 0, such as 0.5 or 2")
    return factor


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run one built-in workload: a fixed number of steps, then exit.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=list(PROFILES), help="the workload")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--steps", type=_steps, help="how many steps [default: by device]")
    amount.add_argument(
        "--scale", type=_scale, default=1.0, help="multiply the default steps by this [default: 1]"
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where to compute [default: cuda]"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    began = time.monotonic()
    steps = args.steps or max(1, round(PROFILES[args.name].steps[args.device] * args.scale))
    try:
        import torch  # noqa: PLC0415 - heavy, and only once the arguments are valid
    except ImportError as exc:
        print(
            f"{PROG} {args.name}: PyTorch is not installed for {sys.executable} ({exc}); "
            "install it (https://pytorch.org/get-started/locally/), or run with a Python "
            "that has it",
            file=sys.stderr,
        )
        return EXIT_NO_TORCH
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"{PROG} {args.name}: PyTorch {torch.__version__} sees no CUDA GPU; use "
            "--device cpu to run on the CPU",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    device = torch.device(args.device)
    try:
        ready, done = kernels.run(torch, args.name, device, steps, _wait_at_gate)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG} {args.name}: out of memory: {reason}", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    print(
        f"{args.name}: {steps} steps on {args.device} in {done - ready:.2f} s, after "
        f"{ready - began:.2f} s of start-up (PyTorch, the device, the data)",
        flush=True,
    )
    _write_section(ready, done)
    return 0


def _wait_at_gate() -> None:
    """In a pair: say this workload is set up, and wait for `interference` to let both
    begin (see enforcer.core.interference.READY_ENV). Alone, or outside it: go at once."""
    ready, go = os.environ.get(READY_ENV), os.environ.get(GO_ENV)
    if not ready or not go:
        return
    try:
        with open(ready, "x"):
            pass
    except OSError as exc:
        print(
            f"{PROG}: cannot create {READY_ENV}={ready} ({exc.strerror or exc}); "
            "starting without waiting for the neighbour",
            file=sys.stderr,
        )
        return
    patience = time.monotonic() + GATE_PATIENCE
    while not os.path.exists(go):
        if time.monotonic() > patience:
            print(
                f"{PROG}: {GO_ENV}={go} did not appear within {GATE_PATIENCE:.0f} s; "
                "starting without the neighbour",
                file=sys.stderr,
            )
            return
        time.sleep(GATE_POLL)


def _write_section(start: float, end: float) -> None:
    """Tell `vram-enforcer interference` which part of the run was the work. The work is
    done either way: if the file cannot be written, the report times the whole command."""
    path = os.environ.get(TIMING_ENV)
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"start_monotonic": start, "end_monotonic": end}, f)
    except OSError as exc:
        print(
            f"{PROG}: cannot write the timed section to {TIMING_ENV}={path}: {exc.strerror or exc}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
