"""The allocation gate on a node (`agent --allocation-gate on`): the profile written under
the kubelet's seccomp root, the socket its `listenerPath` names served, and each gated
container process's listener fd, as runc hands it over, served by a `GateListener`.

One `Ledger` per container (its init and each `kubectl exec` share it), fed by the agent's
NVML passes with what that container holds over all its GPUs, and bounded by its ceiling as
the agent's tenants give it (`ceiling`: `Tenants.whole`, a container over any of its GPUs),
and only where the driver's branch is one whose parameter layouts are known
(`rm_abi.layout_for`): elsewhere a refusal would write the status at a guessed offset of
the caller's memory, so every call goes on. Who the
process is comes from its cgroup on the host (`/proc/<pid>/cgroup`), never from what runc
says alone. Where the container is not known yet (its pod's status does not list its
container ID until it runs) or is not one the gate bounds (a share on each of several GPUs,
a DRA allocation), its calls go on and sampling holds it; the bound applies from the first
pass that knows it.

While the agent runs, nothing here makes a workload's allocations fail: each fd stays open
in this process until every task under its filter has exited, and the listeners fail open.
When the agent exits its copies close, and the pod's sidecar, which holds a second copy of
each (`gate_holder`, reached by `dial_sidecar`), lets the calls go on until an agent takes
the fds back from it (`hold`): without it, every later gated call would fail with ENOSYS.
The same holder takes over while the agent is stopped or stuck: the agent reads an fd of
which a holder has a copy only under that holder's lease, renewed by the `gate-lease`
thread (`gate_holder.LEASE`), and a listener whose lease has lapsed reads nothing. A holder
the agent loses (a renewal or an fd it cannot send) is dialled again by itself, backing
off (`Redial`, thread `gate-redial`), while its sidecar is served.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tenacity

from enforcer.core import gate_profile, rm_abi
from enforcer.core.cgroups import CgroupEntry, container_id, parse_cgroup, pod_uid
from enforcer.core.gate_budget import Budget
from enforcer.core.gate_caps import Caps
from enforcer.core.lending import Tenants
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod import containers_by_id
from enforcer.core.pod_directory import event_about
from enforcer.core.protocol import GATE_HOLDER_SOCKET
from enforcer.core.reasons import Reason
from enforcer.core.rm_abi import layout_for
from enforcer.core.sidecar_presence import sidecar_id
from enforcer.core.tier_choice import driver_branch
from enforcer.edge.backoff import Backoff
from enforcer.edge.gate_holder import (
    LEASE,
    RENEW_EVERY,
    Held,
    beat,
    calls_let_on,
    pass_fd,
    renew,
    same_file,
    take,
    take_over,
)
from enforcer.edge.gate_listener import GateListener, Ledger, LineQuota, Outcome, Turns
from enforcer.edge.gate_overflow import Overflowed, OverflowReader
from enforcer.edge.gate_socket import GateSocket, Handoff
from enforcer.edge.guard import ErrorCounter, LoopGuard
from enforcer.edge.metrics import NodeGateMetrics
from enforcer.edge.procfs import ProcFs
from enforcer.edge.seccomp_root import profile_path, write_profile
from enforcer.edge.sidecar_dialer import Dialled, dial_container

log = logging.getLogger(__name__)

GATE_SOCKET = "seccomp.sock"  # beside the agent's usage socket (the chart's hostPath)
HOLDER_TIMEOUT = 1.0  # s a pod's holder may take to hand its fds over, or take one
# s before its lease ends that the agent stops reading a holder's fds: a reader held past
# the look (the GIL, a loaded node) still never reads as the holder starts to.
READ_MARGIN = RENEW_EVERY
UNBOUNDED = 1 << 62  # the limit of a container the gate does not bound (yet): calls go on
BUDGET = Budget()  # each container's budget of calls (`core/gate_budget.py`)
SAY_THROTTLED_EVERY = 60.0  # s: a container held to its budget is said at most this often
REDIAL_FIRST = 1.0  # s before a lost holder is first dialled again; then doubled each time,
REDIAL_MOST = 60.0  # up to this, while its sidecar is served
HELD = "held"  # a lost holder dialled again, and held (a result of its redials)


@dataclass(frozen=True, slots=True)
class Redial:
    """How this agent reaches a pod's holder again once it has lost it: its sidecar's
    container ID, the dial (`dial_holder`), and whether that sidecar is still of a pod
    served here (the dials stop when it is not)."""

    sidecar: str
    dial: Callable[[], Dialled]
    served: Callable[[], bool]


# Who serves one fd: a listener of its own, or (beyond the caps) the overflow reader.
Served = GateListener | Overflowed


@dataclass(slots=True, eq=False)
class _Holder:
    """A connection to one pod's gate holder, which containers are that pod's, and the
    lease under which this agent reads the fds the holder has a copy of."""

    sock: socket.socket
    member: Callable[[str], bool]
    leased_until: float  # monotonic: `LEASE` after the last acknowledged renewal was sent
    sent: dict[int, float] = field(default_factory=dict)  # the renewal in flight: when sent
    gone: bool = False  # the holder hung up: it reads nothing under this connection
    redial: Redial | None = None  # how to reach it again once lost (None: it is not)
    # Held around each use of `sock` and its close: the threads that renew, hand fds over
    # and drop a holder are several, and a number one closed may name another file of
    # this agent (another pod's holder) by the time another sends on it.
    using: threading.Lock = field(default_factory=threading.Lock)

    def lets_read(self) -> bool:
        return self.gone or time.monotonic() < self.leased_until - READ_MARGIN

    def close(self) -> None:
        """Its lease ended first: the holder reads as soon as it sees the connection end,
        and two readers of one fd may leave one waiting in RECV for the fd's next call."""
        self.leased_until = -math.inf
        with self.using:
            self.sock.close()


