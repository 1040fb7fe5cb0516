"""The Grafana dashboard asks only for series that the components export: a renamed metric
fails here, not silently as an empty panel in production."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.attribution import attribute
from enforcer.core.model import (
    Activity,
    Device,
    GiB,
    ProcessKey,
    ProcessUsage,
    Sample,
    UnitUsage,
)
from enforcer.core.pod import ContainerRef
from enforcer.core.reclaim import views
from enforcer.core.unaccounted import InNoPod, Unaccounted, UndeclaredContainer
from enforcer.edge.metrics import AgentTelemetry, Telemetry, View, WebhookTelemetry

DASHBOARD = Path(__file__).resolve().parents[2] / "helm/vram-enforcer/dashboards/vram-enforcer.json"


def exported(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    sidecar = Telemetry({"namespace": "ml", "pod": "p"})
    gpu = Device(0, "GPU-0", "NVIDIA H100", 80 * GiB, GiB)
    key = ProcessKey(7, 1)
    sample = Sample(0.0, (gpu,), (ProcessUsage(key, "GPU-0", GiB, (), Activity(50, 10)),))
    (main,) = attribute(sample, {key: "main"}, {"main": 4 * GiB})
    units = [main, UnitUsage("b@GPU-0", GiB, (), device_uuid="GPU-0")]
    lending = views([gpu], [main], {"main": GiB // 2})
    sidecar.collector.show(View(units, [gpu], True, sample, lending))
    sidecar.actions.labels("terminate").inc()
    sidecar.reclaims.labels("requests").inc()
    agent = AgentTelemetry()
    agent.node.devices, agent.node.tenants, agent.node.advertised_bytes = [gpu], {"GPU-0": 2}, GiB
    agent.node.lending = lending
    held = (("GPU-0", GiB),)
    undeclared = UndeclaredContainer("r", "p", "u", ContainerRef("c", "containers"), 0, held, False)
    in_no_pod = InNoPod(ProcessUsage(ProcessKey(8, 1), "GPU-0", GiB), None)
    agent.node.unaccounted = Unaccounted((undeclared,), (in_no_pod,))
    webhook = WebhookTelemetry()
    webhook.requests.labels("patched").inc()
    names = exported(sidecar.registry) | exported(agent.registry) | exported(webhook.registry)

    doc = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in doc["panels"] for t in p.get("targets", ())]
    queries += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    asked = {m for q in queries for m in re.findall(r"\bvram_enforcer_\w+", q)}
    assert "vram_enforcer_container_gpu_sm_utilization_ratio" in asked
    assert {"vram_enforcer_gpu_lent_bytes", "vram_enforcer_reclaims_total"} <= asked
    assert "vram_enforcer_gpu_unplaced_bytes" in asked
    assert {"vram_enforcer_undeclared_used_bytes", "vram_enforcer_gpu_outside_pods_bytes"} <= asked
    assert asked <= names, f"not exported: {sorted(asked - names)}"


def test_the_per_gpu_row_repeats_over_a_gpu_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    (row,) = [p for p in doc["panels"] if p.get("repeat") == "gpu"]
    assert row["type"] == "row"
    assert "gpu" in {v["name"] for v in doc["templating"]["list"]}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
