"""The allocation gate's GPU workloads (the research note's `w.py`, §9): what CUDA and
PyTorch make of the driver's out-of-memory status written by the gate.

Usage: gate_workload.py MODE, one JSON object per line on stdout (the test merges them;
each is printed as soon as it is known, so a process stopped half-way still says what it
got to):

  trace    a context, a 256 MiB tensor freed, empty_cache, mem_get_info
  grow     1 GiB tensors until an error (its type and first line), then 512 MiB after
           freeing 1 GiB: "recovered" (PyTorch's allocator; PYTORCH_CUDA_ALLOC_CONF picks
           expandable segments or cudaMallocAsync)
  driver   cuMemAlloc_v2 of 1 GiB until an error, then cuMemCreate of 1 GiB: the codes
  managed  8 GiB of cuMemAllocManaged, prefetched to the GPU: managed memory is not gated
  settle   1 GiB allocated, then freed: how long NVML's figure for this process takes to
           show each (polled every millisecond)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

GiB = 1 << 30
CU_MEM_ATTACH_GLOBAL = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1


def say(**found: Any) -> None:
    print(json.dumps(found), flush=True)


def context() -> Any:
    """PyTorch's context on the first GPU, timed."""
    import torch  # not on the machines that skip the GPU tests

    started = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    say(context_s=time.perf_counter() - started)
    return torch


def trace() -> None:
    torch = context()
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
    say(mem_get_info=list(torch.cuda.mem_get_info()))


def grow() -> None:
    torch = context()
    held = []
    try:
        while True:
            held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    except Exception as exc:  # hoped for: torch.OutOfMemoryError
        say(grown_gib=len(held), error=type(exc).__name__, message=str(exc).splitlines()[0])
    held = held[:-1]
    torch.cuda.empty_cache()
    try:
        held.append(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))
    except Exception as exc:
        say(recovered=False, recovery_error=f"{type(exc).__name__}: {exc}")
    else:
        say(recovered=True)


class _Cuda:
    """The driver API through libcuda.so.1, its results as "CODE NAME"."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = ctypes.c_int()
        ctx = ctypes.c_void_p()
        self.lib.cuInit(0)
        self.lib.cuDeviceGet(ctypes.byref(self.device), 0)
        self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device)
        self.lib.cuCtxSetCurrent(ctx)

    def said(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        return f"{code} {(name.value or b'').decode()}"


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


def driver() -> None:
    cu = _Cuda()
    pointer, n = ctypes.c_uint64(), 0
    while (code := cu.lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(GiB))) == 0:
        n += 1
    say(cu_mem_alloc_gib=n, cu_mem_alloc=cu.said(code))
    prop = _Prop(
        type=CU_MEM_ALLOCATION_TYPE_PINNED,
        location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, 0),
    )
    handle = ctypes.c_uint64()
    code = cu.lib.cuMemCreate(
        ctypes.byref(handle), ctypes.c_size_t(GiB), ctypes.byref(prop), ctypes.c_ulonglong(0)
    )
    say(cu_mem_create=cu.said(code))


def managed() -> None:
    cu = _Cuda()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    before = free.value
    pointer, size = ctypes.c_uint64(), 8 * GiB
    code = cu.lib.cuMemAllocManaged(
        ctypes.byref(pointer), ctypes.c_size_t(size), ctypes.c_uint(CU_MEM_ATTACH_GLOBAL)
    )
    say(managed_alloc=cu.said(code))
    code = cu.lib.cuMemPrefetchAsync(pointer, ctypes.c_size_t(size), cu.device, None)
    say(managed_prefetch=cu.said(code), managed_sync=cu.said(cu.lib.cuCtxSynchronize()))
    cu.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    say(managed_resident_gib=(before - free.value) / GiB)


def _until(seen: Callable[[], bool], deadline: float = 5.0) -> float | None:
    """Milliseconds until `seen()` (polled every millisecond), None past `deadline` s."""
    started = time.perf_counter()
    while time.perf_counter() - started < deadline:
        if seen():
            return (time.perf_counter() - started) * 1000
        time.sleep(0.001)
    return None


def settle() -> None:
    import pynvml

    torch = context()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    pid = os.getpid()

    def mine() -> int:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)

    base = mine()
    say(listed=base > 0, context_bytes=base)
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    say(appear_ms=_until(lambda: mine() >= base + GiB))
    del x
    torch.cuda.empty_cache()
    say(vanish_ms=_until(lambda: mine() < base + GiB))
    pynvml.nvmlShutdown()


MODES = {
    "trace": trace,
    "grow": grow,
    "driver": driver,
    "managed": managed,
    "settle": settle,
}

if __name__ == "__main__":
    MODES[sys.argv[1]]()
