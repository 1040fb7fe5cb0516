"""Findings of the security review of issue 45, step 2, shown on real processes, sockets and
cgroups. Each test here FAILS on c26cc07: it shows the hole, and passes once it is fixed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from enforcer.edge.gate_holder import hand_over, is_listener_fd, take
from enforcer.modes.node_gate import NodeGate, container_ceiling
from tests.helpers import wait_for
from tests.integration.test_node_gate import (  # proven, container: fixtures
    CID,
    DEADLINE,
    NULL_MAJOR,
    Process,
    _Errors,
    container,
    proven,
)

__all__ = ["container", "proven"]


def test_a_handoff_whose_process_ends_at_once_is_handed_to_its_pods_holder_or_not_at_all(
    tmp_path: Path, proven: None, container: Path
) -> None:
    """`NodeGate._take` serves the fd (under its lock), then, after releasing the lock,
    hands `handoff.fd` to the pod's holder. A sampler pass in between (`saw`), finding every
    task under the filter gone (`kubectl exec -- true`), closes that fd: the holder is then
    handed a closed fd (EBADF: the holder is dropped for good, and its pod's calls go on
    unjudged while its usage link stays up) or whatever file reused the number. The pass
    is made to fall in that window by the label callback, which `_take` calls there."""
    process: list[Process] = []
    gate: list[NodeGate] = []

    def label(value: str) -> None:
        if value == "v1":  # on the socket's thread, between `_serve` and `_pass`
            os.kill(process[0].spawned.pid, signal.SIGKILL)
            os.waitpid(process[0].spawned.pid, 0)
            gate[0].saw(None, time.monotonic())  # the sampler's pass: the fd is closed

    gate.append(
        NodeGate(
            tmp_path / "kubelet",
            tmp_path / "run" / "seccomp.sock",
            Path("/proc"),
            {NULL_MAJOR},
            lambda cid: container_ceiling(None, "580.142", cid),
            _Errors(),
            recheck_wait=DEADLINE,
            label=label,
            driver=lambda: "580.142",
        )
    )
    assert gate[0].start() is None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        hand_over(theirs, [])
        gate[0].hold(ours, {CID}.__contains__, time.monotonic())
        process.append(Process([], container))
        process[0].hand_over(tmp_path / "run" / "seccomp.sock", CID)
        wait_for(lambda: gate[0].gated() == {}, what="the handoff served and forgotten")
        theirs.settimeout(0.5)
        got = []
        with contextlib.suppress(TimeoutError):
            while (found := take(theirs)) is not None:  # renewals, and each fd with its claim
                if not isinstance(found, bytes | str):
                    got.append(is_listener_fd(found.fd))
                    os.close(found.fd)
        assert all(got), "a file that is no listener was handed to the pod's holder"
        assert gate[0].holders() == 1, "the holder was dropped: its pod's calls go unjudged"
    finally:
        gate[0].stop()
        theirs.close()
        os.close(process[0].out)
