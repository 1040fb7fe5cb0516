"""A stand-in workload for `vram-enforcer interference`'s tests, with a known profile.

It sleeps through a fixed number of slices: its time is known without a GPU and hardly
depends on how loaded the machine is. With --contend FILE it holds an exclusive flock on
FILE during each slice, as a time-sliced GPU serves one context at a time: two of them
side by side take about twice as long, while a plain one next to anything does not slow
down. It can also hold GPU memory on the fake GPU (the FAKE_NVML_STATE file, edited
under a lock since the runs of a pair edit it at once), fail cold on its first run, crash
out of memory, or fail; and it tells the tests its pid and the GPU it was given. With
--startup it sleeps before its slices, as a framework starts, and with --section it
writes the section of its slices to VRAM_ENFORCER_TIMING_FILE, as the built-ins do;
where it is given a start gate (VRAM_ENFORCER_READY_FILE, VRAM_ENFORCER_GO_FILE), it waits
at it after its start-up, as they do.
"""

import argparse
import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path


def hold_gpu_memory(used: int, sm: int = 0, memory: int = 0) -> None:
    """Report this process holding `used` bytes on the fake GPU (0: nothing), keeping its
    SMs `sm` % and its memory controller `memory` % busy."""
    state = Path(os.environ["FAKE_NVML_STATE"])
    with state.with_name(state.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = json.loads(state.read_text())
        device = doc["devices"][0]
        procs = [p for p in device["compute_processes"] if p["pid"] != os.getpid()]
        if used:
            procs.append(
                {"pid": os.getpid(), "used_bytes": used, "sm_util": sm, "mem_util": memory}
            )
        device["compute_processes"] = procs
        device["used_bytes"] = min(device["total_bytes"], sum(p["used_bytes"] for p in procs))
        tmp = state.with_name(f".{state.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, state)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--slices", type=int, default=20)
    p.add_argument("--slice", type=float, default=0.02, help="seconds")
    p.add_argument("--contend", type=Path, help="the shared 'GPU': a file to flock")
    p.add_argument("--gpu-bytes", type=int, default=0)
    p.add_argument("--sm", type=int, default=0, help="percent SM utilisation, with --gpu-bytes")
    p.add_argument("--mem", type=int, default=0, help="percent memory-controller utilisation")
    p.add_argument("--cold", type=Path, help="sleep --cold-extra more unless FILE exists")
    p.add_argument("--cold-extra", type=float, default=1.0)
    p.add_argument("--pids", type=Path, help="append this process's pid to FILE")
    p.add_argument("--env", type=Path, help="write the GPU variables it was given to FILE")
    p.add_argument("--oom", action="store_true", help="crash as PyTorch does out of memory")
    p.add_argument("--fail", action="store_true", help="exit 3 with a reason")
    p.add_argument("--startup", type=float, default=0.0, help="seconds before the slices")
    p.add_argument("--section", action="store_true", help="write the slices' section")
    p.add_argument("--section-text", help="write this to VRAM_ENFORCER_TIMING_FILE instead")
    return p.parse_args()


def main() -> int:
    args = arguments()
    if args.pids:
        with args.pids.open("a") as f:
            f.write(f"{os.getpid()}\n")
    if args.env:
        names = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
        args.env.write_text(json.dumps({n: os.environ.get(n) for n in names}))
    if args.oom:
        print(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            file=sys.stderr,
        )
        return 1
    if args.fail:
        print("the input file is missing", file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if args.gpu_bytes:
            hold_gpu_memory(args.gpu_bytes, args.sm, args.mem)
        if args.cold and not args.cold.exists():
            args.cold.touch()
            time.sleep(args.cold_extra)
        time.sleep(args.startup)
        if gate := os.environ.get("VRAM_ENFORCER_READY_FILE"):
            Path(gate).touch()
            while not Path(os.environ["VRAM_ENFORCER_GO_FILE"]).exists():
                time.sleep(0.001)
        began = time.monotonic()
        for _ in range(args.slices):
            if args.contend:
                with args.contend.open("a") as gpu:
                    fcntl.flock(gpu, fcntl.LOCK_EX)
                    time.sleep(args.slice)
                time.sleep(0.001)  # let a neighbour woken by the unlock take the next slice
            else:
                time.sleep(args.slice)
        timing = Path(os.environ["VRAM_ENFORCER_TIMING_FILE"])
        if args.section:
            timing.write_text(
                json.dumps({"start_monotonic": began, "end_monotonic": time.monotonic()})
            )
        elif args.section_text is not None:
            timing.write_text(args.section_text)
    finally:
        if args.gpu_bytes:
            hold_gpu_memory(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
