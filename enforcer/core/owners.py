"""The workload a pod belongs to, as a user names it (pure): a Deployment rather than its
ReplicaSet, a CronJob rather than one run's Job, the pod itself when nothing owns it.

Read from what the pod carries: its controller's ownerReference and its labels. Both are
the pod author's (a tenant may write any ownerReference and any label into a pod it
creates), so an owner is only a name to group a namespace's own pods by when a limit is
recommended; nothing is enforced from it, and what does not have the form of a Kubernetes
kind and name is not read (the pod is then its own owner). One owner per pod: its series
is one per pod, whatever the pod says.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from enforcer.core.payloads import Pod
from enforcer.core.pod import json_map, json_maps

# The label the Deployment controller puts on its ReplicaSets and their pods: the hash of
# the pod template, which is also the suffix of the ReplicaSet's name.
TEMPLATE_HASH = "pod-template-hash"

_KIND = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")
# A DNS-1123 subdomain (every workload's name has this form, at most 253 characters).
_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
# A DNS-1123 label: a namespace's name, a container's (at most 63 characters).
_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
# The CronJob controller names each run's Job `<cronjob>-<scheduled time in Unix minutes>`.
_RUN = re.compile(r"(.+)-[0-9]+")


@dataclass(frozen=True, slots=True, order=True)
class Owner:
    """A workload: its kind (Deployment, StatefulSet, DaemonSet, Job, CronJob, ReplicaSet,
    another controller's own kind, or Pod for a pod that nothing owns) and its name."""

    kind: str
    name: str


def is_kind(text: str) -> bool:
    """Whether `text` has the form of a Kubernetes kind (`Deployment`, `RayCluster`)."""
    return _KIND.fullmatch(text) is not None


def is_name(text: str) -> bool:
    """Whether `text` has the form of a workload's or a pod's name (a DNS-1123 subdomain)."""
    return _NAME.fullmatch(text) is not None


def is_label(text: str) -> bool:
    """Whether `text` has the form of a namespace's or a container's name (a DNS-1123
    label)."""
    return _LABEL.fullmatch(text) is not None


def owner_of(pod: Pod) -> Owner:
    """The workload of `pod`: its controller, with a Deployment's ReplicaSet read as the
    Deployment. A Job is its Job: the pod does not say which CronJob made it
    (`cronjob_of` tells, knowing the namespace's CronJobs)."""
    meta = json_map(pod.get("metadata"))
    itself = Owner("Pod", str(meta.get("name") or ""))
    controllers = [r for r in json_maps(meta.get("ownerReferences")) if r.get("controller") is True]
    if len(controllers) != 1:  # none, or more than the API server would let a pod have
        return itself
    kind, name = controllers[0].get("kind"), controllers[0].get("name")
    if not (isinstance(kind, str) and is_kind(kind)):
        return itself
    if not (isinstance(name, str) and is_name(name)):
        return itself
    if kind == "ReplicaSet":
        return _deployment(name, json_map(meta.get("labels")).get(TEMPLATE_HASH)) or Owner(
            kind, name
        )
    return Owner(kind, name)


def _deployment(replica_set: str, template_hash: object) -> Owner | None:
    """The Deployment of a ReplicaSet whose pods carry `pod-template-hash`: the Deployment
    controller names each of its ReplicaSets `<deployment>-<hash>` and puts that hash on its
    pods, so the name without `-<hash>` is the Deployment's (cut to fit 253 characters by
    the controller where the Deployment's name is longer). A ReplicaSet made by hand, whose
    name does not end so, stays a ReplicaSet."""
    if not isinstance(template_hash, str) or not template_hash:
        return None
    suffix = f"-{template_hash}"
    if not replica_set.endswith(suffix) or len(replica_set) == len(suffix):
        return None
    return Owner("Deployment", replica_set.removesuffix(suffix))


def cronjob_of(owner: Owner, cronjobs: Collection[str]) -> Owner:
    """A Job made by one of `cronjobs` (the names of its namespace's CronJobs) as that
    CronJob, whose runs are one workload; any other owner as it is. The Job's own
    ownerReference would say it too, but a week's runs are mostly deleted by then (a
    CronJob keeps 3 by default), while their CronJob remains: a run is known by the name its
    controller gives it, `<cronjob>-<minutes>`."""
    if owner.kind != "Job":
        return owner
    run = _RUN.fullmatch(owner.name)
    if run is None or run[1] not in cronjobs:
        return owner
    return Owner("CronJob", run[1])
