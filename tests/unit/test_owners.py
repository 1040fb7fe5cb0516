"""The workload a pod belongs to, read from what the pod carries, as its controllers write
it (kube-controller-manager's naming), and never more than one per pod whatever it says."""

from __future__ import annotations

from typing import Any, cast

import pytest

from enforcer.core.owners import Owner, cronjob_of, owner_of
from enforcer.core.payloads import Pod


def pod(name: str, *owners: dict[str, Any], **labels: str) -> Pod:
    meta = {"namespace": "ml", "name": name, "labels": labels, "ownerReferences": list(owners)}
    return cast(Pod, {"metadata": meta})


def ref(kind: str, name: object, controller: object = True) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": name,
        "uid": "u",
        "controller": controller,
    }


def test_a_deployments_replica_set_is_read_as_the_deployment() -> None:
    """The Deployment controller names its ReplicaSet `<deployment>-<pod-template-hash>` and
    puts the hash on the pods: without it, the name is the Deployment's."""
    made = pod(
        "serve-7d9f8b6c5-x2x8q",
        ref("ReplicaSet", "serve-7d9f8b6c5"),
        **{"pod-template-hash": "7d9f8b6c5"},
    )
    assert owner_of(made) == Owner("Deployment", "serve")


@pytest.mark.parametrize(
    ("replica_set", "labels"),
    [
        ("serve", {}),  # made by hand: no hash
        ("serve-abc", {"pod-template-hash": "xyz"}),  # a hash its name does not end with
        ("abc", {"pod-template-hash": "abc"}),  # nothing left once cut
    ],
)
def test_a_replica_set_that_is_not_a_deployments_stays_a_replica_set(
    replica_set: str, labels: dict[str, str]
) -> None:
    assert owner_of(pod("p", ref("ReplicaSet", replica_set), **labels)) == Owner(
        "ReplicaSet", replica_set
    )


@pytest.mark.parametrize("kind", ["StatefulSet", "DaemonSet", "Job", "RayCluster"])
def test_other_controllers_are_themselves(kind: str) -> None:
    assert owner_of(pod("p-0", ref(kind, "train"))) == Owner(kind, "train")


@pytest.mark.parametrize(
    "owners",
    [
        (),  # a plain pod
        (ref("ReplicaSet", "a", controller=False),),  # an owner, not its controller
        (ref("Job", "a"), ref("Job", "b")),  # two controllers: the API server allows one
        (ref("Job", "x" * 254),),  # longer than any object's name
        (ref("Job", "Not A Name"),),
        (ref("Job", {"name": "a"}),),
        (ref("Kind With Spaces", "a"),),
        (ref("K" * 64, "a"),),
        ({"controller": True},),
    ],
)
def test_a_pod_without_one_readable_controller_is_its_own_workload(
    owners: tuple[dict[str, Any], ...],
) -> None:
    """What a tenant writes in its pod's ownerReferences is a name, one per pod, in the form
    of a Kubernetes kind and name, or the pod is its own."""
    assert owner_of(pod("lone", *owners)) == Owner("Pod", "lone")


def test_a_cronjobs_runs_are_read_as_the_cronjob_where_it_exists() -> None:
    """The CronJob controller names each run's Job `<cronjob>-<Unix minutes>`; the pod
    names only the Job."""
    nightly = {"nightly", "nightly-2"}
    assert cronjob_of(Owner("Job", "nightly-29412360"), nightly) == Owner("CronJob", "nightly")
    assert cronjob_of(Owner("Job", "nightly-2-29412360"), nightly) == Owner("CronJob", "nightly-2")
    assert cronjob_of(Owner("Job", "train-29412360"), nightly) == Owner("Job", "train-29412360")
    assert cronjob_of(Owner("Job", "nightly-x"), nightly) == Owner("Job", "nightly-x")
    assert cronjob_of(Owner("Job", "nightly"), nightly) == Owner("Job", "nightly")
    assert cronjob_of(Owner("Deployment", "nightly-1"), nightly) == Owner("Deployment", "nightly-1")
