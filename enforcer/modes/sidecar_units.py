"""The sidecar's units: its pod's containers, each process proven by the container ID in its
cgroup (`ContainerAttributor`), and what the node agent asks them to give back
(`AgentReclaims`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from enforcer.core import messages
from enforcer.core.attribution import PodTerms, oldest, pod_processes, pod_units
from enforcer.core.cgroups import container_id
from enforcer.core.declaration import Portion, of_sidecar, portion_basis
from enforcer.core.dra import (
    Allocations,
    DraObjects,
    DraSettings,
    allocations,
    claim_users,
)
from enforcer.core.model import (
    Device,
    MiB,
    ProcessKey,
    ProcessTotal,
    Sample,
    UnitUsage,
)
from enforcer.core.owed import Owed, owed
from enforcer.core.payloads import Pod
from enforcer.core.pod import (
    ContainerRef,
    containers_by_id,
    sole_container,
)
from enforcer.core.reclaim import Gpu, Reclaim, asked
from enforcer.core.settings.sidecar import SidecarSettings
from enforcer.core.units import Unit, of_sole_container
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Membership
from enforcer.modes.pipeline import WholeUnit
from enforcer.modes.sidecar_access import PodView

log = logging.getLogger(__name__)


def pod_terms(settings: SidecarSettings) -> PodTerms:
    """What the sidecar holds its pod's containers to for its whole life: what its settings
    (the environment the webhook wrote) declare, read as the agent reads the same variables
    from the pod's spec (`declaration.of_sidecar`)."""
    declared = of_sidecar(
        settings.limits,
        settings.ceilings,
        settings.portions,
        settings.gpus,
        claims=settings.dra is not None,
    )
    return PodTerms(declared, settings.undeclared_allowed, settings.containers)


@dataclass(frozen=True, slots=True)
class DraReads:
    """DRA: which allocations are GPUs, the pod's claims and its node's slices as last read
    (None before they are), and where each new problem with them is said."""

    settings: DraSettings
    claims: Callable[[], DraObjects | None]
    problem: Callable[[str], None]


