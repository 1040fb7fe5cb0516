"""What a tenant's large pods cost the node agent (issue 35, item 10).

The agent runs as in production (the fake NVML, the kubernetes client, serving pods to
sidecars), against a stand-in API server that answers its list and its watch of the node's
pods. Any tenant on the node can make pods of about 1 MiB (this one: 1 MiB of
annotations, with the managedFields the API server writes for them), and the agent holds
its node's pods in a 160Mi limit:

- **watch**: N such pods arrive by the watch, one event each, half of them first, and then
  each changes once. The figures are the agent's RSS growth per pod over the second half,
  once steady (the first pods also pay for buffers that stay: a one-off), and its CPU per
  change.
- **list**: the agent starts while the N pods are there, so it lists them (in pages, as it
  asks); the figure is its peak RSS, start-up included.

`python bench/pod_memory_bench.py --source DIR` runs the agent from another source tree
(e.g. `git archive <commit> | tar -x -C DIR`), for the figures before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, enforcer_argv, proc_cpu_seconds, proc_status_kib
from bench.flood_bench import IMAGE_ENV
from tests.fakenvml import FakeGpuState, build_fake_nvml
from tests.helpers import api_agent_flags, free_port, wait_for
from tests.pods_api import PodsApi, serving

MiB = 1024**2
NODE = "bench"
ANNOTATION = 128  # bytes per annotation, key and value: many small entries, as a tenant may


def hostile_pod(index: int, annotations: int = MiB, version: int = 1) -> dict[str, Any]:
    """A running pod of a tenant on the node, with `annotations` bytes of annotations and the
    managedFields that name each of them; one container that declares VRAM."""
    keys = [f"tenant.example/a{j:06}" for j in range(annotations // ANNOTATION)]
    value = "x" * (ANNOTATION - len(keys[0]))
    managed: dict[str, Any] = {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in keys}}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"big-{index}",
            "namespace": "tenant",
            "uid": f"uid-{index}",
            "resourceVersion": f"{version}{index:06}",
            "annotations": dict.fromkeys(keys, value),
            "managedFields": [
                {
                    "manager": "kubectl",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": managed,
                }
            ],
        },
        "spec": {
            "nodeName": NODE,
            "containers": [
                {
                    "name": "work",
                    "image": "busybox",
                    "resources": {"limits": {"vram-enforcer.io/vram": "4Gi"}},
                }
            ],
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "work",
                    "containerID": f"containerd://{index:064x}",
                    "state": {"running": {"startedAt": "2026-11-26T00:00:00Z"}},
                }
            ],
        },
    }


@contextmanager
def _agent(
    lib_dir: Path, tmp: Path, api: PodsApi, source: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The agent serving pods, with nothing else that uses the API, and the image's malloc
    settings."""
    state_file = tmp / "gpu.json"
    FakeGpuState.single_gpu().write(state_file)
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: x\n  cluster: {server: "
        f"'{api.url}'}}\nusers:\n- name: x\n  user: {{token: t}}\n"
        "contexts:\n- name: x\n  context: {cluster: x, user: x}\ncurrent-context: x\n"
    )
    argv = enforcer_argv(
        "agent",
        *api_agent_flags(NODE, kubeconfig, tmp / "agent.sock"),
        "--metrics-port",
        str(free_port()),
        "--metrics-address",
        "127.0.0.1",
    )
    env = {
        **os.environ,
        **IMAGE_ENV,
        "LD_LIBRARY_PATH": str(lib_dir),
        "FAKE_NVML_STATE": str(state_file),
        "PYTHONPATH": str(source),
    }
    with (tmp / "agent.log").open("w") as log:
        agent = subprocess.Popen(argv, env=env, stderr=log, cwd=tmp)
    try:
        yield agent
    finally:
        agent.terminate()
        agent.wait(timeout=15)


def _rss_mib(pid: int) -> float:
    return proc_status_kib(pid, "VmRSS") / 1024


def _steady_rss(pid: int, within: float = 60.0) -> float:
    """RSS once it has moved by less than 64 KiB over a second (the agent has taken in what
    it was sent)."""
    ends, last = time.monotonic() + within, -1.0
    while time.monotonic() < ends:
        time.sleep(1.0)
        now = _rss_mib(pid)
        if abs(now - last) < 1 / 16:
            return now
        last = now
    raise TimeoutError(f"the agent's RSS did not settle within {within:.0f}s")


