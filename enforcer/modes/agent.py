"""`vram-enforcer agent`: the node's one NVML reader, capacity advertiser and PID translator.

Its loops share one process, a thread each (docs/architecture.md lists them, by name): the
NVML sampler (with, on each pass, the lending and the backstop), the usage socket, the
metrics server (each pod's series worked out when scraped), the Node's advertiser, the
watches of the node's pods and of the namespaces that opted in, the hard limiter, the
kubelet's pod-resources reader, the pod publisher, the sidecar watch, the evictor and the
Event recorder. Every part is built first, handed what it reads of the others as it is
made (what the sampler's passes leave is `Passes`, the latest of each), and then all start.
NVML or the API being down degrades one part: the socket answers with an error, the Node
keeps its last advertisement, and each part recovers on its own. A bug in one step of a
loop is reported and the loop goes on (`guard.LoopGuard`). A thread that stops anyway ends
the process with status 1, so that the DaemonSet restarts it, and `/healthz` (on the
metrics port) fails once no NVML pass, or no check of the sidecar watch, has completed for
`LIVENESS_AFTER`.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import SIDECAR, Declares
from enforcer.core.gpu_faults import Faults, passed
from enforcer.core.model import Device, Sample, SourceDown, Unplaced
from enforcer.core.node import LABEL_ALLOCATION_GATE
from enforcer.core.payloads import ObjectReference
from enforcer.core.pod_directory import event_about
from enforcer.core.reasons import Reason
from enforcer.core.settings.agent import AgentSettings
from enforcer.core.sidecar_report import SidecarReport, newly_denied
from enforcer.core.tier_choice import HARD_LIMITS_OFF
from enforcer.edge import logs
from enforcer.edge.cgroupfs import ContainerCgroups
from enforcer.edge.guard import LoopGuard, stopped
from enforcer.edge.latest import Latest
from enforcer.edge.listening import SocketInUse
from enforcer.edge.metrics import AgentTelemetry, PodsCollector
from enforcer.edge.metrics_server import MetricsPortError, serve_metrics
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors
from enforcer.edge.pid_view import PidView, PidViewError
from enforcer.edge.procfs import ProcFs
from enforcer.edge.tenants import TenantCache
from enforcer.edge.tier_probe import TierProbe, gate_blocked, host_root, pods_cgroup
from enforcer.edge.usage_server import ServerHooks, ServerMetrics, UsageServer
from enforcer.modes.backstop import Backstop
from enforcer.modes.lender import Lender
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_gate import (
    GATE_SOCKET,
    GateReports,
    NodeGate,
    container_ceiling,
    container_of,
    dial_sidecar,
)
from enforcer.modes.node_view import ClaimReads, NodeView
from enforcer.modes.pod_metrics import LastPass, Peaks, PodCounts, pods_view, with_workloads
from enforcer.modes.tier_watch import TierWatch, told

if TYPE_CHECKING:
    from kubernetes import client

    from enforcer.core.payloads import Pod
    from enforcer.core.protocol import EventRequest
    from enforcer.edge.cgroup_watch import CgroupWatch
    from enforcer.edge.events import EventRecorder
    from enforcer.edge.eviction import Evictor
    from enforcer.edge.node_advertiser import NodeAdvertiser
    from enforcer.edge.node_pods import WatchedPods
    from enforcer.edge.pod_conditions import ConditionWriter
    from enforcer.edge.pod_resources import PodResources
    from enforcer.modes.pod_publisher import PodPublisher
    from enforcer.modes.sidecar_watch import SidecarNews, SidecarWatch
    from enforcer.modes.unaccounted import UnaccountedStep

    # The threads the pod watch wakes: each stops on its `stop` event.
    Woken = (
        HardLimiter
        | CgroupWatch
        | PodPublisher
        | SidecarWatch
        | PodResources
        | Evictor
        | ConditionWriter
    )

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_THREAD_DIED = 1
STALE_INTERVALS = 20  # replies turn into errors once the sample is this many intervals old
LIVENESS_AFTER = (
    60.0  # /healthz fails when no pass (NVML's, the watch's) completed for this long (s)
)
JOIN_WITHIN = 5.0  # on SIGTERM, the threads get this long, together, to end
STOP_CHECK = 1.0  # s: how soon the sampler sees `stop` while it rests on the gate's wish
# s: the least time between the starts of two passes where the allocation gate asks for an
# early one: at most 20 NVML passes a second, however many calls over a limit wait.
EARLY_PASS_GAP = 0.05
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _device_shape(devices: Sequence[Device]) -> tuple[tuple[str, int | None], ...]:
    """What the advertisement depends on: which devices, and how big."""
    return tuple((d.uuid, d.total_bytes) for d in devices)


class GpuFaults:
    """The GPUs that NVML cannot read, while the others are read on (`core/gpu_faults.py`
    decides when to say so): said in the log, the metrics (`gpu_readable`) and, where the
    agent has the API, as Events on its Node (`recorder`: None where it posts none)."""

    def __init__(
        self, telemetry: AgentTelemetry, node_name: str, recorder: EventRecorder | None
    ) -> None:
        self._telemetry = telemetry
        self._node = node_name
        self._recorder = recorder
        self._faults = Faults()

    def update(self, sample: Sample) -> None:
        index = {d.uuid: d.index for d in sample.devices}
        self._faults, changes = passed(self._faults, dict(sample.failed))
        for change in changes:
            if change.why is not None:
                self._tell(
                    messages.gpu_unreadable(change.gpu, index.get(change.gpu), change.why), True
                )
            else:
                self._tell(messages.gpu_readable(change.gpu), False)
        self._telemetry.node.failed = dict(self._faults.said)

    def _tell(self, text: str, warning: bool) -> None:
        log.log(logging.ERROR if warning else logging.INFO, "%s", text)
        if self._recorder is not None and self._node:
            # As the kubelet names its Node in its own Events: the name is the uid.
            about: ObjectReference = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self._node,
                "uid": self._node,
            }
            self._recorder.record(about, str(Reason.GPU_UNREADABLE), text, warning)


class Passes:
    """What the sampler's passes leave for the other threads, the latest of each. Made
    before the sampler and its readers, it is handed to each as it is built."""

    __slots__ = ("container_usage", "devices", "last")

    def __init__(self) -> None:
        # Set when the set or size of the GPUs changes: the advertiser waits on it.
        self.devices: Latest[Sequence[Device]] = Latest(())
        # The sample and each process's container, for the pods' metrics, read when scraped.
        self.last: Latest[LastPass | None] = Latest(None)
        # With hard limits: each container's usage per GPU, for the hard limiter's proof that
        # the driver charges what it limits.
        self.container_usage: Latest[Mapping[str, Mapping[str, int]]] = Latest({})


@dataclass(frozen=True, slots=True)
class PodSteps:
    """What each pass also does with the pod watch: the reclaims (`Lender`), the pods whose
    sidecar is silent enforced by the agent itself (`Backstop`), each container's usage
    kept (`Passes.container_usage`, with hard limits), the memory that no declaration
    accounts for shown and said (`UnaccountedStep`), and each container's peak (`Peaks`,
    where the agent serves pods), and the allocation gate's view of each gated container
    (`NodeGate.saw`, with `--allocation-gate on`)."""

    lender: Lender | None = None
    backstop: Backstop | None = None
    keeps_usage: bool = False
    unaccounted: UnaccountedStep | None = None
    peaks: Peaks | None = None  # each container's peak, kept for its series
    gate: NodeGate | None = None  # the allocation gate's containers, fed each pass


class Sampler(threading.Thread):
    """One NVML pass per interval, published to the socket, the metrics and `passes`."""

    def __init__(
        self,
        source: NvmlSource,
        server: UsageServer,
        telemetry: AgentTelemetry,
        interval: float,
        passes: Passes,
        tenants: TenantCache,
        faults: GpuFaults | None = None,
        steps: PodSteps | None = None,
    ) -> None:
        """`steps`: None without the pod watch."""
        super().__init__(name="nvml-sampler", daemon=True)
        self._source = source
        self._tenants = tenants
        self._faults = faults or GpuFaults(telemetry, "", None)
        self._server = server
        self._telemetry = telemetry
        self._interval = interval
        self._passes = passes
        self._steps = steps or PodSteps()
        self.stop = threading.Event()
        self._up: bool | None = None
        self._unplaced_said: set[int] = set()  # pids, while they stay unplaced
        self._guard = LoopGuard("sampler", telemetry.unexpected.labels("sampler"), log)
        # A bug in what is only shown and said leaves the pass, and the enforcement, whole.
        self._unaccounted_guard = LoopGuard(
            "unaccounted", telemetry.unexpected.labels("unaccounted"), log
        )
        self._gate_guard = LoopGuard(
            "allocation gate", telemetry.unexpected.labels("allocation-gate"), log
        )
        self.last_pass = time.monotonic()  # when the last pass completed without a bug
        self._began = -EARLY_PASS_GAP  # when the last pass began (monotonic)

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self._rest(next_tick):
            if time.monotonic() >= next_tick:  # an early pass keeps the schedule
                next_tick = max(next_tick + self._interval, time.monotonic())
            if self._guard.run(self._pass):
                self.last_pass = time.monotonic()
        if self._steps.gate is not None:  # what it feeds stops with it
            self._steps.gate.stop()

    def _rest(self, tick: float) -> bool:
        """Until `tick`, or sooner where the allocation gate wants a pass (a call over its
        container's limit waits for one begun after it arrived), though no sooner than
        `EARLY_PASS_GAP` after the last began: a tenant's calls never drive more passes
        than that. Whether to stop."""
        wanted = self._steps.gate.wanted if self._steps.gate is not None else None
        while True:
            now, due = time.monotonic(), tick
            if wanted is not None and wanted.is_set():
                due = min(tick, self._began + EARLY_PASS_GAP)
            if now >= due:
                return self.stop.is_set()
            if wanted is None or wanted.is_set():
                if self.stop.wait(due - now):
                    return True
            elif not wanted.wait(min(due - now, STOP_CHECK)) and self.stop.is_set():
                return True

    def _pass(self) -> None:
        if self._steps.gate is not None:  # a call arriving from now on wants the next one
            self._steps.gate.wanted.clear()
        started, began = time.perf_counter(), time.monotonic()
        self._began = began
        sample = self._source.sample()
        self._telemetry.tick_duration.observe(time.perf_counter() - started)
        lending, usage = None, None
        if isinstance(sample, Sample):
            self._telemetry.node.tenants = self._tenants.count(sample)
            # Each process's container, built once per pass, by the first that needs it.
            containers = functools.cache(self._tenants.containers)
            steps = self._steps
            if steps.lender is not None:  # None: no lending is published (`Lender`)
                lending = steps.lender(sample, containers)
            if steps.backstop is not None:  # a silent pod's borrowers, held as told its sidecar
                steps.backstop(sample, containers, lending)
            if steps.keeps_usage or steps.peaks is not None or steps.gate is not None:
                usage = usage_by_container(sample, containers())
                if steps.keeps_usage:
                    self._passes.container_usage.set(usage)
                if steps.peaks is not None:
                    steps.peaks.see(usage)
            self._passes.last.set((sample, containers))
        self._server.publish(sample, lending)
        self._record(sample)
        if self._steps.gate is not None:  # after the usage is out: a bug here never delays it
            self._gate_guard.run(functools.partial(self._steps.gate.saw, usage, began))
        if isinstance(sample, Sample) and self._steps.unaccounted is not None:
            # Last: what is only shown and said never delays the usage the sidecars read.
            self._unaccounted_guard.run(
                functools.partial(self._steps.unaccounted, sample, containers)
            )

    def _record(self, sample: Sample | SourceDown) -> None:
        up = isinstance(sample, Sample)
        if up != self._up:
            if isinstance(sample, Sample):
                log.info("reading NVML: %d device(s)", len(sample.devices))
            else:
                log.error("cannot read GPU usage: %s", sample.reason)
            self._up = up
        self._telemetry.node.source_up = up
        if isinstance(sample, Sample):
            self._telemetry.node.devices = sample.devices
            self._telemetry.node.unplaced = sample.unplaced
            self._say_unplaced(sample.unplaced)
            self._faults.update(sample)
            if _device_shape(sample.devices) != _device_shape(self._passes.devices.get()):
                self._passes.devices.set(sample.devices)

    def _say_unplaced(self, unplaced: Sequence[Unplaced]) -> None:
        """Each process that cannot be placed in a pod, said once while it stays so."""
        held: dict[int, list[Unplaced]] = {}
        for u in unplaced:
            held.setdefault(u.pid, []).append(u)
        for pid in sorted(held.keys() - self._unplaced_said):
            log.warning("%s", messages.unplaced(pid, held[pid]))
        self._unplaced_said = set(held)


class Advertiser(threading.Thread):
    """Re-applies capacity and labels every resync, or at once when the GPUs change."""

    def __init__(
        self,
        advertiser: NodeAdvertiser,
        devices: Latest[Sequence[Device]],
        telemetry: AgentTelemetry,
        resync: float,
    ) -> None:
        """`devices`: the sampler's, set when the set or size of the GPUs changes."""
        super().__init__(name="node-advertiser", daemon=True)
        self._advertiser = advertiser
        self._devices = devices
        self._telemetry = telemetry
        self._resync = resync
        self.stop = threading.Event()
        self._last_error = ""
        self._guard = LoopGuard("advertiser", telemetry.unexpected.labels("advertiser"), log)

    def run(self) -> None:
        while not self.stop.is_set():
            devices = self._devices.wait(self._resync)
            if self.stop.is_set() or not devices:
                continue  # no successful NVML pass yet: never advertise a guess
            self._guard.run(functools.partial(self._sync, devices))

    def _sync(self, devices: Sequence[Device]) -> None:
        from enforcer.edge.kube import Forbidden, KubeError  # noqa: PLC0415 - loaded only when used

        try:
            status_ops, label_ops = self._advertiser.sync(devices)
        except Forbidden as exc:
            self._report(exc, "sync", logging.ERROR)
            return
        except KubeError as exc:
            self._report(exc, "sync", logging.WARNING)
            return
        self._telemetry.node.advertised_bytes = self._advertiser.desired_bytes(devices)
        self._telemetry.node_syncs.inc()
        if status_ops or label_ops or self._last_error:
            log.info("node is up to date (%d status, %d label changes)", status_ops, label_ops)
        self._last_error = ""

    def _report(self, exc: Exception, operation: str, level: int) -> None:
        """Each distinct failure is logged once, not on every resync."""
        self._telemetry.api_errors.labels(operation).inc()
        if str(exc) != self._last_error:
            log.log(level, "%s", exc, exc_info=logs.detail(exc))
            self._last_error = str(exc)


def run(settings: AgentSettings) -> int:
    # A container's processes are listed in its cgroup, on the host's cgroupfs where the
    # chart mounts it: a container's init is found there, not by a scan of every process.
    host_proc = ProcFs(settings.host_proc, ContainerCgroups(Path(settings.cgroup_root)))
    try:
        PidView.of_process(host_proc, "self")
    except PidViewError:
        log.error(
            "the agent must run in the host's PID namespace (hostPID: true), with %s being the "
            "host's /proc: NVML reports host PIDs and only there can they be translated",
            settings.host_proc,
        )
        return EXIT_USAGE
    telemetry = AgentTelemetry()
    advertiser, api = None, None
    if settings.uses_api:
        from enforcer.edge.kube import KubeError, connect  # noqa: PLC0415
        from enforcer.edge.node_advertiser import NodeAdvertiser  # noqa: PLC0415

        try:
            api = connect(settings.kubeconfig)
        except KubeError as exc:
            log.error("%s", exc, exc_info=logs.detail(exc))
            return EXIT_USAGE
        if settings.advertise or settings.labels:
            advertiser = NodeAdvertiser(
                api,
                settings.node_name,
                resource_name=settings.resource_name,
                resource_unit=settings.resource_unit,
                reserve_bytes=settings.reserve_bytes,
                advertise=settings.advertise,
                labels=settings.labels,
            )
    # Threads started from here on, libnvidia-ml's included, inherit the mask: only
    # sigwait() below takes the signals, so a SIGTERM always means a clean shutdown.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    nvml = Nvml(utilisation_every=settings.utilization_interval)
    try:
        nvml.init()
    except NvmlError as exc:  # keep serving errors and retrying: the driver may come later
        log.error(
            "cannot initialise NVML yet (%s); retrying with backoff", exc, exc_info=logs.detail(exc)
        )
    try:
        return _serve(settings, host_proc, nvml, telemetry, advertiser, api)
    finally:
        nvml.shutdown()


def _serve(
    settings: AgentSettings,
    host_proc: ProcFs,
    nvml: Nvml,
    telemetry: AgentTelemetry,
    advertiser: NodeAdvertiser | None,
    api: client.ApiClient | None,
) -> int:
    """Every part is built first, each handed what it needs as it is made; then they all
    start together, and end together."""
    recorder = None  # Events: the agent's own and the sidecars', with the pod watch
    if api is not None and settings.watches_pods:
        from enforcer.edge.events import EventRecorder  # noqa: PLC0415 - loaded only when used

        recorder = EventRecorder(
            api, settings.node_name, settings.node_name, telemetry.event_failures
        )
    served = _served(recorder) if recorder is not None and settings.serve_pods else None
    server = UsageServer(
        Path(settings.socket),
        host_proc,
        ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected),
        stale_after=max(2.0, STALE_INTERVALS * settings.interval),
        hooks=served.hooks if served is not None else None,
    )
    try:
        server.start()
    except (SocketInUse, OSError) as exc:
        log.error("cannot serve on %s: %s", settings.socket, exc)
        return EXIT_USAGE
    source = NvmlSource(nvml, PidView.host(host_proc), gpu_device_majors(host_proc))
    passes = Passes()
    tier = _tier_watch(settings, telemetry)
    watches: tuple[WatchedPods, ...] = ()  # the pods' and the namespaces'
    others: list[Woken] = []
    steps = None
    if api is not None and recorder is not None:
        # The Node's labels as its advertiser last read them: gpu-fractioning's among them.
        labels = advertiser.last_labels if advertiser is not None else dict
        watches, others, steps = _pod_watch(
            settings,
            api,
            recorder,
            telemetry,
            server,
            passes,
            served,
            _Node(tier, labels, _gate_label(advertiser, passes), lambda: nvml.driver_version),
        )
    faults = GpuFaults(telemetry, settings.node_name, recorder)
    sampler = Sampler(
        source,
        server,
        telemetry,
        settings.interval,
        passes,
        TenantCache(host_proc),
        faults,
        steps,
    )
    threads: list[Sampler | Advertiser | WatchedPods | Woken | TierWatch] = [sampler]
    if advertiser is not None:
        threads.append(Advertiser(advertiser, passes.devices, telemetry, settings.resync))
    threads.extend([*watches, *others, *([tier] if tier is not None else [])])
    liveness = max(LIVENESS_AFTER, STALE_INTERVALS * settings.interval)
    sidecars = served.watch if served is not None else None
    check = functools.partial(health, sampler, liveness, sidecars)
    try:
        metrics = serve_metrics(telemetry, settings.metrics_port, settings.metrics_address, check)
    except MetricsPortError as exc:
        log.error("%s", exc)
        server.close()
        return EXIT_USAGE
    for t in threads:
        t.start()
    if recorder is not None:
        recorder.start()
    log.info("agent running on node %r", settings.node_name or "(no API)")
    status = watch([*threads, server.thread, *([metrics.thread] if metrics else [])])
    # The threads that feed the server stop first: it serves until they have.
    for t in threads:
        t.stop.set()
    for each in watches:
        each.close()  # ends a read blocked on the watch
    passes.devices.wake()  # the advertiser, to see its stop
    # One deadline for all: a thread stuck in an API call's retry pause (the API down) is
    # left behind, being a daemon, and the others are not kept waiting behind it.
    deadline = time.monotonic() + JOIN_WITHIN
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    server.close()
    if recorder is not None:
        recorder.close()
    source.close()
    if metrics is not None:
        metrics.close()
    return status


