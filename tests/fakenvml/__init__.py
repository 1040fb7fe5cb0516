"""Build the fake libnvidia-ml.so.1 and describe the GPUs it reports.

The library is compiled from `fake_nvml.c` against NVIDIA's own `nvml.h` (from the
`nvidia-nvml-dev` wheel), so every function we export has the real signature. Its state
is a JSON file (see README.md) that `FakeGpuState` writes atomically.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY = "libnvidia-ml.so.1"
GiB = 1024**3
LIMITS_DRIVER = "615.43.02"  # a driver with nvmlDeviceSetMemoryLimits_v1 (R615+)
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: with soft 0, "no limit"


class FakeNvmlBuildError(RuntimeError):
    pass


def nvml_header_dir() -> Path:
    """The directory holding NVIDIA's nvml.h: $NVML_INCLUDE_DIR or the nvidia-nvml-dev wheel."""
    explicit = os.environ.get("NVML_INCLUDE_DIR")
    if explicit:
        if not (Path(explicit) / "nvml.h").is_file():
            raise FakeNvmlBuildError(f"NVML_INCLUDE_DIR={explicit} holds no nvml.h")
        return Path(explicit)
    try:
        dist = importlib.metadata.distribution("nvidia-nvml-dev")
    except importlib.metadata.PackageNotFoundError:
        raise FakeNvmlBuildError(
            "nvml.h not found: `pip install nvidia-nvml-dev` (part of the dev extras), "
            "or set NVML_INCLUDE_DIR to a directory holding nvml.h"
        ) from None
    for f in dist.files or ():
        if f.name == "nvml.h":
            return Path(str(dist.locate_file(f))).parent
    raise FakeNvmlBuildError("the nvidia-nvml-dev package holds no nvml.h")


