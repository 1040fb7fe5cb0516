"""Which GPU memory no declaration accounts for (issue 43, item 2), from plain data: each byte
NVML lists for a placed process lands in one place, an injected pod's container (held to
its declaration), a container of another pod (undeclared), or no pod; and nothing a tenant
writes in its pod moves its memory out of sight."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import pytest
from prometheus_client import generate_latest

from enforcer.core import messages
from enforcer.core.declaration import ENFORCED, SIDECAR, Declares
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod import ContainerRef
from enforcer.core.unaccounted import (
    InNoPod,
    Unaccounted,
    UndeclaredContainer,
    pod_index,
    unaccounted,
)
from enforcer.edge.metrics import AgentTelemetry, NodeCollector
from enforcer.modes.node_view import NodeView
from enforcer.modes.unaccounted import PER_PASS, SAY_AFTER, UnaccountedStep

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

RES = "vram-enforcer.io/vram"
DECLARES = Declares(RES)
OPTED_IN = frozenset({"ml"})
GPUS = (Device(0, "GPU-a", "H100", 80 * GiB, 0), Device(1, "GPU-b", "H100", 80 * GiB, 0))


def pod(
    name: str,
    namespace: str,
    containers: Mapping[str, str],  # name -> container ID
    *,
    limits: Mapping[str, str] | None = None,  # name -> its VRAM limit
    injected: bool = False,
    labels: Mapping[str, str] | None = None,
) -> Pod:
    """A running pod; `injected`: with the webhook's marks (the enforced label, the sidecar),
    which count only in a namespace that opted in."""
    specs: list[dict[str, Any]] = [
        {
            "name": c,
            "resources": {"limits": {RES: (limits or {})[c]}} if c in (limits or {}) else {},
        }
        for c in containers
    ]
    marks = dict(labels or {})
    if injected:
        specs += [] if SIDECAR in containers else [{"name": SIDECAR}]
        marks[ENFORCED] = "true"
    return cast(
        Pod,
        {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{name}",
                "labels": marks,
            },
            "spec": {"containers": specs},
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {"name": c, "containerID": f"containerd://{cid}"}
                    for c, cid in containers.items()
                ],
            },
        },
    )


def cid(n: int) -> str:
    return f"{n:064x}"


def sample(*held: tuple[int, str, int | None]) -> Sample:
    """Processes (pid, GPU, bytes)."""
    return Sample(0.0, GPUS, tuple(ProcessUsage(ProcessKey(p, 1), g, b) for p, g, b in held))


def found(
    pods: Sequence[Pod], seen: Sample, containers: Mapping[int, str], opted_in: frozenset[str]
) -> Unaccounted:
    by_uid = {p["metadata"]["uid"]: p for p in pods}
    keys = {ProcessKey(p, 1): c for p, c in containers.items()}
    return unaccounted(seen, keys, pod_index(by_uid, opted_in, DECLARES))


def shown(result: Unaccounted) -> dict[tuple[str, str, str], tuple[tuple[str, int], ...]]:
    return {(c.namespace, c.pod, c.container.name): c.gpus for c in result.undeclared}


def test_each_byte_is_an_injected_pods_an_undeclared_containers_or_no_pods() -> None:
    pods = [
        pod("enforced", "ml", {"trainer": cid(1)}, limits={"trainer": "8Gi"}, injected=True),
        pod("plain", "research", {"a": cid(2), "b": cid(3)}),
    ]
    seen = sample(
        (1, "GPU-a", 6 * GiB),  # the enforced container: its own series
        (2, "GPU-a", 12 * GiB),  # research/plain/a, on two GPUs
        (3, "GPU-a", GiB),
        (4, "GPU-b", 3 * GiB),  # research/plain/b
        (5, "GPU-b", 2 * GiB),  # a host process: no container
        (6, "GPU-a", 5 * GiB),  # a container of no pod of the node (docker run)
        (7, "GPU-a", None),  # NVML cannot tell: unknown, never counted as 0 bytes held
    )
    containers = {1: cid(1), 2: cid(2), 3: cid(2), 4: cid(3), 6: cid(9)}
    result = found(pods, seen, containers, OPTED_IN)
    assert shown(result) == {
        ("research", "plain", "a"): (("GPU-a", 13 * GiB),),
        ("research", "plain", "b"): (("GPU-b", 3 * GiB),),
    }
    assert dict(result.outside_pods) == {"GPU-a": 5 * GiB, "GPU-b": 2 * GiB}
    (a, _) = result.undeclared
    assert (a.uid, a.container, a.declared, a.opted_in) == (
        "uid-plain",
        ContainerRef("a", "containers"),
        0,
        False,
    )


def test_a_pod_with_the_webhooks_marks_in_a_namespace_that_did_not_opt_in_hides_nothing() -> None:
    """The enforced label and a container named like the sidecar, written by the tenant:
    the webhook never injected it, so its memory is undeclared, not an enforced pod's."""
    forged = pod("forged", "research", {"trainer": cid(1)}, injected=True)
    result = found([forged], sample((1, "GPU-a", 4 * GiB)), {1: cid(1)}, OPTED_IN)
    assert shown(result) == {("research", "forged", "trainer"): (("GPU-a", 4 * GiB),)}