@dataclass(frozen=True, slots=True)
class _Node:
    """What the agent knows of its node beside its pods: its choice of tier (where it sets
    hard limits), and its labels as its advertiser last read them (gpu-fractioning's)."""

    tier: TierWatch | None
    labels: Callable[[], Mapping[str, str]]
    gate_label: Callable[[str], None] = lambda value: None  # the allocation gate's ("": none)
    driver_version: Callable[[], str] = str  # the sampler's NVML's ("": not read yet)


@dataclass(slots=True)
class _Served:
    """What an agent that serves pods makes before its server: the server's hooks, and what
    they feed: each pod's counts from its sidecar, and what the sidecar watch is told (the
    sidecars that hung up, and those whose signals the kernel refused). The watch itself,
    once made (`_pod_watch`), for the agent's health."""

    hooks: ServerHooks
    counts: PodCounts
    news: SidecarNews
    watch: SidecarWatch | None = None


def _served(recorder: EventRecorder) -> _Served:
    from enforcer.modes.sidecar_watch import SidecarNews  # noqa: PLC0415 - only when used

    def post(pod: Pod, event: EventRequest) -> None:
        """A sidecar's report, on its own pod: sidecars no longer post Events."""
        about = event_about(pod, event.container)
        recorder.record(about, event.reason, event.message, event.warning, from_sidecar=True)

    def keep(pod: Pod, container_id: str, report: SidecarReport) -> None:
        """A sidecar's counts, kept for its pod's series; one whose signals the kernel
        refused since its last leaves its pod to the agent (the watch is told)."""
        if newly_denied(counts.keep(pod, container_id, report), report):
            news.refused(container_id)

    # Every enforced pod's series, served here: the sidecars serve none.
    counts = PodCounts()
    # The sidecar watch reads the server's connections, and the server tells the watch of
    # a sidecar that hung up (its pod is held at once) or whose signals were refused: made
    # first, the news is what both are built with.
    news = SidecarNews()
    no_pods = "the agent has not listed this node's pods yet"
    hooks = ServerHooks(post, keep, news.hung_up, no_pods, sidecars_only=True)
    return _Served(hooks, counts, news)


