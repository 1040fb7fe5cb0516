"""One ResourceClaim, several pods (issue 35): the scheduler placed its allocation once, so
it is enforced once. Each pod that uses it is held to its part (1/n of it), in the sidecar's
view, the agent's hard limits and the agent's lending alike (pure)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.declaration import SIDECAR, Declares
from enforcer.core.dra import Allocations, DraObjects, DraSettings, allocations, claim_users
from enforcer.core.hard_limits import targets
from enforcer.core.lending import Tenant, tenants
from enforcer.core.model import GiB
from enforcer.core.owed import PodOwed, node_claims, pod_owed
from enforcer.core.payloads import Pod

SLICE = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "dra" / "slice.json").read_text()
)
GPUS = {
    "gpu-0": "GPU-00000000-aaaa-bbbb-cccc-000000000000",
    "gpu-1": "GPU-00000001-aaaa-bbbb-cccc-000000000000",
}
NVIDIA = DraSettings()
RES = "vram-enforcer.io/vram"

Doc = dict[str, Any]


def uid(name: str) -> str:
    """The pod's UID, shaped as the API server makes them (the kubelet names cgroups so)."""
    return f"{zlib.crc32(name.encode()):08x}-0000-4000-8000-000000000000"


def cid(name: str) -> str:
    """The ID its container `c` runs as."""
    return f"{zlib.crc32(name.encode()):064x}"


def claim(name: str, size: int, *reserved: str, device: str = "gpu-0") -> Doc:
    """A claim of `size` bytes on `device`, reserved for the pods named `reserved`."""
    result = {
        "request": "vram",
        "driver": "gpu.nvidia.com",
        "pool": "gpu-node",
        "device": device,
        "consumedCapacity": {"memory": str(size)},
    }
    return {
        "metadata": {"name": name, "namespace": "ml"},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": uid(p)} for p in reserved],
        },
    }


def pod(name: str, claim_name: str, phase: str = "Running") -> Pod:
    """A pod whose container `c` uses the claim by `resourceClaimName`, under our sidecar."""
    sidecar = {"name": SIDECAR, "env": [{"name": "VRAM_ENFORCER_LIMITS_FROM", "value": "dra"}]}
    spec = {
        "resourceClaims": [{"name": "vram", "resourceClaimName": claim_name}],
        "containers": [{"name": "c", "resources": {"claims": [{"name": "vram"}]}}],
        "initContainers": [sidecar],
    }
    status = {
        "phase": phase,
        "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid(name)}"}],
    }
    meta = {"name": name, "namespace": "ml", "uid": uid(name), "resourceVersion": "1"}
    return {"metadata": meta, "spec": spec, "status": status}  # type: ignore[typeddict-item]


def by_name(*claims: Doc) -> dict[str, Doc]:
    return {c["metadata"]["name"]: c for c in claims}


def node(pods: list[Pod], reads: dict[str, list[Doc]]) -> dict[str, PodOwed]:
    """What the agent makes of its node: what each pod is owed (by UID), from each pod's own
    read of its claims (`reads`, by pod name) and the node's pods."""
    objects = {uid(name): DraObjects(by_name(*read), (SLICE,)) for name, read in reads.items()}
    claims = node_claims(pods, objects, NVIDIA)
    return {
        p["metadata"]["uid"]: pod_owed(
            p, Declares(RES), opted_in={"ml"}, basis=None, claims=claims[p["metadata"]["uid"]]
        )
        for p in pods
    }


def limits(found: Allocations | PodOwed) -> list[int]:
    if isinstance(found, PodOwed):
        return [o.ceiling for o in found.owed.units]
    return [u.limit_bytes for u in found.units]


def lent(pods: list[Pod], found: dict[str, PodOwed]) -> tuple[Tenant, ...]:
    """The lender's tenants of the node."""
    return tenants([(p, found[p["metadata"]["uid"]]) for p in pods], {}).all


