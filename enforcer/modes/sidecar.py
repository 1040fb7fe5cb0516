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
from dataclasses import replace

from enforcer.core import messages
from enforcer.core.attribution import (
    attribute_declared,
    attribute_per_gpu,
    oldest,
    reported_only,
)
from enforcer.core.cgroups import container_id
from enforcer.core.declaration import Declaration, Portion, portion_basis
from enforcer.core.dra import (
    Allocations,
    DraObjects,
    DraSettings,
    allocations,
    describe_unit,
    of_sole_container,
    unit_containers,
    with_ceilings,
)
from enforcer.core.model import (
    Action,
    Device,
    MiB,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
)
from enforcer.core.payloads import Pod
from enforcer.core.pod import (
    ContainerRef,
    container_limits,
    containers_by_id,
    others_finished,
    sole_container,
    spec_field_of,
)
from enforcer.core.policy import Reason
from enforcer.core.reclaim import Gpu, Reclaim
from enforcer.core.settings.sidecar import SidecarSettings
from enforcer.core.sidecar_report import REPORT_EVERY, SidecarReport
from enforcer.edge import logs
from enforcer.edge.dumpable import forbid_inspection
from enforcer.edge.guard import stopped
from enforcer.edge.listening import SocketInUse
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Membership, Signaller, Terminator
from enforcer.edge.sources import AgentSource, PidView, PidViewError, UsageSource
from enforcer.edge.telemetry import SidecarTelemetry
from enforcer.modes.pipeline import LogReporter, Pipeline, Report, Reporter, WholeUnit
from enforcer.modes.sidecar_access import (
    EventSink,
    NoApi,
    PodAccess,
    PodView,
    direct,
    through_agent,
)

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_HELPER_DIED = 1
POD_UNIT = "(pod)"  # processes whose container cannot be proven, against the pod's total
ALONE_FOR = 10.0  # container mode, without the API: others gone this long means done
UTILISATION_EVERY = 1.0  # reading NVML itself: per-process utilisation, read once a second


