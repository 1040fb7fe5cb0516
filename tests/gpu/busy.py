"""A real CUDA workload that keeps the GPU busy: matmuls until killed.

Usage: busy.py SECONDS. Prints "busy" once the first kernels ran.
"""

import sys
import time

import torch

a = torch.randn(4096, 4096, device="cuda")
b = torch.randn(4096, 4096, device="cuda")
deadline = time.monotonic() + float(sys.argv[1])
torch.cuda.synchronize()
print("busy", flush=True)
while time.monotonic() < deadline:
    for _ in range(20):
        a = (a @ b).tanh_()
    torch.cuda.synchronize()
