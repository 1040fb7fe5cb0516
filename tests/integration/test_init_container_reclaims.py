"""A regular init container that borrows above its request gives memory back as a container
does (issue 35): the agent's lender makes it a tenant of its GPU, decides its reclaim by its
container ID, and its sidecar applies that reclaim to its unit.

Over `tests/fixtures/proc/pod` (see `test_attributors`): pid 50 is a process of container
4444..., here the init container `fetch` of a pod that is still Pending.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from enforcer.core.attribution import PodTerms
from enforcer.core.declaration import CEILINGS_ENV, LIMITS_ENV, Declaration, Declares
from enforcer.core.lending import decide, tenants
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.owed import pod_owed
from enforcer.core.payloads import Pod
from enforcer.core.reclaim import views
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.procfs import ProcFs
from enforcer.modes.sidecar_units import AgentReclaims, ContainerAttributor
from tests.helpers import copy_proc_fixture

FETCH, OTHER = "4" * 64, "9" * 64
ENV = [
    {"name": LIMITS_ENV, "value": json.dumps({"fetch": 4 * GiB, "trainer": 4 * GiB})},
    {"name": CEILINGS_ENV, "value": json.dumps({"fetch": 12 * GiB})},
]
POD = cast(
    Pod,
    {
        "metadata": {"uid": "u-fetch", "namespace": "ml", "name": "train-0"},
        "spec": {
            "initContainers": [{"name": "vram-enforcer", "env": ENV}, {"name": "fetch"}],
            "containers": [{"name": "trainer"}],
        },
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "vram-enforcer",
                    "containerID": f"containerd://{'5' * 64}",
                    "state": {"running": {}},
                },
                {"name": "fetch", "containerID": f"containerd://{FETCH}", "state": {"running": {}}},
            ],
            "containerStatuses": [{"name": "trainer", "state": {"waiting": {}}}],
        },
    },
)
# A neighbour on the same GPU, owed 6Gi of its 8Gi request.
NEIGHBOUR = cast(
    Pod,
    {
        "metadata": {"uid": "u-other", "namespace": "ml", "name": "serve-0"},
        "spec": {
            "initContainers": [
                {
                    "name": "vram-enforcer",
                    "env": [{"name": LIMITS_ENV, "value": json.dumps({"serve": 8 * GiB})}],
                }
            ],
            "containers": [{"name": "serve"}],
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "serve", "containerID": f"containerd://{OTHER}", "state": {"running": {}}}
            ],
        },
    },
)
FETCHING, SERVING = ProcessKey(50, 500050), ProcessKey(70, 500070)


class Asked:
    """The sidecar's source, as far as reclaims go: what the agent asked of this pod."""

    def __init__(self, reclaims: dict[str, Any]) -> None:
        self.reclaims = reclaims


def test_a_borrowing_init_container_is_a_tenant_and_its_sidecar_applies_its_reclaim(
    tmp_path: Path,
) -> None:
    # 16Gi: fetch holds 10Gi (6Gi above its request), the neighbour 2Gi of its 8Gi.
    gpu = Device(0, "GPU-0", "H100", 16 * GiB, 12 * GiB)
    usage = (ProcessUsage(FETCHING, "GPU-0", 10 * GiB), ProcessUsage(SERVING, "GPU-0", 2 * GiB))
    declares = Declares("vram-enforcer.io/vram")
    found = tenants(
        [
            (p, pod_owed(p, declares, opted_in={"ml"}, basis=None, claims=None))
            for p in (POD, NEIGHBOUR)
        ],
        {},
    )
    tenant = found.by_unit["ml/train-0/fetch"]
    assert (tenant.request, tenant.ceiling, tenant.ids) == (4 * GiB, 12 * GiB, {FETCH})
    lending = decide(Sample(0.0, (gpu,), usage), {FETCHING: FETCH, SERVING: OTHER}, found, 2 * GiB)
    assert set(lending.reclaims) == {FETCH}  # asked of the init container, by its ID

    attributor = ContainerAttributor(
        ProcFs(copy_proc_fixture("pod", tmp_path / "proc")),
        cast(Any, SimpleNamespace(pod=POD, error=None, refresh=lambda: None)),
        PodTerms(Declaration({"fetch": 4 * GiB}, {"fetch": 12 * GiB})),
        want_init=False,
        lending=lambda: True,
    )
    units = attributor.attribute(Sample(0.0, (gpu,), usage[:1]))  # the sidecar sees its own
    assert {u.name: (u.used_bytes, u.limit_bytes) for u in units}["fetch"] == (10 * GiB, 12 * GiB)
    gpus = views((gpu,), units, attributor.requests)
    asked = AgentReclaims(cast(AgentLink, Asked(dict(lending.reclaims))), attributor)(gpus)
    assert asked == {"fetch": lending.reclaims[FETCH]}
