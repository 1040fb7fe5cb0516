"""The agent's reclaims: each container's request, ceiling and priority from its pod, and
who is asked to give memory back on which GPU (pure)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from enforcer.core.declaration import SIDECAR, Declares
from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.lending import ELSEWHERE, Tenant, Tenants, decide, tenants
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.owed import PodOwed, owed, pod_owed
from enforcer.core.payloads import Pod

RES = "vram-enforcer.io/vram"
# The namespaces that opted in: every one here, so that what the sidecars carry is read
# (test_declaration.py has a namespace that did not).
OPTED_IN = frozenset({"ml", "web", "x"})


def pod(
    name: str,
    namespace: str,
    request: str | None,
    cid: str,
    ceiling: int | None = None,
    priority: int | None = None,
    sidecar_env: list[dict[str, Any]] | None = None,
) -> Pod:
    """A running pod of one container `c` (ID `cid`), with our sidecar, as the API has it."""
    limits = {} if request is None else {RES: request}
    env = sidecar_env or []
    if ceiling is not None:
        env.append({"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps({"c": ceiling})})
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}],
        "initContainers": [{"name": SIDECAR, "image": "y", "env": env}],
    }
    if priority is not None:
        spec["priority"] = priority
    status = {"containerStatuses": [{"name": "c", "containerID": f"containerd://{cid}"}]}
    meta = {"name": name, "namespace": namespace, "uid": f"uid-{name}"}
    return {"metadata": meta, "spec": spec, "status": status}  # type: ignore[typeddict-item]


def read(
    pods: Iterable[Pod],
    basis: int | None = None,
    allocated: Mapping[str, Allocations] | None = None,
) -> list[tuple[Pod, PodOwed]]:
    """Each pod and what it is owed, as the lender reads them; with DRA, `allocated`: what
    each pod's claims give it (by UID), as `dra.allocations` would have read them."""
    found = []
    for p in pods:
        mine = pod_owed(p, Declares(RES), opted_in=OPTED_IN, basis=basis, claims=None)
        given = (allocated or {}).get(p["metadata"]["uid"])
        if given is not None:
            mine = dataclasses.replace(mine, owed=owed(mine.declared, given, basis))
        found.append((p, mine))
    return found


def test_each_declaring_container_is_a_tenant_with_its_request_ceiling_and_priority() -> None:
    found = tenants(
        read(
            [
                pod("a", "ml", "4Gi", "a" * 64, ceiling=16 * GiB, priority=100),
                pod("b", "ml", "8Gi", "b" * 64),
                pod("cpu", "ml", None, "c" * 64),  # declares nothing: not a tenant
                # A ceiling below the request (not the webhook's) lends nothing.
                pod("d", "web", "8Gi", "d" * 64, ceiling=GiB),
                # Malformed: no borrowing, never an error.
                pod(
                    "e",
                    "web",
                    "1Gi",
                    "e" * 64,
                    sidecar_env=[{"name": "VRAM_ENFORCER_CEILINGS", "value": "{oops"}],
                ),
            ]
        ),
        {},
    ).all
    assert found == (
        Tenant("ml/a/c", "ml", 4 * GiB, 16 * GiB, 100, frozenset({"a" * 64})),
        Tenant("ml/b/c", "ml", 8 * GiB, 8 * GiB, 0, frozenset({"b" * 64})),
        Tenant("web/d/c", "web", 8 * GiB, 8 * GiB, 0, frozenset({"d" * 64})),
        Tenant("web/e/c", "web", GiB, GiB, 0, frozenset({"e" * 64})),
    )


def usage(pid: int, used: int) -> ProcessUsage:
    return ProcessUsage(ProcessKey(pid, pid), "GPU-0", used * GiB)


def sample(*procs: ProcessUsage, total: int = 40, other: int = 0) -> Sample:
    used = sum(p.used_bytes or 0 for p in procs) + other * GiB
    return Sample(1.0, (Device(0, "GPU-0", "H100", total * GiB, used),), procs)


BURSTER, GROWER, STRANGER = ("a" * 64, "b" * 64, "s" * 64)


def tenant(unit: str, request: int, ceiling: int, cid: str, priority: int = 0) -> Tenant:
    """A running container's tenant, its namespace the unit's first part."""
    return Tenant(unit, unit.split("/", 1)[0], request, ceiling, priority, frozenset({cid}))


