"""Each container's peak, kept by the agent from every sampler pass (not only what a scrape
happens to see), over its pod's life on the node (across its restarts), and each pod's
owner, served where Prometheus reads them (`vram-enforcer recommend`)."""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import ENFORCED, SIDECAR
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.edge.metrics import AgentTelemetry, PodsCollector, PodsView
from enforcer.modes.pod_metrics import Peaks, with_workloads

TRAINER, RESTARTED, PLAIN, SIDE = "a" * 64, "b" * 64, "c" * 64, "d" * 64
P1, P2, P3 = (ProcessKey(pid, pid * 10) for pid in (101, 102, 103))
GPUS = (Device(0, "GPU-0", "H100", 80 * GiB, 0), Device(1, "GPU-1", "H100", 80 * GiB, 0))


def pod(name: str, enforced: bool, owner: str | None = None, **containers: str) -> Pod:
    meta: dict[str, Any] = {
        "namespace": "ml",
        "name": name,
        "uid": name,
        "labels": {ENFORCED: "true", "pod-template-hash": "5f6"} if enforced else {},
    }
    if owner is not None:
        meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": owner, "controller": True}]
    statuses = [{"name": n, "containerID": f"containerd://{c}"} for n, c in containers.items()]
    spec = {"containers": [{"name": n} for n in containers]}
    return cast(Pod, {"metadata": meta, "spec": spec, "status": {"containerStatuses": statuses}})


def passed(peaks: Peaks, *held: tuple[ProcessKey, str, int], on: dict[ProcessKey, str]) -> None:
    """One sampler pass, as the agent's sampler feeds it: each process's usage per GPU."""
    sample = Sample(0.0, GPUS, tuple(ProcessUsage(k, gpu, used) for k, gpu, used in held))
    peaks.see(usage_by_container(sample, on))


def scraped(
    pods: dict[str, Pod], peaks: Peaks
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    t = AgentTelemetry()
    view = lambda: with_workloads(PodsView, lambda: pods, peaks, lambda: frozenset({"ml"}))  # noqa: E731
    t.registry.register(PodsCollector(view))
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(generate_latest(t.registry).decode())
        for s in family.samples
        if s.name in ("vram_enforcer_container_peak_bytes", "vram_enforcer_pod_owner")
    }


def peak_of(container: str, pod: str = "serve-5f6-x") -> tuple[str, frozenset[tuple[str, str]]]:
    labels = {"namespace": "ml", "pod": pod, "container": container}
    return ("vram_enforcer_container_peak_bytes", frozenset(labels.items()))


def test_the_peak_is_the_highest_sum_over_gpus_of_any_pass() -> None:
    """trainer holds 3 GiB + 2 GiB on two GPUs in one pass, 1 GiB in the next: its peak is
    5 GiB, whatever a scrape sees now."""
    serve = pod("serve-5f6-x", True, "serve-5f6", trainer=TRAINER, **{SIDECAR: SIDE})
    pods = {"serve-5f6-x": serve}
    peaks = Peaks(lambda: pods)
    on = {P1: TRAINER, P2: TRAINER}
    passed(peaks, (P1, "GPU-0", 3 * GiB), (P2, "GPU-1", 2 * GiB), on=on)
    passed(peaks, (P1, "GPU-0", 1 * GiB), on=on)
    got = scraped(pods, peaks)
    assert got[peak_of("trainer")] == 5 * GiB
    assert peak_of(SIDECAR) not in got  # never the sidecar's
    owner = {
        "namespace": "ml",
        "pod": "serve-5f6-x",
        "owner_kind": "Deployment",
        "owner_name": "serve",
    }
    assert got[("vram_enforcer_pod_owner", frozenset(owner.items()))] == 1


def serving(trainer: str) -> Pod:
    return pod("serve-5f6-x", True, "serve-5f6", trainer=trainer, **{SIDECAR: SIDE})


def test_what_a_container_reached_before_it_was_stopped_outlives_its_restart() -> None:
    """trainer is scraped at 2 GiB, grows to 6 GiB in the passes after (no scrape sees
    them), and is stopped there, over its limit; the kubelet restarts it (a new container
    ID in its pod's status) before the next scrape. Its series says 6 GiB: what it needed,
    not the 2 GiB seen before, nor the 0 its new instance starts at. Its new instance's 3
    GiB leave it there; 7 GiB raise it: the most over its pod's life on the node."""
    pods = {"serve-5f6-x": serving(TRAINER)}
    peaks = Peaks(lambda: pods)
    passed(peaks, (P1, "GPU-0", 2 * GiB), on={P1: TRAINER})
    assert scraped(pods, peaks)[peak_of("trainer")] == 2 * GiB
    passed(peaks, (P1, "GPU-0", 6 * GiB), on={P1: TRAINER})
    pods = {"serve-5f6-x": serving(RESTARTED)}
    passed(peaks, on={})  # stopped; its pod's status names its next instance
    assert scraped(pods, peaks)[peak_of("trainer")] == 6 * GiB
    passed(peaks, (P3, "GPU-0", 3 * GiB), on={P3: RESTARTED})
    assert scraped(pods, peaks)[peak_of("trainer")] == 6 * GiB
    passed(peaks, (P3, "GPU-0", 7 * GiB), on={P3: RESTARTED})
    assert scraped(pods, peaks)[peak_of("trainer")] == 7 * GiB


def test_a_container_on_a_gpu_before_its_pod_names_it_counts_once_named() -> None:
    """trainer's new instance holds 4 GiB before the pod watch has read the status that
    names it, then less: once named, its 4 GiB are its container's."""
    pods = {"serve-5f6-x": serving(TRAINER)}
    peaks = Peaks(lambda: pods)
    passed(peaks, (P1, "GPU-0", GiB), on={P1: TRAINER})
    passed(peaks, (P3, "GPU-0", 4 * GiB), on={P3: RESTARTED})
    pods = {"serve-5f6-x": serving(RESTARTED)}
    passed(peaks, (P3, "GPU-0", GiB), on={P3: RESTARTED})
    assert scraped(pods, peaks)[peak_of("trainer")] == 4 * GiB


def test_a_pod_that_left_is_forgotten_and_one_that_declares_nothing_has_its_owner() -> None:
    """The peaks are kept for the containers of the node's pods only; a pod the webhook did
    not inject gets no peak series (its usage is `undeclared_used_bytes`), but its owner, so
    that its usage is recommended for by workload too."""
    serve = pod("serve-5f6-x", True, "serve-5f6", trainer=TRAINER)
    plain = pod("notebook", False, web=PLAIN)
    pods = {"serve-5f6-x": serve, "notebook": plain}
    peaks = Peaks(lambda: pods)
    passed(peaks, (P1, "GPU-0", 3 * GiB), (P2, "GPU-0", GiB), on={P1: TRAINER, P2: PLAIN})
    got = scraped(pods, peaks)
    assert peak_of("web", "notebook") not in got
    owner = {"namespace": "ml", "pod": "notebook", "owner_kind": "Pod", "owner_name": "notebook"}
    assert got[("vram_enforcer_pod_owner", frozenset(owner.items()))] == 1
    assert peaks.of(pods.values()) == {TRAINER: 3 * GiB, PLAIN: GiB}

    pods = {"notebook": plain}  # serve's pod left the node: a new snapshot of the pods
    passed(peaks, on={})
    pods = {"serve-5f6-x": serve, "notebook": plain}  # named again: it is not kept
    assert peaks.of(pods.values()) == {PLAIN: GiB}
