"""`vram-enforcer sidecar`: per-container VRAM enforcement from inside the pod.

The pod shares one PID namespace (`shareProcessNamespace: true`), so the sidecar sees its
sibling containers' processes in its own `/proc`, and may signal them. Usage comes from
the node agent (PIDs already translated into this namespace) or, with `--source nvml`,
from NVML through the host's `/proc`. A process belongs to a container when the container
ID in its cgroup is one that kubelet reports for this pod; anything less proven is only
reported on, never signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from enforcer.core.model import (
    Action,
)
from enforcer.core.payloads import Pod
from enforcer.core.pod import (
    ContainerRef,
    others_finished,
    spec_field_of,
)
from enforcer.core.protocol import GATE_HOLDER_SOCKET
from enforcer.core.reasons import Reason
from enforcer.core.settings.sidecar import SidecarSettings
from enforcer.core.sidecar_report import REPORT_EVERY, SidecarReport, newly_denied
from enforcer.core.units import Unit
from enforcer.edge import logs
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.dumpable import forbid_inspection
from enforcer.edge.gate_holder import Holder
from enforcer.edge.guard import stopped
from enforcer.edge.listening import SocketInUse
from enforcer.edge.pid_view import PidView, PidViewError
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Signaller, Terminator
from enforcer.edge.sources import UsageSource
from enforcer.edge.telemetry import SidecarTelemetry
from enforcer.modes.pipeline import LogReporter, Pipeline, Report, Reporter
from enforcer.modes.sidecar_access import (
    EventSink,
    NoApi,
    PodAccess,
    PodView,
    direct,
    through_agent,
)
from enforcer.modes.sidecar_units import (
    AgentReclaims,
    ContainerAttributor,
    DraReads,
    pod_terms,
    shares,
)

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_HELPER_DIED = 1
ALONE_FOR = 10.0  # container mode, without the API: others gone this long means done
UTILISATION_EVERY = 1.0  # reading NVML itself: per-process utilisation, read once a second


class EventReporter:
    """Reports as Kubernetes Events on the pod, pointing at the container when there is one."""

    def __init__(
        self,
        events: EventSink,
        refs: Callable[[], Mapping[str, ContainerRef]],
        pod: Callable[[], Pod | None],
    ) -> None:
        self._events = events
        self._refs = refs
        self._pod = pod

    def report(self, report: Report) -> None:
        if report.quiet:
            return  # routine news (a victim has exited) belongs in the log, not in Events
        container = None
        names = Unit.of(report.unit).containers if report.unit else ()
        if len(names) == 1:  # the Event points at the container (not when a claim is shared)
            ref = self._refs().get(names[0])
            spec_field = ref.spec_field if ref else spec_field_of(self._pod() or {}, names[0])
            container = ContainerRef(names[0], spec_field)
        self._events.post(str(report.reason), report.message, not report.normal, container)


def _source(settings: SidecarSettings) -> UsageSource:
    if settings.source == "agent":
        return AgentLink(
            settings.agent_socket,
            settings.stale_after,
            pod=settings.api_access == "agent",
            listen=settings.listen,
        )
    # Loaded only here: pynvml is ~2 MiB of the sidecar's memory, in every enforced pod.
    from enforcer.edge.nvml import Nvml, NvmlError  # noqa: PLC0415
    from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors  # noqa: PLC0415

    host_proc = ProcFs(settings.host_proc or "/host/proc")
    view = PidView.of_process(host_proc, "self")
    nvml = Nvml(utilisation_every=UTILISATION_EVERY)
    try:
        nvml.init()
    except NvmlError as exc:  # keep running, reporting the source down, and retry
        log.error(
            "cannot initialise NVML yet (%s); retrying with backoff", exc, exc_info=logs.detail(exc)
        )
    return NvmlSource(nvml, view, gpu_device_majors())


def _holder(settings: SidecarSettings, telemetry: SidecarTelemetry) -> Holder | None:
    """In a gated pod (`--allocation-gate on`, the webhook's where a container has the
    gate's profile), the allocation gate's second holder of this pod's listener fds beside
    the socket the agent connects to (`--listen`): while the agent is away, the pod's gated
    calls go on unjudged instead of failing with ENOSYS. None elsewhere (no thread, no
    socket), and (said) where it cannot listen."""
    if not settings.allocation_gate or settings.listen is None:
        return None
    path = Path(settings.listen).with_name(Path(GATE_HOLDER_SOCKET).name)
    try:
        holder = Holder(path, telemetry.unexpected.labels("gate-holder"))
    except (OSError, SocketInUse) as exc:
        log.warning(
            "cannot hold this pod's allocation gate fds at %s (%s): if the pod is gated, "
            "its allocation calls fail with ENOSYS while the node agent restarts",
            path,
            exc,
        )
        return None
    holder.start()
    return holder


def run(settings: SidecarSettings) -> int:
    procfs = ProcFs()
    if os.getpid() == 1:
        log.error(
            "the sidecar is PID 1 of its namespace: the pod does not share its process "
            "namespace. Set spec.shareProcessNamespace: true (the webhook does)"
        )
        return EXIT_USAGE
    if (failed := forbid_inspection()) is not None:
        log.warning(
            "cannot close this process to the workload (prctl: %s): a root workload "
            "could ptrace the sidecar or reach its socket",
            failed,
        )
    telemetry = SidecarTelemetry()  # reported to the agent, which serves the pod's metrics
    try:
        source = _source(settings)
        if isinstance(source, AgentLink) and settings.api_access == "agent":
            access = through_agent(source)
        else:
            access = direct(settings, telemetry)
    except (PidViewError, NoApi, SocketInUse) as exc:
        log.error("%s", exc, exc_info=logs.detail(exc))
        return EXIT_USAGE
    except OSError as exc:  # the socket to listen on
        log.error("cannot listen on %s: %s", settings.listen, exc.strerror or exc)
        return EXIT_USAGE
    terminator = Terminator(Signaller(procfs, protected=frozenset({1})))
    pipeline = _pipeline(settings, procfs, source, terminator, access, telemetry)
    for helper in access.helpers:
        helper.start()
    declared = ", ".join(
        [
            *(f"{k}={v}" for k, v in settings.limits.items()),
            *(f"{k}: {share} of a GPU" for k, share in shares(settings.portions)),
            *(f"{k} over {n} GPUs, a share on each" for k, n in settings.gpus.items()),
        ]
    )
    declared = declared or "no declared limits"
    log.info(
        "enforcing %s on pod %s/%s (action %s, source %s, API access %s)",
        "the limits per GPU of the pod's ResourceClaims" if settings.dra else declared,
        settings.namespace,
        settings.pod_name,
        settings.policy.action,
        settings.source,
        settings.api_access,
    )
    counts = _Counts(source, telemetry) if isinstance(source, AgentLink) else None
    holder = _holder(settings, telemetry)
    try:
        return _loop(
            settings, source, pipeline, terminator, procfs, access.pod, access.helpers, counts
        )
    finally:
        if holder is not None:
            holder.stop()
        terminator.close()
        source.close()
        access.close()


def _pipeline(
    settings: SidecarSettings,
    procfs: ProcFs,
    source: UsageSource,
    terminator: Terminator,
    access: PodAccess,
    telemetry: SidecarTelemetry,
) -> Pipeline:
    """The tick: usage per container, decided on, enforced, logged and posted as Events."""
    view = access.pod

    def problem(text: str) -> None:  # a container's GPUs are not proven: said once each
        log.warning("%s", text)
        access.events.post(str(Reason.ALLOCATION_UNKNOWN), text, True)

    # A container with a ceiling is held to it, and to its limit (its request) whenever
    # the agent asks for the memory it borrowed above that.
    agent = source if isinstance(source, AgentLink) else None
    # A ceiling (in bytes or a portion) needs --source agent: the settings refuse it else.
    ceilings, portions = settings.ceilings, settings.portions
    attributor = ContainerAttributor(
        procfs,
        view,
        pod_terms(settings),
        want_init=settings.policy.action is Action.RESTART,
        dra=DraReads(settings.dra, access.claims, problem) if settings.dra else None,
        # With DRA, only an agent that makes tenants of allocations ever asks them back.
        lending=lambda: (
            agent is not None and (agent.lending_dra if settings.dra is not None else agent.lending)
        ),
    )
    reporters: list[Reporter] = [
        LogReporter(),
        EventReporter(access.events, lambda: attributor.refs, lambda: view.pod),
    ]
    if agent is None or not (ceilings or any(p.ceiling for p in portions.values())):
        return Pipeline(source, attributor, settings.policy, terminator, reporters, telemetry)
    reclaimer = AgentReclaims(agent, attributor)
    return Pipeline(
        source,
        attributor,
        settings.policy,
        terminator,
        reporters,
        telemetry,
        requests=lambda: attributor.requests,
        reclaimer=reclaimer,
    )


class _Counts:
    """This pod's counts, sent to the agent at most every REPORT_EVERY seconds when they
    changed (and by the link again to each new connection): the agent serves them. A
    signal the kernel refused goes at once: the agent then holds the pod itself (its
    signals are the agent's, which no security module of the pod's labels refuses)."""

    def __init__(self, link: AgentLink, telemetry: SidecarTelemetry) -> None:
        self._link, self._telemetry = link, telemetry
        self._sent: SidecarReport | None = None
        self._at = -REPORT_EVERY

    def tick(self, now: float) -> None:
        report = self._telemetry.report()
        due = now - self._at >= REPORT_EVERY or newly_denied(self._sent, report)
        if due and report != self._sent:
            self._link.send_report(report)
            self._sent, self._at = report, now


def _loop(
    settings: SidecarSettings,
    source: UsageSource,
    pipeline: Pipeline,
    terminator: Terminator,
    procfs: ProcFs,
    view: PodView,
    helpers: Sequence[threading.Thread],
    counts: _Counts | None = None,
) -> int:
    """Tick when the agent pushes a sample or the interval is up; stop on SIGTERM/SIGINT,
    or with status 1 if a helper thread (the pod watcher, the Event recorder) has stopped:
    container IDs would freeze, and a restarted container would go unenforced."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(wake_r, selectors.EVENT_READ)
    waiting_on: int | None = None
    next_tick = time.monotonic()
    alone = AloneDetector(
        settings.sidecar_mode == "container",
        settings.self_name,
        procfs,
        lambda: view.pod if view.error is None else None,
    )
    try:
        while not stop:
            fd = source.fileno()
            if fd != waiting_on:
                if waiting_on is not None:
                    selector.unregister(waiting_on)
                if fd is not None:
                    selector.register(fd, selectors.EVENT_READ)
                waiting_on = fd
            deadline = terminator.next_deadline()
            wake = next_tick if deadline is None else min(next_tick, deadline)
            ready = selector.select(max(0.0, wake - time.monotonic()))
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 64)
            now = time.monotonic()
            if now >= next_tick or any(key.fd == waiting_on for key, _ in ready):
                pipeline.tick()
                next_tick = now + settings.interval
                if counts is not None:
                    counts.tick(now)
            else:
                pipeline.follow_victims()
            if alone.done(now):
                log.info("every other container has finished: exiting so that the pod can complete")
                return 0
            if dead := stopped(helpers):
                log.error(
                    "the %s thread has stopped (a bug); exiting with status %d so that the "
                    "kubelet restarts the sidecar",
                    ", ".join(dead),
                    EXIT_HELPER_DIED,
                )
                return EXIT_HELPER_DIED
    finally:
        signal.set_wakeup_fd(-1)
        selector.close()
        os.close(wake_r)
        os.close(wake_w)
    log.info("%s: exiting", signal.Signals(stop[0]).name)
    return 0