@dataclass(frozen=True, slots=True)
class GateReports:
    """What the agent makes of its gate: `metrics`, and an Event (`record`, the agent's
    recorder's, rate-limited per pod) on the container's pod for each refusal; `whose`: the
    pod of a container ID and the container's name, among the pods the agent serves."""

    metrics: NodeGateMetrics
    whose: Callable[[str], tuple[Pod, str] | None]
    record: Callable[[ObjectReference, str, str, bool], None]


@dataclass(slots=True)
class _Container:
    """One gated container: its ledger, its budget of calls (`core/gate_budget.py`), the
    listeners of its processes, by fd (beyond the node's caps, the overflow reader's), and
    its pod (None: not known), for the caps."""

    ledger: Ledger
    turns: Turns
    pod: str | None = None
    named: tuple[str, str, str] | None = None  # its series' labels, once counted
    # Its calls throttled (held back by its budget): said once a `SAY_THROTTLED_EVERY`.
    throttled: LineQuota = field(default_factory=lambda: LineQuota(1, SAY_THROTTLED_EVERY))
    listeners: dict[int, Served] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)  # fd -> the process it was handed for
    held_by: dict[int, _Holder] = field(default_factory=dict)  # fd -> its copy's holder, last

    def lets_read(self, fd: int) -> bool:
        """Whether this agent may read `fd` now: no holder has a copy, or under its lease."""
        holder = self.held_by.get(fd)
        return holder is None or holder.lets_read()


