"""`vram-enforcer doctor`: what works here, what does not, and what to do about it.

Each check is tried for real (NVML is initialised, the socket is asked, the API server
is asked what this identity may do) and answers with one line and, when it fails, a fix.
Run it inside a pod (`kubectl exec <pod> -c vram-enforcer -- vram-enforcer doctor`), on
a node, or on a workstation before using `exec`. A check that does not apply where it runs
is a skip that says why, never a failure: on a workstation (not in a pod, no kubelet, no
kubeconfig) there is no agent, kubelet or API to ask, and `exec` needs none of them.

A sidecar of 0.2.0 (`--api-access agent`, the default) makes no API request: the node
agent connects to its socket, brings it its pod and posts its Events. In one, doctor reads
whether the sidecar listens and the agent is connected, and does not ask the API (the
sidecar holds no token); elsewhere it checks no RBAC for the sidecar. Only for a sidecar of
`--api-access direct` (as sidecars of 0.1.0) does it check the Role they need.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from enforcer.core import messages
from enforcer.core.dra import shareable_gpus
from enforcer.core.model import Device, SourceDown, format_bytes
from enforcer.core.parsing import kubernetes_version
from enforcer.core.protocol import Challenge, ProtocolError, Usage, decode_reply, encode_request
from enforcer.core.settings.common import DEFAULT_SOCKET
from enforcer.core.settings.doctor import DoctorSettings
from enforcer.core.tier_choice import R615, Probe, choose
from enforcer.edge.nvml import Nvml, NvmlError, unavailable_fix
from enforcer.edge.pod_resources import PodResourcesError, list_once
from enforcer.edge.procfs import INITIAL_PID_NS, ProcFs
from enforcer.edge.tier_probe import TierProbe, host_root, own_cgroup

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

EXIT_PROBLEMS = 1
API_DEADLINE = 5.0  # doctor is run by hand: each API check answers within seconds


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # ok, fail, skip, or note (works, in a lesser way: said, but not a failure)
    detail: str
    fix: str = ""


def render(checks: list[Check]) -> str:
    """The report a person reads: one line per check, fixes indented below failures."""
    mark = {"ok": "ok  ", "fail": "FAIL", "skip": "skip", "note": "note"}
    lines = []
    for c in checks:
        lines.append(f"[{mark[c.status]}] {c.name}: {c.detail}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    failed = sum(c.status == "fail" for c in checks)
    lines.append("all checks passed" if not failed else f"{failed} check(s) failed")
    return "\n".join(lines)


def _memory(d: Device) -> str:
    """A GPU's memory, and how much of it the driver keeps (nothing can allocate that, and
    neither the capacity nor the lending counts it)."""
    total = format_bytes(d.total_bytes or 0)
    if d.reserved_bytes is None:
        return f"{total}, reserved by the driver: unknown (no NVML memory info v2)"
    return f"{total}, {format_bytes(d.reserved_bytes)} of it reserved by the driver"


def check_nvml() -> Check:
    nvml = Nvml()
    try:
        nvml.init()
        snap = nvml.snapshot()
    except NvmlError as exc:
        needs = "the agent and exec need NVML; a sidecar needs none: --no-nvml there"
        return Check("NVML", "fail", str(exc), f"{unavailable_fix(exc)}. {needs}")
    finally:
        nvml.shutdown()
    gpus = ", ".join(f"{d.index}: {d.name} ({_memory(d)})" for d in snap.devices)
    found = (
        f"driver {nvml.driver_version}, {len(snap.devices)} device(s) [{gpus}], "
        f"{len(snap.processes)} process(es) using them"
    )
    if snap.failed:
        index = {d.uuid: d.index for d in snap.devices}
        lost = "; ".join(
            messages.gpu_unreadable(uuid, index.get(uuid), why) for uuid, why in snap.failed
        )
        return Check(
            "NVML",
            "fail",
            f"{found}; {lost}",
            "the other GPUs are enforced; drain the node and reset the GPU",
        )
    return Check("NVML", "ok", found)


TIER = "enforcement tier"


def check_tier() -> Check:
    """Which tier holds a limit on this machine and why: `tier_choice.choose` over what the
    tier probe finds for this process's own cgroup (what exec would make its command's
    cgroup below), as exec and the agent choose. Reads, never sets."""
    nvml = Nvml()
    try:
        probe = TierProbe(own_cgroup, host_root()).probe(nvml)
    finally:
        nvml.shutdown()
    if probe.nvml_error:
        return Check(TIER, "skip", "NVML is not available: the NVML check says why")
    choice = choose(probe)
    if choice.refuses:
        proof = (
            "whether the driver charges an ordinary process (not an MPS client) to them shows "
            "only once one uses memory: the agent says it per pod (VRAMHardLimit or "
            "VRAMSamplingOnly), exec in its log"
        )
        return Check(TIER, "ok", f"{choice.said()}; {proof}")
    return Check(TIER, "note", choice.said(), _fix(probe))


def _fix(probe: Probe) -> str:
    """What to do for the driver to refuse allocations past a limit here."""
    if probe.too_old:
        do = f"install an NVIDIA driver of R{R615} or later"
    elif probe.children_without_dmem:
        do = (
            f"enable dmem for the children of {probe.no_dmem_at} and of each ancestor "
            "(echo +dmem > cgroup.subtree_control, from the top down)"
        )
    elif not probe.root:
        do = "run as root"
    else:
        do = f"NVIDIA R{R615}+, cgroup v2, root, a GPU not in MIG mode"
    return (
        "allocations past a limit succeed and the offender is stopped within one "
        f"interval; for the driver to refuse them: {do}"
    )


def check_pid_namespace(procfs: ProcFs) -> Check:
    ns = procfs.pid_ns("self")
    if ns is None:
        return Check("PID namespace", "fail", "cannot read /proc/self/ns/pid")
    if ns == INITIAL_PID_NS:
        return Check("PID namespace", "ok", "the host's: NVML's pids are this machine's pids")
    return Check(
        "PID namespace",
        "ok",
        f"a container's (inode {ns}): NVML's host pids need the agent, or exec --host-proc",
    )


AGENT_PODS = "kubectl -n <ns> get pods -l app.kubernetes.io/component=agent -o wide"
_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


WORKSTATION = "not in a pod, no kubelet"


@dataclass(frozen=True, slots=True)
class Place:
    """Where doctor runs, as far as a check depends on it: in a pod, beside a kubelet, and
    whether a kubeconfig is there to reach an API server from outside a pod."""

    in_pod: bool
    kubelet: bool
    kubeconfig: bool

    @property
    def workstation(self) -> bool:
        """Not in a pod and no kubelet: exec needs no agent, kubelet or API here."""
        return not self.in_pod and not self.kubelet


def place(settings: DoctorSettings) -> Place:
    """Read from the environment the kubelet gives every container, the kubelet's socket,
    and where the Kubernetes client looks for a kubeconfig (`--kubeconfig`, `$KUBECONFIG`,
    `~/.kube/config`)."""
    kubeconfig = (
        bool(settings.kubeconfig)
        or bool(os.environ.get("KUBECONFIG"))
        or os.path.exists(os.path.expanduser("~/.kube/config"))
    )
    return Place(
        in_pod=bool(os.environ.get("KUBERNETES_SERVICE_HOST")),
        kubelet=bool(settings.pod_resources_socket)
        and os.path.exists(settings.pod_resources_socket),
        kubeconfig=kubeconfig,
    )


def agent_expected(settings: DoctorSettings, where: Place) -> bool:
    """Whether a missing agent socket is a failure: where the agent belongs (in a pod,
    beside a kubelet) or a socket other than the default was named. Elsewhere this is a
    workstation, where exec needs no agent."""
    return not where.workstation or settings.agent_socket != DEFAULT_SOCKET


def check_agent(path: str, expected: bool = True) -> Check:
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return _no_agent_socket(path, expected)
    except OSError:  # not ours to look at (a directory's permissions): connecting says why
        mode = stat.S_IFSOCK
    if not stat.S_ISSOCK(mode):
        return Check(
            "agent socket",
            "fail",
            f"{path} is {_KINDS.get(stat.S_IFMT(mode), 'a special file')}, not a socket",
            f"give the node agent's socket (its --socket; {DEFAULT_SOCKET} by default) with "
            "--agent-socket or $VRAM_ENFORCER_AGENT_SOCKET",
        )
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(path)
            conn.sendall(encode_request())
            replies = conn.makefile("rb")
            reply = decode_reply(replies.readline())
            answered = ""
            while isinstance(reply, Challenge):  # a kernel < 6.5: prove who we are
                if reply.nonce != answered:
                    conn.sendall(encode_request("usage", reply.nonce))
                    answered = reply.nonce
                reply = decode_reply(replies.readline())
    except ConnectionRefusedError:  # a socket file, but no agent: not started, or died
        return Check(
            "agent socket",
            "fail",
            f"nothing listens on {path} (connection refused): the node agent is not running, "
            "or is restarting",
            f"{AGENT_PODS}; its log says why (kubectl logs)",
        )
    except (OSError, ProtocolError) as exc:
        return Check(
            "agent socket",
            "fail",
            f"{path}: {exc}",
            "the agent may be restarting; its log says why (kubectl logs)",
        )
    if isinstance(reply, SourceDown):
        return Check(
            "agent socket",
            "fail",
            f"the agent answers but {reply.reason}",
            "the agent serves the sidecars of injected pods and the node itself: run doctor "
            "there (kubectl exec -c vram-enforcer, or on the node); else it cannot read NVML "
            "on this node: see its log",
        )
    if not isinstance(reply, Usage):  # a pod, unasked for
        return Check(
            "agent socket",
            "fail",
            f"{path}: the agent answered a usage request with a pod",
            "run the agent and this image of the same release",
        )
    return Check(
        "agent socket",
        "ok",
        f"{len(reply.sample.devices)} GPU(s); {len(reply.sample.processes)} GPU process(es) "
        "visible to this "
        "PID namespace",
    )


def _no_agent_socket(path: str, expected: bool) -> Check:
    if not expected:
        return Check(
            "agent socket",
            "skip",
            f"does not apply: {path} does not exist, and this is taken for a workstation "
            f"({WORKSTATION}), where exec needs no agent (it reads NVML itself). On a GPU "
            f"node of a cluster the agent must be there: {AGENT_PODS}",
        )
    return Check(
        "agent socket",
        "fail",
        f"{path} does not exist",
        "is the node agent (DaemonSet) running on this node, and is /run/vram-enforcer "
        f"mounted? {AGENT_PODS}",
    )


SIDECAR_SOCKET = "sidecar socket"
UNIX_SOCKETS = "/proc/net/unix"
SIDECAR_LOG = "kubectl logs <pod> -c vram-enforcer"
_LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags
_CONNECTED = 3  # SS_CONNECTED in its St
_SOURCE_UP = (
    "whether it is: the sidecar's log (`enforcement resumed`, or `waiting for the node "
    "agent`) and vram_enforcer_source_up on its /metrics"
)


def check_sidecar_socket(path: str, table: str = UNIX_SOCKETS) -> Check:
    """In a sidecar of 0.2.0 the node agent connects to the sidecar's socket, not the
    sidecar to the agent's. Whether the sidecar listens there and the agent is connected is
    read from the kernel's table of this network namespace's Unix sockets (the pod's):
    doctor does not connect, since the sidecar refuses, and logs, any caller of its own pod."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return Check(
            SIDECAR_SOCKET,
            "fail",
            f"{path} does not exist: the sidecar is not listening (it has not started, or "
            "could not)",
            f"its log says why: {SIDECAR_LOG}",
        )
    except OSError:  # not ours to look at: the table below still tells
        mode = stat.S_IFSOCK
    if not stat.S_ISSOCK(mode):
        return Check(
            SIDECAR_SOCKET,
            "fail",
            f"{path} is {_KINDS.get(stat.S_IFMT(mode), 'a special file')}, not a socket",
            "VRAM_ENFORCER_LISTEN must be the sidecar's --listen (the webhook sets "
            "/run/vram-enforcer/sidecar.sock)",
        )
    try:
        listening, connected = _unix_sockets(Path(table).read_text(errors="replace"), path)
    except OSError as exc:
        return Check(
            SIDECAR_SOCKET,
            "note",
            f"{path} is a socket; whether the node agent is connected to it cannot be read ({exc})",
            _SOURCE_UP,
        )
    if not listening:
        return Check(
            SIDECAR_SOCKET,
            "fail",
            f"nothing listens on {path}: the sidecar is not running, or is restarting",
            f"its log says why: {SIDECAR_LOG} (--previous after a restart)",
        )
    if not connected:
        return Check(
            SIDECAR_SOCKET,
            "fail",
            f"the sidecar listens on {path}, but the node agent is not connected to it: the "
            "sidecar has no usage to enforce on",
            f"is a node agent of 0.2.0 running on this node ({AGENT_PODS}), and may it read "
            "the sidecar's root with ptrace (AppArmor)? Its log says why it cannot connect",
        )
    return Check(
        SIDECAR_SOCKET,
        "ok",
        f"the sidecar listens on {path}, and the node agent is connected to it: it brings "
        "the usage and this pod, and posts the sidecar's Events",
    )


