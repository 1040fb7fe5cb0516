"""A real CUDA workload: allocate GPU memory step by step, then hold it.

Usage: alloc.py STEP_MIB STEPS HOLD_SECONDS. Prints the total after each step.
"""

import sys
import time

import torch

step_mib, steps, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
blocks = []
for i in range(steps):
    blocks.append(torch.empty(step_mib * 1024 * 1024, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print(f"allocated {(i + 1) * step_mib} MiB", flush=True)
    time.sleep(0.2)
time.sleep(hold)
print("done", flush=True)