def build_fake_nvml(build_dir: Path) -> Path:
    """Compile the library into `build_dir` (if stale) and return that directory."""
    build_dir.mkdir(parents=True, exist_ok=True)
    target = build_dir / LIBRARY
    if target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return build_dir
    fd, tmp = tempfile.mkstemp(dir=build_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    cmd = [
        "gcc",
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-std=c11",
        "-pthread",
        f"-Wl,-soname,{LIBRARY}",
        f"-I{nvml_header_dir()}",
        "-o",
        tmp,
        str(SOURCE),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        raise FakeNvmlBuildError(f"gcc failed building the fake NVML:\n{result.stderr}")
    os.replace(tmp, target)  # atomic: concurrent test runs never load half a library
    return build_dir


def _device(index: int, **fields: Any) -> dict[str, Any]:
    device: dict[str, Any] = {
        "uuid": f"GPU-{index:08x}-fake-4000-8000-{index:012x}",
        "name": "NVIDIA H100 80GB HBM3",
        "total_bytes": 80 * GiB,
        "used_bytes": 0,
        "compute_processes": [],
        "graphics_processes": [],
        "errors": {},
    }
    device.update(fields)
    return device


class FakeGpuState:
    """The JSON the fake library reads; `data` is the document itself, for anything unusual."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @classmethod
    def single_gpu(cls, total_bytes: int = 80 * GiB) -> FakeGpuState:
        return cls(
            {
                "driver_version": "550.54.15",
                "errors": {},
                "init_error": None,
                "devices": [_device(0, total_bytes=total_bytes)],
            }
        )

    def support_memory_limits(self, supported: bool = True, charges: bool = True) -> None:
        """A driver new enough for per-cgroup limits (R615+), or the default, older one.
        `charges=False`: a driver that holds the limits but charges no process's memory to
        them (`currentUsed` 0), as one that binds only MPS clients would for others."""
        self.data["driver_version"] = LIMITS_DRIVER if supported else "550.54.15"
        self.data["limits_charge"] = int(charges)

    def limits_backend(self, backend: str) -> None:
        """ "dmem" (the default: the kernel's dmem controller, Linux 6.14+) or "misc" (the
        driver's own fallback on older kernels, whose limits do not nest)."""
        self.data["limits_backend"] = backend

    def without_dmem_below(self, cgroup: Path) -> None:
        """`cgroup`'s cgroup.subtree_control lacks dmem: no cgroup below it has dmem files
        (this kernel has no dmem controller, so the state file says it)."""
        self.data.setdefault("subtree_without_dmem", []).append(str(cgroup))

    def set_reserved(self, device_index: int, reserved_bytes: int) -> None:
        """The memory the driver and firmware set aside on a GPU (NVML memory info v2's
        `reserved`; 512 MiB unless set)."""
        self.devices[device_index]["reserved_bytes"] = reserved_bytes

    def copy(self) -> FakeGpuState:
        return FakeGpuState(copy.deepcopy(self.data))

    @property
    def devices(self) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = self.data["devices"]
        return devices

    def add_device(self, **fields: Any) -> dict[str, Any]:
        device = _device(len(self.devices), **fields)
        self.devices.append(device)
        return device

    def set_process(
        self,
        device_index: int,
        pid: int,
        used_bytes: int | None,
        kind: str = "compute",
        managed_bytes: int = 0,
    ) -> None:
        """Report `pid` (a host pid) holding `used_bytes` (None: not available) on a device,
        `managed_bytes` of it allocated with cudaMallocManaged (charged to no cgroup)."""
        procs = self.devices[device_index][f"{kind}_processes"]
        procs[:] = [p for p in procs if p["pid"] != pid]
        process: dict[str, Any] = {"pid": pid, "used_bytes": used_bytes}
        if managed_bytes:
            process["managed_bytes"] = managed_bytes
        procs.append(process)
        self._sync_used(device_index)

    def set_utilization(self, device_index: int, pid: int, sm: int, memory: int) -> None:
        """Hold a compute process of the device at `sm` % SM and `memory` % memory-controller
        utilisation: a steady load, as NVML's per-process samples report it."""
        for p in self.devices[device_index]["compute_processes"]:
            if p["pid"] == pid:
                p["sm_util"], p["mem_util"] = sm, memory
                return
        raise KeyError(f"no compute process {pid} on device {device_index}")

    def remove_process(self, pid: int) -> None:
        for i, device in enumerate(self.devices):
            for kind in ("compute_processes", "graphics_processes"):
                device[kind] = [p for p in device[kind] if p["pid"] != pid]
            self._sync_used(i)

    def _sync_used(self, device_index: int) -> None:
        device = self.devices[device_index]
        used: dict[int, int] = {}
        for kind in ("compute_processes", "graphics_processes"):
            for p in device[kind]:
                used[p["pid"]] = max(used.get(p["pid"], 0), p["used_bytes"] or 0)
        device["used_bytes"] = min(device["total_bytes"], sum(used.values()))

    def enable_mig(self, device_index: int, partitions: list[dict[str, Any]]) -> None:
        self.devices[device_index]["mig"] = {"mode": 1, "devices": partitions}

    def inject_error(self, function: str, error: str, device_index: int | None = None) -> None:
        """Make `function` (an NVML symbol name, or "*") return NVML_ERROR_<error>."""
        target = self.data if device_index is None else self.devices[device_index]
        target.setdefault("errors", {})[function] = error

    def clear_errors(self) -> None:
        self.data["errors"] = {}
        for device in self.devices:
            device["errors"] = {}

    def write(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, path)


def limit_records(state_file: Path) -> list[dict[str, Any]]:
    """Every nvmlDeviceSetMemoryLimits_v1 call the fake accepted, oldest first: device,
    cgroup (the path as given), inode, soft, hard (what the driver holds since), asked_hard
    (what the caller asked: `hard` differs where the driver kept the old one, a limit below
    usage),
    ancestors (the inodes whose dmem.min it moved) and the caller's pid."""
    path = state_file.with_name(state_file.name + ".limits.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]
