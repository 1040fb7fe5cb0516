"""Second red-team review of issue 45, step 2: findings shown by failing tests (not fixed)."""

from __future__ import annotations

import time
from pathlib import Path

from enforcer.core.gate_budget import Budget
from enforcer.core.gate_caps import Caps
from tests.helpers import wait_for
from tests.integration.test_node_gate import (  # proven, container: fixtures
    BACK_TO_BACK,
    CID,
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
