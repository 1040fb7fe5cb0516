"""One scrape target per node (issue 36): the agent's /metrics with every enforced pod's
series, against the per-pod scrapes of the same pods that each sidecar served before.

A full node: 110 pods (the kubelet's default maximum), each with two declaring containers
(one with a ceiling) and the sidecar, each container with one process on each of 8 GPUs,
with utilisation; every sidecar has reported its counts. The agent's side is its real
registry (`AgentTelemetry` with the `PodsCollector` the agent registers) over the real
readers (`pod_metrics.pods_view`: the pods, the lender's tenants made by `lending.tenants`
and its decision by `lending.decide`). The sidecars' side is what each one registered
before: a `Telemetry` over its tick's `View`, per-process series included (they were on
by default), rendered once per pod. Both render with prometheus_client's
`generate_latest`, as the HTTP handler does; CPU is this process's, memory the peak that
tracemalloc sees during one scrape.

`served()` asks the agent's registry for /metrics over HTTP, from a client in a process of
its own, through the metrics server that the repository's `serve_metrics` starts: the CPU
this process spent per scrape (the render and the server around it). Run against the
commit before to compare servers (issue 42, item 6: the event loop against a thread per
connection), e.g. in turn, with the file copied into a checkout of that commit:

    .venv/bin/python bench/scrape_bench.py
    .venv/bin/python bench/scrape_bench.py --served 40
"""

from __future__ import annotations

import inspect
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.attribution import attribute
from enforcer.core.declaration import CEILINGS_ENV, ENFORCED, SIDECAR, Declares
from enforcer.core.lending import decide, tenants
from enforcer.core.model import Activity, Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.owed import pod_owed
from enforcer.core.payloads import Pod
from enforcer.core.sidecar_report import ACTIONS, NEEDED_BY, REFUSED, SidecarReport
from enforcer.edge.metrics import AgentTelemetry, PodsCollector, Telemetry
from enforcer.edge.telemetry import View
from enforcer.modes.pod_metrics import PodCounts, pods_view

RES = "vram-enforcer.io/vram"
GPUS = 8


def node(pods: int) -> tuple[Sample, dict[ProcessKey, str], list[Pod]]:
    """The node's sample, each process's container ID, and its pods."""
    devices = tuple(
        Device(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 80 * GiB, 0) for i in range(GPUS)
    )
    processes: list[ProcessUsage] = []
    containers: dict[ProcessKey, str] = {}
    listed: list[Pod] = []
    for p in range(pods):
        statuses, ids = [], {}
        for c, name in enumerate(("trainer", "helper", SIDECAR)):
            cid = f"{p:060x}{c:04x}"
            ids[name] = cid
            statuses.append({"name": name, "containerID": f"containerd://{cid}"})
        for c, name in enumerate(("trainer", "helper")):
            key = ProcessKey(10_000 + 2 * p + c, 1_000_000 + p)
            containers[key] = ids[name]
            for g in range(GPUS):
                used = (p % 7 + 1) * 64 * 1024**2 * (c + 1)
                processes.append(ProcessUsage(key, f"GPU-{g}", used, (), Activity(p % 50, p % 20)))
        spec = {
            "containers": [
                {"name": "trainer", "resources": {"limits": {RES: str(4 * GiB)}}},
                {"name": "helper", "resources": {"limits": {RES: str(2 * GiB)}}},
                {
                    "name": SIDECAR,
                    "env": [{"name": CEILINGS_ENV, "value": json.dumps({"trainer": 8 * GiB})}],
                },
            ]
        }
        listed.append(
            Pod(  # type: ignore[typeddict-item]
                metadata={
                    "namespace": "ml",
                    "name": f"train-{p}",
                    "uid": f"uid-{p}",
                    "labels": {ENFORCED: "true"},
                },
                spec=spec,
                status={"phase": "Running", "containerStatuses": statuses},
            )
        )
    used = sum(u.used_bytes or 0 for u in processes) // GPUS
    devices = tuple(Device(d.index, d.uuid, d.name, d.total_bytes, used) for d in devices)
    return Sample(time.time(), devices, tuple(processes)), containers, listed


def report() -> SidecarReport:
    return SidecarReport(
        dict.fromkeys(ACTIONS, 3),
        dict.fromkeys(NEEDED_BY, 1),
        dict.fromkeys(REFUSED, 0),
        {"tick": 0},
        86_400,
        120.0,
    )


def timed(render: Any, rounds: int) -> dict[str, Any]:
    """CPU per render (median), the body's size and series, and the peak allocation."""
    body = render()
    cpu = []
    for _ in range(rounds):
        t0 = time.process_time()
        render()
        cpu.append(time.process_time() - t0)
    tracemalloc.start()
    render()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    series = sum(len(f.samples) for f in text_string_to_metric_families(body.decode()))
    return {
        "cpu_ms": statistics.median(cpu) * 1000,
        "bytes": len(body),
        "series": series,
        "peak_alloc_mib": peak / 1024**2,
    }