def test_four_pods_that_reserve_one_claim_are_owed_its_allocation_once() -> None:
    """The review's case: four pods name one 10Gi claim. Each is held to a quarter of it,
    in the lender, on its pod cgroup and in its sidecar's own view, and told why."""
    names = ["a", "b", "c", "d"]
    shared = claim("shared", 10 * GiB, *names)
    pods = [pod(n, "shared") for n in names]
    found = node(pods, {n: [shared] for n in names})
    owed = lent(pods, found)
    assert [t.request for t in owed] == [10 * GiB // 4] * 4
    assert sum(t.request for t in owed) == 10 * GiB
    dirs = {uid(n): f"/k/pod-{n}" for n in names}
    each = targets(found.values(), dirs, {})
    assert [t.gpu_limits for t in each.values()] == [((GPUS["gpu-0"], 10 * GiB // 4),)] * 4
    assert sum(limit for t in each.values() for _, limit in t.gpu_limits) == 10 * GiB
    # The sidecar reads its own pod's claim alone: reservedFor is enough to say the same.
    alone = allocations(pods[0], by_name(shared), [SLICE], NVIDIA, {})
    assert limits(alone) == [10 * GiB // 4]
    (why,) = alone.problems
    assert "'shared' is used by 4 pods" in why and "1/4 of it, 2.50 GiB of 10.00 GiB" in why


def test_a_claim_reserved_by_one_pod_is_unchanged() -> None:
    mine = claim("mine", 10 * GiB, "a")
    found = node([pod("a", "mine")], {"a": [mine]})[uid("a")]
    assert limits(found) == [10 * GiB] and found.owed.problems == ()
    # A read made before its reservation (the pod is not listed yet) counts the pod too.
    early = allocations(pod("a", "mine"), by_name(claim("mine", GiB)), [SLICE], NVIDIA, {})
    assert limits(early) == [GiB]


def test_pods_of_the_claim_that_are_not_on_this_node_still_count() -> None:
    """reservedFor lists a pod that this node does not run (one on its way here, or one
    whose reservation the controller has not dropped yet): its part is not handed to the
    pods here, which are owed half of the allocation between them."""
    shared = claim("shared", 8 * GiB, "a", "b", "elsewhere", "gone")
    pods = [pod("a", "shared"), pod("b", "shared")]
    found = node(pods, {"a": [shared], "b": [shared]})
    assert [limits(f) for f in found.values()] == [[2 * GiB], [2 * GiB]]
    assert sum(t.request for t in lent(pods, found)) == 4 * GiB


def test_the_node_joins_reads_of_different_ages_and_its_own_pods() -> None:
    """Each pod's claim was read when that pod changed: a's read predates b and c. The
    node's view joins every read and the pods that name the claim (c, not in any read
    yet), so a is not left holding the whole allocation."""
    pods = [pod("a", "shared"), pod("b", "shared"), pod("c", "shared")]
    reads = {
        "a": [claim("shared", 9 * GiB, "a")],
        "b": [claim("shared", 9 * GiB, "a", "b")],
        "c": [claim("shared", 9 * GiB, "a", "b")],
    }
    assert [limits(f) for f in node(pods, reads).values()] == [[3 * GiB]] * 3
    # A pod that has finished uses the claim no more, unless its reservation is still there.
    done = [*pods[:2], pod("c", "shared", phase="Succeeded")]
    assert [limits(f) for f in node(done, reads).values()][:2] == [[9 * GiB // 2]] * 2
    users = claim_users(done, [DraObjects(by_name(claim("shared", GiB, "c")))])
    assert users[("ml", "shared")] == {uid("a"), uid("b"), uid("c")}


def test_a_claim_reserved_for_something_other_than_pods_is_held_to_zero() -> None:
    """A workload reservation names no pods: how many share the allocation is unknown."""
    odd = claim("odd", 10 * GiB)
    odd["status"]["reservedFor"] = [
        {"apiGroup": "scheduling.k8s.io", "resource": "workloads", "name": "w", "uid": "w1"}
    ]
    found = allocations(pod("a", "odd"), {"odd": odd}, [SLICE], NVIDIA, {})
    assert limits(found) == [0] and found.unresolved == frozenset()
    assert "reserved for something other than pods" in found.problems[0]


# --- the property: never owed more than was placed ----------------------------------------

NAMES = [f"p{i}" for i in range(6)]


@st.composite
def nodes(draw: st.DrawFn) -> tuple[list[Pod], dict[str, list[Doc]], dict[str, int]]:
    """Pods of a node sharing claims; each claim reserved for some of them and for pods
    elsewhere; each pod's read of its claim of any age (a subset of the reservations)."""
    sizes = draw(st.lists(st.integers(0, 80 * GiB), min_size=1, max_size=3))
    devices = [draw(st.sampled_from(sorted(GPUS))) for _ in sizes]
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True))
    uses = {n: draw(st.integers(0, len(sizes) - 1)) for n in names}
    phases = {n: draw(st.sampled_from(["Running", "Pending", "Succeeded"])) for n in names}
    pods = [pod(n, f"claim-{uses[n]}", phases[n]) for n in names]
    reads: dict[str, list[Doc]] = {}
    for n in names:
        users = [m for m in names if uses[m] == uses[n]] + ["elsewhere"]
        seen = draw(st.lists(st.sampled_from(users), unique=True))
        reads[n] = [claim(f"claim-{uses[n]}", sizes[uses[n]], *seen, device=devices[uses[n]])]
    placed: dict[str, int] = {}
    for size, device in zip(sizes, devices, strict=True):
        placed[GPUS[device]] = placed.get(GPUS[device], 0) + size
    return pods, reads, placed


@given(nodes())
def test_what_a_node_owes_on_a_gpu_never_exceeds_what_was_placed_there(
    drawn: tuple[list[Pod], dict[str, list[Doc]], dict[str, int]],
) -> None:
    pods, reads, placed = drawn
    found = node(pods, reads)
    owed: dict[str, int] = {}
    for t in lent(pods, found):
        assert t.gpu is not None
        owed[t.gpu] = owed.get(t.gpu, 0) + t.request
    assert all(owed[gpu] <= placed[gpu] for gpu in owed)
    # The pod cgroups' hard limits, of the pods that may still run (a finished one holds
    # nothing, and no longer counts as a user unless its reservation is still there).
    held: dict[str, int] = {}
    running = [found[p["metadata"]["uid"]] for p in pods if p["status"]["phase"] != "Succeeded"]
    dirs = {p.uid: f"/k/pod-{p.name}" for p in running}
    for target in targets(running, dirs, {}).values():
        for gpu, limit in target.gpu_limits:
            held[gpu] = held.get(gpu, 0) + limit
    assert all(held[gpu] <= placed[gpu] for gpu in held)