def _gate_label(advertiser: NodeAdvertiser | None, passes: Passes) -> Callable[[str], None]:
    """How the allocation gate says its state on the Node (`node.LABEL_ALLOCATION_GATE`,
    "": none): through the advertiser, woken to write it now (not at its next resync)."""

    def say(value: str) -> None:
        if advertiser is not None:
            advertiser.extra_labels.set({LABEL_ALLOCATION_GATE: value} if value else {})
            passes.devices.wake()

    return say


def _tier_watch(settings: AgentSettings, telemetry: AgentTelemetry) -> TierWatch | None:
    """The node's tier, probed now and every minute, where the agent sets hard limits;
    sampling alone, said once, where it does not."""
    if not settings.hard_limits:
        told(HARD_LIMITS_OFF, telemetry)
        return None
    where = pods_cgroup(Path(settings.cgroup_root))
    return TierWatch(Nvml(), TierProbe(where, host_root(Path(settings.host_proc))), telemetry)


def _pod_watch(
    settings: AgentSettings,
    api: client.ApiClient,
    recorder: EventRecorder,
    telemetry: AgentTelemetry,
    server: UsageServer,
    passes: Passes,
    served: _Served | None,
    node_facts: _Node,
) -> tuple[tuple[WatchedPods, ...], list[Woken], PodSteps]:
    """The one watch of this node's pods, and what it wakes: the hard limiter (with the
    recorder of its Events) and the pod replies to sidecars; and the watch of the namespaces
    that opted in, whose pods' sidecar environment the limiter, the lender and the backstop
    read (the agent's own never). Each pod's DRA objects are read once per change of the
    pod, for both. The limiter has an NVML session of its own (NVML counts
    initialisations): the sampler's is not shared. `served`: where the agent serves pods,
    what its server's hooks feed. Returned with them: what each sampler pass does with the
    pods (`PodSteps`). `node_facts`: its tier and its labels, as last read."""
    from enforcer.edge.claims import ClaimCache, ClaimReader  # noqa: PLC0415 - only when used
    from enforcer.edge.eviction import Evictor  # noqa: PLC0415
    from enforcer.edge.namespaces import OptedInNamespaces  # noqa: PLC0415
    from enforcer.edge.node_pods import NodePods  # noqa: PLC0415
    from enforcer.edge.pod_conditions import ConditionWriter  # noqa: PLC0415
    from enforcer.edge.pod_resources import PodResources  # noqa: PLC0415
    from enforcer.edge.sidecar_dialer import Dialer  # noqa: PLC0415
    from enforcer.modes.last_enforcement import LastEnforcement  # noqa: PLC0415
    from enforcer.modes.pod_publisher import PodPublisher  # noqa: PLC0415
    from enforcer.modes.sidecar_watch import SidecarProcesses, SidecarWatch  # noqa: PLC0415
    from enforcer.modes.unaccounted import UnaccountedStep  # noqa: PLC0415

    claims = ClaimCache(ClaimReader(api, settings.node_name))
    limiter_woken, publisher_woken = threading.Event(), threading.Event()
    lender_woken, resources_woken = threading.Event(), threading.Event()
    pods = NodePods(
        api, settings.node_name, (limiter_woken, publisher_woken, lender_woken, resources_woken)
    )
    namespaces = OptedInNamespaces(
        api, settings.namespace, (limiter_woken, lender_woken, publisher_woken)
    )
    # No DRA driver's allocations are GPUs (`--dra-drivers` empty): no claim is read.
    reads = ClaimReads(claims.last, claims.objects_or_problem, settings.dra)
    node = NodeView(
        pods.snapshot,
        namespaces.names,
        Declares(settings.resource_name, settings.resource_unit, SIDECAR),
        reads if settings.dra.drivers else None,
        node_facts.labels,
    )
    woken: list[Woken] = []
    if settings.hard_limits:
        woken += _hard_limits(
            settings, node, passes, recorder, telemetry, limiter_woken, node_facts.tier
        )
    lender, backstop, gate = None, None, None
    peaks: Peaks | None = None
    if served is not None:
        dra = claims if settings.dra.drivers else None
        assigned = None
        if settings.pod_resources_socket:
            kubelet = PodResources(Path(settings.pod_resources_socket), resources_woken, telemetry)
            assigned = (lambda: kubelet.last, settings.gpu_resources)
            woken.append(kubelet)
        lender = Lender(
            node,
            lender_woken,
            settings.reclaim_watermark,
            telemetry,
            assigned,
            reserve_bytes=settings.reserve_bytes,
        )
        gate = _node_gate(
            settings,
            server.host_proc,
            lender,
            telemetry,
            node_facts,
            GateReports(
                telemetry.gate, functools.partial(container_of, node.injected), recorder.record
            ),
        )
        woken.append(
            PodPublisher(
                pods,
                server.publish_pods,
                dra,
                publisher_woken,
                telemetry,
                opted_in=namespaces.names,
            )
        )
        host_proc = server.host_proc
        dialer = Dialer(
            functools.partial(dial_sidecar, host_proc, gate, node.injected),
            served.news.woken.set,
            telemetry.unexpected.labels("sidecar-dial"),
        )
        sidecars = SidecarWatch(
            node.injected,
            server,
            served.news,
            recorder,
            telemetry,
            (dialer, SidecarProcesses(host_proc)),
        )
        served.watch = sidecars
        woken.append(sidecars)
        # A pod whose process the kernel will not let the agent signal is evicted instead.
        evictor = Evictor(
            api, recorder, telemetry.unexpected.labels("evictor"), settings.eviction_timeout
        )
        woken.append(evictor)
        backstop = Backstop(
            node, lambda: sidecars.silent, recorder, telemetry, host_proc, evictor.evict
        )
        # Each enforcement the recorder is told of (the sidecars' and the agent's own) is
        # kept on its pod as a condition, which outlives the Event.
        conditions = ConditionWriter(api, telemetry.condition_failures)
        woken.append(conditions)
        recorder.told = LastEnforcement(
            conditions, pods.snapshot, passes.last.get, lambda: lender.tenants, namespaces.names
        ).told
        view = functools.partial(
            pods_view,
            passes.last.get,
            pods.snapshot,
            lender,
            telemetry.node,
            served.counts,
            backstop,
            namespaces.names,
        )
        peaks = Peaks(pods.snapshot)
        view = functools.partial(with_workloads, view, pods.snapshot, peaks, namespaces.names)
        telemetry.registry.register(PodsCollector(view, settings.per_process_metrics))
    shown = UnaccountedStep(node, telemetry.node, recorder, settings.namespace)
    return (
        (pods, namespaces),
        woken,
        PodSteps(lender, backstop, settings.hard_limits, shown, peaks, gate),
    )


