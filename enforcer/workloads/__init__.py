"""Built-in synthetic PyTorch workloads for `vram-enforcer interference`, one per profile:
compute-bound (`matmul`), memory-bandwidth-bound (`copy`), a small CNN's training steps
(`cnn`) and a latency-bound inference loop (`infer`).

Run one as `python -m enforcer.workloads NAME [--steps N | --scale F] [--device cuda|cpu]`.
Each does a fixed amount of work (its steps), so that its time is the measure: next to a
neighbour the same work takes longer. Each times its steps itself, after its start-up
(importing PyTorch, creating the CUDA context, allocating its data: a few seconds), and
writes that section to the file `interference` names in TIMING_ENV, so that the start-up
does not dilute the slowdown; and in a pair, it starts its steps when its neighbour does
(the start gate, READY_ENV and GO_ENV), so that the two are timed side by side.
PyTorch is imported only once the arguments are valid, and nothing else of the enforcer
is imported here at all.

This module is the catalogue: names, default steps per device, GPU memory. The work
itself is in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Where `vram-enforcer interference` asks for the section a workload timed itself; the
# same name as enforcer.core.interference.TIMING_ENV, which this package may not import.
TIMING_ENV = "VRAM_ENFORCER_TIMING_FILE"
# Its start gate (enforcer.core.interference.READY_ENV, GO_ENV): once set up, create the
# first file, and start the work when the second exists, with the neighbour's.
READY_ENV = "VRAM_ENFORCER_READY_FILE"
GO_ENV = "VRAM_ENFORCER_GO_FILE"

EXIT_OUT_OF_MEMORY = 3
EXIT_NO_TORCH = 4
EXIT_NO_DEVICE = 5  # --device cuda, and PyTorch sees no CUDA GPU

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True, slots=True)
class Profile:
    """A built-in workload: its default steps on each device and its GPU memory."""

    name: str
    steps: Mapping[str, int]  # by device: about 10 s on an H100-class GPU, 5-10 s on a CPU
    tensor_bytes: int  # what it allocates on a GPU, before PyTorch's CUDA context


PROFILES: Mapping[str, Profile] = {
    p.name: p
    for p in (
        # A, B and C: 8192 x 8192 bf16 each. Each step is 1.1 TFLOP.
        Profile("matmul", {"cuda": 6000, "cpu": 400}, 3 * 8192 * 8192 * 2),
        # Two 1 GiB float32 tensors; each step reads one and writes the other.
        Profile("copy", {"cuda": 12000, "cpu": 1000}, 2 * GiB),
        # About: a 1.2 M-parameter ResNet with momentum, and batch 256's activations.
        Profile("cnn", {"cuda": 2000, "cpu": 40}, 1536 * MiB),
        # About: a 19 M-parameter transformer (76 MiB) and batches of up to 8 x 128 tokens.
        Profile("infer", {"cuda": 5000, "cpu": 40}, 128 * MiB),
    )
}
