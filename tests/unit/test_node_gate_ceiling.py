"""What the agent's allocation gate holds a container to (issue 45, step 2): its ceiling,
only where its pod names it and the driver's branch has known parameter layouts; a refusal
on another branch would write the status at a guessed offset of the caller's memory."""

from __future__ import annotations

import pytest

from enforcer.core.lending import Tenant, Tenants
from enforcer.modes.node_gate import container_ceiling

GIB = 1 << 30
CID = "ab" * 32
TENANTS = Tenants.of(
    [Tenant("ml/p/c", "ml", request=GIB, ceiling=4 * GIB, priority=0, ids=frozenset({CID}))]
)


@pytest.mark.parametrize("version", ["535.43.02", "580.142", "595.45.04"])
def test_a_named_container_on_a_known_branch_is_held_to_its_ceiling(version: str) -> None:
    assert container_ceiling(TENANTS, version, CID) == 4 * GIB


@pytest.mark.parametrize("version", ["525.147.05", "615.10", "", "simulated"])
def test_on_a_branch_whose_layouts_are_not_known_nothing_is_bounded(version: str) -> None:
    assert container_ceiling(TENANTS, version, CID) is None


def test_a_container_the_pods_do_not_name_is_not_bounded() -> None:
    assert container_ceiling(TENANTS, "580.142", "cd" * 32) is None
    assert container_ceiling(None, "580.142", CID) is None  # the pods not listed yet