def _node_gate(
    settings: AgentSettings,
    host_proc: ProcFs,
    lender: Lender | None,
    telemetry: AgentTelemetry,
    node_facts: _Node,
    reports: GateReports,
) -> NodeGate | None:
    """With `--allocation-gate on` (which needs the pods served: the lender's tenants give
    each container's ceiling; the sampler's NVML, the driver's branch), the node's gate,
    started before the first pass (it stops with the sampler), its metrics and Events
    `reports`."""
    if settings.allocation_gate != "on" or lender is None:
        return None
    gate = NodeGate(
        Path(settings.kubelet_root),
        Path(settings.socket).parent / GATE_SOCKET,
        Path(settings.host_proc),
        gpu_device_majors(host_proc) or (),
        lambda cid: container_ceiling(lender.tenants, node_facts.driver_version(), cid),
        telemetry.unexpected.labels("allocation-gate"),
        recheck_wait=max(2 * settings.interval, 0.25),
        label=node_facts.gate_label,
        reports=reports,
        driver=node_facts.driver_version,
        unproven=settings.allocation_gate_unproven,
        blocked=gate_blocked(),
    )
    why = gate.start()
    if why is not None:
        log.warning("the allocation gate does not run on this node: %s", why)
    return gate


def _hard_limits(
    settings: AgentSettings,
    node: NodeView,
    passes: Passes,
    recorder: EventRecorder,
    telemetry: AgentTelemetry,
    woken: threading.Event,
    tier: TierWatch | None,
) -> list[Woken]:
    """The hard limiter, woken by the pod watch, its --cgroup-scan, and a watch of new pods'
    and containers' cgroups: a container's limit lands a pass, not a scan, after the runtime
    made its cgroup (the scan stays, for what inotify misses)."""
    from enforcer.edge.cgroup_watch import CgroupWatch  # noqa: PLC0415 - only when used

    root = Path(settings.cgroup_root)
    return [
        HardLimiter(
            Nvml(),
            node,
            passes,
            recorder,
            telemetry,
            cgroups=(root, settings.cgroup_scan),
            changed=woken,
            tier=tier.latest if tier is not None else None,
        ),
        CgroupWatch(
            root,
            woken,
            telemetry.cgroup_watch_overflows,
            telemetry.unexpected.labels("cgroup-watch"),
        ),
    ]


