"""Whether this machine can run the GPU tests: a real NVIDIA driver with a GPU, and PyTorch."""

import importlib.util
from functools import cache


@cache
def why_no_gpu() -> str | None:
    """None when the GPU tests can run, else why not (the skip reason)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        return f"no NVIDIA driver/GPU: {exc}"
    if count == 0:
        return "NVML reports no GPU"
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    return None