def test_a_pod_that_opted_out_of_an_opted_in_namespace_counts_and_says_so() -> None:
    out = pod("out", "ml", {"trainer": cid(1)}, labels={"vram-enforcer.io/inject": "false"})
    result = found([out], sample((1, "GPU-b", GiB)), {1: cid(1)}, OPTED_IN)
    ((held,),) = [c.gpus for c in result.undeclared]
    assert held == ("GPU-b", GiB) and result.undeclared[0].opted_in


def test_what_an_injected_pods_sidecar_container_holds_is_undeclared_and_told_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sidecar uses no GPU memory, and is in no enforced series: what a process in its
    container holds (exec'd there) is shown as its container's, declaring nothing, not
    left out as an injected pod's, and told once on the pod as any undeclared container."""
    enforced = pod(
        "enforced",
        "ml",
        {"trainer": cid(1), SIDECAR: cid(2)},
        limits={"trainer": "8Gi"},
        injected=True,
    )
    seen = sample((1, "GPU-a", 9 * GiB), (2, "GPU-b", 3 * GiB))  # trainer: its own series
    containers = {1: cid(1), 2: cid(2)}
    result = found([enforced], seen, containers, OPTED_IN)
    assert shown(result) == {("ml", "enforced", SIDECAR): (("GPU-b", 3 * GiB),)}
    assert dict(result.outside_pods) == {}
    (held,) = result.undeclared
    assert (held.declared, held.sidecar) == (0, True)

    step, _, recorder = stepping({"uid-enforced": enforced})
    with caplog.at_level(logging.WARNING, "enforcer.modes.unaccounted"):
        for _ in range(3):
            step(seen, lambda: {ProcessKey(p, 1): c for p, c in containers.items()})
    assert recorder.said == [("enforced", f"spec.containers{{{SIDECAR}}}", "VRAMUndeclared", True)]
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        "pod ml/enforced: the vram-enforcer sidecar's container holds 3.00 GiB of GPU-b; the "
        "sidecar uses no GPU memory, so another process runs in its container (kubectl exec "
        "-c vram-enforcer, which the chart's webhook.protectInjectedPods refuses to all but "
        "cluster administrators) and declares no VRAM. Nothing limits it; its memory is "
        "counted as undeclared (vram_enforcer_undeclared_used_bytes)"
    )


def test_a_declaration_no_sidecar_holds_counts_only_while_it_is_kept() -> None:
    """Outside the opted-in namespaces a container declares in its resources alone (what the
    scheduler counted): within it, accounted for; above it, its whole usage is shown. A
    declared byte hides nothing."""
    within = pod("within", "research", {"c": cid(1)}, limits={"c": "8Gi"})
    above = pod("above", "research", {"c": cid(2)}, limits={"c": "1"})
    seen = sample((1, "GPU-a", 8 * GiB), (2, "GPU-a", 2 * GiB), (3, "GPU-b", GiB))
    result = found([within, above], seen, {1: cid(1), 2: cid(2), 3: cid(2)}, OPTED_IN)
    assert shown(result) == {("research", "above", "c"): (("GPU-a", 2 * GiB), ("GPU-b", GiB))}
    assert result.undeclared[0].declared == 1
    assert dict(result.outside_pods) == {}


