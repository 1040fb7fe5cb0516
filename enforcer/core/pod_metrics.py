"""The series the agent serves for each enforced container of its node (pure).

One scrape target per node: the agent knows every GPU process (NVML), its container (its
cgroup), every pod of the node and what each declares (`lending.Tenants`), and what each
borrows above its request (the lender's view of each GPU), so it works out each
container's series itself, whatever its sidecar says. A container is named by its pod's
status (namespace, pod, container); only containers of pods the webhook injected count,
never their sidecar.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from enforcer.core.attribution import attribute, gpu_shares
from enforcer.core.declaration import SIDECAR, injected
from enforcer.core.lending import Tenants
from enforcer.core.model import Activity, ProcessKey, Sample
from enforcer.core.owners import Owner, owner_of
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id, json_map
from enforcer.core.reclaim import Gpu


@dataclass(frozen=True, slots=True)
class Named:
    """A container of an enforced pod, as its labels name it."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class OnGpu:
    """A container's part of one GPU."""

    gpu: str
    used: int
    activity: Activity | None  # its processes' utilisation summed; None: not known
    limit: int | None = None  # DRA: what its claim was allocated there
    over_request: int | None = None  # what it holds above its request there (borrowers)


@dataclass(frozen=True, slots=True)
class ContainerSeries:
    who: Named
    used: int
    limit: int | None  # its request over all GPUs; None: it declares none, or per GPU (DRA)
    ceiling: int | None  # what it may borrow up to, where above its request
    gpus: tuple[OnGpu, ...]
    processes: tuple[tuple[int, str, int], ...]  # (host pid, GPU, bytes), largest first


def enforced_containers(pods: Iterable[Pod], opted_in: AbstractSet[str]) -> dict[str, Named]:
    """Container ID -> its name, for every container of the pods the webhook injected
    (`declaration.injected`, in the namespaces of `opted_in`), their sidecar's aside (a
    container not created yet has no ID): a label alone names no pod's series."""
    found: dict[str, Named] = {}
    for pod in pods:
        if not injected(pod, opted_in):
            continue
        meta = json_map(pod.get("metadata"))
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        for cid, ref in containers_by_id(pod).items():
            if ref.name != SIDECAR:
                found[cid] = Named(namespace, name, ref.name)
    return found


def container_series(
    sample: Sample,
    containers: Mapping[ProcessKey, str],
    named: Mapping[str, Named],
    owed: Tenants | None,
    lent: Sequence[Gpu] = (),
) -> tuple[ContainerSeries, ...]:
    """Each named container's series: its usage over all and per GPU (from the processes
    its cgroup holds, `containers`: each process's container ID), with the request and
    ceiling it declared (`owed`: the lender's tenants, None before they are known), and
    what it holds above its request on each GPU where some may borrow (`lent`)."""
    unit_of = {key: cid for key, cid in containers.items() if cid in named}
    usage = {u.name: u for u in attribute(sample, unit_of, dict.fromkeys(named, 0))}
    held: dict[str, list[tuple[str, int, Activity | None]]] = {}
    for part in gpu_shares(usage.values(), sample):
        held.setdefault(part.unit, []).append((part.gpu, part.used_bytes, part.activity))
    request: dict[str, int] = {}
    ceiling: dict[str, int] = {}
    on_gpu: dict[tuple[str, str], int] = {}  # DRA: (container ID, GPU) -> its allocation
    for tenant in owed.all if owed is not None else ():
        for cid in tenant.ids:
            if tenant.confined and tenant.gpu is not None:
                on_gpu[cid, tenant.gpu] = tenant.request
            else:  # over all its GPUs (a share on each of N, N times)
                request[cid] = tenant.request * tenant.gpus
            if tenant.ceiling > tenant.request:  # DRA: above its one claim, on that GPU
                ceiling[cid] = tenant.ceiling * tenant.gpus
    over: dict[tuple[str, str], int] = {}
    for view in lent:
        for share in view.shares:
            borrower = owed.owner(share.unit) if owed is not None else None
            for cid in borrower.ids if borrower is not None else ():
                over[cid, view.uuid] = over.get((cid, view.uuid), 0) + share.borrowed
    found = []
    for cid, who in sorted(named.items(), key=lambda n: (n[1].namespace, n[1].pod, n[1].container)):
        unit = usage[cid]
        gpus = {
            gpu: OnGpu(gpu, used, activity, on_gpu.get((cid, gpu)), over.get((cid, gpu)))
            for gpu, used, activity in held.get(cid, ())
        }
        for (of, gpu), limit in on_gpu.items():  # an allocation is shown where still unused
            if of == cid and gpu not in gpus:
                gpus[gpu] = OnGpu(gpu, 0, None, limit, over.get((cid, gpu)))
        processes = tuple(
            (p.key.pid, gpu, used)
            for p in unit.processes
            for gpu, used in p.by_device
            if used is not None
        )
        found.append(
            ContainerSeries(
                who,
                unit.used_bytes,
                request.get(cid),
                ceiling.get(cid),
                tuple(gpus[g] for g in sorted(gpus)),
                processes,
            )
        )
    return tuple(found)


def peak_series(
    named: Mapping[str, Named], peaks: Mapping[str, int]
) -> tuple[tuple[Named, int], ...]:
    """Each named container's peak (`peaks`: by the container ID its pod's status names,
    the most the container held over all GPUs, over all its instances: a restart does not
    start it again), 0 until it holds some."""
    found = ((who, peaks.get(cid, 0)) for cid, who in named.items())
    return tuple(sorted(found, key=lambda s: (s[0].namespace, s[0].pod, s[0].container)))


def pod_owners(pods: Iterable[Pod]) -> tuple[tuple[str, str, Owner], ...]:
    """(namespace, pod, its workload) of each of `pods`: one series per pod."""
    found = set()
    for pod in pods:
        meta = json_map(pod.get("metadata"))
        found.add((str(meta.get("namespace") or ""), str(meta.get("name") or ""), owner_of(pod)))
    return tuple(sorted(found))
