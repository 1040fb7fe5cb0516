"""The built-in workloads' work, in PyTorch.

This module does not import PyTorch: `__main__` hands the module over once it is known
to be installed. So every module of the package imports without it (the image, which
has no PyTorch, imports them all as a smoke test). Each workload takes PyTorch and the
device, sets itself up, and returns its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from enforcer.workloads import GiB, MiB

Step = Callable[[int], None]


def run(
    torch: Any, name: str, device: Any, steps: int, when_set_up: Callable[[], None]
) -> tuple[float, float]:
    """Set workload `name` up, call `when_set_up`, then run its steps; (steps began, done)
    on CLOCK_MONOTONIC, the clock `exec` times the whole command with."""
    torch.manual_seed(0)
    step = WORKLOADS[name](torch, device)
    _finish(torch, device)
    when_set_up()
    ready = time.monotonic()
    for i in range(steps):
        step(i)
    _finish(torch, device)
    return ready, time.monotonic()


def _finish(torch: Any, device: Any) -> None:
    """Wait for the device: CUDA calls only queue the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul(torch: Any, device: Any) -> Step:
    """Compute-bound: C = A @ B, 8192 x 8192 in bf16 on a GPU (1024 in fp32 on a CPU)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def step(_: int) -> None:
        torch.matmul(a, b, out=c)

    return step


def copy(torch: Any, device: Any) -> Step:
    """Memory-bandwidth-bound: copies between two 1 GiB tensors (64 MiB on a CPU)."""
    size = GiB if device.type == "cuda" else 64 * MiB
    tensors = [torch.ones(size // 4, device=device), torch.empty(size // 4, device=device)]

    def step(i: int) -> None:
        tensors[(i + 1) % 2].copy_(tensors[i % 2])

    return step


def cnn(torch: Any, device: Any) -> Step:
    """Training steps of a small ResNet on random 32x32 images (batch 256; 16 on a CPU),
    with SGD and momentum: convolutions, batch norm and the optimiser's memory traffic."""
    nn = torch.nn
    module: Any = nn.Module

    class Block(module):  # type: ignore[misc]
        """A ResNet basic block: two 3x3 convolutions and a shortcut."""

        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: Any) -> Any:
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    batch = 256 if device.type == "cuda" else 16
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        Block(64, 64, 1),
        Block(64, 128, 2),
        Block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, 10),
    ).to(device)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = nn.CrossEntropyLoss()
    images = torch.randn(batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def step(_: int) -> None:
        optimiser.zero_grad(set_to_none=True)
        loss(model(images), labels).backward()
        optimiser.step()

    return step


def infer(torch: Any, device: Any) -> Step:
    """Latency-bound: a 6-layer transformer encoder (d_model 512) answering requests of
    1 to 8 sequences of 128 tokens in turn, each answered before the next, as a server
    does: short kernels, a GPU often idle between them."""
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(device).eval()
    requests = [torch.randn(b, 128, 512, device=device) for b in range(1, 9)]

    def step(i: int) -> None:
        with torch.inference_mode():
            model(requests[i % len(requests)])
        _finish(torch, device)

    return step


WORKLOADS: dict[str, Callable[[Any, Any], Step]] = {
    "matmul": matmul,
    "copy": copy,
    "cnn": cnn,
    "infer": infer,
}