def test_resources_the_api_server_would_refuse_declare_nothing() -> None:
    garbled = pod("garbled", "research", {"c": cid(1)}, limits={"c": "lots"})
    result = found([garbled], sample((1, "GPU-a", GiB)), {1: cid(1)}, OPTED_IN)
    assert [c.declared for c in result.undeclared] == [0]


def test_a_container_two_pods_list_is_in_neither() -> None:
    pods = [pod("one", "research", {"c": cid(1)}), pod("two", "research", {"c": cid(1)})]
    result = found(pods, sample((1, "GPU-a", GiB)), {1: cid(1)}, OPTED_IN)
    assert result.undeclared == () and dict(result.outside_pods) == {"GPU-a": GiB}


def stepping(
    pods: Mapping[str, Pod] | None, opted_in: frozenset[str] | None = OPTED_IN
) -> tuple[UnaccountedStep, NodeCollector, Recorded]:
    """The agent's step over `pods` (read as they are at each pass), what it shows, and
    what it tells."""
    recorder, node = Recorded(), AgentTelemetry().node
    view = NodeView(lambda: pods, lambda: opted_in, DECLARES)
    return (
        UnaccountedStep(view, node, cast("EventRecorder", recorder), "vram-enforcer"),
        node,
        recorder,
    )


def test_nothing_is_known_before_the_pods_and_the_namespaces_are_listed() -> None:
    seen, keys = sample((1, "GPU-a", GiB)), {ProcessKey(1, 1): cid(1)}
    for pods, opted_in in (({}, None), (None, OPTED_IN)):
        step, shown, recorder = stepping(pods, opted_in)
        step(seen, lambda: keys)
        assert shown.unaccounted is None and recorder.said == []


def test_a_pod_that_changes_is_read_again() -> None:
    """The pods' index is made again when a pod's object changes (the watch replaces it):
    a container the kubelet names later, in a new status, is then the pod's."""
    pods = {"uid-p": pod("p", "research", {})}
    seen, keys = sample((1, "GPU-a", GiB)), {ProcessKey(1, 1): cid(1)}
    step, shown, _ = stepping(pods)
    step(seen, lambda: keys)
    assert shown.unaccounted is not None and shown.unaccounted.outside_pods == {"GPU-a": GiB}
    pods["uid-p"] = pod("p", "research", {"c": cid(1)})
    step(seen, lambda: keys)
    assert shown.unaccounted.undeclared[0].gpus == (("GPU-a", GiB),)
    assert shown.unaccounted.outside_pods == {}


def test_the_series_name_each_container_and_gpu_and_every_gpus_memory_outside_pods() -> None:
    telemetry = AgentTelemetry()
    telemetry.node.devices = GPUS
    held = UndeclaredContainer(
        "research", "plain", "u", ContainerRef("a", "containers"), 0, (("GPU-a", GiB),), False
    )
    host = ProcessUsage(ProcessKey(9, 1), "GPU-b", 2 * GiB)
    telemetry.node.unaccounted = Unaccounted((held,), (InNoPod(host, None),))
    text = generate_latest(telemetry.registry).decode()
    assert (
        'vram_enforcer_undeclared_used_bytes{container="a",gpu="GPU-a",namespace="research",'
        'pod="plain"} 1.073741824e+09'
    ) in text
    outside = "vram_enforcer_gpu_outside_pods_bytes{gpu="
    assert f'{outside}"0",model="H100",parent_uuid="",uuid="GPU-a"}} 0.0' in text
    assert f'{outside}"1",model="H100",parent_uuid="",uuid="GPU-b"}} 2.147483648e+09' in text
    telemetry.node.unaccounted = None  # not known: no series, never a guessed 0
    assert (
        "vram_enforcer_gpu_outside_pods_bytes{" not in generate_latest(telemetry.registry).decode()
    )


