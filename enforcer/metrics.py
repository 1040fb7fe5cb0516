"""Prometheus metrics: a custom collector over the latest tick, plus counters.

The gauges are rendered from an immutable snapshot that each tick replaces, so the series
of a process that is gone disappear on the next scrape without any bookkeeping. Counters
and the tick histogram are ordinary prometheus_client metrics in the same registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from enforcer.model import Device, UnitUsage

log = logging.getLogger(__name__)

PREFIX = "vram_enforcer_"
TICK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class View:
    """What the gauges show: the latest tick's units and devices, and whether data is flowing."""

    units: Sequence[UnitUsage] = ()
    devices: Sequence[Device] = ()
    source_up: bool = False


class EnforcerCollector(Collector):
    """Renders a `View`; `base_labels` (e.g. namespace and pod) go on every unit series."""

    def __init__(self, base_labels: Mapping[str, str], unit_label: str = "container") -> None:
        self._base = dict(base_labels)
        self._unit_label = unit_label
        self._view = View()
        self._lock = threading.Lock()

    def show(self, view: View) -> None:
        with self._lock:
            self._view = view

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            view = self._view
        base_names = list(self._base)
        base_values = list(self._base.values())
        unit_labels = [*base_names, self._unit_label]
        used = GaugeMetricFamily(
            PREFIX + "container_used_bytes",
            "GPU memory used by the unit's processes",
            labels=unit_labels,
        )
        limit = GaugeMetricFamily(
            PREFIX + "container_limit_bytes",
            "The unit's declared GPU memory limit",
            labels=unit_labels,
        )
        proc = GaugeMetricFamily(
            PREFIX + "process_used_bytes",
            "GPU memory used by one process on one device",
            labels=[*unit_labels, "pid", "device"],
        )
        for unit in view.units:
            values = [*base_values, unit.name]
            used.add_metric(values, unit.used_bytes)
            limit.add_metric(values, unit.limit_bytes)
            for p in unit.processes:
                for device, bytes_used in p.by_device:
                    if bytes_used is not None:
                        proc.add_metric([*values, str(p.key.pid), device], bytes_used)
        yield from (used, limit, proc)
        up = GaugeMetricFamily(
            PREFIX + "source_up", "1 when GPU usage could be read on the last tick"
        )
        up.add_metric([], 1.0 if view.source_up else 0.0)
        yield up
        yield from _device_families(view.devices)


def _device_families(devices: Sequence[Device]) -> Iterator[Metric]:
    labels = ["gpu", "uuid", "model", "parent_uuid"]
    total = GaugeMetricFamily(PREFIX + "gpu_total_bytes", "Total memory of the GPU", labels=labels)
    used = GaugeMetricFamily(PREFIX + "gpu_used_bytes", "Used memory of the GPU", labels=labels)
    for d in devices:
        values = [str(d.index), d.uuid, d.name, d.parent_uuid or ""]
        if d.total_bytes is not None:
            total.add_metric(values, d.total_bytes)
        if d.used_bytes is not None:
            used.add_metric(values, d.used_bytes)
    yield total
    yield used


class Telemetry:
    """The registry of one long-running mode and the metrics every mode shares."""

    def __init__(self, base_labels: Mapping[str, str], unit_label: str = "container") -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.collector = EnforcerCollector(base_labels, unit_label)
        self.registry.register(self.collector)
        self.actions = Counter(
            PREFIX + "actions",
            "Enforcement actions taken, by action (warn, terminate, kill, dry-run)",
            ["action"],
            registry=self.registry,
        )
        self.refused = Counter(
            PREFIX + "signals_refused",
            "Signals not sent because the target could not be verified, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.event_failures = Counter(
            PREFIX + "events_failed",
            "Kubernetes Events not posted, by reason (api, forbidden, dropped)",
            ["reason"],
            registry=self.registry,
        )
        self.tick_duration = Histogram(
            PREFIX + "tick_duration_seconds",
            "Wall time of one enforcement tick (sample, attribute, decide, act, report)",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )


class NodeCollector(Collector):
    """The agent's view of its node: GPUs, health, and what it advertised."""

    def __init__(self) -> None:
        self.devices: Sequence[Device] = ()
        self.source_up = False
        self.advertised_bytes: int | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        devices, up, advertised = self.devices, self.source_up, self.advertised_bytes
        yield from _device_families(devices)
        gauge = GaugeMetricFamily(PREFIX + "source_up", "1 when the last NVML pass succeeded")
        gauge.add_metric([], 1.0 if up else 0.0)
        yield gauge
        node = GaugeMetricFamily(
            PREFIX + "node_advertised_bytes",
            "VRAM this node advertises as capacity (bytes), once the API has accepted it",
        )
        if advertised is not None:
            node.add_metric([], advertised)
        yield node


class AgentTelemetry:
    """The node agent's registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.node = NodeCollector()
        self.registry.register(self.node)
        self.tick_duration = Histogram(
            PREFIX + "tick_duration_seconds",
            "Wall time of one NVML pass over all GPUs of the node",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            PREFIX + "agent_requests",
            "Requests answered on the usage socket, by result (ok, error, refused)",
            ["result"],
            registry=self.registry,
        )
        self.connections = Gauge(
            PREFIX + "agent_connections",
            "Open connections on the usage socket",
            registry=self.registry,
        )
        self.api_errors = Counter(
            PREFIX + "api_errors",
            "Kubernetes API calls that failed after their retries, by operation",
            ["operation"],
            registry=self.registry,
        )


class WebhookTelemetry:
    """The admission webhook's registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            PREFIX + "admission_requests",
            "Admission reviews answered, by result (patched, skipped, denied, invalid, error)",
            ["result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            PREFIX + "admission_duration_seconds",
            "Time from a review's request line to its answer, body read and JSON included",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self.cert_reloads = Counter(
            PREFIX + "webhook_certificate_reloads",
            "Serving certificate changes seen on disk, by result (ok, error)",
            ["result"],
            registry=self.registry,
        )


class MetricsPortError(Exception):
    """`--metrics-port` cannot be served; the message names the flag, the address and why."""


def serve_metrics(
    registry: CollectorRegistry, port: int | None, address: str
) -> MetricsServer | None:
    """Start the /metrics endpoint when a port is set (every mode shares this start-up rule)."""
    if port is None:
        return None
    try:
        server = MetricsServer(registry, port, address)
    except OSError as exc:
        raise MetricsPortError(
            f"--metrics-port {port}: cannot listen on {address}: {exc.strerror}"
        ) from None
    log.info("serving metrics on http://%s:%d/metrics", address, server.port)
    return server


class MetricsServer:
    """The /metrics HTTP endpoint, stoppable for a clean shutdown."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str) -> None:
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, addr=address, registry=registry)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