class ContainerAttributor:
    """Units are the pod's containers, proven by container ID; the sidecar and pid 1 are out.

    The shell of `owed.owed` and `attribution.pod_units`, which decide what each unit is
    owed and held to: it reads each process's cgroup and command line, the pod, its claims,
    and whether the agent lends, and says in the log what changed.

    Container IDs are matched to names through the pod's status. Before the API has ever
    answered, that is possible in one case only: the pod has a single container besides
    the sidecar (`PodTerms.spec_containers`, from the webhook) and, among all of the pod's
    processes, exactly one container ID other than the sidecar's and pause's has been seen
    since the sidecar started. Then that ID is the container. A second ID (an ephemeral
    container, or a restart) makes it ambiguous, and only the pod's total is reported until
    the API answers.
    """

    def __init__(
        self,
        procfs: ProcFs,
        view: PodView,
        terms: PodTerms,
        want_init: bool,
        dra: DraReads | None = None,
        lending: Callable[[], bool] = lambda: False,
    ) -> None:
        """`view`: the pod as last known, asked again for a container it does not list yet;
        `dra`: with DRA, the limits per GPU come from the pod's claims (None: declared);
        `lending`: whether the agent decides reclaims (a ceiling is a limit only then)."""
        self._procfs = procfs
        self._view = view
        self._terms = terms
        self._basis_said: int | None = None  # the GPU memory the portions were last counted on
        self._lending = lending
        # Unit -> its request, for those that may borrow above it (as of the last tick).
        self.requests: dict[str, int] = {}
        self._borrowing: bool | None = None  # as last said in the log
        self._want_init = want_init
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
        self._owed: tuple[tuple[Allocations | None, int | None], Owed] | None = None

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
        seen = pod_processes(known, by_id, self._inits(by_id) if self._want_init else {})
        owing = self._owed_now(pod, by_id, sample.devices)
        lending = self._lends(owing)
        found = pod_units(sample, seen, owing, self._terms.undeclared_allowed, lending)
        self.requests = found.requests
        if seen.unproven:
            self._view.refresh()  # a new container (or a restart) the cached pod does not know yet
        return found.units

    def _owed_now(
        self, pod: Pod | None, by_id: Mapping[str, ContainerRef], devices: Sequence[Device]
    ) -> Owed:
        """What each unit is owed (`owed.owed`), worked out again only when its inputs
        change: the pod's claims as read (DRA; until they are, no container is enforced on
        any GPU), or the GPU memory its portions count against."""
        claimed, basis = None, None
        if self._dra is not None:
            claimed = self._allocations(pod, self._dra)
            if claimed is None:
                everyone = {*self._terms.spec_containers, *(r.name for r in by_id.values())}
                claimed = Allocations(unresolved=frozenset(everyone))
        else:
            basis = self._basis(devices)
        if self._owed is None or self._owed[0] != (claimed, basis):
            self._owed = ((claimed, basis), owed(self._terms.declared, claimed, basis))
        return self._owed[1]

    def _allocations(self, pod: Pod | None, dra: DraReads) -> Allocations | None:
        """What the pod's claims give each container per GPU, None until they have been read
        (the pod watcher logs why not); each new problem with them said once."""
        objects = dra.claims()
        if pod is None or objects is None:
            return None
        if self._last is not None and self._last[0] is pod and self._last[1] is objects:
            return self._last[2]  # the same reads as the last tick: the same answer
        # Its own pod's read of a claim is all it knows of who shares it (reservedFor).
        users = claim_users((pod,), (objects,))
        found = allocations(pod, objects.claims, objects.slices, dra.settings, users)
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
        by_id = sole_container(self._terms.spec_containers, self._seen_without_api)
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
        names = Unit.of(unit).containers
        if not names:  # the pod's own unit: what is in no proven container is never signalled
            return lambda pid: False
        ids = {cid for cid, ref in self._by_id.items() if ref.name in names}
        return lambda pid: pid != 1 and self._procfs.container_id(pid) in ids

    def whole(self, unit: UnitUsage) -> WholeUnit:
        """Restart semantics: the container's init, whose end makes the kubelet restart the
        container with every process in it; each GPU process when its init is not known."""
        init = of_sole_container(unit.name, self._inits(self._by_id))
        if init is not None:
            return WholeUnit((init,), restart=True)
        return WholeUnit(unit.processes)

    def _basis(self, devices: Sequence[Device]) -> int | None:
        """The memory of the node's smallest GPU, where a container declares a portion of
        one (else None: nothing counts against it); said in the log when it changes."""
        declared = self._terms.declared
        if not declared.portions:
            return None
        basis = portion_basis(devices)
        if basis != self._basis_said:
            self._basis_said = basis
            shares = portions_text(declared.portions)
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
        return basis

    def _lends(self, owing: Owed) -> bool:
        """Whether the agent decides reclaims, for the units that may borrow; when it does
        not, a unit is held to its request (an agent of an earlier release would never ask
        for memory back). Said in the log when that changes."""
        if not owing.borrowing:
            return False
        lending = self._lending()
        if lending != self._borrowing:
            self._borrowing = lending
            ceilings = {o.unit.containers[0]: o.ceiling * o.gpus for o in owing.units if o.borrows}
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
        return lending

    def container(self, container_id: str) -> str | None:
        """The name of this pod's container that runs as `container_id`, as this tick
        matched IDs to containers; None for an ID of no container of the pod."""
        ref = self._by_id.get(container_id)
        return None if ref is None else ref.name

    def label(self, unit: str) -> str:
        return Unit.of(unit).described()


class AgentReclaims:
    """What the node agent asks this pod to give back, as the pipeline's reclaimer
    (`reclaim.asked`). The agent alone sees every pod on a GPU, so it decides; the sidecar,
    which may signal in its pod, carries it out."""

    def __init__(self, link: AgentLink, attributor: ContainerAttributor) -> None:
        self._link = link
        self._attributor = attributor

    def __call__(self, gpus: tuple[Gpu, ...], /) -> dict[str, Reclaim]:
        return asked(gpus, self._link.reclaims, self._attributor.container)


def portions_text(portions: Mapping[str, Portion]) -> str:
    return ", ".join(f"{name} {share}" for name, share in shares(portions))


def shares(portions: Mapping[str, Portion]) -> list[tuple[str, str]]:
    return [
        (name, f"{p.request}" + (f" up to {p.ceiling}" if p.ceiling else ""))
        for name, p in sorted(portions.items())
    ]
