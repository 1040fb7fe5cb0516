"""A stand-in for NVIDIA's `apply-cuda-memory-limits` CDI hook (a test double of a
third-party component, the outermost boundary): what the NVIDIA container toolkit
(1.20.1+, PR #2075 of NVIDIA/nvidia-container-toolkit) runs as an OCI `createRuntime` hook
for each GPU of a container, before the container's first instruction.

As NVIDIA's does: the OCI state on stdin names the container's init pid and its bundle;
`NVIDIA_GPU_MEMORY_REQUEST` and `NVIDIA_GPU_MEMORY_LIMIT` are read from the bundle's
`config.json` (`process.env`, the first entry of each name, in whole MiB); with either
absent it sets nothing; the container's cgroup is the one `/proc/<pid>/cgroup` names; it
calls `nvmlDeviceSetMemoryLimits_v1` there on the GPU of its `--gpu-id`, soft = the
request and hard = the limit, in bytes, and fails (so does the container's creation) on
any error. Unlike NVIDIA's, which joins `/sys/fs/cgroup` with a one-line cgroup file (a
pure cgroup v2 host), it reads the `0::` line and the cgroup2 mount from mountinfo, as
this test machine has a hybrid hierarchy. It loads the fake NVML of `--library`, and
appends what it did, and when, to `--log` as one JSON line.

`--get CGROUP` reads a cgroup's limit on the GPU back (`nvmlDeviceGetMemoryLimits_v1`),
as any NVML reader would, for the test to see what the driver holds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

MIB = 1024 * 1024
SUCCESS = 0


class SetLimits(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class GetLimits(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


def lookup_env(env: list[str], key: str) -> str | None:
    """The OCI spec's first entry named `key`, as the toolkit's `LookupEnv` reads it."""
    for entry in env:
        name, _, value = entry.partition("=")
        if name == key:
            return value
    return None


def cgroup_of(pid: int) -> str:
    """The absolute path of `pid`'s cgroup v2 directory."""
    mount = next(
        line.split(" - ")[0].split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split(" - ")[1].split()[0] == "cgroup2"
    )
    own = next(
        line[3:]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line[:3] == "0::"
    )
    return mount.rstrip("/") + own


def device(nvml: ctypes.CDLL, uuid: str) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    check(nvml.nvmlInit_v2(), "nvmlInit_v2")
    check(nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)), uuid)
    return handle


def check(code: int, what: str) -> None:
    if code != SUCCESS:
        sys.exit(f"apply-cuda-memory-limits (stand-in): {what} failed: NVML error {code}")


def apply(args: argparse.Namespace) -> None:
    state = json.load(sys.stdin)
    spec = json.loads((Path(state["bundle"]) / "config.json").read_text())
    env = spec.get("process", {}).get("env", [])
    request = lookup_env(env, "NVIDIA_GPU_MEMORY_REQUEST")
    limit = lookup_env(env, "NVIDIA_GPU_MEMORY_LIMIT")
    if request is None or limit is None:
        return
    pid = int(state["pid"])
    cgroup = cgroup_of(pid)
    soft, hard = int(request) * MIB, int(limit) * MIB
    nvml = ctypes.CDLL(args.library)
    handle = device(nvml, args.gpu_id)
    limits = SetLimits(cgroup.encode(), soft, hard)
    check(nvml.nvmlDeviceSetMemoryLimits_v1(handle, ctypes.byref(limits)), "Set")
    with open(args.log, "a") as log:
        seen = {
            "container": state["id"],
            "status": state["status"],  # "creating": before the workload's first instruction
            "comm": Path(f"/proc/{pid}/comm").read_text().strip(),
            "cgroup": cgroup,
            "gpu": args.gpu_id,
            "soft": soft,
            "hard": hard,
        }
        log.write(json.dumps(seen) + "\n")


def get(args: argparse.Namespace) -> None:
    nvml = ctypes.CDLL(args.library)
    handle = device(nvml, args.gpu_id)
    limits = GetLimits(args.get.encode(), 0, 0, 0)
    check(nvml.nvmlDeviceGetMemoryLimits_v1(handle, ctypes.byref(limits)), "Get")
    print(json.dumps({"soft": limits.softLimit, "hard": limits.hardLimit}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-id", required=True)
    parser.add_argument("--library", required=True)
    parser.add_argument("--log")
    parser.add_argument("--get")
    args = parser.parse_args()
    if args.get:
        get(args)
    else:
        apply(args)


if __name__ == "__main__":
    main()