class AloneDetector:
    """In "container" sidecar mode, decides when the other containers are gone for good.

    With the pod's status (`pod`: None while it cannot be read fresh), the status decides:
    terminated, and not to be restarted under the pod's restartPolicy. Without it, no other
    process in the pod for ALONE_FOR seconds, after having seen one, is taken as the end.
    """

    def __init__(
        self,
        enabled: bool,
        me: str,
        procfs: ProcFs,
        pod: Callable[[], Pod | None],
    ) -> None:
        self._enabled = enabled
        self._me = me
        self._procfs = procfs
        self._pod = pod
        self._self_cid = procfs.container_id("self")
        self._seen_others = False
        self._alone_since: float | None = None
        self._next_check = 0.0

    def done(self, now: float) -> bool:
        if not self._enabled or now < self._next_check:
            return False
        self._next_check = now + 1.0
        pod = self._pod()
        if pod is not None:
            return others_finished(pod, self._me)
        others = [
            pid
            for pid in self._procfs.pids()
            if pid not in (1, os.getpid()) and self._procfs.container_id(pid) != self._self_cid
        ]
        if others:
            self._seen_others, self._alone_since = True, None
            return False
        if not self._seen_others:
            return False
        if self._alone_since is None:
            self._alone_since = now
        return now - self._alone_since >= ALONE_FOR
