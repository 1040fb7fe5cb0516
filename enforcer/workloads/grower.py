"""`python -m enforcer.workloads.grower DIR`: the command that `vram-enforcer demo` runs.

It allocates no GPU memory at all: it *says* it holds more simulated GPU memory every
EVERY seconds, a STEP at a time up to PEAK, by writing the amount to `DIR/<its pid>`,
where the demo's simulated GPU reads it as NVML would list a process's usage. It then
holds PEAK for HOLD seconds and exits 0, unless the enforcer stopped it first. It is a
real process that the real enforcer samples, attributes and signals; it imports nothing
of the enforcer (it runs under it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PROG = "python -m enforcer.workloads.grower"
# Every line it prints says so; the same label as enforcer.edge.simulated_gpu.LABEL,
# which this package may not import.
LABEL = "[simulated GPU]"
MiB = 1024**2
STEP = 256 * MiB
PEAK = 1536 * MiB  # above the demo's default 1Gi limit; a --limit of 1536Mi or more fits it
EVERY = 0.25  # seconds between two steps: a few of the enforcer's samples each
HOLD = 1.0  # seconds at PEAK before exiting: the enforcer sees it there


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=f"Claim {STEP // MiB} MiB more simulated GPU memory every {EVERY:g} s, "
        f"up to {PEAK // MiB} MiB, hold it {HOLD:g} s, and exit. Nothing is allocated: "
        "the amount is written to DIR/<pid> for vram-enforcer demo's simulated GPU.",
    )
    p.add_argument(
        "directory",
        type=Path,
        metavar="DIR",
        help="where the simulated GPU reads what each process holds",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # A ^C ends it as it ends a C program (status 130 through the enforcer), with no traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    pid = os.getpid()
    held = 0
    while True:
        held += STEP
        try:
            _claim(args.directory, pid, held)
        except OSError as exc:
            print(
                f"{PROG}: cannot write to {args.directory} ({exc.strerror or exc}): give the "
                "directory the simulated GPU reads (vram-enforcer demo makes one)",
                file=sys.stderr,
            )
            return 2
        print(
            f"{LABEL} grower (pid {pid}): holds {held // MiB} MiB of simulated GPU memory",
            flush=True,
        )
        if held >= PEAK:
            break
        time.sleep(EVERY)
    time.sleep(HOLD)
    print(f"{LABEL} grower (pid {pid}): done, exiting with {held // MiB} MiB", flush=True)
    return 0


def _claim(directory: Path, pid: int, held: int) -> None:
    """Replace DIR/<pid> at once, so that the simulated GPU never reads half a number."""
    tmp = directory / f".{pid}.tmp"
    tmp.write_text(f"{held}\n")
    tmp.replace(directory / str(pid))


if __name__ == "__main__":
    sys.exit(main())