def test_the_event_says_what_is_held_where_and_why_the_pod_is_not_enforced() -> None:
    held = UndeclaredContainer(
        "research", "p", "u", ContainerRef("a", "containers"), 0, (("GPU-a", 12 * GiB),), False
    )
    assert messages.undeclared(held).startswith(
        "container 'a' holds 12.00 GiB of GPU-a and declares no VRAM: its namespace 'research' "
        "has not opted in (label vram-enforcer.io/inject=enabled)"
    )
    above = UndeclaredContainer(
        "ml", "p", "u", ContainerRef("a", "containers"), GiB, (("GPU-a", 2 * GiB),), True
    )
    text = messages.undeclared(above)
    assert "holds 2.00 GiB of GPU-a, more than the 1.00 GiB it declares" in text
    assert "the webhook did not inject its pod" in text


class Recorded:
    """The agent's recorder, as the Events reach it."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str, str, bool]] = []

    def record(
        self, about: Mapping[str, str], reason: str, message: str, warning: bool, once: bool
    ) -> None:
        assert once  # a lasting fact: not said again by a restarted agent
        self.said.append((about["name"], about.get("fieldPath", ""), reason, warning))


def test_each_undeclared_container_is_told_once_while_its_pod_lives_a_few_a_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seven pods hold memory undeclared, one of them in the agent's own namespace: over
    passes, each container is said once in the log, at most PER_PASS a pass, and each but
    the agent's namespace's told on its pod; a pod that leaves and comes back is told
    again."""
    pods = {f"uid-p{n}": pod(f"p{n}", "research", {"c": cid(n)}) for n in range(1, 7)} | {
        "uid-own": pod("own", "vram-enforcer", {"c": cid(7)})
    }
    seen = sample(*((n, "GPU-a", GiB) for n in range(1, 8)))
    keys = {ProcessKey(n, 1): cid(n) for n in range(1, 8)}
    step, node, recorder = stepping(pods)
    with caplog.at_level(logging.WARNING, "enforcer.modes.unaccounted"):
        step(seen, lambda: keys)
        assert len(caplog.records) == PER_PASS == 5
        for _ in range(3):
            step(seen, lambda: keys)
    said = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert said == [*(f"pod research/p{n}" for n in range(1, 7)), "pod vram-enforcer/own"]
    assert node.unaccounted is not None and len(node.unaccounted.undeclared) == 7
    assert sorted(name for name, *_ in recorder.said) == [f"p{n}" for n in range(1, 7)]
    assert set(recorder.said) == {
        (f"p{n}", "spec.containers{c}", "VRAMUndeclared", True) for n in range(1, 7)
    }
    gone = pods.pop("uid-p1")
    step(seen, lambda: keys)
    pods["uid-p1"] = gone  # the same UID back: forgotten meanwhile, told again
    step(seen, lambda: keys)
    assert [name for name, *_ in recorder.said].count("p1") == 2


def test_a_process_in_no_pod_is_said_once_with_its_pid_once_it_stays_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host process and one in a container no pod lists: each said once, after SAY_AFTER
    passes in a row (a new pod's container may be seen before the watch names it), however
    many passes follow; one that a pod claims meanwhile is never said."""
    newcomer = pod("newcomer", "ml", {"c": cid(3)}, limits={"c": "8Gi"}, injected=True)
    pods: dict[str, Pod] = {}
    seen = sample((1, "GPU-a", 2 * GiB), (2, "GPU-b", GiB), (3, "GPU-a", GiB))
    keys = {ProcessKey(2, 1): cid(2), ProcessKey(3, 1): cid(3)}
    step, _, _ = stepping(pods)
    with caplog.at_level(logging.WARNING, "enforcer.modes.unaccounted"):
        for n in range(SAY_AFTER * 3):
            if n == SAY_AFTER - 2:
                pods["uid-newcomer"] = newcomer  # the watch names its container now
            step(seen, lambda: keys)
            assert len(caplog.records) == (2 if n >= SAY_AFTER - 1 else 0)
    host, docker = (r.getMessage() for r in caplog.records)
    assert host == (
        "pid 1 holds 2.00 GiB on GPU-a and is in no pod of this node: it runs in no container "
        "(a host process). Nothing limits it; its memory is counted as in no pod "
        "(vram_enforcer_gpu_outside_pods_bytes)"
    )
    assert docker.startswith(
        f"pid 2 holds 1.00 GiB on GPU-b and is in no pod of this node: its container "
        f"{cid(2)[:12]} is in no pod's status"
    )
