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
When the agent exits, its copies close and every later gated call of those containers
fails with ENOSYS: the second holder the design gives each pod (its sidecar, failing open
while the agent is away) is not built yet (docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from enforcer.core import gate_profile
from enforcer.core.cgroups import container_id, parse_cgroup
from enforcer.core.lending import Tenants
from enforcer.core.rm_abi import layout_for
from enforcer.core.tier_choice import driver_branch
from enforcer.edge.gate_listener import GateListener, Ledger
from enforcer.edge.gate_socket import GateSocket, Handoff
from enforcer.edge.guard import ErrorCounter
from enforcer.edge.seccomp_root import profile_path, write_profile

log = logging.getLogger(__name__)

GATE_SOCKET = "seccomp.sock"  # beside the agent's usage socket (the chart's hostPath)
UNBOUNDED = 1 << 62  # the limit of a container the gate does not bound (yet): calls go on


@dataclass(slots=True)
class _Container:
    """One gated container: its ledger and the listeners of its processes, by fd."""

    ledger: Ledger
    listeners: dict[int, GateListener] = field(default_factory=dict)


class NodeGate:
    """`start()` writes the profile and serves the socket; `saw()`, on each good NVML pass,
    feeds every gated container's ledger and checks its listeners."""

    def __init__(
        self,
        kubelet_root: Path,
        socket_path: Path,
        host_proc: Path,
        majors: Collection[int],
        ceiling: Callable[[str], int | None],
        errors: ErrorCounter,
        recheck_wait: float,
        label: Callable[[str], None] = lambda value: None,
    ) -> None:
        """`ceiling(container_id)`: what the gate holds a container to, None where it does
        not bound it (`container_ceiling`). `label(value)`: the gate's state for the Node's
        label (`pending` while it waits for the runtime's first handoff, `v1` after it; ""
        where it does not run)."""
        self._profile = profile_path(kubelet_root, gate_profile.PROFILE_NAME)
        self._host_proc = host_proc
        self._majors = frozenset(majors)
        self._ceiling = ceiling
        self._errors = errors
        self._recheck_wait = recheck_wait
        self._machine = os.uname().machine
        self._label = label
        self._socket = GateSocket(socket_path, self._take, errors)
        self._socket_path = socket_path
        self._lock = threading.Lock()
        self._containers: dict[str, _Container] = {}
        self._handed_over = False  # a gated process came: the node's runtime is proven

    def start(self) -> str | None:
        """Serves the socket, then writes the gating profile (the plain one where the gate
        cannot run here); why the gate does not run, or None."""
        why = self._why_not()
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
        self._label("" if why else "pending")
        log.info(
            "allocation gate: %s written%s",
            self._profile,
            f" without the gate ({why})" if why else f", listening on {self._socket_path}",
        )
        return why

    def _why_not(self) -> str | None:
        if not gate_profile.supports(self._machine):
            return f"no allocation gate profile for {self._machine} nodes (x86_64, aarch64)"
        if not self._majors:
            return "no NVIDIA device node on this machine"
        return None

    def stop(self) -> None:
        """Stops serving: the fds stay open (a gated call then waits, never fails) until
        this process exits."""
        if self._socket.alive():
            self._socket.stop()
        with self._lock:
            for c in self._containers.values():
                for listener in c.listeners.values():
                    listener.stop()

    def _take(self, handoff: Handoff) -> None:
        """One process runc handed over: its container found from its cgroup, and served."""
        try:
            text = (self._host_proc / str(handoff.pid) / "cgroup").read_text()
        except OSError as exc:
            text = ""
            log.warning("allocation gate: cannot read pid %d's cgroup: %s", handoff.pid, exc)
        cid = container_id(parse_cgroup(text)) if text else None
        if cid != handoff.container_id:
            # Served all the same (closing the fd would fail every gated call of the
            # process with ENOSYS), but never bounded: its calls go on.
            log.warning(
                "allocation gate: pid %d is in container %s by its cgroup, not %s as runc "
                "says; its allocations are not gated",
                handoff.pid,
                cid,
                handoff.container_id,
            )
            cid = f"unproven:{handoff.pid}:{handoff.container_id}"
        with self._lock:
            gated = self._containers.get(cid)
            if gated is None:
                gated = self._containers[cid] = _Container(Ledger(UNBOUNDED))
            listener = GateListener(
                handoff.fd,
                gated.ledger,
                self._majors,
                self._errors,
                recheck_wait=self._recheck_wait,
                pid=handoff.pid,
                who=f"container {handoff.container_id[:12]}",
            )
            gated.listeners[handoff.fd] = listener
        listener.start()
        if not self._handed_over:  # only the socket's thread takes handoffs
            self._handed_over = True
            self._label("v1")
        log.info("allocation gate: serving pid %d of container %s", handoff.pid, cid)

    def saw(self, usage: Mapping[str, Mapping[str, int]] | None, at: float) -> None:
        """An NVML pass begun at `at` (monotonic): each container's usage by GPU, or None
        where the pass failed (each ledger keeps its last good view: usage not read never
        makes room). The listeners are checked either way."""
        with self._lock:
            for cid, gated in list(self._containers.items()):
                ceiling = self._ceiling(cid)  # an unproven key is never a container ID
                gated.ledger.limit(UNBOUNDED if ceiling is None else ceiling)
                if usage is not None:
                    gated.ledger.saw(sum(usage.get(cid, {}).values()), at)
                self._check(cid, gated)

    def _check(self, cid: str, gated: _Container) -> None:
        """Each listener checked (restarted if it stopped); the fds whose tasks have all
        exited closed, and the container forgotten once it has none."""
        for fd, listener in list(gated.listeners.items()):
            if _hung_up(fd):
                listener.stop()
                with contextlib.suppress(OSError):
                    os.close(fd)
                del gated.listeners[fd]
            else:
                listener.check()
        if not gated.listeners:
            del self._containers[cid]

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


def _hung_up(fd: int) -> bool:
    """Whether every task under the fd's filter has exited."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(ev & (select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0))
