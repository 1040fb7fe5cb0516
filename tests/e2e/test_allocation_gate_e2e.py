"""The allocation gate's Kubernetes path on the real kubelet, containerd and runc (issue 45,
step 2; docs/architecture.md, "The allocation gate on Kubernetes").

A `Localhost` profile (`core/gate_profile.py`) under the kubelet's seccomp root reaches runc
as written; runc connects to its `listenerPath` and hands over each container's listener fd
with the container's state; the NOTIFY rules survive next to the `ioctl` allow under the
libseccomp that runc links (2.5.4 on this machine folds a bare `ioctl` allow over them, the
trap a third container shows); and the gate answers the container's driver calls: one
within the limit goes on, one over it gets the driver's out-of-memory status and returns 0,
through XFER and through i386's `int 0x80` as well. The stand-in (tests/integration/
rm_standin.py) runs in an image of Debian's python3, as uid 65532, from a hostPath.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from enforcer.core import gate_profile
from enforcer.core.cgroups import container_id, parse_cgroup
from enforcer.core.model import GiB
from enforcer.core.rm_abi import NV_ERR_NO_MEMORY
from enforcer.edge.gate_listener import GateListener, Ledger, Outcome
from enforcer.edge.gate_socket import GateSocket, Handoff
from tests.e2e.cluster import ApiServer
from tests.e2e.images import python_image
from tests.e2e.node import BIN, RealNode, container_log, missing, runc
from tests.helpers import wait_for

NODE = "gate-node"
NAMESPACE = "allocation-gate"
IMAGE = "localhost/python:e2e"
STANDIN = Path(__file__).resolve().parents[1] / "integration"
LIMIT = 4 * GiB
UNTOUCHED = 0xFFFFFFFF  # the stand-in's status before the call
TRAP = "vram-enforcer/trap.json"
STEPS = {
    "within": f"form=nvos64,class=0x40,size={3 * GiB}",
    "over": f"form=nvos64,class=0x40,size={2 * GiB}",
    "wrapped": f"form=nvos21,class=0x40,size={2 * GiB},wrap=1",
    "i386": f"form=nvos64,class=0x40,size={2 * GiB},abi=i386",
    "context": "form=nvos64,class=0x80",
}


class _Errors:
    def __init__(self) -> None:
        self.count = 0.0

    def inc(self, amount: float = 1) -> None:
        self.count += amount


@dataclass
class Gate:
    """A test-side listener: the gate socket, and one GateListener per container fd over
    one ledger whose usage is what it let through (the driver's count, as NVML would show
    it once asked)."""

    handoffs: list[tuple[Handoff, str | None]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    listeners: list[GateListener] = field(default_factory=list)
    errors: _Errors = field(default_factory=_Errors)
    ledger: Ledger = field(default_factory=lambda: Ledger(LIMIT))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, handoff: Handoff) -> None:
        cgroup = Path(f"/proc/{handoff.pid}/cgroup").read_text()
        self.handoffs.append((handoff, container_id(parse_cgroup(cgroup))))
        major = os.major(os.stat("/dev/null").st_rdev)
        listener = GateListener(
            handoff.fd, self.ledger, {major}, self.errors, self.count, self.sample
        )
        self.listeners.append(listener)
        listener.start()

    def count(self, outcome: Outcome, seconds: float) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def sample(self) -> None:
        """An early pass, asked for by a recheck once every grant has settled: it shows what
        was let through."""
        self.ledger.saw(self.ledger.view().held(), time.monotonic())

    def close(self) -> None:
        for listener in self.listeners:
            listener.stop()
        for handoff, _ in self.handoffs:
            os.close(handoff.fd)


@pytest.fixture
def real_node(apiserver: ApiServer, tmp_path: Path) -> Iterator[RealNode]:
    reason = missing()
    if reason:
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    image = python_image(tmp_path / "python.tar", IMAGE)
    (tmp_path / "node").mkdir()
    node = RealNode(apiserver, tmp_path / "node", name=NODE, images=[image])
    try:
        core = node.core
        assert core is not None
        with contextlib.suppress(client.ApiException):  # made by an earlier test
            core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield node
    finally:
        node.close()


@pytest.fixture
def gate_node(real_node: RealNode, tmp_path: Path) -> Iterator[tuple[RealNode, Gate, Path]]:
    gate = Gate()
    gate.ledger.saw(0, time.monotonic())
    sock = tmp_path / "seccomp.sock"
    server = GateSocket(sock, gate.take, gate.errors)
    server.start()
    try:
        yield real_node, gate, sock
    finally:
        server.stop()
        gate.close()


def pod(name: str, seccomp: dict[str, str], steps: list[str] | None = None) -> dict[str, Any]:
    """The stand-in's steps (STEPS') in a non-root container with `seccomp` as its
    profile."""
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "standin",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        "python3",
                        "/standin/rm_standin.py",
                        *(list(STEPS.values()) if steps is None else steps),
                    ],
                    "securityContext": {
                        "runAsUser": 65532,
                        "runAsNonRoot": True,
                        "allowPrivilegeEscalation": False,
                        "seccompProfile": seccomp,
                    },
                    "volumeMounts": [
                        {"name": "standin", "mountPath": "/standin", "readOnly": True}
                    ],
                }
            ],
            "volumes": [{"name": "standin", "hostPath": {"path": str(STANDIN)}}],
        },
    }


def run(node: RealNode, body: dict[str, Any]) -> tuple[client.V1Pod, dict[str, dict[str, Any]]]:
    """Runs the pod to its end; its container id and the stand-in's lines by step name."""
    core = node.core
    assert core is not None
    name = body["metadata"]["name"]
    core.create_namespaced_pod(NAMESPACE, body)

    def ended() -> client.V1Pod | None:
        found = core.read_namespaced_pod(name, NAMESPACE)
        return found if found.status.phase in ("Succeeded", "Failed") else None

    try:
        done: client.V1Pod = wait_for(ended, timeout=120, what=f"{name} to end")
    except AssertionError as exc:
        found = core.read_namespaced_pod(name, NAMESPACE)
        raise AssertionError(
            f"{exc}: {found.status}\ncontainerd's log ends:\n{node.log('containerd')[-3000:]}"
        ) from None
    text = container_log(node, done, "standin")
    assert done.status.phase == "Succeeded", text
    lines = [json.loads(line) for line in text.splitlines()]
    by_step = {key: line for key, line in zip(STEPS, lines, strict=True)}
    return done, by_step