LISTED = (
    tenant("ml/a/c", 4 * GiB, 24 * GiB, BURSTER),
    tenant("ml/b/c", 16 * GiB, 16 * GiB, GROWER),
    tenant("web/s/c", 8 * GiB, 8 * GiB, STRANGER),
)
FOUND = Tenants.of(LISTED)
CONTAINERS = {
    ProcessKey(1, 1): BURSTER,
    ProcessKey(2, 2): GROWER,
    ProcessKey(3, 3): STRANGER,
    ProcessKey(4, 4): BURSTER,
}


def test_a_borrower_is_asked_only_once_the_gpu_cannot_honour_the_others_requests() -> None:
    # 40 GiB: the borrower holds 16 (12 lent), the grower 4 of its 16, the stranger 8 of 8:
    # 12 free, the grower is owed 12 -> with a 2 GiB watermark, 2 short.
    roomy = decide(
        sample(usage(1, 10), usage(2, 4), usage(3, 8), usage(4, 2)), CONTAINERS, FOUND, 0
    )
    assert roomy.reclaims == {} and roomy.gpus[0].free == 16 * GiB
    short = decide(
        sample(usage(1, 12), usage(2, 4), usage(3, 8), usage(4, 4)), CONTAINERS, FOUND, 2 * GiB
    )
    (asked,) = short.reclaims.values()
    assert list(short.reclaims) == [BURSTER]
    assert asked.victim.unit == "ml/a/c" and asked.victim.borrowed == 12 * GiB
    assert asked.shortfall == 2 * GiB and asked.owed_to == ("ml/b/c",)
    # Told to the pod of its processes, and no other.
    assert short.victims == {BURSTER: frozenset({ProcessKey(1, 1), ProcessKey(4, 4)})}


def test_who_needed_the_memory_is_named_only_within_the_victims_namespace() -> None:
    stranger = Tenants.of((*LISTED[:2], tenant("web/s/c", 16 * GiB, 16 * GiB, STRANGER)))
    short = decide(sample(usage(1, 16), usage(2, 4), usage(3, 4)), CONTAINERS, stranger, 0)
    (asked,) = short.reclaims.values()
    assert asked.owed_to == ("ml/b/c", ELSEWHERE)


def test_with_no_ceiling_on_the_node_nothing_is_decided() -> None:
    plain = Tenants.of(dataclasses.replace(t, ceiling=t.request) for t in LISTED)
    full = decide(sample(usage(1, 30), usage(2, 4), usage(3, 6)), CONTAINERS, plain, 2 * GiB)
    assert full.reclaims == {} and full.gpus == ()


def test_the_lowest_priority_borrower_goes_first() -> None:
    two = Tenants.of(
        (
            LISTED[0],
            tenant("ml/b/c", 4 * GiB, 24 * GiB, GROWER, -5),
            tenant("web/s/c", 16 * GiB, 16 * GiB, STRANGER),
        )
    )
    # Both lend 8; the stranger is owed 6 of 16, 2 are free: 4 short, which one covers.
    short = decide(sample(usage(1, 12), usage(2, 12), usage(3, 10), total=36), CONTAINERS, two, 0)
    assert list(short.reclaims) == [GROWER]