def health(sampler: Sampler, after: float, sidecars: SidecarWatch | None = None) -> str | None:
    """What /healthz says: the sampler must have completed a pass, and the sidecar watch (if
    it runs) a check, within `after` seconds: one stuck in the kernel is not alive."""
    now = time.monotonic()
    age = now - sampler.last_pass
    if not sampler.is_alive() or age > after:
        return f"no NVML pass has completed for {age:.0f}s (the limit is {after:.0f}s)"
    if sidecars is not None and (age := now - sidecars.last_check) > after:
        return (
            f"no check of the sidecar watch has completed for {age:.0f}s "
            f"(the limit is {after:.0f}s)"
        )
    return None


def watch(threads: Sequence[threading.Thread], poll: float = 1.0) -> int:
    """Wait for SIGTERM or SIGINT (0), or for one of `threads` to stop (1): a thread that
    stops on its own ends the agent, so that the DaemonSet restarts it, rather than leaving
    it half-working while the main thread waits."""
    while True:
        received = signal.sigtimedwait(_STOP_SIGNALS, poll)
        if received is not None:
            log.info("%s: shutting down", signal.Signals(received.si_signo).name)
            return 0
        dead = stopped(threads)
        if dead:
            log.error(
                "the %s thread has stopped; exiting with status %d so that the agent is restarted",
                ", ".join(dead),
                EXIT_THREAD_DIED,
            )
            return EXIT_THREAD_DIED