def _unix_sockets(table: str, path: str) -> tuple[bool, bool]:
    """Whether a socket listens at `path`, and whether one of its connections is accepted:
    from /proc/net/unix (`Num: RefCount Protocol Flags Type St Inode Path`, in hex), where a
    listener and each connection it accepted show its path. A caller not yet accepted is
    not connected: a sidecar that is stopped leaves the agent's there."""
    wanted = os.path.normpath(path)
    listening = connected = False
    for line in table.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) < 8 or os.path.normpath(fields[7]) != wanted:
            continue
        try:
            flags, state = int(fields[3], 16), int(fields[5], 16)
        except ValueError:
            continue
        listening |= bool(flags & _LISTENING)
        connected |= not flags & _LISTENING and state == _CONNECTED
    return listening, connected


# What each component asks of the API, as (verb, resource, subresource, namespaced).
# The sidecar's are those of --api-access direct (the Role of deploy/rbac/sidecar.yaml,
# which sidecars of 0.1.0 need); the agent's include reading the node's pods and posting
# Events, which it does for the sidecars of 0.2.0, setting a pod's condition (its last
# enforcement), and reading which namespaces opted in.
_NEEDS: dict[str, list[tuple[str, str, str | None, bool]]] = {
    "sidecar": [
        ("get", "pods", None, True),
        ("create", "events", None, True),
        ("patch", "events", None, True),
    ],
    "agent": [
        ("get", "nodes", None, False),
        ("patch", "nodes", None, False),
        ("patch", "nodes", "status", False),
        ("list", "pods", None, False),
        ("watch", "pods", None, False),
        ("delete", "pods", None, False),
        ("patch", "pods", "status", False),
        ("create", "pods", "eviction", False),
        ("list", "namespaces", None, False),
        ("watch", "namespaces", None, False),
        ("create", "events", None, False),
        ("patch", "events", None, False),
        ("list", "events", None, False),
    ],
}
NO_SIDECAR_RBAC = (
    "a sidecar of --api-access agent (the default) makes no API request: the node agent "
    "reads its pod and posts its Events"
)