def test_a_ceiling_is_read_from_the_sidecars_environment_never_from_an_annotation() -> None:
    """The annotation can be patched after admission (where no policy refuses it); the
    sidecar's environment cannot: the webhook wrote it there."""
    patched = pod("a", "ml", "4Gi", "a" * 64)
    patched["metadata"]["annotations"] = {"vram-enforcer.io/vram-ceiling": "80Gi"}
    assert tenants(read([patched]), {}).all[0].ceiling == 4 * GiB
    # Only the container named as our sidecar counts, not a look-alike of the workload's.
    other = pod("b", "ml", "4Gi", "b" * 64)
    other["spec"]["containers"][0]["env"] = [
        {"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps({"c": 80 * GiB})}
    ]
    assert tenants(read([other]), {}).all[0].ceiling == 4 * GiB


def test_a_pod_only_reported_on_borrows_nothing_above_its_request() -> None:
    """A pod in `warn` or a dry run is never made to give back what it borrowed: lent it,
    its neighbours would go without their requests. Its ceiling (in bytes or a portion) is
    its request; read only where the namespace opted in, as its ceilings are."""
    dry = [{"name": "VRAM_ENFORCER_DRY_RUN", "value": "true"}]
    warn = [{"name": "VRAM_ENFORCER_ACTION", "value": "warn"}]
    kai = [
        {"name": "VRAM_ENFORCER_LIMITS", "value": "{}"},
        {
            "name": "VRAM_ENFORCER_PORTIONS",
            "value": json.dumps({"c": {"request": "0.25", "ceiling": "0.5"}}),
        },
        *dry,
    ]
    found = tenants(
        read(
            [
                pod("d", "ml", "4Gi", "d" * 64, ceiling=16 * GiB, sidecar_env=list(dry)),
                pod("w", "ml", "4Gi", "e" * 64, ceiling=16 * GiB, sidecar_env=list(warn)),
                pod("k", "ml", None, "f" * 64, sidecar_env=kai),
                pod("t", "ml", "4Gi", "a" * 64, ceiling=16 * GiB),  # enforced: it borrows
            ],
            80 * GiB,
        ),
        {},
    )
    assert [(t.unit, t.request, t.ceiling) for t in found.all] == [
        ("ml/d/c", 4 * GiB, 4 * GiB),
        ("ml/w/c", 4 * GiB, 4 * GiB),
        ("ml/k/c", 20 * GiB, 20 * GiB),
        ("ml/t/c", 4 * GiB, 16 * GiB),
    ]


def test_a_kai_fraction_is_a_tenant_once_its_gpus_memory_is_known() -> None:
    """A pod that declares by KAI's annotations has no resource of ours: its share is what
    the webhook froze into its sidecar's environment, a portion counted against one GPU."""
    frozen = [
        {"name": "VRAM_ENFORCER_LIMITS", "value": "{}"},
        {
            "name": "VRAM_ENFORCER_PORTIONS",
            "value": json.dumps({"c": {"request": "0.25", "ceiling": "0.5"}}),
        },
    ]
    kai = pod("k", "ml", None, "f" * 64, sidecar_env=frozen)
    assert tenants(read([kai], 80 * GiB), {}).all == (
        tenant("ml/k/c", 20 * GiB, 40 * GiB, "f" * 64),
    )
    # Not counted before a GPU is known.
    assert tenants(read([kai]), {}).all == ()


def test_a_pod_whose_declaration_cannot_be_read_is_its_own_loss_and_is_said() -> None:
    """Issue 35, item 8: one pod's sidecar environment that no webhook wrote (`[` nested
    100,000 deep, a portion past decimal's range) made every pass raise, for the node. It
    is that pod's alone: it declares nothing, or borrows nothing, and says why."""
    deep = [{"name": "VRAM_ENFORCER_LIMITS", "value": "[" * 100_000}]
    huge = [
        {"name": "VRAM_ENFORCER_LIMITS", "value": "{}"},
        {"name": "VRAM_ENFORCER_PORTIONS", "value": '{"c": {"request": "1E+999999"}}'},
    ]
    spoiled = [{"name": "VRAM_ENFORCER_CEILINGS", "value": "[" * 100_000}]
    found = tenants(
        read(
            [
                pod("a", "ml", "4Gi", "a" * 64, ceiling=16 * GiB),
                pod("deep", "x", None, "d" * 64, sidecar_env=deep),
                pod("huge", "x", None, "e" * 64, sidecar_env=huge),
                pod("spoiled", "x", "2Gi", "f" * 64, sidecar_env=spoiled),
            ],
            80 * GiB,
        ),
        {},
    )
    assert found.all == (
        tenant("ml/a/c", 4 * GiB, 16 * GiB, "a" * 64),
        tenant("x/spoiled/c", 2 * GiB, 2 * GiB, "f" * 64),
    )
    assert sorted(found.unread) == ["x/deep", "x/huge", "x/spoiled"]
    assert found.unread["x/deep"].startswith("declares nothing: VRAM_ENFORCER_LIMITS: ")
    assert "is not a portion of a GPU" in found.unread["x/huge"]
    assert found.unread["x/spoiled"].startswith("borrows nothing: VRAM_ENFORCER_CEILINGS: ")


# --- DRA: each allocation is a tenant on its GPU -----------------------------------------

DRA_ENV = [{"name": "VRAM_ENFORCER_LIMITS_FROM", "value": "dra"}]


def dra_pod(name: str, cid: str | None, ceiling: int | None = None) -> Pod:
    """A DRA pod of one container `c` (running as `cid`; None: not started), declaring
    nothing of its own: its claim is its request."""
    env = [*DRA_ENV]
    if ceiling is not None:
        env.append({"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps({"c": ceiling})})
    made = pod(name, "ml", None, cid or "", sidecar_env=env)
    if cid is None:
        made["status"] = {}
    return made


def on(gpu: str, size: int, *containers: str) -> Allocations:
    return Allocations((GpuUnit(gpu, containers, size, ()),))


def test_each_dra_allocation_is_a_tenant_on_its_gpu_started_or_not() -> None:
    """The claim is the request; the sidecar's ceiling raises it only where the container
    has that one allocation. A container not started yet is owed its claim already: DRA
    says which GPU it is on."""
    pods = [
        dra_pod("burst", "a" * 64, ceiling=24 * GiB),
        dra_pod("new", None),
        dra_pod("wide", "d" * 64, ceiling=24 * GiB),
    ]
    wide = Allocations(
        (GpuUnit("GPU-0", ("c",), 4 * GiB, ()), GpuUnit("GPU-1", ("c",), 4 * GiB, ()))
    )
    allocated = {
        "uid-burst": on("GPU-0", 4 * GiB, "c"),
        "uid-new": on("GPU-0", 16 * GiB, "c"),
        "uid-wide": wide,
    }
    assert tenants(read(pods, None, allocated), {}).all == (
        Tenant(
            "ml/burst/c@GPU-0", "ml", 4 * GiB, 24 * GiB, 0, frozenset({"a" * 64}), "GPU-0", True
        ),
        Tenant("ml/new/c@GPU-0", "ml", 16 * GiB, 16 * GiB, 0, frozenset(), "GPU-0", True),
        # on two GPUs: which one its ceiling is for would be a guess; it borrows nowhere
        Tenant("ml/wide/c@GPU-0", "ml", 4 * GiB, 4 * GiB, 0, frozenset({"d" * 64}), "GPU-0", True),
        Tenant("ml/wide/c@GPU-1", "ml", 4 * GiB, 4 * GiB, 0, frozenset({"d" * 64}), "GPU-1", True),
    )
    # Claims not read yet: nobody.
    assert tenants(read(pods), {}).all == ()
    # A pod that has finished is owed nothing, whatever its claims were last read to hold.
    pods[1]["status"] = {"phase": "Succeeded"}
    found = tenants(read(pods, None, allocated), {})
    assert [t.unit for t in found.all] == [
        "ml/burst/c@GPU-0",
        "ml/wide/c@GPU-0",
        "ml/wide/c@GPU-1",
    ]


def test_a_dra_borrower_is_reclaimed_when_the_scheduler_hands_out_what_it_borrowed() -> None:
    """40 GiB: the borrower's claim is 4 GiB (ceiling 24) and it holds 20 there (and 2 on
    another GPU, which is not its claim's); a pod owed 16 GiB is placed before it starts:
    20 free, 18 needed with the watermark. A second, owed 4 GiB: 22 needed, 2 short."""
    borrower = Tenant(
        "ml/b/c@GPU-0", "ml", 4 * GiB, 24 * GiB, 0, frozenset({BURSTER}), "GPU-0", True
    )
    first = Tenant("ml/n/c@GPU-0", "ml", 16 * GiB, 16 * GiB, 0, frozenset(), "GPU-0", True)
    second = Tenant("web/m/c@GPU-0", "web", 4 * GiB, 4 * GiB, 0, frozenset(), "GPU-0", True)
    devices = (
        Device(0, "GPU-0", "H100", 40 * GiB, 20 * GiB),
        Device(1, "GPU-1", "H100", 40 * GiB, 2 * GiB),
    )
    seen = Sample(1.0, devices, (usage(1, 20), ProcessUsage(ProcessKey(1, 1), "GPU-1", 2 * GiB)))
    containers = {ProcessKey(1, 1): BURSTER}
    roomy = decide(seen, containers, Tenants.of((borrower, first)), 2 * GiB)
    assert roomy.reclaims == {}
    (gpu,) = [g for g in roomy.gpus if g.uuid == "GPU-0"]
    assert (gpu.free, gpu.requested, gpu.shares[0].borrowed) == (20 * GiB, 20 * GiB, 16 * GiB)
    short = decide(seen, containers, Tenants.of((borrower, first, second)), 2 * GiB)
    (asked,) = short.reclaims.values()
    assert list(short.reclaims) == [BURSTER] and asked.gpu == "GPU-0"
    assert (asked.shortfall, asked.victim.borrowed) == (2 * GiB, 16 * GiB)
    # The GPU is in the reason already: the owed are named by container, in its namespace.
    assert asked.owed_to == ("ml/n/c", ELSEWHERE)
    assert short.victims == {BURSTER: frozenset({ProcessKey(1, 1)})}


def test_a_container_the_kubelet_gave_a_gpu_is_owed_its_request_there_before_it_starts() -> None:
    """Node mode, with a device plugin: the kubelet's pod resources say which GPU each
    container got. A pod owed 16 GiB there, not started yet, makes a borrower give back
    what the GPU can no longer lend: 40 GiB, the borrower holds 26 of a 4 GiB request, 14
    are free, and 16 plus the 2 GiB watermark are needed."""
    borrower = pod("b", "ml", "4Gi", "a" * 64, ceiling=32 * GiB)
    newcomer = pod("n", "ml", "16Gi", "")
    newcomer["status"] = {}  # admitted by the kubelet, its container not created yet
    seen = Sample(1.0, (Device(0, "GPU-0", "H100", 40 * GiB, 26 * GiB),), (usage(1, 26),))
    containers = {ProcessKey(1, 1): "a" * 64}
    # Without the kubelet's word, the newcomer uses no GPU yet and is owed nothing anywhere.
    unknown = tenants(read([borrower, newcomer]), {})
    assert [t.unit for t in unknown.all] == ["ml/b/c"]
    assert decide(seen, containers, unknown, 2 * GiB).reclaims == {}
    gave = {("ml", "n", "c"): "GPU-0", ("ml", "b", "c"): "GPU-0"}
    known = tenants(read([borrower, newcomer]), gave)
    assert known.all[1] == Tenant("ml/n/c", "ml", 16 * GiB, 16 * GiB, 0, frozenset(), "GPU-0")
    (asked,) = decide(seen, containers, known, 2 * GiB).reclaims.values()
    assert (asked.owed_to, asked.shortfall, asked.victim.borrowed) == (
        ("ml/n/c",),
        4 * GiB,
        22 * GiB,
    )


def test_a_container_seen_on_another_gpu_than_the_kubelet_gave_is_counted_as_nvml_shows_it() -> (
    None
):
    """A container can still reach another GPU (NVIDIA_VISIBLE_DEVICES in its own spec).
    Owed its request on the GPU it was given and holding memory elsewhere, it would hold
    memory no reclaim could take back: once seen elsewhere it counts as NVML shows it, and
    lends on that GPU what it holds above its request."""
    sly = Tenant("ml/s/c", "ml", 4 * GiB, 32 * GiB, 0, frozenset({BURSTER}), "GPU-0")
    owed = Tenant("ml/o/c", "ml", 30 * GiB, 30 * GiB, 0, frozenset({GROWER}), "GPU-1")
    devices = (
        Device(0, "GPU-0", "H100", 40 * GiB, 0),
        Device(1, "GPU-1", "H100", 40 * GiB, 20 * GiB),
    )
    on_other = ProcessUsage(ProcessKey(1, 1), "GPU-1", 20 * GiB)
    seen = Sample(1.0, devices, (on_other,))
    found = decide(seen, {ProcessKey(1, 1): BURSTER}, Tenants.of((sly, owed)), 2 * GiB)
    (gpu1,) = [g for g in found.gpus if g.uuid == "GPU-1"]
    assert {s.unit: s.borrowed for s in gpu1.shares} == {"ml/s/c": 16 * GiB, "ml/o/c": 0}
    (asked,) = found.reclaims.values()  # 30 owed + 2 > 20 free
    assert asked.victim.unit == "ml/s/c" and asked.gpu == "GPU-1"
    # Confined (DRA: the sidecar holds it to 0 on GPU-1), the same memory is no one's.
    confined = dataclasses.replace(sly, confined=True)
    found = decide(seen, {ProcessKey(1, 1): BURSTER}, Tenants.of((confined, owed)), 2 * GiB)
    assert found.reclaims == {}