class NodeGate:
    """`start()` writes the profile and serves the socket; `saw()`, on each good NVML pass,
    feeds every gated container's ledger and checks its listeners."""

    def __init__(  # noqa: PLR0913 - each a part of the node the gate serves, or says
        self,
        kubelet_root: Path,
        socket_path: Path,
        host_proc: Path,
        majors: Collection[int],
        ceiling: Callable[[str], int | None],
        errors: ErrorCounter,
        recheck_wait: float,
        label: Callable[[str], None] = lambda value: None,
        reports: GateReports | None = None,
        driver: Callable[[], str] = str,
        unproven: bool = False,
        blocked: str = "",
        budget: Budget = BUDGET,
        caps: Caps | None = None,
    ) -> None:
        """`ceiling(container_id)`: what the gate holds a container to, None where it does
        not bound it (`container_ceiling`). `label(value)`: the gate's state for the Node's
        label (`node.LABEL_ALLOCATION_GATE`: `pending` while it waits for the runtime's
        first handoff, `v1` after it, `unproven` where the driver's branch keeps it off,
        `forced` where `unproven` runs it there all the same; "" where it does not run).
        `reports`: its metrics and Events (none in tests). `driver()`: the driver's version
        as the sampler's NVML read it ("" before); `unproven`: run the gate on a driver
        branch that no GPU run has proven (`rm_abi.PROVEN_BRANCHES`); `blocked`: why the
        kernel keeps the gate from running here (`tier_probe.gate_blocked`), "" where not;
        `budget`: each container's, from empty (`core/gate_budget.py`); `caps`: how many
        fds are served by threads of their own, the others by the overflow reader."""
        self._profile = profile_path(kubelet_root, gate_profile.PROFILE_NAME)
        self._host_proc = host_proc
        self._majors = frozenset(majors)
        self._ceiling = ceiling
        self._errors = errors
        self._recheck_wait = recheck_wait
        self._machine = os.uname().machine
        self._label = label
        self._reports = reports
        self._driver = driver
        self._unproven = unproven
        self._blocked = blocked
        self._budget = budget
        self._proven = False  # the driver's branch is proven: the label may say v1
        self._undecided = False  # the driver's version was not read at start
        self._socket = GateSocket(socket_path, self._take, errors)
        self._socket_path = socket_path
        self._lock = threading.Lock()
        # The last pass (each container's usage by GPU, None where it failed, and when it
        # began): a container served later starts from it, not from nothing.
        self._last: tuple[Mapping[str, Mapping[str, int]] | None, float] | None = None
        self._containers: dict[str, _Container] = {}
        self._handed_over = False  # a gated process came: the node's runtime is proven
        self._holders: list[_Holder] = []
        self._numbers = itertools.count(1)  # of the renewals
        self._stopping = threading.Event()
        # Set by a call over its container's limit: it waits for a pass begun after it
        # arrived (`decide`), which the agent's sampler takes early (`Sampler`).
        self.wanted = threading.Event()
        self._renewer: threading.Thread | None = None  # `gate-lease`, from the first holder
        self._renewing = LoopGuard("allocation gate lease", errors, log)
        self._redialling: set[str] = set()  # sidecars with a `gate-redial` thread: one each
        self._redials = LoopGuard("allocation gate redial", errors, log)
        self._caps = caps or Caps()
        # One overflow reader per pod (`gate_overflow`): what holds one holds its pod alone.
        self._overflow: dict[str | None, OverflowReader] = {}
        self._overflowed: dict[str | None, int] = {}  # fds each serves, for the gauge

    def start(self) -> str | None:
        """Serves the socket, then writes the gating profile (the plain one where the gate
        cannot run here, or before the driver's version is read: `saw` starts it again
        once it is); why the gate does not run, or None."""
        why, says = self._why_not()
        if why is None:
            try:
                self._socket.start()
            except OSError as exc:
                why = f"cannot serve {self._socket_path}: {exc.strerror or exc}"
        if why is not None and not gate_profile.supports(self._machine):
            return why  # no profile at all: the webhook's pods then cannot start here
        listener = None if why is not None else str(self._socket_path)
        wrote = write_profile(self._profile, gate_profile.profile(self._machine, listener))
        if wrote is not None:
            if why is None:
                self._socket.stop()
            return wrote
        self._label(says if why else "pending" if self._proven else "forced")
        log.info(
            "allocation gate: %s written%s",
            self._profile,
            f" without the gate ({why})" if why else f", listening on {self._socket_path}",
        )
        return why

    def _why_not(self) -> tuple[str | None, str]:
        """Why the gate does not run here (None: it runs), and what the label says then."""
        if not gate_profile.supports(self._machine):
            return f"no allocation gate profile for {self._machine} nodes (x86_64, aarch64)", ""
        if not self._majors:
            return "no NVIDIA device node on this machine", ""
        if self._blocked:
            return self._blocked, ""
        version = self._driver()
        self._undecided = not version
        if not version:
            return "the driver's version is not read yet (decided on the first pass)", ""
        branch = driver_branch(version)
        self._proven = branch in rm_abi.PROVEN_BRANCHES
        if self._proven or self._unproven:
            return None, ""
        proven = ", ".join(map(str, sorted(rm_abi.PROVEN_BRANCHES))) or "none yet"
        return (
            f"driver {version}: its branch is not proven for the allocation gate (proven: "
            f"{proven}; tests/gpu/offline.sh gate proves one); --allocation-gate-unproven "
            "runs it all the same",
            "unproven",
        )

    def stop(self) -> None:
        """Stops serving: the fds stay open until this process exits; a gated call then
        waits, never fails, and goes on unjudged where its pod's holder has a copy (told
        by the end of its connection, once no listener here reads). The file is the plain
        profile first: runc refuses to start a container whose listener it cannot reach,
        so one started while no agent serves (a rollout, an upgrade, an uninstall) starts
        ungated, held by sampling, and the next agent's `start` writes the gate back."""
        if self._socket.alive():
            wrote = write_profile(self._profile, gate_profile.profile(self._machine, None))
            if wrote is not None:
                log.warning(
                    "allocation gate: %s; until an agent serves again here, "
                    "containers given the profile fail to start",
                    wrote,
                )
            else:
                log.info(
                    "allocation gate: %s written without the gate: containers started "
                    "before an agent serves again here run ungated, held by sampling",
                    self._profile,
                )
            self._socket.stop()
        self._stopping.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:  # a listener's stop may wait on a call it reads: not under it
            listeners = [li for c in self._containers.values() for li in c.listeners.values()]
            holders, self._holders = self._holders, []
        for holder in holders:
            holder.close()
        for listener in listeners:
            listener.stop()
        with self._lock:
            readers = list(self._overflow.values())
        for reader in readers:
            reader.stop()

    def _take(self, handoff: Handoff) -> None:
        """One process runc handed over: its container found from its cgroup, served, and
        a copy handed to its pod's holder."""
        found = self._container_of(handoff.pid)
        cid = handoff.container_id
        # Its pid is in `cid`, but the fd is whoever connected's word: the first caller's
        # cgroup proves it is that container's filter (`GateListener`'s `vouch`).
        vouch: Callable[[int], bool] | None = functools.partial(self._in_container, cid)
        if found != cid:
            # Served all the same (closing the fd would fail every gated call of the
            # process with ENOSYS), but never bounded: its calls go on.
            log.warning(
                "allocation gate: pid %d is in container %s by its cgroup, not %s as runc "
                "says; its allocations are not gated",
                handoff.pid,
                found,
                cid,
            )
            cid, vouch = f"unproven:{handoff.pid}:{cid}", None
        held = Held(handoff.fd, cid, handoff.pid)
        listener = self._serve(held, vouch)
        if not self._handed_over:  # only the socket's thread takes handoffs
            self._handed_over = True
            if self._proven:  # else it stays `forced`
                self._label("v1")
        with self._lock:
            holders = [h for h in self._holders if h.member(cid)]
        for holder in holders:
            self._pass(holder, held, listener)

    def _container_of(self, pid: int) -> str | None:
        """The container a process (or thread) is in by its own cgroup; None where it is
        in none, or has ended."""
        entries = self._cgroup(pid)
        return None if entries is None else container_id(entries)

    def _cgroup(self, pid: int) -> tuple[CgroupEntry, ...] | None:
        try:
            return parse_cgroup((self._host_proc / str(pid) / "cgroup").read_text())
        except OSError:
            return None

    def _serve(
        self,
        held: Held,
        vouch: Callable[[int], bool] | None = None,
        holder: _Holder | None = None,
    ) -> Served:
        """Serve one process's fd under its container's ledger (`held.container_id`,
        proven by the caller, or an unproven key that is never bounded); `vouch`: for an
        fd a holder handed back, whether each caller is of that container; `holder`: the
        one that has a copy, under whose lease it is read. Its listener: who serves the fd
        while its number names it (`_pass`)."""
        cid = held.container_id
        entries = self._cgroup(held.pid)
        pod = None if entries is None else pod_uid(entries)
        with self._lock:
            gated = self._containers.get(cid)
            if gated is None:
                gated = _Container(Ledger(UNBOUNDED), Turns(self._budget))
                self._containers[cid] = gated
                if self._last is not None:  # after a restart, a holder's: usage to judge on
                    self._feed(cid, gated.ledger, *self._last)
            gated.pod = gated.pod or pod  # None: its first process ended before it was read
            if holder is not None:
                gated.held_by[held.fd] = holder
            may_read = functools.partial(gated.lets_read, held.fd)
            turn = functools.partial(self._turn, gated, cid)
            if self._caps.overflows(self._threaded(), gated.pod):
                reader = self._overflow_of(gated.pod)
                served = reader.serve(held.fd, gated.pod, held.pid, may_read, turn)
                gated.listeners[held.fd] = served
                gated.pids[held.fd] = held.pid
                return served
            listener = GateListener(
                held.fd,
                gated.ledger,
                self._majors,
                self._errors,
                recheck_wait=self._recheck_wait,
                pid=held.pid,
                who=f"container {cid.rsplit(':', 1)[-1][:12]}",
                vouch=vouch,
                may_read=may_read,
                count=self._count,
                want_pass=self.wanted.set,
                turn=turn,
            )
            listener.refused = functools.partial(self._refused, gated, cid)
            gated.listeners[held.fd] = listener
            gated.pids[held.fd] = held.pid
        listener.start()
        log.info("allocation gate: serving pid %d of container %s", held.pid, cid)
        return listener

    def _overflow_of(self, pod: str | None) -> OverflowReader:
        """`_lock` held: the pod's overflow reader, made at its first fd past the caps."""
        reader = self._overflow.get(pod)
        if reader is None:
            gauge = functools.partial(self._overflow_gauge, pod)
            reader = self._overflow[pod] = OverflowReader(self._errors, self._count, gauge)
        return reader

    def _overflow_gauge(self, pod: str | None, served: int) -> None:
        """From a pod's overflow reader (under its own lock: this takes none of ours)."""
        self._overflowed[pod] = served
        if self._reports is not None:
            self._reports.metrics.overflow.set(sum(self._overflowed.values()))

    def _threaded(self) -> dict[str | None, int]:
        """`_lock` held: the fds served by threads of their own, by pod."""
        served: dict[str | None, int] = {}
        for gated in self._containers.values():
            mine = sum(isinstance(s, GateListener) for s in gated.listeners.values())
            served[gated.pod] = served.get(gated.pod, 0) + mine
        return served

    def hold(
        self,
        sock: socket.socket,
        member: Callable[[str], bool],
        since: float,
        redial: Redial | None = None,
    ) -> bool:
        """A connection to the gate holder of one pod's sidecar, proven to be that
        sidecar's by whoever connected, begun at `since` (monotonic, before the connect:
        the holder keeps off for `LEASE` from its accept, which is later);
        `member(container_id)`: whether a container is of that pod; `redial`: how to reach
        it again where its fds cannot be taken or it is lost later (`_redial`). Whether it
        is held (its fds taken, and not lost as it was given the pod's). The fds it held are
        served (after this agent's restart they are its only copies), and it is given a
        copy of each fd served for the pod's containers, now and as they come; each is
        read here under the holder's lease from then on. The connection stays open: its
        end, when this process exits, is the holder's word to let the calls go on until
        an agent is back, as a lease not renewed is while this process is stopped."""
        if self._stopping.is_set():  # a redial that ended after the gate stopped
            sock.close()
            return False
        sock.settimeout(HOLDER_TIMEOUT)
        try:
            taken, let_on = take_over(sock)
        except (OSError, ValueError) as exc:
            sock.close()
            log.warning("allocation gate: a holder's fds not taken: %s", exc)
            if redial is not None:
                self._redial_later(redial, member)
            return False
        self._let_on(let_on)
        holder = _Holder(sock, member, since + LEASE, redial=redial)
        has: set[int] = set()  # the fds served here of which the holder has a copy
        for held in taken:
            if (served := self._served_as(held.fd)) is not None:
                os.close(held.fd)  # a copy of one this agent serves already
                has.add(served[0].fd)
                self._held_by(*served, holder)
                continue
            has.add(held.fd)
            # Its claim is a hint. Only a container of the holder's pod is bounded, and
            # only once a caller's own cgroup names it (the fd may be anyone's: `vouch`).
            if member(held.container_id):
                vouch = functools.partial(self._in_container, held.container_id)
                self._serve(held, vouch, holder)
            else:
                log.warning(
                    "allocation gate: a holder says its fd for pid %d serves container %s, "
                    "which is not of its pod; its allocations are not gated",
                    held.pid,
                    held.container_id,
                )
                # One key for all such fds of this holder: one budget of calls, however
                # many fds it hands over (each would otherwise have a budget of its own).
                unproven = f"unproven:holder:{id(holder):x}"
                self._serve(Held(held.fd, unproven, held.pid), holder=holder)
        with self._lock:
            self._holders.append(holder)
            ours = [
                (Held(fd, cid, gated.pids[fd]), listener)
                for cid, gated in self._containers.items()
                if member(cid)
                for fd, listener in gated.listeners.items()
            ]
            if self._renewer is None:
                self._renewer = threading.Thread(
                    target=self._renew_loop, name="gate-lease", daemon=True
                )
                self._renewer.start()
        for held, listener in ours:
            if held.fd not in has:
                self._pass(holder, held, listener)
        with self._lock:
            return holder in self._holders  # not lost as it was given the fds

    def _held_by(self, held: Held, listener: Served, holder: _Holder) -> None:
        """`holder` has a copy of `held.fd`, served here by `listener`: read under its lease
        from now (nothing where the fd was closed meanwhile, its number perhaps reused)."""
        with self._lock:
            gated = self._containers.get(held.container_id)
            if gated is not None and gated.listeners.get(held.fd) is listener:
                gated.held_by[held.fd] = holder

    def _renew_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._renewing.run(self._renew_round):
                self._stopping.wait(1.0)  # a bug: said and counted, tried again after a breath

    def _renew_round(self) -> None:
        """Each holder's lease renewed (one renewal in flight each: a stopped holder's
        socket never fills), then their acknowledgements read for `RENEW_EVERY`."""
        with self._lock:
            holders = list(self._holders)
        for holder in holders:
            if not holder.sent:
                number = next(self._numbers)
                holder.sent[number] = time.monotonic()
                try:
                    with holder.using:
                        renew(holder.sock, number)
                except OSError as exc:
                    self._lost(holder, f"cannot renew its lease: {exc}")
        deadline = time.monotonic() + RENEW_EVERY
        while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            poller = select.poll()
            by_fd = {h.sock.fileno(): h for h in holders if h.sock.fileno() != -1}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(min(left, 0.1) * 1000):
                self._acknowledged(by_fd[fd])

    def _acknowledged(self, holder: _Holder) -> None:
        """One message of a holder: an acknowledgement extends the lease from when its
        renewal was sent; its end (the sidecar ended) frees its fds."""
        try:
            with holder.using:
                found = take(holder.sock)
        except OSError as exc:
            self._lost(holder, f"its connection failed: {exc}")
            return
        if found is None:
            self._drop_hung_up()
            return
        number = beat(found, "ack") if isinstance(found, bytes) else None
        if not isinstance(found, bytes) or number is None or number not in holder.sent:
            if isinstance(found, Held):
                os.close(found.fd)
            log.warning("allocation gate: dropped a message of a holder: %r", found)
            return
        holder.leased_until = max(holder.leased_until, holder.sent.pop(number) + LEASE)
        self._let_on(calls_let_on(found))

    def _let_on(self, calls: int) -> None:
        """What a holder says it let go on while this agent was away (or before it ran)."""
        if calls:
            log.warning(
                "allocation gate: a pod's holder let %d gated calls go on unjudged while the "
                "agent was away",
                calls,
            )
            if self._reports is not None:
                self._reports.metrics.let_on.inc(calls)

    def _count(self, outcome: Outcome, seconds: float) -> None:
        if self._reports is not None:
            self._reports.metrics.calls.labels(outcome).inc()
            self._reports.metrics.seconds.observe(seconds)

    def _refused(self, gated: _Container, cid: str, line: str) -> None:
        """One refusal (its line, also those the log held back): counted by container, and
        an Event on its pod (the recorder's budget per pod bounds a flood)."""
        if self._reports is None or (found := self._name(gated, cid)) is None:
            return  # its pod no longer served: said in the log only
        pod, name = found
        self._reports.metrics.refusals.labels(*_labels(pod, name)).inc()
        self._reports.record(event_about(pod, name), Reason.ALLOCATION_REFUSED, line, True)

    def _turn(self, gated: _Container, cid: str) -> float:
        """How long one of the container's listeners waits before it reads its next call:
        over its budget (throttled), the call is counted, and said at most once a minute."""
        wait = gated.turns.take()
        if wait <= 0:
            return wait
        if (held := gated.throttled.take(time.monotonic())) is not None:
            self._name(gated, cid)
            log.warning(
                "allocation gate: %s issues gated driver calls faster than its budget (%g a "
                "second after a burst of %d): its calls are throttled to that pace, its "
                "threads waiting in the kernel meanwhile (%d more throttled since this was "
                "last said)",
                _who(gated, cid),
                self._budget.rate,
                self._budget.burst,
                held,
            )
        if self._reports is not None and gated.named is not None:
            self._reports.metrics.throttled.labels(*gated.named).inc()
        return wait

    def _name(self, gated: _Container, cid: str) -> tuple[Pod, str] | None:
        """The container's pod and name, if the agent serves its pod now: its series'
        labels from then on."""
        if self._reports is None or (found := self._reports.whose(cid)) is None:
            return None
        gated.named = _labels(*found)
        return found

    def _in_container(self, cid: str, tid: int) -> bool:
        return self._container_of(tid) == cid

    def _served_as(self, fd: int) -> tuple[Held, Served] | None:
        """The fd served here that `fd` is a copy of, if any, and its listener."""
        with self._lock:
            return next(
                (
                    (Held(ours, cid, gated.pids[ours]), listener)
                    for cid, gated in self._containers.items()
                    for ours, listener in gated.listeners.items()
                    if same_file(fd, ours)
                ),
                None,
            )

    def _pass(self, holder: _Holder, held: Held, listener: Served) -> None:
        """A copy of `held.fd` to `holder` while `listener` still serves it. The sampler
        closes an fd whose tasks have all exited (a `kubectl exec -- true`), and its number
        may then name another file of this agent: so the fd is duplicated under the lock,
        where it is proven still ours, and the copy sent."""
        with self._lock:
            gated = self._containers.get(held.container_id)
            if gated is None or gated.listeners.get(held.fd) is not listener:
                return  # ended meanwhile: nothing left to hold
            try:
                copy = os.dup(held.fd)
            except OSError as exc:
                log.warning("allocation gate: cannot copy an fd for a holder: %s", exc)
                return
        try:
            with holder.using:
                pass_fd(holder.sock, Held(copy, held.container_id, held.pid))
        except OSError as exc:
            self._lost(holder, f"cannot hand it an fd: {exc}")
            return
        finally:
            os.close(copy)
        self._held_by(held, listener, holder)

    def _lost(self, holder: _Holder, why: str) -> None:
        """A holder whose connection this agent closes: its lease is never renewed, so
        the fds it has a copy of are its to read (it sees the connection end) until it is
        dialled again (`_redial`, by itself), never both of ours."""
        with self._lock:
            ours = holder in self._holders  # not lost already, by another thread
            if ours:
                self._holders.remove(holder)
        holder.close()
        if not ours:
            return
        log.warning(
            "allocation gate: lost a pod's holder (%s); its pod's calls go on unjudged "
            "until it is dialled again",
            why,
        )
        if holder.redial is not None:
            self._redial_later(holder.redial, holder.member)

    def _redial_later(self, redial: Redial, member: Callable[[str], bool]) -> None:
        """A `gate-redial` thread for a holder this agent lost or could not take, unless
        one runs for its sidecar already (that one dials on) or the gate stops."""
        with self._lock:
            if self._stopping.is_set() or redial.sidecar in self._redialling:
                return
            self._redialling.add(redial.sidecar)
        log.info(
            "allocation gate: dialling the holder of sidecar %s again in %g s",
            redial.sidecar[:12],
            REDIAL_FIRST,
        )
        redialling = functools.partial(self._redial, redial, member)
        threading.Thread(  # a bug: said and counted, and the next loss dials again
            target=self._redials.run, args=(redialling,), name="gate-redial", daemon=True
        ).start()

    def _redial(self, redial: Redial, member: Callable[[str], bool]) -> None:
        """A holder lost (or whose fds were not taken) dialled again, `REDIAL_FIRST` later
        and then backing off (doubling up to `REDIAL_MOST`, jittered), until it is held
        again (or by the dial of its sidecar's usage link), its sidecar is no longer
        served, or the gate stops. Each dial counted by its result; the first failure and
        the end said."""
        wait = tenacity.wait_exponential(multiplier=REDIAL_FIRST, max=REDIAL_MOST)
        backoff = Backoff(wait + tenacity.wait_random(0, REDIAL_FIRST / 2))
        name = redial.sidecar[:12]
        settled = False
        try:
            while not self._stopping.wait(backoff.failed(time.monotonic())):
                if settled := self._settled(redial.sidecar):
                    log.info("allocation gate: the holder of sidecar %s is held again", name)
                    return
                if not redial.served():
                    log.info("allocation gate: sidecar %s is no longer served", name)
                    return
                dial = functools.partial(self._dial_again, redial, member)
                why = self._redials.result(dial) or "a bug (said above)"
                settled = why == HELD and self._settled(redial.sidecar)
                self._redialled(HELD if settled else "failed")
                if settled:
                    log.info(
                        "allocation gate: the holder of sidecar %s dialled again and held "
                        "(dial %d)",
                        name,
                        backoff.failures,
                    )
                    return
                if backoff.failures == 1:
                    log.warning(
                        "allocation gate: cannot dial the holder of sidecar %s again yet (%s); "
                        "dialling it again, at most every %g s",
                        name,
                        why,
                        REDIAL_MOST,
                    )
        finally:
            if not settled:
                with self._lock:
                    self._redialling.discard(redial.sidecar)

    def _dial_again(self, redial: Redial, member: Callable[[str], bool]) -> str:
        """One dial of a lost holder, held where it answers: `HELD`, else why not."""
        since = time.monotonic()
        found = redial.dial()
        if not isinstance(found, socket.socket):
            return str(found)
        held = self.hold(found, member, since, redial)
        return HELD if held else "its fds not taken, or it was lost again as it was given them"

    def _settled(self, sidecar: str) -> bool:
        """Whether this agent holds a connection to the holder of `sidecar`; if so, its
        redial ends (in the same step, so that a loss from now on starts another)."""
        with self._lock:
            held = any(h.redial is not None and h.redial.sidecar == sidecar for h in self._holders)
            if held:
                self._redialling.discard(sidecar)
            return held

    def _redialled(self, result: str) -> None:
        if self._reports is not None:
            self._reports.metrics.redials.labels(result).inc()

    def _drop_hung_up(self) -> None:
        """The connections of holders that hung up closed: a sidecar that ended (its
        copies closed with it), or one that took a newer connection (read under that one's
        lease from then on); the fds they had a copy of are this agent's to read."""
        with self._lock:
            ended = [h for h in self._holders if _hung_up(h.sock.fileno())]
            for holder in ended:
                holder.gone = True
                self._holders.remove(holder)
        for holder in ended:  # out of the lock: one may be in a send for `HOLDER_TIMEOUT`
            holder.close()

    def saw(self, usage: Mapping[str, Mapping[str, int]] | None, at: float) -> None:
        """An NVML pass begun at `at` (monotonic): each container's usage by GPU, or None
        where the pass failed (each ledger keeps its last good view: usage not read never
        makes room). The listeners are checked either way (how many are stuck, a gauge),
        and the connections of holders that hung up (a sidecar that ended, or took a newer
        connection) are closed."""
        if self._undecided and self._driver():
            why = self.start()
            if why is not None:
                log.warning("the allocation gate does not run on this node: %s", why)
        self._drop_hung_up()
        ended: list[tuple[int, Served]] = []
        with self._lock:
            self._last = (usage, at)
            for cid, gated in list(self._containers.items()):
                self._feed(cid, gated.ledger, usage, at)
                ended += self._check(cid, gated)
            stalled = sum(
                listener.stalled
                for gated in self._containers.values()
                for listener in gated.listeners.values()
            )
            idle = [self._overflow.pop(p) for p, r in list(self._overflow.items()) if r.idle()]
        if self._reports is not None:
            self._reports.metrics.stalled.set(stalled)
        # Out of the lock: a stop waits for a call its listener may still be reading (up
        # to `STOP_WITHIN`), and the lease's renewals and runc's handoffs need the lock.
        for fd, listener in ended:
            if listener.stop():
                os.close(fd)  # else a thread still reads it: left open, as said
        for reader in idle:  # a pod's reader with nothing left to serve: its thread ends
            reader.stop()

    def _feed(
        self, cid: str, ledger: Ledger, usage: Mapping[str, Mapping[str, int]] | None, at: float
    ) -> None:
        """A pass to one container's ledger, with its ceiling now (an unproven key is never
        a container ID: unbounded). A failed pass shows no free: a call that waited for it
        is refused on the last good view."""
        ceiling = self._ceiling(cid)
        ledger.limit(UNBOUNDED if ceiling is None else ceiling)
        if usage is not None:
            ledger.saw(sum(usage.get(cid, {}).values()), at)
        else:
            ledger.tried(at)

    def _check(self, cid: str, gated: _Container) -> list[tuple[int, Served]]:
        """Each listener checked (restarted if it stopped); those whose tasks have all
        exited taken out, to be stopped and their fds closed by the caller, and the
        container forgotten once it has none."""
        ended = []
        for fd, listener in list(gated.listeners.items()):
            if _hung_up(fd):
                ended.append((fd, listener))
                del gated.listeners[fd]
                del gated.pids[fd]
                gated.held_by.pop(fd, None)
            else:
                listener.check()
        if not gated.listeners:
            del self._containers[cid]
            if self._reports is not None and gated.named is not None:
                for series in (self._reports.metrics.refusals, self._reports.metrics.throttled):
                    with contextlib.suppress(KeyError):  # its series go with it
                        series.remove(*gated.named)
        return ended

    def holders(self) -> int:
        """How many pods' holders this agent is connected to (for tests and doctor)."""
        with self._lock:
            return len(self._holders)

    def gated(self) -> dict[str, int]:
        """Container ID -> how many of its processes are served (for tests and doctor)."""
        with self._lock:
            return {cid: len(c.listeners) for cid, c in self._containers.items()}