def agent_telemetry(pods: int) -> tuple[AgentTelemetry, Sample, dict[ProcessKey, str], list[Pod]]:
    """The agent's registry with every pod's series, as the agent registers it."""
    sample, containers, listed = node(pods)
    ml = frozenset({"ml"})
    found = tenants(
        [(p, pod_owed(p, Declares(RES), opted_in=ml, basis=None, claims=None)) for p in listed], {}
    )
    lending = decide(sample, containers, found, 2 * GiB)
    counts = PodCounts()
    by_uid = {str(p["metadata"]["uid"]): p for p in listed}
    for pod in listed:
        sidecar_id = pod["status"]["containerStatuses"][2]["containerID"].split("//")[1]  # type: ignore[typeddict-item]
        counts.keep(pod, sidecar_id, report())
    agent = AgentTelemetry()

    def view() -> Any:
        return pods_view(
            lambda: (sample, lambda: containers),
            lambda: by_uid,
            SimpleNamespace(tenants=found),
            SimpleNamespace(lending=lending.gpus),
            counts,
            SimpleNamespace(counts={}),
        )

    agent.registry.register(PodsCollector(view))
    return agent, sample, containers, listed


CLIENT = """
import socket, sys
port, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for _ in range(n):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n".encode())
        while s.recv(1 << 16):
            pass
"""


def served(pods: int = 110, scrapes: int = 40, probes: int = 2000) -> dict[str, Any]:
    """CPU of this process per /metrics scrape and per /healthz probe over HTTP, from a
    client of its own (a new connection each, as Prometheus' and the kubelet's)."""
    from enforcer.edge.metrics_server import serve_metrics

    agent = agent_telemetry(pods)[0]
    # The commit before took the registry; since issue 42, the mode's telemetry.
    first = next(iter(inspect.signature(serve_metrics).parameters))
    server = serve_metrics(
        agent.registry if first == "registry" else agent,  # type: ignore[arg-type]
        0,
        "127.0.0.1",
        lambda: None,
    )
    assert server is not None

    def cost(path: str, n: int) -> tuple[float, float]:
        client = [sys.executable, "-c", CLIENT, str(server.port), path]
        subprocess.run([*client, "2"], check=True)  # warm
        cpu, wall = time.process_time(), time.perf_counter()
        subprocess.run([*client, str(n)], check=True)
        return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n

    try:
        cpu, wall = cost("/metrics", scrapes)
        probe_cpu, _ = cost("/healthz", probes)
    finally:
        server.close()
    return {
        "scrapes": scrapes,
        "cpu_ms": cpu * 1000,
        "wall_ms": wall * 1000,
        "probes": probes,
        "healthz_cpu_us": probe_cpu * 1e6,
    }


def run(pods: int = 110, rounds: int = 20) -> dict[str, Any]:
    agent, sample, containers, listed = agent_telemetry(pods)
    one = timed(lambda: generate_latest(agent.registry), rounds)

    # Before: each sidecar's own registry, its units as its tick attributed them.
    sidecars = []
    for pod in listed:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        ids = {
            s["containerID"].split("//")[1]: s["name"] for s in pod["status"]["containerStatuses"]
        }  # type: ignore[typeddict-item]
        unit_of = {k: ids[c] for k, c in containers.items() if c in ids}
        mine = Sample(
            sample.sampled_at,
            sample.devices,
            tuple(p for p in sample.processes if p.key in unit_of),
        )
        units = attribute(mine, unit_of, {"trainer": 8 * GiB, "helper": 2 * GiB})
        t = Telemetry({"namespace": str(ns), "pod": str(name)})
        t.collector.show(View(units, sample.devices, True, mine, ()))
        sidecars.append(t)
    each = [timed(lambda t=t: generate_latest(t.registry), max(1, rounds // 4)) for t in sidecars]
    before = {
        "targets": pods,
        "cpu_ms": sum(e["cpu_ms"] for e in each),
        "bytes": sum(e["bytes"] for e in each),
        "series": sum(e["series"] for e in each),
        "peak_alloc_mib": max(e["peak_alloc_mib"] for e in each),
    }
    return {
        "pods": pods,
        "containers": 2 * pods,
        "gpus": GPUS,
        "agent": {**one, "targets": 1},
        "sidecars": before,
    }


def show(row: dict[str, Any]) -> None:
    a, s = row["agent"], row["sidecars"]
    print(
        f"one scrape of the agent, {row['pods']} pods x 2 containers x {row['gpus']} GPUs: "
        f"{a['cpu_ms']:.1f} ms CPU, {a['bytes'] / 1024:.0f} KiB, {a['series']} series, peak "
        f"allocation {a['peak_alloc_mib']:.1f} MiB; before, {s['targets']} sidecar scrapes: "
        f"{s['cpu_ms']:.1f} ms CPU in all, {s['bytes'] / 1024:.0f} KiB, {s['series']} series"
    )
    if served := row.get("served"):
        print(
            f"the same over HTTP, from a client of its own: {served['cpu_ms']:.1f} ms CPU and "
            f"{served['wall_ms']:.1f} ms a scrape ({served['scrapes']} scrapes); a /healthz "
            f"probe {served['healthz_cpu_us']:.0f} us of CPU ({served['probes']} probes)"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--served"]:
        print(json.dumps(served(scrapes=int(sys.argv[2]))))
    else:
        result = run()
        show(result)
        print(json.dumps(result, indent=2))