def versions() -> str:
    """containerd's and runc's (with the libseccomp runc links), for the report."""
    found = [
        subprocess.run(
            [str(BIN / "containerd"), "--version"], capture_output=True, text=True
        ).stdout,
        subprocess.run([str(runc()), "--version"], capture_output=True, text=True).stdout,
    ]
    return " | ".join(" ".join(v.split()) for v in found)


def test_runc_hands_each_gated_container_to_the_listener_and_its_calls_are_judged(
    gate_node: tuple[RealNode, Gate, Path],
) -> None:
    node, gate, sock = gate_node
    seccomp_root = node.dir / "kubelet" / "seccomp"
    written = seccomp_root / gate_profile.PROFILE_NAME
    written.parent.mkdir(parents=True)
    machine = os.uname().machine
    written.write_text(json.dumps(gate_profile.profile(machine, str(sock))))
    print("versions:", versions())

    # A container under RuntimeDefault: never handed over, its calls reach the "driver".
    _, lines = run(node, pod("plain", {"type": "RuntimeDefault"}))
    assert gate.handoffs == [] and gate.outcomes == []
    for key, line in lines.items():
        assert (line["ret"], line["errno"], line["status"]) == (-1, errno.ENOTTY, UNTOUCHED), key

    # Under the gating profile: runc dialled the socket with the container's fd and state.
    gated, lines = run(
        node, pod("gated", {"type": "Localhost", "localhostProfile": gate_profile.PROFILE_NAME})
    )
    cid = gated.status.container_statuses[0].container_id.split("://")[1]
    assert len(gate.handoffs) == 1, gate.handoffs
    handoff, from_cgroup = gate.handoffs[0]
    assert from_cgroup == cid == handoff.container_id
    assert handoff.metadata == gate_profile.LISTENER_METADATA
    assert handoff.annotations.get("io.kubernetes.cri.sandbox-name") == "gated"
    # Within the limit: on to the driver. Over it, plain, wrapped or through int 0x80: the
    # driver's out-of-memory status and a 0 return, the process alive to say so.
    assert (lines["within"]["ret"], lines["within"]["status"]) == (-1, UNTOUCHED), lines
    for key in ("over", "wrapped", "i386"):
        assert (lines[key]["ret"], lines[key]["status"]) == (0, NV_ERR_NO_MEMORY), (key, lines)
    assert (lines["context"]["ret"], lines["context"]["status"]) == (-1, UNTOUCHED), lines
    assert sorted(gate.outcomes) == sorted(
        [Outcome.ALLOWED, Outcome.REFUSED, Outcome.REFUSED, Outcome.REFUSED, Outcome.NOT_MEMORY]
    ), gate.outcomes
    assert gate.errors.count == 0

    # The trap: the same rules beside a bare `ioctl` allow, as in every RuntimeDefault. The
    # libseccomp runc links folds the NOTIFY rules into the allow without a word: runc
    # still hands the fd over, but nothing is ever notified.
    trap = gate_profile.profile(machine, str(sock))
    trap["syscalls"][-1] = {"names": ["ioctl"], "action": "SCMP_ACT_ALLOW"}
    (seccomp_root / TRAP).write_text(json.dumps(trap))
    before = len(gate.outcomes)
    _, lines = run(node, pod("trap", {"type": "Localhost", "localhostProfile": TRAP}))
    print("handoffs after the trap:", len(gate.handoffs))
    for key, line in lines.items():
        assert (line["ret"], line["status"]) == (-1, UNTOUCHED), (key, lines)
    assert len(gate.outcomes) == before


