"""The agent keeps the last enforcement on each pod as its condition: told of each Event it
posts on a pod (`EventRecorder`'s `told`, the sidecars' reports and its own alike), it
writes the condition (`edge/pod_conditions.py`) from its own view (`core/last_enforcement.py`):
the pod and the sampler's pass as they were when told, what the pod declares, and its
action (its sidecar's environment, which the webhook wrote, read where its namespace opted
in: `pod_policy`, as the backstop reads it)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping

from enforcer.core.declaration import SIDECAR
from enforcer.core.last_enforcement import (
    ENFORCING,
    as_policy_says,
    condition,
    container_named,
    seen,
)
from enforcer.core.lending import Tenants
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.core.pod import containers_by_id
from enforcer.core.pod_metrics import ContainerSeries, Named, container_series
from enforcer.core.policy import PolicyConfig
from enforcer.core.reasons import Reason
from enforcer.core.settings.sidecar import pod_policy
from enforcer.edge.pod_conditions import ConditionWriter
from enforcer.modes.pod_metrics import LastPass


class LastEnforcement:
    """Reads the node's pods, the sampler's last pass and the lender's tenants (what each
    container declares) when told; works the condition out on the writer's thread."""

    def __init__(
        self,
        writer: ConditionWriter,
        pods: Callable[[], Mapping[str, Pod] | None],
        last: Callable[[], LastPass | None],
        owed: Callable[[], Tenants | None],
        opted_in: Callable[[], frozenset[str] | None],
    ) -> None:
        self._writer = writer
        self._pods = pods
        self._last = last
        self._owed = owed
        self._opted_in = opted_in
        self._evicted: set[str] = set()  # pods made to leave: their condition says so
        self._lock = threading.Lock()  # told in any thread

    def told(self, about: ObjectReference, reason: str) -> None:
        """An Event about to be posted: an enforcement on a pod sets the pod's condition,
        the latest replacing the one before, but for an eviction: the pod is leaving, and
        the backstop's signal, refused again on later passes, does not hide why."""
        if about.get("kind") != "Pod" or reason not in ENFORCING:
            return
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        uid, pods = about.get("uid", ""), self._pods()
        pod = (pods or {}).get(uid)
        opted_in = self._opted_in() or frozenset()
        policy = pod_policy(pod, SIDECAR, opted_in) if pod is not None else None
        said = as_policy_says(Reason(reason), policy is not None and policy.dry_run)
        if said is None:  # a would-be report on a pod not in a dry run: a forgery
            return
        with self._lock:
            if pods is not None:
                self._evicted &= pods.keys()  # those gone are forgotten
            if reason == Reason.EVICTED:
                self._evicted.add(uid)
            elif uid in self._evicted:
                return
        make = functools.partial(
            _condition, said, about, at, pod, policy, self._last(), self._owed()
        )
        self._writer.set(about, make)


def _condition(
    reason: Reason,
    about: ObjectReference,
    at: str,
    pod: Pod | None,
    policy: PolicyConfig | None,
    passed: LastPass | None,
    owed: Tenants | None,
) -> dict[str, str]:
    container = container_named(about.get("fieldPath", ""))
    series: tuple[ContainerSeries, ...] = ()
    if pod is not None and passed is not None and container is not None:
        sample, containers = passed
        ns, name = about.get("namespace", ""), about.get("name", "")
        named = {
            cid: Named(ns, name, ref.name)
            for cid, ref in containers_by_id(pod).items()
            if ref.name == container
        }
        series = container_series(sample, containers(), named, owed)
    action = policy.action if policy is not None else None
    return condition(seen(reason, pod, container, series, action), at)