def check_api(settings: DoctorSettings, where: Place) -> list[Check]:
    if not where.in_pod and not where.kubeconfig:
        return [
            Check(
                "Kubernetes API",
                "skip",
                "does not apply: not in a pod, and no kubeconfig (--kubeconfig, $KUBECONFIG, "
                "~/.kube/config), so there is no API server to ask; exec needs none. To "
                "check a cluster's RBAC from here, give --kubeconfig",
            )
        ]
    if settings.listen is not None and settings.api_access == "agent" and not settings.kubeconfig:
        return [
            Check(
                "Kubernetes API",
                "skip",
                f"not needed here: {NO_SIDECAR_RBAC}, so this sidecar holds no API "
                "token; run doctor in the agent's pod for the API and the agent's "
                "RBAC",
            )
        ]
    # The kubernetes client is loaded only for this check (about 40 MiB).
    from enforcer.edge.kube import KubeError, access_allowed, connect, server_version  # noqa: PLC0415

    try:
        api = connect(settings.kubeconfig)
        version = server_version(api, deadline=API_DEADLINE)
    except KubeError as exc:
        return [
            Check(
                "Kubernetes API",
                "fail",
                str(exc),
                "check the kubeconfig, or the pod's ServiceAccount token",
            )
        ]
    checks = [
        Check("Kubernetes API", "ok", f"reachable, {version}"),
        check_dra(api, version, settings),
    ]
    for component, needs in _NEEDS.items():
        if component == "sidecar" and settings.api_access == "agent":
            checks.append(
                Check(
                    "RBAC for the sidecar",
                    "skip",
                    f"none needed: {NO_SIDECAR_RBAC} (the agent's RBAC is checked "
                    "below); --api-access direct checks the Role that sidecars of "
                    "0.1.0 need",
                )
            )
            continue
        denied = []
        for verb, resource, sub, namespaced in needs:
            ns = settings.namespace if namespaced else None
            what = f"{verb} {resource}{'/' + sub if sub else ''}"
            try:
                if not access_allowed(api, verb, resource, ns, sub, deadline=API_DEADLINE):
                    denied.append(what)
            except KubeError as exc:
                denied.append(f"{what} (cannot ask: {exc})")
        scope = f" in namespace {settings.namespace}" if component == "sidecar" else ""
        if denied:
            fix = (
                "add the namespace to the chart's sidecar.namespaces (or apply "
                "deploy/rbac/sidecar.yaml there), or run the sidecar with --api-access "
                "agent, which needs none"
                if component == "sidecar"
                else "apply deploy/rbac/agent.yaml (or the chart's ClusterRole)"
            )
            problem = f"this identity may not {', '.join(denied)}{scope}"
            checks.append(Check(f"RBAC for the {component}", "fail", problem, fix))
        else:
            checks.append(
                Check(f"RBAC for the {component}", "ok", f"all it needs is allowed{scope}")
            )
    return checks


