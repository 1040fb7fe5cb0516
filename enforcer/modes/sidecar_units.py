"""The sidecar's units: its pod's containers, each process proven by the container ID in its
cgroup (`ContainerAttributor`), and what the node agent asks them to give back
(`AgentReclaims`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

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
    sole_container,
)
from enforcer.core.reclaim import Gpu, Reclaim
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Membership
from enforcer.edge.sources import AgentSource
from enforcer.modes.pipeline import WholeUnit
from enforcer.modes.sidecar_access import PodView

log = logging.getLogger(__name__)

POD_UNIT = "(pod)"  # processes whose container cannot be proven, against the pod's total


@dataclass(frozen=True, slots=True)
class DraReads:
    """DRA: which allocations are GPUs, the pod's claims and its node's slices as last read
    (None before they are), and where each new problem with them is said."""

    settings: DraSettings
    claims: Callable[[], DraObjects | None]
    problem: Callable[[str], None]


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
        view: PodView,
        declared: Declaration,
        undeclared_allowed: bool,
        want_init: bool,
        spec_containers: tuple[str, ...] = (),
        dra: DraReads | None = None,
        lending: Callable[[], bool] = lambda: False,
    ) -> None:
        """`view`: the pod as last known, asked again for a container it does not list yet;
        `dra`: with DRA, the limits per GPU come from the pod's claims (None: declared)."""
        self._procfs = procfs
        self._view = view
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
        self._dra = dra
        self._problems_said: frozenset[str] = frozenset()
        self._last: tuple[object, object, Allocations] | None = None  # (pod, objects, result)

    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]:
        pod = self._view.pod
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
            held = (held | set(self._declared.requests) | found.claiming) - found.unresolved
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
            self._view.refresh()  # a new container (or a restart) the cached pod does not know yet
            units.append(reported_only(POD_UNIT, sample, known, total, cmdlines))
        return tuple(units)

    def _allocations(
        self, pod: Pod | None, dra: DraReads, by_id: Mapping[str, ContainerRef]
    ) -> Allocations:
        """What the pod's claims give each container per GPU; each new problem said once.

        Until the claims have been read (the pod watcher logs why not), no container is
        enforced on any GPU."""
        objects = dra.claims()
        if pod is None or objects is None:
            everyone = frozenset(self._spec_containers) | {r.name for r in by_id.values()}
            return Allocations(unresolved=everyone)
        if self._last is not None and self._last[0] is pod and self._last[1] is objects:
            return self._last[2]  # the same reads as the last tick: the same answer
        found = allocations(pod, objects.claims, objects.slices, dra.settings)
        self._last = (pod, objects, found)
        for text in found.problems:
            if text not in self._problems_said:
                dra.problem(text)
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
            return self._declared.requests, self._declared.ceilings
        basis = portion_basis(devices)
        if basis != self._basis:
            self._basis = basis
            shares = portions_text(self._declared.portions)
            if basis is None:
                log.warning(
                    "NVML shows no whole GPU's memory: the portions of a GPU (%s) are "
                    "not checked until it does",
                    shares,
                )
            else:
                log.info(
                    "portions of a GPU (%s) count against %d MiB, the memory of the "
                    "node's smallest GPU as KAI counts it",
                    shares,
                    basis // MiB,
                )
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
                log.info(
                    "the node agent decides reclaims: containers may borrow up to their "
                    "ceilings (%s)",
                    messages.amounts(ceilings),
                )
            else:
                log.warning(
                    "the node agent does not decide reclaims for these containers (a "
                    "release before ceilings, or before ceilings with DRA?): they are "
                    "held to their requests, not their ceilings (%s), until it does",
                    messages.amounts(ceilings),
                )
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
            (unit_containers(s.unit), g.uuid): s.unit for g in gpus for s in g.shares if s.borrowed
        }
        asked: dict[str, Reclaim] = {}
        for cid, reclaim in self._source.reclaims.items():
            name = self._attributor.container(cid)
            unit = lending.get(((name,), reclaim.gpu)) if name is not None else None
            if unit is not None:
                asked.setdefault(unit, reclaim)
        return asked


def portions_text(portions: Mapping[str, Portion]) -> str:
    return ", ".join(f"{name} {share}" for name, share in shares(portions))


def shares(portions: Mapping[str, Portion]) -> list[tuple[str, str]]:
    return [
        (name, f"{p.request}" + (f" up to {p.ceiling}" if p.ceiling else ""))
        for name, p in sorted(portions.items())
    ]