class ContainerAttributor:
    """Units are the pod's containers, proven by container ID; the sidecar and pid 1 are out.

    Container IDs are matched to names through the pod's status. Before the API has ever
    answered, that is possible in one case only: the pod has a single container besides
    the sidecar (`spec_containers`, from the webhook) and, among all of the pod's processes,
    exactly one container ID other than the sidecar's and pause's has been seen since the
    sidecar started. Then that ID is the container. A second ID (an ephemeral container, or
    a restart) makes it ambiguous, and only the pod's total is reported until the API
    answers.
    """

    def __init__(
        self,
        procfs: ProcFs,
        pod: Callable[[], Pod | None],
        refresh: Callable[[], None],
        declared: Declaration,
        undeclared_allowed: bool,
        want_init: bool,
        spec_containers: tuple[str, ...] = (),
        dra: DraSettings | None = None,
        claims: Callable[[], DraObjects | None] = lambda: None,
        problem: Callable[[str], None] = lambda text: None,
        lending: Callable[[], bool] = lambda: False,
    ) -> None:
        self._procfs = procfs
        self._pod = pod
        self._refresh = refresh
        # A container's ceiling is its limit only while the agent decides reclaims.
        self._declared = declared
        self._basis: int | None = None  # the GPU memory the portions were last counted on
        self._lending = lending
        # Unit -> its request, for those that may borrow above it (as of the last tick).
        self.requests: dict[str, int] = {}
        self._borrowing: bool | None = None  # as last said in the log
        self._undeclared_allowed = undeclared_allowed
        self._want_init = want_init
        self._spec_containers = spec_containers
        self._self = os.getpid()
        self._self_cid = procfs.container_id("self")
        # (container ID or None, command line) per process, read once per process.
        self._known: dict[ProcessKey, tuple[str | None, str]] = {}
        self._seen_without_api: set[str] = set()
        self._without_api_said = ""
        self._by_id: dict[str, ContainerRef] = {}
        self.refs: dict[str, ContainerRef] = {}
        # DRA (limits per GPU from the pod's claims): None when the limits are declared.
        self._dra = dra
        self._claims = claims
        self._problem = problem
        self._problems_said: frozenset[str] = frozenset()
        self._last: tuple[object, object, Allocations] | None = None  # (pod, objects, result)

    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]:
        pod = self._pod()
        by_id = containers_by_id(pod) if pod is not None else self._without_api()
        self._by_id = by_id
        self.refs = {ref.name: ref for ref in by_id.values()}
        known: dict[ProcessKey, tuple[str | None, str]] = {}
        for key in {p.key for p in sample.processes}:
            if key.pid in (1, self._self):
                continue
            info = self._known.get(key) or self._read(key)
            if info is None or (info[0] is not None and info[0] == self._self_cid):
                continue
            known[key] = info
        self._known = known
        unit_of = {key: by_id[cid].name for key, (cid, _) in known.items() if cid in by_id}
        cmdlines = {key: cmd for key, (_, cmd) in known.items()}
        if self._dra is not None:
            claimed = self._allocations(pod, self._dra, by_id)
            found, self.requests = with_ceilings(claimed, self._borrowed(self._declared.ceilings))
            held = {r.name for r in by_id.values()} if not self._undeclared_allowed else set()
            # A container that declared VRAM (0 too: no claim) is held to what its claims give.
            held = (held | set(self._declared.limits) | found.claiming) - found.unresolved
            units = list(attribute_per_gpu(sample, unit_of, found, held, cmdlines))
            total = sum(u.limit_bytes for u in found.units)
        else:
            requests, ceilings = self._in_bytes(sample.devices)
            declared = {**requests, **self._borrowed(ceilings)}
            # A portion not counted yet (no GPU's memory known) is not taken as 0.
            counted = [r for r in by_id.values() if r.name not in self._declared.portions]
            limits = container_limits(declared, counted, self._undeclared_allowed)
            gpus = self._declared.gpus
            units = list(attribute_declared(sample, unit_of, limits, gpus, cmdlines))
            self.requests = {
                u.name: requests[name] // gpus.get(name, 1)
                for u in units
                if (name := unit_containers(u.name)[0]) in ceilings
            }
            total = sum(declared.values())
        if self._want_init:
            inits = self._inits(by_id)
            units = [replace(u, init_process=of_sole_container(u.name, inits)) for u in units]
        unproven = [key for key in known if key not in unit_of]
        if unproven:
            self._refresh()  # a new container (or a restart) the cached pod does not know yet
            units.append(reported_only(POD_UNIT, sample, known, total, cmdlines))
        return tuple(units)

    def _allocations(
        self, pod: Pod | None, dra: DraSettings, by_id: Mapping[str, ContainerRef]
    ) -> Allocations:
        """What the pod's claims give each container per GPU; each new problem said once.

        Until the claims have been read (the pod watcher logs why not), no container is
        enforced on any GPU."""
        objects = self._claims()
        if pod is None or objects is None:
            everyone = frozenset(self._spec_containers) | {r.name for r in by_id.values()}
            return Allocations(unresolved=everyone)
        if self._last is not None and self._last[0] is pod and self._last[1] is objects:
            return self._last[2]  # the same reads as the last tick: the same answer
        found = allocations(pod, objects.claims, objects.slices, dra)
        self._last = (pod, objects, found)
        for text in found.problems:
            if text not in self._problems_said:
                self._problem(text)
        self._problems_said = frozenset(found.problems)
        return found

    def _without_api(self) -> dict[str, ContainerRef]:
        """Container ID -> container while the pod's status has never been read (see above)."""
        pause = self._procfs.container_id(1)
        for pid in self._procfs.pids():
            cid = self._procfs.container_id(pid)
            if cid is not None and cid not in (self._self_cid, pause):
                self._seen_without_api.add(cid)
        by_id = sole_container(self._spec_containers, self._seen_without_api)
        for ref in by_id.values():
            self._say_once(f"enforcing container {ref.name!r}, the pod's only one, by its ID")
        if not by_id:
            self._say_once(
                "the pod's containers cannot be told apart until its status is read: only the "
                "pod's total is checked, and nothing is signalled"
            )
        return by_id

    def _say_once(self, what: str) -> None:
        if what != self._without_api_said:
            self._without_api_said = what
            log.warning("this pod's containers are not known yet; %s", what)

    def _read(self, key: ProcessKey) -> tuple[str | None, str] | None:
        """(container ID or None, command line) of a process; None when it cannot be read
        now, which is not remembered: the next tick reads again."""
        st = self._procfs.stat(key.pid)
        if st is None or st.start_time != key.start_time:
            return None  # gone, unreadable, or its pid now names another process
        entries = self._procfs.cgroup(key.pid)
        if entries is None:
            return None
        return container_id(entries), self._procfs.cmdline(key.pid) or ""

    def _inits(self, by_id: Mapping[str, ContainerRef]) -> dict[str, ProcessTotal]:
        """Each container's init process, from one scan of /proc. In a shared PID namespace
        its parent is 0, but so is that of a `kubectl exec` into the container, which is
        always younger: the oldest such process of the container is its init."""
        candidates: dict[str, list[ProcessTotal]] = {}
        for pid in self._procfs.pids():
            st = self._procfs.stat(pid)
            if st is None or st.ppid != 0 or pid == 1:
                continue
            ref = by_id.get(self._procfs.container_id(pid) or "")
            if ref is not None:
                cmd = self._procfs.cmdline(pid) or ""
                found = ProcessTotal(ProcessKey(pid, st.start_time), 0, (), cmd)
                candidates.setdefault(ref.name, []).append(found)
        return {name: init for name, found in candidates.items() if (init := oldest(found))}

    def membership(self, unit: str) -> Membership:
        """Re-proven before every signal: the pid's cgroup still names one of the IDs of the
        unit's containers (as this tick matched IDs to containers)."""
        if unit == POD_UNIT:
            return lambda pid: False
        names = unit_containers(unit)
        ids = {cid for cid, ref in self._by_id.items() if ref.name in names}
        return lambda pid: pid != 1 and self._procfs.container_id(pid) in ids

    def whole(self, unit: UnitUsage) -> WholeUnit:
        """Restart semantics: the container's init, whose end makes the kubelet restart the
        container with every process in it; each GPU process when its init is not known."""
        init = of_sole_container(unit.name, self._inits(self._by_id))
        if init is not None:
            return WholeUnit((init,), restart=True)
        return WholeUnit(unit.processes)

    def _in_bytes(self, devices: Sequence[Device]) -> tuple[Mapping[str, int], Mapping[str, int]]:
        """(requests, ceilings above them) in bytes, a portion of a GPU counted against the
        memory of the node's smallest GPU; said in the log when that changes."""
        if not self._declared.portions:
            return self._declared.limits, self._declared.ceilings
        basis = portion_basis(devices)
        if basis != self._basis:
            self._basis = basis
            shares = _portions(self._declared.portions)
            if basis is None:
                log.warning("NVML shows no whole GPU's memory: the portions of a GPU (%s) are "
                            "not checked until it does", shares)  # fmt: skip
            else:
                log.info("portions of a GPU (%s) count against %d MiB, the memory of the "
                         "node's smallest GPU as KAI counts it", shares, basis // MiB)  # fmt: skip
        return self._declared.in_bytes(basis)

    def _borrowed(self, ceilings: Mapping[str, int]) -> Mapping[str, int]:
        """The ceilings, while the agent decides reclaims; else none, so a container is held
        to its request (an agent of an earlier release would never ask for memory back)."""
        if not ceilings:
            return {}
        lending = self._lending()
        if lending != self._borrowing:
            self._borrowing = lending
            if lending:
                log.info("the node agent decides reclaims: containers may borrow up to their "
                         "ceilings (%s)", messages.amounts(ceilings))  # fmt: skip
            else:
                log.warning("the node agent does not decide reclaims for these containers (a "
                            "release before ceilings, or before ceilings with DRA?): they are "
                            "held to their requests, not their ceilings (%s), until it does",
                            messages.amounts(ceilings))  # fmt: skip
        return ceilings if lending else {}

    def container(self, container_id: str) -> str | None:
        """The name of this pod's container that runs as `container_id`, as this tick
        matched IDs to containers; None for an ID of no container of the pod."""
        ref = self._by_id.get(container_id)
        return None if ref is None else ref.name

    def label(self, unit: str) -> str:
        return "the pod as a whole" if unit == POD_UNIT else describe_unit(unit)


class AgentReclaims:
    """What the node agent asks this pod to give back, as the pipeline's reclaimer. The
    agent alone sees every pod on a GPU, so it decides; the sidecar, which may signal in
    its pod, carries it out, and only where its own view of the tick agrees that the
    container holds more than its request on that GPU (a sample between the two never
    makes it stop a container at or under its request)."""

    def __init__(self, source: AgentSource, attributor: ContainerAttributor) -> None:
        self._source = source
        self._attributor = attributor

    def __call__(self, gpus: tuple[Gpu, ...], /) -> dict[str, Reclaim]:
        # (the unit's one container, GPU) -> the unit: `trainer`, or with DRA `trainer@GPU-...`
        lending = {
            (unit_containers(s.unit), g.uuid): s.unit for g in gpus for s in g.shares if s.lent
        }
        asked: dict[str, Reclaim] = {}
        for cid, reclaim in self._source.reclaims.items():
            name = self._attributor.container(cid)
            unit = lending.get(((name,), reclaim.gpu)) if name is not None else None
            if unit is not None:
                asked.setdefault(unit, reclaim)
        return asked


def _portions(portions: Mapping[str, Portion]) -> str:
    return ", ".join(f"{name} {share}" for name, share in _shares(portions))


def _shares(portions: Mapping[str, Portion]) -> list[tuple[str, str]]:
    return [
        (name, f"{p.request}" + (f" up to {p.ceiling}" if p.ceiling else ""))
        for name, p in sorted(portions.items())
    ]


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
        names = unit_containers(report.unit) if report.unit and report.unit != POD_UNIT else ()
        if len(names) == 1:  # the Event points at the container (not when a claim is shared)
            ref = self._refs().get(names[0])
            spec_field = ref.spec_field if ref else spec_field_of(self._pod() or {}, names[0])
            container = ContainerRef(names[0], spec_field)
        self._events.post(str(report.reason), report.message, not report.normal, container)


def _source(settings: SidecarSettings) -> UsageSource:
    if settings.source == "agent":
        return AgentSource(
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


def run(settings: SidecarSettings) -> int:
    procfs = ProcFs()
    if os.getpid() == 1:
        log.error(
            "the sidecar is PID 1 of its namespace: the pod does not share its process "
            "namespace. Set spec.shareProcessNamespace: true (the webhook does)"
        )
        return EXIT_USAGE
    if (failed := forbid_inspection()) is not None:
        log.warning("cannot close this process to the workload (prctl: %s): a root workload "
                    "could ptrace the sidecar or reach its socket", failed)  # fmt: skip
    telemetry = SidecarTelemetry()  # reported to the agent, which serves the pod's metrics
    try:
        source = _source(settings)
        if isinstance(source, AgentSource) and settings.api_access == "agent":
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
            *(f"{k}: {share} of a GPU" for k, share in _shares(settings.portions)),
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
    counts = _Counts(source, telemetry) if isinstance(source, AgentSource) else None
    try:
        return _loop(settings, source, pipeline, terminator, procfs, access.pod, access.helpers,
                     counts)  # fmt: skip
    finally:
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
    agent = source if isinstance(source, AgentSource) else None
    # A ceiling (in bytes or a portion) needs --source agent: the settings refuse it else.
    ceilings, portions = settings.ceilings, settings.portions
    attributor = ContainerAttributor(
        procfs,
        lambda: view.pod,
        view.refresh,
        Declaration(settings.limits, ceilings, portions, gpus=settings.gpus),
        settings.undeclared_allowed,
        want_init=settings.policy.action is Action.RESTART,
        spec_containers=settings.containers,
        dra=settings.dra,
        claims=access.claims,
        problem=problem,
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
    return Pipeline(source, attributor, settings.policy, terminator, reporters, telemetry,
                    requests=lambda: attributor.requests, reclaimer=reclaimer)  # fmt: skip


class _Counts:
    """This pod's counts, sent to the agent at most every REPORT_EVERY seconds when they
    changed (and by the source again to each new connection): the agent serves them."""

    def __init__(self, source: AgentSource, telemetry: SidecarTelemetry) -> None:
        self._source, self._telemetry = source, telemetry
        self._sent: SidecarReport | None = None
        self._at = -REPORT_EVERY

    def tick(self, now: float) -> None:
        if now - self._at < REPORT_EVERY:
            return
        report = self._telemetry.report()
        if report != self._sent:
            self._source.send_report(report)
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