DRA_MODE = "VRAM per GPU (DRA)"


def check_dra(api: ApiClient, version: str, settings: DoctorSettings) -> Check:
    """Which placement this cluster can use: DRA with consumable capacity (per GPU), or the
    extended resource (per node); and why."""
    from enforcer.edge.claims import SLICES  # noqa: PLC0415 - with the client, as above
    from enforcer.edge.kube import KubeError, call  # noqa: PLC0415

    node_mode = "node-level mode (vram-enforcer.io/vram counted per node) is what this cluster has"
    known = kubernetes_version(version)
    minor = known[1] if known is not None and known[0] == 1 else None
    if minor is not None and minor < 34:
        return Check(DRA_MODE, "note", f"Kubernetes {version} has no DRA (1.34+): {node_mode}")
    try:
        listed = call(api, "GET", SLICES, "resourceslices", deadline=API_DEADLINE, verb="list")
    except KubeError as exc:
        return Check(
            DRA_MODE,
            "note",
            f"cannot list ResourceSlices ({exc}): cannot tell",
            "in DRA mode the node agent lists them (deploy/rbac/agent.yaml, the chart's "
            "ClusterRole): run doctor in the agent's pod to tell",
        )
    items = listed.get("items") if isinstance(listed, dict) else None
    gpus = shareable_gpus(items if isinstance(items, list) else [], settings.dra)
    gate = (
        ""
        if minor is None or minor >= 36
        else (
            f"; Kubernetes {version} also needs the DRAConsumableCapacity feature gate "
            "(beta and on by default from 1.36)"
        )
    )
    if not gpus:
        drivers = ", ".join(sorted(settings.dra.drivers))
        return Check(
            DRA_MODE,
            "note",
            f"no ResourceSlice of {drivers} publishes a GPU shareable by memory with a "
            f"{settings.dra.uuid_attribute!r} attribute: {node_mode}{gate}",
            "for DRA mode, run NVIDIA's DRA driver with its ConsumableShares gate and "
            "--consumable-shares=memory (see docs/install.md)",
        )
    shown = ", ".join(gpus[:4]) + (f" and {len(gpus) - 4} more" if len(gpus) > 4 else "")
    return Check(
        DRA_MODE,
        "ok",
        f"{len(gpus)} GPU(s) shareable by memory ({shown}): DRA mode "
        f"can be used (the chart's webhook.draDeviceClass){gate}",
    )