def _child(argv: list[str], started: list[subprocess.Popen[bytes]]) -> Iterator[dict[str, Any]]:
    """A helper process of the test (killed with its group at the end), its JSON lines."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    started.append(proc)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line: dict[str, Any] = json.loads(raw)
        assert "bug" not in line, line
        yield line


def _until(lines: Iterator[dict[str, Any]], done: Callable[[dict[str, Any]], bool]) -> None:
    for line in lines:
        if done(line):
            return
    raise AssertionError("the helper ended first")


def test_the_agent_killed_and_started_again_under_a_gated_container_never_fails_its_calls(
    real_node: RealNode, tmp_path: Path
) -> None:
    """Design §3.5's restart: a gated container calls every 20 ms for a minute while the
    agent's gate (`NodeGate`, in a process of its own, over the node's kubelet root) is
    SIGKILLed and started again; the pod's gate holder (`gate-holder`, here in a PID
    namespace of its own on the host, not yet in the sidecar's container) lets the calls go
    on meanwhile and hands the fd to the new gate. No call fails with ENOSYS or hangs; the
    calls over the limit are refused before the kill and after the restart."""
    node, started = real_node, list[subprocess.Popen[bytes]]()
    holder = tmp_path / "gate-holder.sock"
    gated_steps = [f"form=nvos64,class=0x40,size={2 * GiB},time=3000,gap=0.02", STEPS["over"]]
    agent = [sys.executable, str(STANDIN / "gate_agent.py"), str(node.dir), "*", str(LIMIT)]
    agent += [str(3 * GiB), str(holder)]
    try:
        holding = [sys.executable, str(STANDIN / "gate_sidecar.py"), str(holder)]
        sidecar = _child(["unshare", "--pid", "--fork", *holding], started)
        _until(sidecar, lambda line: line["agent"] is False)
        first = _child(agent, started)
        _until(first, lambda line: line.get("ready") is True)
        core = node.core
        assert core is not None
        profile = {"type": "Localhost", "localhostProfile": gate_profile.PROFILE_NAME}
        core.create_namespaced_pod(NAMESPACE, pod("restarted", profile, gated_steps))
        _until(first, lambda line: line.get("gated") == 1)
        _until(sidecar, lambda line: line["held"] == 1 and line["agent"])
        os.killpg(started[1].pid, signal.SIGKILL)
        started[1].wait()
        _until(sidecar, lambda line: line["let_on"] >= 5 and not line["agent"])
        second = _child(agent, started)
        _until(second, lambda line: line.get("gated") == 1)
        _until(sidecar, lambda line: line["agent"])

        def ended() -> client.V1Pod | None:
            found = core.read_namespaced_pod("restarted", NAMESPACE)
            return found if found.status.phase in ("Succeeded", "Failed") else None

        done: client.V1Pod = wait_for(ended, timeout=180, what="the gated pod to end")
        text = container_log(node, done, "standin")
        assert done.status.phase == "Succeeded", text
        looped, last = (json.loads(line) for line in text.splitlines())
        counts = looped["counts"]
        print("calls by ret/errno/status:", counts)
        assert not [k for k in counts if k.split("/")[1] == str(errno.ENOSYS)], counts
        assert counts.get(f"0/0/{NV_ERR_NO_MEMORY:#x}", 0) > 0, counts  # judged
        assert counts.get(f"-1/{errno.ENOTTY}/{UNTOUCHED:#x}", 0) >= 5, counts  # let go on
        assert (last["ret"], last["status"]) == (0, NV_ERR_NO_MEMORY), last  # judged again
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
