"""Hard limits: from a cgroup's mkdir to the driver's limit on it, with the watch of new
cgroups (`edge/cgroup_watch.py`, inotify) and with the 1 s --cgroup-scan poll alone.

The agent's own HardLimiter thread (and CgroupWatch thread), in a process of its own that
loads the fake libnvidia-ml as an R615 driver; a scratch tree in the cgroup v2 hierarchy
laid out as the kubelet's systemd driver lays it out. Each trial makes a new pod's cgroup,
then its container's, at a random moment of the poll's period (so the poll is measured at
no lucky phase), and times each until nvmlDeviceSetMemoryLimits_v1 has returned for it.
Nothing else wakes the limiter: the pod is in its view before its cgroup is made, with
the container's ID in its status, so what is measured is how soon a new cgroup is found.
In a cluster the kubelet names a container's ID in the pod's status only after it has
started (its PLEG relist, 1 s), and a container's own limit waits for that (the pod watch
wakes the limiter then); a pod's cgroup needs no status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, percentile
from tests.e2e.podsim import CGROUP2

_MEASURE = """
import json, os, random, secrets, sys, threading, time
from pathlib import Path
from types import SimpleNamespace
from tests.fakenvml import FakeGpuState
from tests.helpers import remove_cgroup_tree, wait_for
from tests.integration.test_backstop import declaring
from enforcer.core.declaration import Declares
from enforcer.core.model import GiB
from enforcer.edge.cgroup_watch import CgroupWatch
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView

trials, state_file, root = int(sys.argv[1]), Path(os.environ["FAKE_NVML_STATE"]), Path(sys.argv[2])
state = FakeGpuState.single_gpu()
state.support_memory_limits()
state.write(state_file)
set_at = {}


class Timed(Nvml):
    def set_memory_limit(self, gpu, cgroup, hard, soft=0):
        done = super().set_memory_limit(gpu, cgroup, hard, soft)
        set_at.setdefault(cgroup, time.monotonic())
        return done


qos = root / "kubepods.slice" / "kubepods-burstable.slice"
qos.mkdir(parents=True)
nvml = Timed()
nvml.init()
devices = list(nvml.snapshot().devices)
pods = {}
figures = {}
try:
    for mode in ("watch", "poll"):
        woken = threading.Event()
        telemetry = AgentTelemetry()
        limiter = HardLimiter(
            nvml,
            NodeView(lambda: dict(pods), lambda: frozenset({"team"}), Declares("vram-enforcer.io/vram")),
            SimpleNamespace(devices=Latest(devices), container_usage=Latest({})),
            None,
            telemetry,
            cgroups=(root, 1.0),
            changed=woken,
        )
        threads = [limiter]
        if mode == "watch":
            threads.append(CgroupWatch(root, woken, telemetry.cgroup_watch_overflows,
                                       telemetry.unexpected.labels("cgroup-watch")))
        for t in threads:
            t.start()
        windows = {"pod": [], "container": []}
        for _ in range(trials):
            uid, cid = secrets.token_hex(16), secrets.token_hex(32)
            uid = f"{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:]}"
            pod = declaring(uid, "p", "c", cid, {"VRAM_ENFORCER_LIMITS": GiB})
            pod["metadata"]["resourceVersion"] = "1"
            pods[uid] = pod
            pod_dir = qos / f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
            for level, made in (("pod", pod_dir), ("container", pod_dir / f"cri-containerd-{cid}.scope")):
                time.sleep(random.uniform(0.0, 1.0))
                at = time.monotonic()
                made.mkdir()
                wait_for(lambda: str(made) in set_at, timeout=30, what=f"the {level}'s limit")
                windows[level].append((set_at[str(made)] - at) * 1000)
        for t in threads:
            t.stop.set()
        woken.set()
        for t in threads:
            t.join(timeout=10)
        figures[mode] = windows
finally:
    nvml.shutdown()
    remove_cgroup_tree(root)
print(json.dumps(figures))
"""


def available() -> str | None:
    if os.geteuid() != 0 or not (CGROUP2 / "cgroup.procs").exists():
        return "needs root and a cgroup v2 hierarchy"
    return None


def run(lib_dir: Path, tmp: Path, trials: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(lib_dir),
        "FAKE_NVML_STATE": str(tmp / "cgroup-watch-gpu.json"),
        "PYTHONPATH": str(ROOT),
    }
    root = CGROUP2 / f"vram-bench-watch-{os.getpid()}.slice"
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(trials), str(root)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30 + 8 * trials,
        check=True,
    )
    figures = json.loads(done.stdout.splitlines()[-1])
    rows = {"trials": trials, "cgroup_scan_s": 1.0}
    for mode, windows in figures.items():
        for level, ms in windows.items():
            ms.sort()
            rows[f"{mode}_{level}_ms"] = {
                "p50": percentile(ms, 0.5),
                "p99": percentile(ms, 0.99),
                "max": ms[-1],
            }
    return rows


def show(row: dict[str, Any]) -> None:
    print(f"a new cgroup to its hard limit ({row['trials']} trials, --cgroup-scan 1 s):")
    for mode in ("watch", "poll"):
        for level in ("pod", "container"):
            at = row[f"{mode}_{level}_ms"]
            print(
                f"  {mode:5} {level:9}: p50 {at['p50']:7.1f} ms  p99 {at['p99']:7.1f} ms  "
                f"max {at['max']:7.1f} ms"
            )