KUBELET = "kubelet pod resources"


def check_pod_resources(socket: str, workstation: bool = False) -> Check:
    """Whether the kubelet says which devices each container got: then the agent owes a
    container's request on the GPU a device plugin gave it from before it starts."""
    where = "owed where NVML shows it using a GPU, once it does"
    if not socket:
        return Check(KUBELET, "skip", "--pod-resources-socket is empty")
    if not os.path.exists(socket) and workstation:
        return Check(
            KUBELET,
            "skip",
            f"does not apply: no socket at {socket}, and this is taken for a workstation "
            f"({WORKSTATION}), where exec needs no kubelet",
        )
    if not os.path.exists(socket):
        return Check(
            KUBELET,
            "note",
            f"no socket at {socket}: a container's request is {where}",
            "on a node, give the kubelet's pod-resources socket (--pod-resources-socket; "
            "it is below the kubelet's --root-dir)",
        )
    try:
        found = list_once(Path(socket))
    except PodResourcesError as exc:
        fix = "is the kubelet running, and may this user connect to its socket?"
        return Check(KUBELET, "fail", f"the kubelet at {socket} does not answer ({exc})", fix)
    counts = Counter(r for devices in found.values() for r in devices)
    given = ", ".join(f"{n} with {r}" for r, n in sorted(counts.items())) or "none has a device"
    owed = "a container's request is owed on the GPU a device plugin gave it before it starts"
    return Check(KUBELET, "ok", f"answers: of this node's containers, {given}; {owed}")


def run(settings: DoctorSettings) -> int:
    procfs = ProcFs()
    where = place(settings)
    checks = [check_pid_namespace(procfs)]
    listen = settings.listen
    socket_check: Callable[[], list[Check]]
    if listen is not None:  # a sidecar of 0.2.0: the agent connects to it
        socket_name, socket_check = SIDECAR_SOCKET, lambda: [check_sidecar_socket(listen)]
    else:
        expected = agent_expected(settings, where)
        socket_name = "agent socket"
        socket_check = lambda: [check_agent(settings.agent_socket, expected)]  # noqa: E731
    steps: list[tuple[bool, str, Callable[[], list[Check]]]] = [
        (settings.nvml, "NVML", lambda: [check_nvml(), check_tier()]),
        (settings.agent, socket_name, socket_check),
        (settings.api, "Kubernetes API", lambda: check_api(settings, where)),
    ]
    for wanted, name, step in steps:
        checks += step() if wanted else [Check(name, "skip", "not asked for")]
    checks.append(check_pod_resources(settings.pod_resources_socket, where.workstation))
    if settings.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(render(checks))
    return EXIT_PROBLEMS if any(c.status == "fail" for c in checks) else 0
