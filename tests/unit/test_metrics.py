"""The collector renders the latest tick; series of processes that are gone disappear."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.attribution import attribute
from enforcer.core.model import (
    Activity,
    Device,
    GiB,
    ProcessKey,
    ProcessTotal,
    ProcessUsage,
    Sample,
    UnitUsage,
)
from enforcer.edge.metrics import Telemetry, View


def scrape(t: Telemetry) -> str:
    return generate_latest(t.registry).decode()


def samples(t: Telemetry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(scrape(t)):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def test_unit_process_device_and_health_series() -> None:
    t = Telemetry({"namespace": "ml", "pod": "trainer-0"})
    p = ProcessTotal(
        ProcessKey(42, 1), 3 * GiB, (("GPU-a", 1 * GiB), ("GPU-b", 2 * GiB), ("GPU-c", None))
    )
    dev = Device(0, "GPU-a", "NVIDIA H100", 80 * GiB, 10 * GiB)
    t.collector.show(View([UnitUsage("main", 4 * GiB, (p,))], [dev], source_up=True))
    got = samples(t)
    labels = {"namespace": "ml", "pod": "trainer-0", "container": "main"}
    assert got[key("vram_enforcer_container_used_bytes", **labels)] == 3 * GiB
    assert got[key("vram_enforcer_container_limit_bytes", **labels)] == 4 * GiB
    assert (
        got[key("vram_enforcer_process_used_bytes", **labels, pid="42", device="GPU-b")] == 2 * GiB
    )
    assert got[key("vram_enforcer_process_used_bytes", **labels, pid="42", device="GPU-a")] == GiB
    # Unknown usage is not exported as a number.
    assert key("vram_enforcer_process_used_bytes", **labels, pid="42", device="GPU-c") not in got
    assert got[key("vram_enforcer_source_up")] == 1.0
    gpu = {"gpu": "0", "uuid": "GPU-a", "model": "NVIDIA H100", "parent_uuid": ""}
    assert got[key("vram_enforcer_gpu_total_bytes", **gpu)] == 80 * GiB
    assert got[key("vram_enforcer_gpu_used_bytes", **gpu)] == 10 * GiB
    assert got[key("vram_enforcer_tick_duration_seconds_count")] == 0
    assert any(name == "process_resident_memory_bytes" for name, _ in got)


def test_series_of_gone_processes_disappear() -> None:
    t = Telemetry({})
    p = ProcessTotal(ProcessKey(42, 1), 1, (("GPU-a", 1),))
    t.collector.show(View([UnitUsage("main", 10, (p,))], [], source_up=True))
    assert 'pid="42"' in scrape(t)
    t.collector.show(View([UnitUsage("main", 10, ())], [], source_up=False))
    text = scrape(t)
    assert 'pid="42"' not in text
    assert "vram_enforcer_source_up 0.0" in text


def test_action_and_refusal_counters() -> None:
    t = Telemetry({})
    t.actions.labels("terminate").inc()
    t.refused.labels("identity-changed").inc()
    got = samples(t)
    assert got[key("vram_enforcer_actions_total", action="terminate")] == 1
    assert got[key("vram_enforcer_signals_refused_total", reason="identity-changed")] == 1


def test_per_gpu_memory_and_utilisation_series() -> None:
    """Each unit's memory and utilisation per GPU: a DRA unit keeps its container label and
    limit per GPU; utilisation NVML cannot tell has no series rather than a 0."""
    t = Telemetry({"namespace": "ml", "pod": "p"})
    a, b, c = ProcessKey(10, 1), ProcessKey(11, 1), ProcessKey(12, 1)
    sample = Sample(
        0.0,
        (),
        (
            ProcessUsage(a, "GPU-0", 2 * GiB, (), Activity(60, 20)),
            ProcessUsage(b, "GPU-0", GiB, (), Activity(25, 5)),
            ProcessUsage(c, "MIG-2", GiB, (), None),
        ),
    )
    (main_unit,) = attribute(sample, dict.fromkeys([a, b, c], "main"), {"main": 8 * GiB})
    units = [main_unit, UnitUsage("a+b@GPU-1", 4 * GiB, (), device_uuid="GPU-1")]
    t.collector.show(View(units, [], True, sample))
    got = samples(t)
    main = {"namespace": "ml", "pod": "p", "container": "main"}
    assert got[key("vram_enforcer_container_gpu_used_bytes", **main, gpu="GPU-0")] == 3 * GiB
    assert got[key("vram_enforcer_container_gpu_sm_utilization_ratio", **main, gpu="GPU-0")] == 0.85
    assert (
        got[key("vram_enforcer_container_gpu_memory_utilization_ratio", **main, gpu="GPU-0")]
        == 0.25
    )
    assert got[key("vram_enforcer_container_gpu_used_bytes", **main, gpu="MIG-2")] == GiB
    assert key("vram_enforcer_container_gpu_sm_utilization_ratio", **main, gpu="MIG-2") not in got
    dra = {"namespace": "ml", "pod": "p", "container": "a+b", "gpu": "GPU-1"}
    assert got[key("vram_enforcer_container_gpu_limit_bytes", **dra)] == 4 * GiB
    assert got[key("vram_enforcer_container_gpu_sm_utilization_ratio", **dra)] == 0.0


def test_the_agent_serves_each_enforced_containers_series_and_each_pods_counts() -> None:
    """One scrape target per node: the agent's registry carries every enforced pod's series,
    labelled by namespace, pod and container, and what each pod's sidecar counted; a
    process's series only when asked for (they grow with pids)."""
    from enforcer.core.pod_metrics import ContainerSeries, Named, OnGpu
    from enforcer.core.sidecar_report import SidecarReport
    from enforcer.edge.metrics import AgentTelemetry, PodsCollector, PodsView

    trainer = ContainerSeries(
        Named("ml", "train-0", "trainer"),
        6 * GiB,
        4 * GiB,
        12 * GiB,
        (OnGpu("GPU-a", 6 * GiB, Activity(50, 25), None, 2 * GiB),),
        ((4242, "GPU-a", 6 * GiB),),
    )
    view = PodsView(
        (trainer,), {("ml", "train-0"): SidecarReport({"kill": 1}, ticks=10, tick_seconds=0.5)}
    )
    for per_process in (False, True):
        t = AgentTelemetry()
        t.registry.register(PodsCollector(lambda: view, per_process))
        got = samples(t)  # type: ignore[arg-type]
        labels = {"namespace": "ml", "pod": "train-0", "container": "trainer"}
        on_gpu = {**labels, "gpu": "GPU-a"}
        assert got[key("vram_enforcer_container_used_bytes", **labels)] == 6 * GiB
        assert got[key("vram_enforcer_container_limit_bytes", **labels)] == 4 * GiB
        assert got[key("vram_enforcer_container_ceiling_bytes", **labels)] == 12 * GiB
        assert got[key("vram_enforcer_container_gpu_used_bytes", **on_gpu)] == 6 * GiB
        assert got[key("vram_enforcer_container_gpu_over_request_bytes", **on_gpu)] == 2 * GiB
        assert got[key("vram_enforcer_container_gpu_sm_utilization_ratio", **on_gpu)] == 0.5
        assert key("vram_enforcer_container_gpu_limit_bytes", **on_gpu) not in got  # not DRA
        pod = {"namespace": "ml", "pod": "train-0"}
        assert got[key("vram_enforcer_actions_total", **pod, action="kill")] == 1
        assert got[key("vram_enforcer_sidecar_ticks_total", **pod)] == 10
        assert got[key("vram_enforcer_sidecar_tick_seconds_total", **pod)] == 0.5
        process = key("vram_enforcer_process_used_bytes", **on_gpu, pid="4242")
        assert (process in got) is per_process