def container_ceiling(tenants: Tenants | None, driver_version: str, cid: str) -> int | None:
    """What the gate holds container `cid` to: its ceiling over any of its GPUs, where the
    agent's pods name it and the driver's parameter layouts are known; else None."""
    branch = driver_branch(driver_version)
    if tenants is None or branch is None or layout_for(branch) is None:
        return None
    tenant = tenants.whole.get(cid)
    return None if tenant is None else tenant.ceiling


def _labels(pod: Pod, name: str) -> tuple[str, str, str]:
    """A container's series' labels: namespace, pod, container."""
    meta = pod.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", ""), name


def _who(gated: _Container, cid: str) -> str:
    """A container as the log names it: by its pod where known, and its ID."""
    short = cid.rsplit(":", 1)[-1][:12]
    if gated.named is None:
        return f"container {short}"
    namespace, pod, name = gated.named
    return f"container {name} of pod {namespace}/{pod} ({short})"


def _hung_up(fd: int) -> bool:
    """Whether every task under the fd's filter has exited (or its socket's peer has
    closed)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(ev & (select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0))


def dial_sidecar(
    host_proc: ProcFs,
    gate: NodeGate | None,
    injected: Callable[[], Mapping[str, Pod] | None],
    sidecar: str,
) -> Dialled:
    """A connection to the usage link of the sidecar container `sidecar`; with the gate
    on, its pod's gate holder too, dialled and proven as the link is and handed to the
    gate (`NodeGate.hold`) here, on the dial's thread (the handover may wait)."""
    found = dial_container(host_proc, sidecar)
    if gate is None or not isinstance(found, socket.socket):
        return found
    since = time.monotonic()
    redial = Redial(
        sidecar,
        functools.partial(dial_holder, host_proc, sidecar),
        functools.partial(_served, injected, sidecar),
    )
    holder = redial.dial()
    if isinstance(holder, socket.socket):
        gate.hold(holder, functools.partial(_of_pod, injected, sidecar), since, redial)
    else:
        log.info(
            "allocation gate: sidecar %s holds no copy of its pod's fds: %s", sidecar[:12], holder
        )
    return found