def _delivered(api: PodsApi) -> None:
    wait_for(api.events.empty, timeout=120.0, what="every watch event sent")


def _add(api: PodsApi, pid: int, indices: range) -> float:
    """The agent's RSS once these pods have arrived by its watch."""
    for i in indices:
        api.send("ADDED", hostile_pod(i))
    _delivered(api)
    return _steady_rss(pid)


def watch(lib_dir: Path, tmp: Path, pods: int, source: Path = ROOT) -> dict[str, Any]:
    """RSS growth per pod as N large pods arrive by the watch, and CPU per change of one."""
    tmp.mkdir(parents=True, exist_ok=True)
    with serving([]) as api, _agent(lib_dir, tmp, api, source) as agent:
        wait_for(api.watching.is_set, timeout=30.0, what="the agent's watch")
        base = _steady_rss(agent.pid)
        half = _add(api, agent.pid, range(pods // 2))
        held = _add(api, agent.pid, range(pods // 2, pods))
        changes = [hostile_pod(i, version=2) for i in range(pods)]
        cpu = proc_cpu_seconds(agent.pid)
        for pod in changes:
            api.send("MODIFIED", pod)
        _delivered(api)
        changed = _steady_rss(agent.pid)
        cpu = proc_cpu_seconds(agent.pid) - cpu
        peak = proc_status_kib(agent.pid, "VmHWM") / 1024
    return {
        "pods": pods,
        "pod_bytes": len(json.dumps(hostile_pod(0))),
        "rss_before_mib": base,
        "rss_with_half_mib": half,
        "rss_with_pods_mib": held,
        "rss_after_changes_mib": changed,
        "peak_rss_mib": peak,
        "mib_per_pod": (held - half) / (pods - pods // 2),
        # the changes' CPU over the settling seconds: the sampler's passes are in it too
        "cpu_ms_per_change": 1000 * cpu / pods,
    }


def listing(lib_dir: Path, tmp: Path, pods: int, source: Path = ROOT) -> dict[str, Any]:
    """The agent's peak RSS when it starts on a node that holds N large pods."""
    tmp.mkdir(parents=True, exist_ok=True)
    listed = [json.dumps(hostile_pod(i)).encode() for i in range(pods)]
    with serving(listed) as api, _agent(lib_dir, tmp, api, source) as agent:
        wait_for(api.watching.is_set, timeout=60.0, what="the agent's watch, after its list")
        held = _steady_rss(agent.pid)
        peak = proc_status_kib(agent.pid, "VmHWM") / 1024
    return {"pods": pods, "pages": len(api.pages), "rss_mib": held, "peak_rss_mib": peak}


def run(lib_dir: Path, tmp: Path, pods: int, source: Path = ROOT) -> dict[str, Any]:
    return {
        "watch": watch(lib_dir, tmp / "watch", pods, source),
        "list": listing(lib_dir, tmp / "list", pods, source),
    }


def show(row: dict[str, Any]) -> None:
    w, listed = row["watch"], row["list"]
    print(
        f"agent memory per {w['pod_bytes'] / MiB:.1f} MiB pod on its node: "
        f"{w['mib_per_pod'] * 1024:.0f} KiB ({w['pods']} pods: {w['rss_before_mib']:.1f} -> "
        f"{w['rss_with_half_mib']:.1f} -> {w['rss_with_pods_mib']:.1f} MiB, "
        f"{w['rss_after_changes_mib']:.1f} MiB after a change "
        f"of each, peak {w['peak_rss_mib']:.1f}); CPU per change of a pod "
        f"{w['cpu_ms_per_change']:.1f} ms; started on a node with {listed['pods']} such pods "
        f"(listed in {listed['pages']} pages): peak {listed['peak_rss_mib']:.1f} MiB, then "
        f"{listed['rss_mib']:.1f} MiB"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=50)
    p.add_argument("--source", type=Path, default=ROOT, help="the tree to run the agent from")
    args = p.parse_args()
    if not (args.source / "enforcer").is_dir():
        p.error(f"{args.source} holds no enforcer package")
    with tempfile.TemporaryDirectory() as tmp:
        lib_dir = build_fake_nvml(ROOT / ".build" / "fakenvml")
        show(run(lib_dir, Path(tmp), args.pods, args.source.resolve()))


if __name__ == "__main__":
    main()
