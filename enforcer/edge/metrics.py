"""Prometheus metrics: a custom collector over the latest tick, plus counters.

The gauges are rendered from an immutable snapshot that each tick replaces, so the series
of a process that is gone disappear on the next scrape without any bookkeeping. Counters
and the tick histogram are ordinary prometheus_client metrics in the same registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enforcer.core.attribution import gpu_shares
from enforcer.core.model import Device, Unplaced
from enforcer.core.owners import Owner
from enforcer.core.pod_metrics import ContainerSeries, Named
from enforcer.core.reclaim import Gpu
from enforcer.core.sidecar_report import ACTIONS, NEEDED_BY, REFUSED, SidecarReport
from enforcer.core.unaccounted import Unaccounted
from enforcer.core.units import Unit
from enforcer.edge.gate_listener import Outcome
from enforcer.edge.telemetry import View

log = logging.getLogger(__name__)

PREFIX = "vram_enforcer_"
TICK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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
        per_gpu = [*unit_labels, "gpu"]
        gpu_used = GaugeMetricFamily(
            PREFIX + "container_gpu_used_bytes",
            "GPU memory used by the unit's processes on one GPU",
            labels=per_gpu,
        )
        gpu_limit = GaugeMetricFamily(
            PREFIX + "container_gpu_limit_bytes",
            "The unit's limit on one GPU: what DRA allocated there (0 on a GPU not given)",
            labels=per_gpu,
        )
        sm = GaugeMetricFamily(
            PREFIX + "container_gpu_sm_utilization_ratio",
            "Share of the GPU's time its SMs ran the unit's kernels, in NVML's latest sample "
            "period (0-1, summed over the unit's processes)",
            labels=per_gpu,
        )
        bandwidth = GaugeMetricFamily(
            PREFIX + "container_gpu_memory_utilization_ratio",
            "Share of the GPU's time its memory controller read or wrote for the unit, in "
            "NVML's latest sample period (0-1, summed over the unit's processes)",
            labels=per_gpu,
        )
        proc = GaugeMetricFamily(
            PREFIX + "process_used_bytes",
            "GPU memory used by one process on one device",
            labels=[*unit_labels, "pid", "device"],
        )
        labelled = {}
        for unit in view.units:
            # `a+b@GPU-...` (DRA): the containers, and the GPU on a label of its own
            shown = (
                unit.name if unit.device_uuid is None else "+".join(Unit.of(unit.name).containers)
            )
            values = labelled[unit.name] = [*base_values, shown]
            if unit.device_uuid is None:
                used.add_metric(values, unit.used_bytes)
                limit.add_metric(values, unit.limit_bytes)
            else:
                gpu_limit.add_metric([*values, unit.device_uuid], unit.limit_bytes)
            for p in unit.processes:
                for device, bytes_used in p.by_device:
                    if bytes_used is not None:
                        proc.add_metric([*values, str(p.key.pid), device], bytes_used)
        for share in gpu_shares(view.units, view.sample) if view.sample is not None else ():
            values = [*labelled.get(share.unit, [*base_values, share.unit]), share.gpu]
            gpu_used.add_metric(values, share.used_bytes)
            if share.activity is not None:
                sm.add_metric(values, share.activity.sm_percent / 100)
                bandwidth.add_metric(values, share.activity.memory_percent / 100)
        yield from (used, limit, gpu_used, gpu_limit, sm, bandwidth, proc)
        yield from _lending(view.gpus, labelled, base_values, unit_labels)
        up = GaugeMetricFamily(
            PREFIX + "source_up", "1 when GPU usage could be read on the last tick"
        )
        up.add_metric([], 1.0 if view.source_up else 0.0)
        yield up
        yield from _device_families(view.devices)


def _lending(
    gpus: Sequence[Gpu],
    labelled: Mapping[str, list[str]],
    base_values: list[str],
    unit_labels: list[str],
) -> Iterator[Metric]:
    """What each unit with a request holds above it, per GPU, and each such GPU's free
    memory: the two sides of a reclaim."""
    over = GaugeMetricFamily(
        PREFIX + "container_gpu_over_request_bytes",
        "GPU memory the unit holds above its request on one GPU: lent while the GPU can spare "
        "it, and taken back first when it cannot",
        labels=[*unit_labels, "gpu"],
    )
    for gpu in gpus:
        for share in gpu.shares:
            values = labelled.get(share.unit, [*base_values, share.unit])
            over.add_metric([*values, gpu.uuid], share.borrowed)
    yield over
    yield _free(gpus)


def _free(gpus: Sequence[Gpu]) -> Metric:
    return _per_gpu(
        "gpu_free_bytes",
        "Free memory of a GPU shared by units with requests: what the watermark is kept from",
        gpus,
        lambda gpu: gpu.free,
    )


def _gpu_lending(gpus: Sequence[Gpu]) -> Iterator[Metric]:
    """The agent's view of each GPU where a container may borrow: what its requests keep
    for them, what is borrowed above them, and what is free."""
    yield _per_gpu(
        "gpu_requested_bytes",
        "The requests of the containers on a GPU where one may borrow: what it keeps for them",
        gpus,
        lambda gpu: gpu.requested,
    )
    yield _per_gpu(
        "gpu_lent_bytes",
        "GPU memory its containers hold above their requests: the first to be taken back",
        gpus,
        lambda gpu: sum(s.borrowed for s in gpu.shares),
    )
    yield _free(gpus)


def _per_gpu(name: str, help: str, gpus: Sequence[Gpu], value: Callable[[Gpu], int]) -> Metric:
    family = GaugeMetricFamily(PREFIX + name, help, labels=["uuid"])
    for gpu in gpus:
        family.add_metric([gpu.uuid], value(gpu))
    return family


_DEVICE_LABELS = ["gpu", "uuid", "model", "parent_uuid"]


def _device_values(d: Device) -> list[str]:
    return [str(d.index), d.uuid, d.name, d.parent_uuid or ""]


def _device_families(devices: Sequence[Device]) -> Iterator[Metric]:
    labels = _DEVICE_LABELS
    total = GaugeMetricFamily(PREFIX + "gpu_total_bytes", "Total memory of the GPU", labels=labels)
    used = GaugeMetricFamily(PREFIX + "gpu_used_bytes", "Used memory of the GPU", labels=labels)
    for d in devices:
        values = _device_values(d)
        if d.total_bytes is not None:
            total.add_metric(values, d.total_bytes)
        if d.used_bytes is not None:
            used.add_metric(values, d.used_bytes)
    yield total
    yield used


def _unexpected_errors(registry: CollectorRegistry) -> Counter:
    return Counter(
        PREFIX + "unexpected_errors",
        "Exceptions that escaped one step of a loop (bugs), by loop; the loop went on",
        ["loop"],
        registry=registry,
    )


def http_closed(registry: CollectorRegistry) -> Counter:
    return Counter(
        PREFIX + "http_connections_closed",
        "Connections a server of ours closed, by server (metrics, webhook) and reason "
        "(deadline: a request not whole in time, or a TLS handshake; unread: an answer not "
        "taken in time; made-way: for a newcomer, its peer holding the most; tls: a failed "
        "handshake)",
        ["server", "reason"],
        registry=registry,
    )


def event_failures(registry: CollectorRegistry) -> Counter:
    return Counter(
        PREFIX + "events_failed",
        "Kubernetes Events not posted, by reason (api, forbidden, dropped, spam, unexpected)",
        ["reason"],
        registry=registry,
    )


def hard_limit_gauge(labels: list[str], registry: CollectorRegistry) -> Gauge:
    return Gauge(
        PREFIX + "hard_limit_bytes",
        "The GPU memory limit the driver holds a cgroup to on a GPU, refusing allocations "
        "past it (bytes); absent where sampling alone enforces",
        labels,
        registry=registry,
    )


# The allocation gate's time per call: a few microseconds served inline, up to a recheck's
# wait (at least 250 ms) for a call that waits for a fresh pass.
GATE_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.25, 1.0)


def _gate_seconds(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        PREFIX + "allocation_gate_seconds",
        "The allocation gate's time per call, from reading it to answering it",
        buckets=GATE_BUCKETS,
        registry=registry,
    )


class GateMetrics:
    """exec's allocation gate: its calls by outcome, its refusals, its time per call, and
    whether its listener is stuck (`container` is exec's unit)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            PREFIX + "allocation_gate_calls",
            "The driver's allocation calls the allocation gate answered, by outcome "
            "(allowed, refused, not_memory, not_gpu, unsure, abandoned, error)",
            ["container", "outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            PREFIX + "allocation_refusals",
            "GPU allocations the allocation gate refused with the driver's out-of-memory status",
            ["container"],
            registry=registry,
        )
        self.seconds = _gate_seconds(registry)
        self.stalled = Gauge(
            PREFIX + "allocation_gate_stalled",
            "1 while a call has waited unanswered for a second (the listener is stuck)",
            registry=registry,
        )


class NodeGateMetrics:
    """The agent's allocation gate (`--allocation-gate on`), under exec's names: its calls
    by outcome and its time per call over the node (container IDs come and go: a series
    per container and outcome would be kept for ever), its refusals and its calls throttled
    by container (each removed when the container's last gated process exits), how many of
    its listeners are stuck, the calls the pods' holders let go on while the agent was
    away, and its dials of the holders it lost."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            PREFIX + "allocation_gate_calls",
            "The driver's allocation calls the node's allocation gate answered, by outcome "
            "(allowed, refused, not_memory, not_gpu, unproven, unsure, abandoned, overflow, "
            "error)",
            ["outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            PREFIX + "allocation_refusals",
            "GPU allocations the allocation gate refused with the driver's out-of-memory "
            "status, by container",
            ["namespace", "pod", "container"],
            registry=registry,
        )
        self.seconds = _gate_seconds(registry)
        self.stalled = Gauge(
            PREFIX + "allocation_gate_stalled",
            "Gated processes whose listener has left a call unanswered for a second",
            registry=registry,
        )
        self.throttled = Counter(
            PREFIX + "allocation_gate_throttled",
            "Gated calls of a container read later than they came, its budget of calls "
            "spent (its threads waited in the kernel), by container",
            ["namespace", "pod", "container"],
            registry=registry,
        )
        self.overflow = Gauge(
            PREFIX + "allocation_gate_overflow",
            "Gated processes served beyond the agent's caps (per pod, per node) by its one "
            "overflow reader, which lets their calls go on unjudged (outcome overflow)",
            registry=registry,
        )
        self.let_on = Counter(
            PREFIX + "allocation_gate_let_on",
            "Gated calls the pods' gate holders let go on unjudged while the agent was "
            "away (restarted, stopped or stuck), as they tell it when it is back",
            registry=registry,
        )
        self.redials = Counter(
            PREFIX + "allocation_gate_redials",
            "Dials of a pod's gate holder the agent had lost (a renewal or an fd it could "
            "not send), by result (held, failed)",
            ["result"],
            registry=registry,
        )
        for outcome in Outcome:  # every series at 0 from the start
            self.calls.labels(outcome)
        for result in ("held", "failed"):
            self.redials.labels(result)


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
        self.reclaims = Counter(
            PREFIX + "reclaims",
            "Signals sent to take back GPU memory lent above a request, by whose need "
            "(requests: a unit short of its request; unrequested: the watermark kept for "
            "processes that declared no request)",
            ["needed_by"],
            registry=self.registry,
        )
        self.refused = Counter(
            PREFIX + "signals_refused",
            "Signals not sent because the target could not be verified, by reason",
            ["reason"],
            registry=self.registry,
        )
        # Every label value at 0 from the start: a series born at 1 shows no increase in
        # Prometheus, and the dashboard's first action or reclaim would not show.
        for action in ACTIONS:
            self.actions.labels(action)
        for needed_by in NEEDED_BY:
            self.reclaims.labels(needed_by)
        for refused in REFUSED:
            self.refused.labels(refused)
        self.event_failures = event_failures(self.registry)
        self.hard_limits = hard_limit_gauge([unit_label, "gpu"], self.registry)
        self.tick_duration = Histogram(
            PREFIX + "tick_duration_seconds",
            "Wall time of one enforcement tick (sample, attribute, decide, act, report)",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.unexpected = _unexpected_errors(self.registry)
        self.http_closed = http_closed(self.registry)
        self.gate = GateMetrics(self.registry)


class NodeCollector(Collector):
    """The agent's view of its node: GPUs, health, and what it advertised."""

    def __init__(self) -> None:
        self.devices: Sequence[Device] = ()
        self.source_up = False
        self.advertised_bytes: int | None = None
        self.tenants: Mapping[str, int] = {}  # GPU uuid -> containers with a process on it
        self.failed: Mapping[str, str] = {}  # GPU uuid -> why the last pass could not read it
        self.lending: Sequence[Gpu] = ()  # the GPUs where containers may borrow, last pass
        self.unplaced: Sequence[Unplaced] = ()  # what the last pass could not place in a pod
        # What no declaration accounts for, as of the last pass (None: the pods not listed).
        self.unaccounted: Unaccounted | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        devices, up, advertised = self.devices, self.source_up, self.advertised_bytes
        tenants, failed = self.tenants, self.failed
        yield from _device_families(devices)
        yield from _gpu_lending(self.lending)
        readable = GaugeMetricFamily(
            PREFIX + "gpu_readable",
            "1 when the last NVML pass read the GPU; 0 when it could not (a GPU off the bus): "
            "its processes are not enforced by sampling, the other GPUs' are",
            labels=_DEVICE_LABELS,
        )
        for d in devices if up else ():
            readable.add_metric(_device_values(d), 0.0 if d.uuid in failed else 1.0)
        yield readable
        shared = GaugeMetricFamily(
            PREFIX + "gpu_tenants",
            "Containers (or, outside containers, cgroups) with a process on the GPU",
            labels=_DEVICE_LABELS,
        )
        for d in devices:
            if d.uuid in tenants:
                shared.add_metric(_device_values(d), tenants[d.uuid])
        yield shared
        yield from _unplaced(devices, self.unplaced)
        yield from _unaccounted(devices, self.unaccounted)
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


def _unplaced(devices: Sequence[Device], unplaced: Sequence[Unplaced]) -> Iterator[Metric]:
    """Per GPU, what processes that cannot be placed in a pod hold, and how many they are:
    on every GPU, 0 included, so that an alert can read it."""
    held: dict[str, int] = {}
    pids: dict[str, set[int]] = {}
    for u in unplaced:
        held[u.device_uuid] = held.get(u.device_uuid, 0) + (u.used_bytes or 0)
        pids.setdefault(u.device_uuid, set()).add(u.pid)
    amount = GaugeMetricFamily(
        PREFIX + "gpu_unplaced_bytes",
        "GPU memory (bytes, as far as NVML reports it) of processes whose PID namespace the "
        "agent cannot read (a security module refuses it), so that no pod is charged for it; "
        "never signalled, and never free to lend",
        labels=_DEVICE_LABELS,
    )
    count = GaugeMetricFamily(
        PREFIX + "gpu_unplaced_processes",
        "Processes on the GPU whose PID namespace the agent cannot read",
        labels=_DEVICE_LABELS,
    )
    for d in devices:
        amount.add_metric(_device_values(d), held.get(d.uuid, 0))
        count.add_metric(_device_values(d), len(pids.get(d.uuid, ())))
    yield amount
    yield count


def _unaccounted(devices: Sequence[Device], unaccounted: Unaccounted | None) -> Iterator[Metric]:
    """What each container of a pod the agent does not enforce holds on each GPU where it
    declares no VRAM (or holds more than it declares), and per GPU (0 included, so that an
    alert can read it) what processes in no pod hold; neither before the pods are listed."""
    undeclared = GaugeMetricFamily(
        PREFIX + "undeclared_used_bytes",
        "GPU memory a container holds on one GPU while its pod declares no VRAM for it (or "
        "less than it holds) and the webhook did not inject it: nothing limits it",
        labels=[*_CONTAINER_LABELS, "gpu"],
    )
    outside = GaugeMetricFamily(
        PREFIX + "gpu_outside_pods_bytes",
        "GPU memory of processes in no pod of the node (host processes, containers the kubelet "
        "did not start): nothing limits them",
        labels=_DEVICE_LABELS,
    )
    if unaccounted is not None:
        for c in unaccounted.undeclared:
            for gpu, used in c.gpus:
                undeclared.add_metric([c.namespace, c.pod, c.container.name, gpu], used)
        for d in devices:
            outside.add_metric(_device_values(d), unaccounted.outside_pods.get(d.uuid, 0))
    yield undeclared
    yield outside


@dataclass(frozen=True, slots=True)
class PodsView:
    """The agent's series of its node's enforced pods, as of a scrape."""

    containers: Sequence[ContainerSeries] = ()
    # (namespace, pod) -> what its sidecar alone knows, with what the agent's backstop did
    # there while the sidecar was silent (`core/sidecar_report.py`).
    reports: Mapping[tuple[str, str], SidecarReport] = field(default_factory=dict)
    # Each enforced container's peak, and each pod's workload (`vram-enforcer recommend`).
    peaks: Sequence[tuple[Named, int]] = ()
    owners: Sequence[tuple[str, str, Owner]] = ()


_CONTAINER_LABELS = ["namespace", "pod", "container"]
_POD_LABELS = ["namespace", "pod"]
# A sidecar's report: its family, the metric the agent serves it as, the label, the help.
_REPORTED = (
    (
        "actions",
        "actions",
        "action",
        "Enforcement actions taken in the pod, by action (warn, terminate, kill, restart, "
        "dry-run): by its sidecar, and by the agent while the sidecar was silent",
    ),
    (
        "reclaims",
        "reclaims",
        "needed_by",
        "Signals sent in the pod to take back GPU memory lent above a request, by whose need "
        "(requests: a unit short of its request; unrequested: the watermark kept for "
        "processes that declared no request)",
    ),
    (
        "refused",
        "signals_refused",
        "reason",
        "Signals not sent in the pod because the target could not be verified, by reason",
    ),
    (
        "unexpected",
        "sidecar_unexpected_errors",
        "loop",
        "Exceptions that escaped one step of a loop of the pod's sidecar (bugs), by loop",
    ),
)


class PodsCollector(Collector):
    """Every enforced container's series, worked out when scraped (`pod_metrics`), and the
    counts each sidecar reported; a process's series only with `per_process` (their number
    grows with pids)."""

    def __init__(self, view: Callable[[], PodsView], per_process: bool = False) -> None:
        self._view = view
        self._per_process = per_process

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        yield from _container_families(view.containers, self._per_process)
        yield from _workload_families(view)
        for family, metric, label, help in _REPORTED:
            counter = CounterMetricFamily(PREFIX + metric, help, labels=[*_POD_LABELS, label])
            for pod, report in sorted(view.reports.items()):
                for value, count in sorted(report.family(family).items()):
                    counter.add_metric([*pod, value], count)
            yield counter
        ticks = CounterMetricFamily(
            PREFIX + "sidecar_ticks", "Enforcement ticks of the pod's sidecar", labels=_POD_LABELS
        )
        seconds = CounterMetricFamily(
            PREFIX + "sidecar_tick_seconds",
            "Wall time of the pod's sidecar's ticks, in all (divided by its ticks: the mean tick)",
            labels=_POD_LABELS,
        )
        for pod, report in sorted(view.reports.items()):
            ticks.add_metric(list(pod), report.ticks)
            seconds.add_metric(list(pod), report.tick_seconds)
        yield ticks
        yield seconds


def _container_families(
    containers: Sequence[ContainerSeries], per_process: bool
) -> Iterator[Metric]:
    def family(name: str, help: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, help, labels=[*_CONTAINER_LABELS, *labels])

    used = family("container_used_bytes", "GPU memory the container's processes hold, on all GPUs")
    limit = family(
        "container_limit_bytes",
        "The GPU memory the container declared (its "
        "request: what the scheduler counted), over all GPUs",
    )
    ceiling = family(
        "container_ceiling_bytes",
        "What the container may borrow up to above its request while its GPU has room",
    )
    gpu_used = family(
        "container_gpu_used_bytes", "GPU memory the container's processes hold on one GPU", ["gpu"]
    )
    gpu_limit = family(
        "container_gpu_limit_bytes",
        "The container's limit on one GPU: what DRA allocated there",
        ["gpu"],
    )
    over = family(
        "container_gpu_over_request_bytes",
        "GPU memory the container holds above "
        "its request on one GPU: lent while the GPU can spare it, and taken back "
        "first when it cannot",
        ["gpu"],
    )
    sm = family(
        "container_gpu_sm_utilization_ratio",
        "Share of the GPU's time its SMs ran the "
        "container's kernels, in NVML's latest sample period (0-1, summed over its "
        "processes)",
        ["gpu"],
    )
    bandwidth = family(
        "container_gpu_memory_utilization_ratio",
        "Share of the GPU's time its "
        "memory controller read or wrote for the container, in NVML's latest "
        "sample period (0-1, summed over its processes)",
        ["gpu"],
    )
    process = family(
        "process_used_bytes",
        "GPU memory one process of the container holds on one GPU (its host pid)",
        ["pid", "gpu"],
    )
    for c in containers:
        labels = [c.who.namespace, c.who.pod, c.who.container]
        used.add_metric(labels, c.used)
        if c.limit is not None:
            limit.add_metric(labels, c.limit)
        if c.ceiling is not None:
            ceiling.add_metric(labels, c.ceiling)
        for g in c.gpus:
            gpu_used.add_metric([*labels, g.gpu], g.used)
            if g.limit is not None:
                gpu_limit.add_metric([*labels, g.gpu], g.limit)
            if g.over_request is not None:
                over.add_metric([*labels, g.gpu], g.over_request)
            if g.activity is not None:
                sm.add_metric([*labels, g.gpu], g.activity.sm_percent / 100)
                bandwidth.add_metric([*labels, g.gpu], g.activity.memory_percent / 100)
        for pid, gpu, held in c.processes if per_process else ():
            process.add_metric([*labels, str(pid), gpu], held)
    yield from (used, limit, ceiling, gpu_used, gpu_limit, over, sm, bandwidth)
    if per_process:
        yield process


def _workload_families(view: PodsView) -> Iterator[Metric]:
    """What a limit is chosen from: each container's peak, and each pod's owner."""
    peak = GaugeMetricFamily(
        PREFIX + "container_peak_bytes",
        "The most GPU memory the container held at once over all its GPUs, as the agent saw "
        "it since the container (re)started; max_over_time() gives it over a window",
        labels=_CONTAINER_LABELS,
    )
    for who, held in view.peaks:
        peak.add_metric([who.namespace, who.pod, who.container], held)
    owner = GaugeMetricFamily(
        PREFIX + "pod_owner",
        "1 for the workload the pod belongs to (Deployment, StatefulSet, DaemonSet, Job, "
        "ReplicaSet, another controller's kind, or Pod), as the pod says it",
        labels=[*_POD_LABELS, "owner_kind", "owner_name"],
    )
    for namespace, pod, of in view.owners:
        owner.add_metric([namespace, pod, of.kind, of.name], 1)
    yield peak
    yield owner


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
            "Requests answered on the usage socket, by result (ok, error, refused), samples "
            "(pushed) and pods (pod) pushed to subscribers, and sidecars' Events (event) and "
            "counts (report) taken",
            ["result"],
            registry=self.registry,
        )
        self.unguarded = Gauge(
            PREFIX + "pods_unguarded",
            "Enforced pods of this node whose sidecar is stopped, has ended or hung up (at "
            "once), or has not been heard for 10 s while running",
            registry=self.registry,
        )
        self.held_by_agent = Gauge(
            PREFIX + "pods_held_by_agent",
            "Pods whose limits the agent enforces itself while their sidecar is silent",
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
        self.node_syncs = Counter(
            PREFIX + "node_syncs",
            "Times the Node's capacity and labels were checked against NVML (and patched if "
            "they differed)",
            registry=self.registry,
        )
        self.event_failures = event_failures(self.registry)
        self.condition_failures = Counter(
            PREFIX + "conditions_failed",
            "Pod conditions (the last enforcement on a pod) not written, by reason (api, "
            "forbidden, dropped, gone, unexpected)",
            ["reason"],
            registry=self.registry,
        )
        self.hard_limits = hard_limit_gauge(["namespace", "pod", "container", "gpu"], self.registry)
        self.foreign_limits = Gauge(
            PREFIX + "foreign_limit_bytes",
            "A GPU memory limit someone else (owner) set on a cgroup the agent would hold, "
            "which it leaves as it is (bytes)",
            ["namespace", "pod", "container", "gpu", "owner"],
            registry=self.registry,
        )
        self.container_tier = Gauge(
            PREFIX + "container_tier",
            "1 for the enforcement tier that holds a running container that declares VRAM "
            "(driver-limit, sampling), once the agent knows it",
            ["namespace", "pod", "container", "tier"],
            registry=self.registry,
        )
        self.hard_limit_calls = Counter(
            PREFIX + "hard_limit_calls",
            "Per-cgroup GPU memory limits set or cleared through NVML, by operation (set, "
            "clear) and result (set, unsupported, forbidden, no-cgroup, rejected, "
            "no-dmem, not-applied, failed)",
            ["operation", "result"],
            registry=self.registry,
        )
        self.node_tier = Gauge(
            PREFIX + "node_tier",
            "The enforcement tier that holds limits on this node (1; the others 0), by tier: "
            "driver-limit (the driver refuses an allocation past a limit, sampling as the "
            "backstop) or sampling (alone); the agent logs why",
            ["tier"],
            registry=self.registry,
        )
        self.cgroup_watch_overflows = Counter(
            PREFIX + "cgroup_watch_overflows",
            "Times the inotify queue of the watch of new pods' and containers' cgroups "
            "overflowed: their limits waited for the next --cgroup-scan",
            registry=self.registry,
        )
        self.gate = NodeGateMetrics(self.registry)
        self.unexpected = _unexpected_errors(self.registry)
        self.http_closed = http_closed(self.registry)


ADMISSION_RESULTS = ("patched", "skipped", "denied", "invalid", "error")


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
        # At 0 from the start, as the sidecar's counters: the first denial shows in rate().
        for result in ADMISSION_RESULTS:
            self.requests.labels(result)
        for result in ("ok", "error"):
            self.cert_reloads.labels(result)
        self.unexpected = _unexpected_errors(self.registry)
        self.http_closed = http_closed(self.registry)
