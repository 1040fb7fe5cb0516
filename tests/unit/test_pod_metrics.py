"""Each enforced container's series, as the agent works them out for its one scrape target:
from NVML's processes, their containers, the pods and the lender's tenants; never a
sidecar's, never a pod the webhook did not enforce."""

from __future__ import annotations

from typing import Any, cast

from enforcer.core.declaration import ENFORCED, SIDECAR
from enforcer.core.lending import Tenant, Tenants
from enforcer.core.model import Activity, Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod_metrics import Named, OnGpu, container_series, enforced_containers
from enforcer.core.reclaim import Gpu, Share

TRAINER, HELPER, SIDE, OTHER = "a" * 64, "b" * 64, "c" * 64, "d" * 64
P1, P2, P3, P4 = (ProcessKey(pid, pid * 10) for pid in (101, 102, 103, 104))


def pod(name: str, enforced: bool, namespace: str = "ml", **containers: str) -> Pod:
    statuses = [{"name": n, "containerID": f"containerd://{cid}"} for n, cid in containers.items()]
    doc: dict[str, Any] = {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "uid": name,
            "labels": {ENFORCED: "true"} if enforced else {},
        },
        "spec": {"containers": [{"name": n} for n in containers]},
        "status": {"containerStatuses": statuses},
    }
    return cast(Pod, doc)


def test_only_the_containers_of_injected_pods_are_named_never_their_sidecar() -> None:
    """A pod of a namespace the webhook does not mutate that carries the label and a
    container under the sidecar's name names no series (issue 42, item 11)."""
    pods = [
        pod("train", True, trainer=TRAINER, helper=HELPER, **{SIDECAR: SIDE}),
        pod("plain", False, web=OTHER),
        pod("forged", True, "elsewhere", web="e" * 64, **{SIDECAR: "f" * 64}),
    ]
    assert enforced_containers(pods, frozenset({"ml"})) == {
        TRAINER: Named("ml", "train", "trainer"),
        HELPER: Named("ml", "train", "helper"),
    }


def test_usage_per_container_and_gpu_with_its_request_ceiling_and_what_it_borrows() -> None:
    """trainer declares 4Gi with a ceiling of 12Gi and holds 6Gi on GPU-0 and 1Gi on GPU-1;
    helper declares nothing; a process of another pod and one of the sidecar count for no
    named container."""
    sample = Sample(
        0.0,
        (Device(0, "GPU-0", "H100", 80 * GiB, 0),),
        (
            ProcessUsage(P1, "GPU-0", 6 * GiB, (), Activity(40, 10)),
            ProcessUsage(P1, "GPU-1", 1 * GiB, (), None),
            ProcessUsage(P2, "GPU-0", 2 * GiB, (), Activity(5, 5)),
            ProcessUsage(P3, "GPU-0", 9 * GiB),
            ProcessUsage(P4, "GPU-0", GiB),
        ),
    )
    containers = {P1: TRAINER, P2: HELPER, P3: OTHER, P4: SIDE}
    named = {TRAINER: Named("ml", "train", "trainer"), HELPER: Named("ml", "train", "helper")}
    owed = Tenants.of(
        [Tenant("ml/train/trainer", "ml", 4 * GiB, 12 * GiB, 0, frozenset({TRAINER}))]
    )
    lent = [
        Gpu("GPU-0", 80 * GiB, 18 * GiB, (Share("ml/train/trainer", 4 * GiB, 12 * GiB, 6 * GiB),))
    ]
    helper, trainer = container_series(sample, containers, named, owed, lent)
    assert (trainer.used, trainer.limit, trainer.ceiling) == (7 * GiB, 4 * GiB, 12 * GiB)
    assert trainer.gpus == (
        OnGpu("GPU-0", 6 * GiB, Activity(40, 10), None, 2 * GiB),
        OnGpu("GPU-1", GiB, None),
    )
    assert trainer.processes == ((101, "GPU-0", 6 * GiB), (101, "GPU-1", GiB))
    assert (helper.used, helper.limit, helper.ceiling) == (2 * GiB, None, None)
    # Before the lender has read the pods, usage alone.
    assert container_series(sample, containers, named, None)[1].limit is None


def test_a_dra_allocation_is_a_limit_on_its_gpu_shown_while_unused() -> None:
    owed = Tenants.of(
        [
            Tenant(
                "ml/train/trainer@GPU-1",
                "ml",
                10 * GiB,
                16 * GiB,
                0,
                frozenset({TRAINER}),
                "GPU-1",
                confined=True,
            )
        ]
    )
    sample = Sample(0.0, (), (ProcessUsage(P1, "GPU-0", GiB),))
    (trainer,) = container_series(
        sample, {P1: TRAINER}, {TRAINER: Named("ml", "train", "trainer")}, owed
    )
    assert trainer.limit is None  # per GPU, not a sum
    assert trainer.ceiling == 16 * GiB  # above its one claim, which it may borrow over
    assert trainer.gpus == (OnGpu("GPU-0", GiB, None), OnGpu("GPU-1", 0, None, 10 * GiB))
