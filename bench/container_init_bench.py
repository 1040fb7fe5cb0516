"""What finding one container's init costs the node agent (issue 35, item 9).

The backstop's `restart` needs the init of a container that is over its limit, and the
agent's dialer that of each sidecar's container. Before, `ProcFs.container_inits` found it
by one pass over every process of the node (reading each one's cgroup); now it reads the
container's own cgroups (`cgroup.procs`, found by the container's ID under the host's
cgroupfs) and only the processes listed there. Here: one container of a few processes in a
pod's cgroup as the kubelet lays it out, beside `pods - 1` other pods' cgroups, on a host
with `extra` more processes (sleepers) outside it; each way timed `repeats` times.

Needs root and a writable cgroup v2 hierarchy (cgroups are made only there).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from enforcer.edge.cgroupfs import ContainerCgroups, v2_root
from enforcer.edge.procfs import ProcFs
from tests.helpers import remove_cgroup_tree, wait_for


def _container(size: int) -> list[str]:
    """A container's init (`sh`), with `size - 1` children."""
    return ["sh", "-c", f"for i in $(seq {size - 1}); do sleep 600 & done; wait"]


def available() -> str | None:
    root = v2_root()
    if os.geteuid() != 0 or root is None or not os.access(root, os.W_OK):
        return "needs root and a writable cgroup v2 hierarchy"
    return None


def _pod_dir(kubepods: Path, index: int) -> Path:
    uid = f"{index:08x}_0000_4000_8000_000000000000"
    return kubepods / "kubepods-burstable.slice" / f"kubepods-burstable-pod{uid}.slice"


def _timed(call: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return times


def run(extra: int = 2000, pods: int = 110, repeats: int = 20, size: int = 5) -> dict[str, Any]:
    root = v2_root()
    assert root is not None  # available() said so
    top = root / f"vram-bench-{secrets.token_hex(4)}"
    kubepods = top / "kubepods.slice"
    cid = secrets.token_hex(32)
    boxes = [
        _pod_dir(kubepods, i) / f"cri-containerd-{secrets.token_hex(32)}.scope"
        for i in range(1, pods)
    ]
    box = _pod_dir(kubepods, 0) / f"cri-containerd-{cid}.scope"
    started: list[subprocess.Popen[bytes]] = []
    try:
        for path in [box, *boxes]:
            path.mkdir(parents=True)
        script = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        started.append(subprocess.Popen(["sh", "-c", script, str(box), *_container(size)]))
        wait_for(
            lambda: len((box / "cgroup.procs").read_text().split()) == size,
            timeout=120,
            what="the container",
        )
        started += [subprocess.Popen(["sleep", "600"]) for _ in range(extra)]
        scan, cgroups = ProcFs(), ProcFs(cgroups=ContainerCgroups(top))
        expected = scan.container_inits({cid})
        assert expected == cgroups.container_inits({cid}), expected
        scanned = _timed(lambda: scan.container_inits({cid}), repeats)
        warm = _timed(lambda: cgroups.container_inits({cid}), repeats)
        cold = _timed(lambda: ProcFs(cgroups=ContainerCgroups(top)).container_inits({cid}), repeats)
        return {
            "node_processes": len(scan.pids()),
            "extra_processes": extra,
            "container_processes": size,
            "pods": pods,
            "repeats": repeats,
            "scan_ms_median": statistics.median(scanned),
            "scan_ms_max": max(scanned),
            "cgroup_ms_median": statistics.median(warm),
            "cgroup_ms_max": max(warm),
            "cgroup_first_ms_median": statistics.median(cold),
            "cgroup_first_ms_max": max(cold),
        }
    finally:
        for pid in ContainerCgroups.procs(str(box)) or ():  # the init's children too
            os.kill(pid, signal.SIGKILL)
        for proc in started:
            proc.kill()
        for proc in started:
            proc.wait()
        remove_cgroup_tree(top)


def show(row: dict[str, Any]) -> None:
    print(
        f"a container's init, {row['container_processes']} processes, among "
        f"{row['node_processes']} on the host and {row['pods']} pods' cgroups: scan of /proc "
        f"p50 {row['scan_ms_median']:.1f} ms (max {row['scan_ms_max']:.1f}); from its cgroup "
        f"p50 {row['cgroup_ms_median']:.2f} ms (max {row['cgroup_ms_max']:.2f}), "
        f"{row['cgroup_first_ms_median']:.2f} ms when the pods' cgroups are looked for first "
        f"(max {row['cgroup_first_ms_max']:.2f})"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--extra", type=int, default=2000, help="processes outside the container")
    p.add_argument("--pods", type=int, default=110)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--size", type=int, default=5, help="processes in the container")
    args = p.parse_args()
    if reason := available():
        sys.exit(f"skipped: {reason}")
    found = run(args.extra, args.pods, args.repeats, args.size)
    show(found)
    print(json.dumps(found, indent=2))
