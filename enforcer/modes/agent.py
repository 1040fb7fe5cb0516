"""`vram-enforcer agent`: the node's one NVML reader, capacity advertiser and PID translator.

Its loops share one process, a thread each (docs/architecture.md lists them, by name): the
NVML sampler (with, on each pass, the lending and the backstop), the usage socket, the
metrics server (each pod's series worked out when scraped), the Node's advertiser, the
watches of the node's pods and of the namespaces that opted in, the hard limiter, the
kubelet's pod-resources reader, the pod publisher, the sidecar watch, the evictor and the
Event recorder.
NVML or the API being down degrades one part: the socket answers with an error, the Node
keeps its last advertisement, and each part recovers on its own. A bug in one step of a
loop is reported and the loop goes on (`guard.LoopGuard`). A thread that stops anyway ends
the process with status 1, so that the DaemonSet restarts it, and `/healthz` (on the
metrics port) fails once no NVML pass has completed for `LIVENESS_AFTER`.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import SIDECAR
from enforcer.core.gpu_faults import Faults, passed
from enforcer.core.model import Device, Sample, SourceDown
from enforcer.core.payloads import ObjectReference
from enforcer.core.pod_directory import event_about
from enforcer.core.reasons import Reason
from enforcer.core.settings.agent import AgentSettings
from enforcer.edge import logs
from enforcer.edge.cgroupfs import ContainerCgroups
from enforcer.edge.guard import LoopGuard, stopped
from enforcer.edge.listening import SocketInUse
from enforcer.edge.metrics import AgentTelemetry, PodsCollector
from enforcer.edge.metrics_server import MetricsPortError, serve_metrics
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sources import PidView, PidViewError
from enforcer.edge.tenants import TenantCache
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from enforcer.modes.backstop import Backstop
from enforcer.modes.lender import Lender
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from enforcer.modes.pod_metrics import LastPass, PodCounts, pods_view

if TYPE_CHECKING:
    from kubernetes import client

    from enforcer.core.payloads import Pod
    from enforcer.core.protocol import EventRequest
    from enforcer.edge.events import EventRecorder
    from enforcer.edge.eviction import Evictor
    from enforcer.edge.node_advertiser import NodeAdvertiser
    from enforcer.edge.node_pods import WatchedPods
    from enforcer.edge.pod_resources import PodResources
    from enforcer.modes.pod_publisher import PodPublisher
    from enforcer.modes.sidecar_watch import SidecarWatch

    # The threads the pod watch wakes: each stops on its `stop` event.
    Woken = HardLimiter | PodPublisher | SidecarWatch | PodResources | Evictor

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_THREAD_DIED = 1
STALE_INTERVALS = 20  # replies turn into errors once the sample is this many intervals old
LIVENESS_AFTER = 60.0  # /healthz fails when no NVML pass has completed for this long (s)
JOIN_WITHIN = 5.0  # on SIGTERM, the threads get this long, together, to end
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _device_shape(devices: Sequence[Device]) -> tuple[tuple[str, int | None], ...]:
    """What the advertisement depends on: which devices, and how big."""
    return tuple((d.uuid, d.total_bytes) for d in devices)


class GpuFaults:
    """The GPUs that NVML cannot read, while the others are read on (`core/gpu_faults.py`
    decides when to say so): said in the log, the metrics (`gpu_readable`) and, where the
    agent has the API, as Events on its Node."""

    def __init__(self, telemetry: AgentTelemetry, node_name: str) -> None:
        self._telemetry = telemetry
        self._node = node_name
        self.recorder: EventRecorder | None = None  # set when the agent posts Events
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
        if self.recorder is not None and self._node:
            # As the kubelet names its Node in its own Events: the name is the uid.
            about: ObjectReference = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self._node,
                "uid": self._node,
            }
            self.recorder.record(about, str(Reason.GPU_UNREADABLE), text, warning)


class Sampler(threading.Thread):
    """One NVML pass per interval, published to the socket and the metrics."""

    def __init__(
        self,
        source: NvmlSource,
        server: UsageServer,
        telemetry: AgentTelemetry,
        interval: float,
        devices_changed: threading.Event,
        tenants: TenantCache,
        faults: GpuFaults | None = None,
    ) -> None:
        super().__init__(name="nvml-sampler", daemon=True)
        self._source = source
        self._tenants = tenants
        self.faults = faults or GpuFaults(telemetry, "")
        self._server = server
        self._telemetry = telemetry
        self._interval = interval
        self._devices_changed = devices_changed
        self.stop = threading.Event()
        # The reclaims decided on each pass, once the node's pods are watched (`Lender`).
        self.lender: Lender | None = None
        # The pods whose sidecar is silent, enforced by the agent itself (`Backstop`).
        self.backstop: Backstop | None = None
        # With hard limits: each container's usage per GPU, as of the last pass, for the
        # proof that the driver charges what it limits (replaced whole: read by another thread).
        self.keeps_usage = False
        self.container_usage: Mapping[str, Mapping[str, int]] = {}
        self.last: LastPass | None = None  # for the pods' metrics, read when scraped
        self.devices: Sequence[Device] = ()
        self._up: bool | None = None
        self._guard = LoopGuard("sampler", telemetry.unexpected.labels("sampler"), log)
        self.last_pass = time.monotonic()  # when the last pass completed without a bug

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self.stop.wait(max(0.0, next_tick - time.monotonic())):
            next_tick = max(next_tick + self._interval, time.monotonic())
            if self._guard.run(self._pass):
                self.last_pass = time.monotonic()

    def _pass(self) -> None:
        started = time.perf_counter()
        sample = self._source.sample()
        self._telemetry.tick_duration.observe(time.perf_counter() - started)
        lending = None
        if isinstance(sample, Sample):
            self._telemetry.node.tenants = self._tenants.count(sample)
            # Each process's container, built once per pass, by the first that needs it.
            containers = functools.cache(self._tenants.containers)
            if self.lender is not None:  # None (its pass failed): no lending is published
                lending = self.lender(sample, containers)
            if self.backstop is not None:
                self.backstop(sample, containers)
            if self.keeps_usage:
                self.container_usage = usage_by_container(sample, containers())
            self.last = (sample, containers)
        self._server.publish(sample, lending)
        self._record(sample)

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
            self.faults.update(sample)
            if _device_shape(sample.devices) != _device_shape(self.devices):
                self.devices = sample.devices
                self._devices_changed.set()


class Advertiser(threading.Thread):
    """Re-applies capacity and labels every resync, or at once when the GPUs change."""

    def __init__(
        self,
        advertiser: NodeAdvertiser,
        sampler: Sampler,
        telemetry: AgentTelemetry,
        resync: float,
        devices_changed: threading.Event,
    ) -> None:
        super().__init__(name="node-advertiser", daemon=True)
        self._advertiser = advertiser
        self._sampler = sampler
        self._telemetry = telemetry
        self._resync = resync
        self._devices_changed = devices_changed
        self.stop = threading.Event()
        self._last_error = ""
        self._guard = LoopGuard("advertiser", telemetry.unexpected.labels("advertiser"), log)

    def run(self) -> None:
        while not self.stop.is_set():
            self._devices_changed.wait(self._resync)
            self._devices_changed.clear()
            devices = self._sampler.devices
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
    server = UsageServer(
        Path(settings.socket),
        host_proc,
        ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected),
        stale_after=max(2.0, STALE_INTERVALS * settings.interval),
    )
    try:
        server.start()
    except (SocketInUse, OSError) as exc:
        log.error("cannot serve on %s: %s", settings.socket, exc)
        return EXIT_USAGE
    changed = threading.Event()
    source = NvmlSource(nvml, PidView.host(host_proc), gpu_device_majors(host_proc))
    faults = GpuFaults(telemetry, settings.node_name)
    sampler = Sampler(
        source, server, telemetry, settings.interval, changed, TenantCache(host_proc), faults
    )
    threads: list[Sampler | Advertiser | WatchedPods | Woken] = [sampler]
    if advertiser is not None:
        threads.append(Advertiser(advertiser, sampler, telemetry, settings.resync, changed))
    recorder = None
    watches: tuple[WatchedPods, ...] = ()  # the pods' and the namespaces'
    if api is not None and settings.watches_pods:
        recorder, watches, others = _pod_watch(settings, api, sampler, telemetry, server)
        threads.extend([*watches, *others])
        faults.recorder = recorder
    liveness = max(LIVENESS_AFTER, STALE_INTERVALS * settings.interval)
    check = functools.partial(health, sampler, liveness)
    try:
        metrics = serve_metrics(
            telemetry.registry, settings.metrics_port, settings.metrics_address, check
        )
    except MetricsPortError as exc:
        log.error("%s", exc)
        server.close()
        return EXIT_USAGE
    for t in threads:
        t.start()
    if recorder is not None:
        recorder.start()
    log.info("agent running on node %r", settings.node_name or "(no API)")
    status = watch([*threads, server.thread])
    server.close()
    for t in threads:
        t.stop.set()
    for each in watches:
        each.close()  # ends a read blocked on the watch
    changed.set()
    # One deadline for all: a thread stuck in an API call's retry pause (the API down) is
    # left behind, being a daemon, and the others are not kept waiting behind it.
    deadline = time.monotonic() + JOIN_WITHIN
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if recorder is not None:
        recorder.close()
    source.close()
    if metrics is not None:
        metrics.close()
    return status


def _pod_watch(
    settings: AgentSettings,
    api: client.ApiClient,
    sampler: Sampler,
    telemetry: AgentTelemetry,
    server: UsageServer,
) -> tuple[EventRecorder, tuple[WatchedPods, ...], list[Woken]]:
    """The one watch of this node's pods, and what it wakes: the hard limiter (with the
    recorder of its Events) and the pod replies to sidecars; and the watch of the namespaces
    that opted in, whose pods' sidecar environment the limiter, the lender and the backstop
    read (the agent's own never). Each pod's DRA objects are read once per change of the
    pod, for both. The limiter has an NVML session of its own (NVML counts
    initialisations): the sampler's is not shared."""
    from enforcer.edge.claims import ClaimCache, ClaimReader  # noqa: PLC0415 - only when used
    from enforcer.edge.events import EventRecorder  # noqa: PLC0415
    from enforcer.edge.eviction import Evictor  # noqa: PLC0415
    from enforcer.edge.namespaces import OptedInNamespaces  # noqa: PLC0415
    from enforcer.edge.node_pods import NodePods  # noqa: PLC0415
    from enforcer.edge.pod_resources import PodResources  # noqa: PLC0415
    from enforcer.edge.sidecar_dialer import dial_sidecars  # noqa: PLC0415
    from enforcer.modes.pod_publisher import PodPublisher  # noqa: PLC0415
    from enforcer.modes.sidecar_watch import SidecarProcesses, SidecarWatch  # noqa: PLC0415

    claims = ClaimCache(ClaimReader(api, settings.node_name))
    recorder = EventRecorder(api, settings.node_name, settings.node_name, telemetry.event_failures)
    limiter_woken, publisher_woken = threading.Event(), threading.Event()
    lender_woken, resources_woken = threading.Event(), threading.Event()
    pods = NodePods(
        api, settings.node_name, (limiter_woken, publisher_woken, lender_woken, resources_woken)
    )
    namespaces = OptedInNamespaces(api, settings.namespace, (limiter_woken, lender_woken))
    node = NodeView(
        pods.snapshot, namespaces.names, (settings.resource_name, settings.resource_unit)
    )
    woken: list[Woken] = []
    if settings.hard_limits:
        sampler.keeps_usage = True
        woken.append(
            HardLimiter(
                Nvml(),
                node,
                sampler,
                recorder,
                telemetry,
                cgroups=(Path(settings.cgroup_root), settings.cgroup_scan),
                changed=limiter_woken,
                claims=(claims.objects_or_problem, settings.dra),
            )
        )
    if settings.serve_pods:
        server.no_pods = "the agent has not listed this node's pods yet"

        def post(pod: Pod, event: EventRequest) -> None:
            """A sidecar's report, on its own pod: sidecars no longer post Events."""
            about = event_about(pod, event.container)
            recorder.record(about, event.reason, event.message, event.warning)

        server.events = post
        dra = claims if settings.dra.drivers else None
        assigned = None
        if settings.pod_resources_socket:
            kubelet = PodResources(Path(settings.pod_resources_socket), resources_woken, telemetry)
            assigned = (lambda: kubelet.last, settings.gpu_resources)
            woken.append(kubelet)
        sampler.lender = Lender(
            node,
            lender_woken,
            SIDECAR,
            settings.reclaim_watermark,
            telemetry,
            (claims.last, settings.dra) if dra else None,
            assigned,
        )
        woken.append(PodPublisher(pods, server.publish_pods, dra, publisher_woken, telemetry))
        dial = functools.partial(dial_sidecars, server.host_proc)
        sidecars = SidecarWatch(
            pods.snapshot, server, recorder, telemetry, dial, SidecarProcesses(server.host_proc)
        )
        server.hung_up = sidecars.hung_up  # a killed sidecar's pod is held at once
        woken.append(sidecars)
        # A pod whose process the kernel will not let the agent signal is evicted instead.
        evictor = Evictor(api, recorder, telemetry.unexpected.labels("evictor"))
        woken.append(evictor)
        backstop = Backstop(
            node,
            lambda: sidecars.silent,
            SIDECAR,
            recorder,
            telemetry,
            server.host_proc,
            (claims.last, settings.dra) if dra else None,
            evictor.evict,
        )
        sampler.backstop = backstop
        # Every enforced pod's series, served here: the sidecars serve none.
        counts = PodCounts()
        server.reports = counts.keep
        lender = sampler.lender
        view = functools.partial(
            pods_view,
            lambda: sampler.last,
            pods.snapshot,
            lambda: lender.tenants,
            lambda: telemetry.node.lending,
            counts,
            lambda: backstop.counts,
        )
        telemetry.registry.register(PodsCollector(view, settings.per_process_metrics))
    return recorder, (pods, namespaces), woken


def health(sampler: Sampler, after: float) -> str | None:
    """What /healthz says: the sampler must have completed a pass within `after` seconds."""
    age = time.monotonic() - sampler.last_pass
    if not sampler.is_alive() or age > after:
        return f"no NVML pass has completed for {age:.0f}s (the limit is {after:.0f}s)"
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
