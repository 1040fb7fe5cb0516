"""The agent's reclaims: each container's request, ceiling and priority from its pod, and
who is asked to give memory back on which GPU (pure)."""

from __future__ import annotations

import json
from typing import Any

from enforcer.core.declaration import SIDECAR
from enforcer.core.lending import ELSEWHERE, Tenant, decide, tenants
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod

RES = "vram-enforcer.io/vram"


def pod(name: str, namespace: str, request: str | None, cid: str, ceiling: int | None = None,
        priority: int | None = None, sidecar_env: list[dict[str, Any]] | None = None) -> Pod:  # fmt: skip
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


def test_each_declaring_container_is_a_tenant_with_its_request_ceiling_and_priority() -> None:
    found = tenants(
        [
            pod("a", "ml", "4Gi", "a" * 64, ceiling=16 * GiB, priority=100),
            pod("b", "ml", "8Gi", "b" * 64),
            pod("cpu", "ml", None, "c" * 64),  # declares nothing: not a tenant
            # A ceiling below the request (not the webhook's) lends nothing.
            pod("d", "web", "8Gi", "d" * 64, ceiling=GiB),
            # Malformed: no borrowing, never an error.
            pod("e", "web", "1Gi", "e" * 64,
                sidecar_env=[{"name": "VRAM_ENFORCER_CEILINGS", "value": "{oops"}]),
        ],
        RES,
        1,
        SIDECAR,
        None,
    )  # fmt: skip
    assert found == {
        "a" * 64: Tenant("ml/a/c", "ml", 4 * GiB, 16 * GiB, 100),
        "b" * 64: Tenant("ml/b/c", "ml", 8 * GiB, 8 * GiB, 0),
        "d" * 64: Tenant("web/d/c", "web", 8 * GiB, 8 * GiB, 0),
        "e" * 64: Tenant("web/e/c", "web", GiB, GiB, 0),
    }


def usage(pid: int, used: int) -> ProcessUsage:
    return ProcessUsage(ProcessKey(pid, pid), "GPU-0", used * GiB)


def sample(*procs: ProcessUsage, total: int = 40, other: int = 0) -> Sample:
    used = sum(p.used_bytes or 0 for p in procs) + other * GiB
    return Sample(1.0, (Device(0, "GPU-0", "H100", total * GiB, used),), procs)


BURSTER, GROWER, STRANGER = ("a" * 64, "b" * 64, "s" * 64)
FOUND = {
    BURSTER: Tenant("ml/a/c", "ml", 4 * GiB, 24 * GiB, 0),
    GROWER: Tenant("ml/b/c", "ml", 16 * GiB, 16 * GiB, 0),
    STRANGER: Tenant("web/s/c", "web", 8 * GiB, 8 * GiB, 0),
}
CONTAINERS = {ProcessKey(1, 1): BURSTER, ProcessKey(2, 2): GROWER, ProcessKey(3, 3): STRANGER,
              ProcessKey(4, 4): BURSTER}  # fmt: skip


def test_a_burster_is_asked_only_once_the_gpu_cannot_honour_the_others_requests() -> None:
    # 40 GiB: the burster holds 16 (12 lent), the grower 4 of its 16, the stranger 8 of 8:
    # 12 free, the grower is owed 12 -> with a 2 GiB watermark, 2 short.
    roomy = decide(sample(usage(1, 10), usage(2, 4), usage(3, 8), usage(4, 2)), CONTAINERS,
                   FOUND, 0)  # fmt: skip
    assert roomy.reclaims == {} and roomy.gpus[0].free == 16 * GiB
    short = decide(sample(usage(1, 12), usage(2, 4), usage(3, 8), usage(4, 4)), CONTAINERS,
                   FOUND, 2 * GiB)  # fmt: skip
    (asked,) = short.reclaims.values()
    assert list(short.reclaims) == [BURSTER]
    assert asked.victim.unit == "ml/a/c" and asked.victim.lent == 12 * GiB
    assert asked.shortfall == 2 * GiB and asked.owed_to == ("ml/b/c",)
    # Told to the pod of its processes, and no other.
    assert short.victims == {BURSTER: frozenset({ProcessKey(1, 1), ProcessKey(4, 4)})}


def test_who_needed_the_memory_is_named_only_within_the_victims_namespace() -> None:
    stranger = {**FOUND, STRANGER: Tenant("web/s/c", "web", 16 * GiB, 16 * GiB, 0)}
    short = decide(sample(usage(1, 16), usage(2, 4), usage(3, 4)), CONTAINERS, stranger, 0)
    (asked,) = short.reclaims.values()
    assert asked.owed_to == ("ml/b/c", ELSEWHERE)


def test_with_no_ceiling_on_the_node_nothing_is_decided() -> None:
    plain = {cid: Tenant(t.unit, t.namespace, t.request, t.request, 0) for cid, t in FOUND.items()}
    full = decide(sample(usage(1, 30), usage(2, 4), usage(3, 6)), CONTAINERS, plain, 2 * GiB)
    assert full.reclaims == {} and full.gpus == ()


def test_the_lowest_priority_borrower_goes_first() -> None:
    two = {**FOUND, GROWER: Tenant("ml/b/c", "ml", 4 * GiB, 24 * GiB, -5),
           STRANGER: Tenant("web/s/c", "web", 16 * GiB, 16 * GiB, 0)}  # fmt: skip
    # Both lend 8; the stranger is owed 6 of 16, 2 are free: 4 short, which one covers.
    short = decide(sample(usage(1, 12), usage(2, 12), usage(3, 10), total=36), CONTAINERS, two, 0)
    assert list(short.reclaims) == [GROWER]


def test_a_ceiling_is_read_from_the_sidecars_environment_never_from_an_annotation() -> None:
    """The annotation can be patched after admission (where no policy refuses it); the
    sidecar's environment cannot: the webhook wrote it there."""
    patched = pod("a", "ml", "4Gi", "a" * 64)
    patched["metadata"]["annotations"] = {"vram-enforcer.io/vram-ceiling": "80Gi"}
    assert tenants([patched], RES, 1, SIDECAR, None)["a" * 64].ceiling == 4 * GiB
    # Only the container named as our sidecar counts, not a look-alike of the workload's.
    other = pod("b", "ml", "4Gi", "b" * 64)
    other["spec"]["containers"][0]["env"] = [
        {"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps({"c": 80 * GiB})}
    ]
    assert tenants([other], RES, 1, SIDECAR, None)["b" * 64].ceiling == 4 * GiB


def test_a_kai_fraction_is_a_tenant_once_its_gpus_memory_is_known() -> None:
    """A pod that declares by KAI's annotations has no resource of ours: its share is what
    the webhook froze into its sidecar's environment, a portion counted against one GPU."""
    frozen = [{"name": "VRAM_ENFORCER_LIMITS", "value": "{}"},
              {"name": "VRAM_ENFORCER_PORTIONS",
               "value": json.dumps({"c": {"request": "0.25", "ceiling": "0.5"}})}]  # fmt: skip
    kai = pod("k", "ml", None, "f" * 64, sidecar_env=frozen)
    assert tenants([kai], RES, 1, SIDECAR, 80 * GiB) == {
        "f" * 64: Tenant("ml/k/c", "ml", 20 * GiB, 40 * GiB, 0)
    }
    assert tenants([kai], RES, 1, SIDECAR, None) == {}  # not counted before a GPU is known
