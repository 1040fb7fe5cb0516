"""Second red-team review of issue 45, step 2: findings shown by failing tests (not fixed)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from enforcer.core.gate_budget import Budget
from enforcer.core.gate_caps import Caps
from enforcer.edge import gate_listener
from enforcer.edge.gate_listener import let_go_on
from tests.helpers import wait_for
from tests.integration.test_node_gate import (  # proven, container: fixtures
    BACK_TO_BACK,
    CID,
    GIB,
    UNTOUCHED,
    Node,
    Process,
    container,
    proven,
)

__all__ = ["container", "proven"]


def test_a_flood_from_a_process_beyond_its_pods_cap_is_held_to_its_containers_budget(
    tmp_path: Path, proven: None, container: Path
) -> None:
    """Review 2, finding 1: the budget holds a flooding container's listeners, but a 17th
    process of the pod (or of a pod past the node's cap) is served by the overflow reader,
    which answers its calls as fast as it can, with no turn: the flood the budget was made
    to hold costs the agent a thread at full speed (and delays every other overflowed
    call of the node behind it). Same bound as the listeners' flood test."""
    budget = Budget(rate=20.0, burst=50)
    node = Node(tmp_path, budget=budget, caps=Caps(per_pod=0))  # every fd overflows
    assert node.gate.start() is None
    flood = Process([BACK_TO_BACK], container)
    try:
        started = time.monotonic()
        flood.hand_over(node.socket, CID)
        wait_for(lambda: node.gate.gated() == {CID: 1}, what="the handoff")
        assert flood.spawned.go() == 0
        wait_for(lambda: _overflowed(node) > budget.burst, what="the flood past its burst")
        time.sleep(1.0)
        elapsed, read = time.monotonic() - started, _overflowed(node)
        assert read <= budget.burst + 2 * budget.rate * elapsed, (read, elapsed)
    finally:
        flood.kill()
        node.gate.stop()


def _overflowed(node: Node) -> float:
    return node.metric("allocation_gate_calls_total", outcome="overflow") or 0


def test_a_second_reader_of_one_overflowed_fd_never_holds_the_other_pods_overflowed_calls(
    tmp_path: Path, proven: None, container: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2, finding 2: the pod's holder has a copy of every fd of its pod, the
    overflowed ones too, and reads it once it sees the agent's connection end (at once,
    whatever the lease: `Holder.reading`), which the agent ends itself in `_lost` while its
    own lease still runs (up to `LEASE`): two readers. `let_go_on` looks for a call and
    then RECVs; where the other reader takes the call between the two, RECV waits for the
    next call on that fd (the kernel ends the wait only when the fd's tasks have all
    exited), which its tenant need never make: the one `gate-overflow` thread then answers
    no other fd of the node. The race is forced here at its window: the holder (a copy of
    the fd, read by the test) takes the call just after the reader looked, and the tenant
    stops its process. Another pod's overflowed call must still go on: its pod's reader is
    another thread."""
    node = Node(tmp_path, caps=Caps(per_pod=0))  # every fd overflows
    assert node.gate.start() is None
    # Another pod's container (each pod's overflowed fds have a reader of their own: a
    # wedge holds the tenant's own pod alone).
    other = container.parent.parent / "pod5e1b0c7a-0d2e-4f6a-8b1c-2d3e4f5a6b7c" / ("ef" * 32)
    other.mkdir(parents=True)
    tenant = Process(["form=nvos64,class=0x80,time=1000,gap=0.5"], container)
    assert tenant.spawned.listener is not None
    holder = os.dup(tenant.spawned.listener)  # the pod's holder's copy
    looked = gate_listener._readable
    raced: list[int] = []

    def race(fd: int) -> bool:
        waiting = looked(fd)
        if waiting and not raced and threading.current_thread().name == "gate-overflow":
            raced.append(fd)
            assert let_go_on(holder)  # the holder answers it first
            os.kill(tenant.spawned.pid, signal.SIGSTOP)  # and no more calls come
        return waiting

    monkeypatch.setattr(gate_listener, "_readable", race)
    try:
        tenant.hand_over(node.socket, CID)
        wait_for(lambda: node.gate.gated() == {CID: 1}, what="the handoff")
        assert tenant.spawned.go() == 0
        wait_for(lambda: bool(raced), what="the race")
        second = Process([f"form=nvos64,class=0x40,size={GIB}"], other)
        second.hand_over(node.socket, "ef" * 32)
        (line,) = second.run()  # "the stand-in hung": the overflow reader waits in RECV
        assert (line["ret"], line["status"]) == (-1, UNTOUCHED), line
    finally:
        os.kill(tenant.spawned.pid, signal.SIGKILL)
        os.waitpid(tenant.spawned.pid, 0)
        os.close(holder)
        node.gate.stop()