def dial_holder(host_proc: ProcFs, sidecar: str) -> Dialled:
    """A connection to the gate holder of the sidecar container `sidecar` (blocking, as
    `NodeGate.hold` reads it), found and proven as its usage link is; or why not."""
    found = dial_container(host_proc, sidecar, GATE_HOLDER_SOCKET, socket.SOCK_SEQPACKET)
    if isinstance(found, socket.socket):
        found.setblocking(True)
    return found


def container_of(
    injected: Callable[[], Mapping[str, Pod] | None], cid: str
) -> tuple[Pod, str] | None:
    """The served pod of container `cid` and the container's name, if any (`GateReports`)."""
    for pod in (injected() or {}).values():
        if (ref := containers_by_id(pod).get(cid)) is not None:
            return pod, ref.name
    return None


def _of_pod(injected: Callable[[], Mapping[str, Pod] | None], sidecar: str, cid: str) -> bool:
    """Whether `cid` is a container of the pod whose sidecar is `sidecar` (not the sidecar)."""
    return cid != sidecar and any(
        sidecar_id(pod) == sidecar and cid in containers_by_id(pod)
        for pod in (injected() or {}).values()
    )


def _served(injected: Callable[[], Mapping[str, Pod] | None], sidecar: str) -> bool:
    """Whether `sidecar` is the sidecar of a pod served here (True before the pods are
    known: its holder is dialled again until they are)."""
    pods = injected()
    return pods is None or any(sidecar_id(pod) == sidecar for pod in pods.values())
