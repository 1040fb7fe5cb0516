"""The agent's driver limits against the fake NVML and real cgroups: read before the first
write, a limit someone else set left as it is and explained, our own adopted, and a Set
that does not read back not counted as held (issue 44, items 2 and 3)."""

from __future__ import annotations

import secrets
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from enforcer.core.declaration import SIDECAR, Declares
from enforcer.core.hard_limits import FRACTIONING_LABEL
from enforcer.core.model import (
    Device,
    GiB,
    HeldLimit,
    LimitOutcome,
    LimitResult,
    format_bytes,
)
from enforcer.core.payloads import Pod
from enforcer.edge.cgroupfs import first_without, move
from enforcer.edge.driver_tier import apply
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from tests.unit.test_shared_claims import uid

RES = "vram-enforcer.io/vram"
CID = secrets.token_hex(32)  # its own: another run on the machine finds no process of it


@dataclass
class Said:
    reason: str
    message: str
    warning: bool


class Recorder:
    """The agent's Event recorder, as the limiter's Events reach it."""

    def __init__(self) -> None:
        self.said: list[Said] = []

    def record(
        self, about: object, reason: str, message: str, warning: bool, once: bool = False
    ) -> None:
        self.said.append(Said(reason, message, warning))

    def of(self, reason: str) -> list[Said]:
        return [s for s in self.said if s.reason == reason]


def trainer(
    env: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    container_id: str = CID,
) -> Pod:
    """A running pod whose container `c` declares 8Gi, with `env` in its own spec."""
    spec = {
        "containers": [
            {
                "name": "c",
                "resources": {"limits": {RES: "8Gi"}},
                "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
            },
            {"name": SIDECAR},
        ]
    }
    status = {
        "phase": "Running",
        "containerStatuses": [{"name": "c", "containerID": f"containerd://{container_id}"}],
    }
    meta = {
        "name": "train",
        "namespace": "ml",
        "uid": uid("train"),
        "resourceVersion": "1",
        "annotations": annotations or {},
    }
    return cast(Pod, {"metadata": meta, "spec": spec, "status": status})


@dataclass
class Node:
    limiter: HardLimiter
    pods: dict[str, Pod]
    recorder: Recorder
    telemetry: AgentTelemetry
    pod_dir: Path
    leaf: Path
    gpu: str
    labels: dict[str, str]


@pytest.fixture
def node(fake_nvml: Any, cgroup2: Path) -> Node:
    """One R615 GPU, the kubelet's cgroups of pod `train` below a scratch cgroup, and the
    agent's hard limiter over them (its own NVML session, as the agent's)."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    pod_dir = cgroup2 / "kubepods.slice" / f"kubepods-pod{uid('train').replace('-', '_')}.slice"
    leaf = pod_dir / f"cri-containerd-{CID}.scope"
    leaf.mkdir(parents=True)
    gpu = fake_nvml.state.devices[0]["uuid"]
    pods: dict[str, Pod] = {}
    labels: dict[str, str] = {}
    recorder, telemetry = Recorder(), AgentTelemetry()
    nvml = Nvml()
    nvml.init()
    limiter = HardLimiter(
        nvml,
        NodeView(lambda: pods, lambda: frozenset({"ml"}), Declares(RES), labels=lambda: labels),
        cast(
            Any,
            SimpleNamespace(
                devices=Latest([Device(0, gpu, "H100", 80 * GiB, 0)]), container_usage=Latest({})
            ),
        ),
        cast(Any, recorder),
        telemetry,
        cgroups=(cgroup2, 60.0),
        changed=threading.Event(),
    )
    return Node(limiter, pods, recorder, telemetry, pod_dir, leaf, gpu, labels)


def another_writer(gpu: str, cgroup: Path, hard: int, soft: int = 0) -> None:
    """Someone else's Set (NVIDIA's hook, an operator), from an NVML session of its own."""
    other = Nvml()
    other.init()
    try:
        assert other.set_memory_limit(gpu, str(cgroup), hard, soft).result is LimitResult.SET
    finally:
        other.shutdown()


def on(fake_nvml: Any, cgroup: Path) -> list[tuple[int, int]]:
    """(soft, hard) of every Set on `cgroup`, by anyone, in order."""
    return [(r["soft"], r["hard"]) for r in fake_nvml.limit_records() if r["cgroup"] == str(cgroup)]


@pytest.mark.parametrize(
    ("held", "warning"), [(6 * GiB, False), (8 * GiB - 1000, False), (12 * GiB, True)]
)
def test_a_limit_the_toolkit_set_on_the_leaf_is_left_as_it_is_and_explained(
    node: Node, fake_nvml: Any, held: int, warning: bool
) -> None:
    """NVIDIA's hook set the container's leaf at creation, from NVIDIA_GPU_MEMORY_LIMIT in
    its spec: the agent reads before its first write, never sets or clears that limit, and
    says so once on the pod (a Warning when it lets the container past what it is owed),
    with the series naming the owner. Even where it is what the agent would have set (in
    whole MiB): the hook's, not adopted, so the two never both act on one container."""
    another_writer(node.gpu, node.leaf, held)
    node.pods[uid("train")] = trainer({"NVIDIA_GPU_MEMORY_LIMIT": str(held // 2**20)})
    for _ in range(2):
        node.limiter._pass()
    assert on(fake_nvml, node.leaf) == [(0, held)]  # untouched
    assert on(fake_nvml, node.pod_dir) == [(0, 8 * GiB)]  # the pod's is ours
    (said,) = node.recorder.of("VRAMForeignLimit")
    assert said.warning is warning
    assert f"held by nvidia-container-toolkit at {format_bytes(held)} on {node.gpu}" in (
        said.message
    )
    series = node.telemetry.registry.get_sample_value(
        "vram_enforcer_foreign_limit_bytes",
        {
            "namespace": "ml",
            "pod": "train",
            "container": "c",
            "gpu": node.gpu,
            "owner": "nvidia-container-toolkit",
        },
    )
    assert series == held
    # The pod goes: its own limit is cleared, the foreign one never, and its series goes.
    node.pods.clear()
    node.limiter._pass()
    assert on(fake_nvml, node.leaf) == [(0, held)]
    assert on(fake_nvml, node.pod_dir)[-1][1] != 8 * GiB
    assert "vram_enforcer_foreign_limit_bytes{" not in _exposition(node.telemetry)


def test_a_limit_nobody_names_is_foreign_with_an_unknown_owner(node: Node, fake_nvml: Any) -> None:
    another_writer(node.gpu, node.pod_dir, 4 * GiB)
    node.pods[uid("train")] = trainer()
    node.limiter._pass()
    assert on(fake_nvml, node.pod_dir) == [(0, 4 * GiB)]
    (said,) = node.recorder.of("VRAMForeignLimit")
    assert "the pod is held by unknown at 4.00 GiB" in said.message and not said.warning


def test_a_restarted_agent_adopts_its_own_limits_and_drops_an_older_releases_reservation(
    node: Node, fake_nvml: Any
) -> None:
    """The agent before this one held the pod to 8Gi with a soft limit (an older release)
    and the leaf to 8Gi: the pod's is rewritten with soft 0, the leaf's left as it is;
    both are its own, so both are cleared when the pod goes."""
    another_writer(node.gpu, node.pod_dir, 8 * GiB, 4 * GiB)
    another_writer(node.gpu, node.leaf, 8 * GiB)
    node.pods[uid("train")] = trainer()
    node.limiter._pass()
    assert on(fake_nvml, node.pod_dir) == [(4 * GiB, 8 * GiB), (0, 8 * GiB)]
    assert on(fake_nvml, node.leaf) == [(0, 8 * GiB)]
    assert node.recorder.of("VRAMForeignLimit") == []
    node.pods.clear()
    node.limiter._pass()
    assert on(fake_nvml, node.leaf)[-1][1] != 8 * GiB  # cleared: it was ours


def test_a_pod_gpu_fractioning_serves_gets_nothing_of_ours_and_is_told_once(
    node: Node, fake_nvml: Any
) -> None:
    """KAI's NvFractions on a node that gpu-fractioning's MPS daemon labelled: its hook sets
    the pod's leaves, and sampling cannot see its MPS clients. Nothing is set; said once.
    The same pod on an unlabelled node is ours."""
    nv = {"nvidia.com/container.c.gpu-memory.request": "8Gi"}
    node.pods[uid("train")] = trainer(annotations=nv)
    node.labels[FRACTIONING_LABEL] = "615"
    for _ in range(2):
        node.limiter._pass()
    assert fake_nvml.limit_records() == []
    (said,) = node.recorder.said
    assert said.reason == "VRAMForeignLimit" and not said.warning
    assert said.message.startswith("held by gpu-fractioning (R615 + MPS)")
    del node.labels[FRACTIONING_LABEL]
    node.limiter._pass()
    assert on(fake_nvml, node.pod_dir) == [(0, 8 * GiB)]


class RacedNvml(Nvml):
    """The agent's NVML session, with another writer that sets the same cgroup right after
    each of its Sets: what a read back must catch."""

    def __init__(self, racer: int) -> None:
        super().__init__()
        self.racer = racer

    def set_memory_limit(
        self, gpu_uuid: str, cgroup: str, hard_bytes: int, soft_bytes: int = 0
    ) -> Any:
        outcome = super().set_memory_limit(gpu_uuid, cgroup, hard_bytes, soft_bytes)
        another_writer(gpu_uuid, Path(cgroup), self.racer)
        return outcome


def test_a_set_that_a_racing_writer_overwrote_is_not_held(fake_nvml: Any, cgroup2: Path) -> None:
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    gpu = fake_nvml.state.devices[0]["uuid"]
    raced = RacedNvml(6 * GiB)
    raced.init()
    try:
        outcome = apply(raced, gpu, str(cgroup2), 8 * GiB)
        assert outcome.result is LimitResult.NOT_APPLIED
        assert outcome.detail == "a hard limit of 6.00 GiB, soft 0 B"
        plain = Nvml()
        plain.init()
        try:
            assert apply(plain, gpu, str(cgroup2), 8 * GiB).result is LimitResult.SET
            assert plain.memory_limit(gpu, str(cgroup2)) == HeldLimit(8 * GiB, 0, 0)
        finally:
            plain.shutdown()
    finally:
        raced.shutdown()


def test_a_leaf_limit_that_does_not_read_back_is_said_and_not_retried_until_it_changes(
    node: Node, fake_nvml: Any
) -> None:
    node.limiter._nvml = RacedNvml(6 * GiB)
    node.limiter._nvml.init()
    node.pods[uid("train")] = trainer()
    for _ in range(3):
        node.limiter._pass()
    # One Set each (the racer's follow): never sent again while nothing changes.
    assert on(fake_nvml, node.leaf) == [(0, 8 * GiB), (0, 6 * GiB)]
    # Said once each: the pod's tier (its own cgroup), and the container's leaf, a Warning.
    leaf, pods = sorted(node.recorder.of("VRAMSamplingOnly"), key=lambda s: s.message)
    assert pods.message.startswith(f"no hard limit: {node.gpu}: NVML accepted the limit for")
    assert leaf.warning
    assert leaf.message.startswith(f"container c on {node.gpu}: no hard limit: NVML accepted")
    assert "the driver then reads a hard limit of 6.00 GiB" in leaf.message


def _exposition(telemetry: AgentTelemetry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(telemetry.registry).decode()


class RefusingNvml(Nvml):
    """The agent's NVML session, where the driver refuses one cgroup as NVIDIA documents a
    cgroup without dmem files (Set NOT_FOUND: `LimitResult.NO_DMEM`, as `Nvml` answers it),
    or with NOT_SUPPORTED, and takes every other."""

    def __init__(self, cgroup: Path, result: LimitResult) -> None:
        super().__init__()
        self.refused, self.result, self.asked = str(cgroup), result, 0

    def set_memory_limit(
        self, gpu_uuid: str, cgroup: str, hard_bytes: int, soft_bytes: int = 0
    ) -> LimitOutcome:
        if cgroup != self.refused:
            return super().set_memory_limit(gpu_uuid, cgroup, hard_bytes, soft_bytes)
        self.asked += 1
        return LimitOutcome(self.result, "Not Found")


@pytest.mark.parametrize("result", [LimitResult.NO_DMEM, LimitResult.UNSUPPORTED])
def test_a_cgroup_the_driver_refuses_is_said_once_and_never_makes_the_gpu_final(
    node: Node, fake_nvml: Any, cgroup2: Path, result: LimitResult
) -> None:
    """A leaf without dmem files (or NOT_SUPPORTED from it, where the pod's cgroup on the
    same GPU took its limit) is a fact about that cgroup: said once, naming the first
    cgroup that does not enable dmem below it, not asked again, and the GPU goes on taking
    limits: a container restarted into a new cgroup gets its own."""
    refusing = RefusingNvml(node.leaf, result)
    refusing.init()
    node.limiter._nvml = refusing
    node.pods[uid("train")] = trainer()
    for _ in range(3):
        node.limiter._pass()
    assert refusing.asked == 1
    assert on(fake_nvml, node.pod_dir) == [(0, 8 * GiB)]
    # Said once on the pod (a Warning), and in its tier Event: sampling holds container c.
    said, tier = node.recorder.of("VRAMSamplingOnly")
    assert said.warning and said.message.startswith(f"container c on {node.gpu}: no hard limit:")
    assert f"the cgroup {node.leaf} has no dmem files" in said.message
    assert f"{cgroup2} does not enable dmem for its children)" in said.message
    assert "drivers from R615" not in said.message
    assert tier.message.startswith(f"no hard limit: container c: the cgroup {node.leaf} has no")
    # The container restarts: a new ID, a new cgroup, asked (and the GPU still takes limits).
    restarted = node.pod_dir / f"cri-containerd-{'e' * 64}.scope"
    restarted.mkdir()
    restart = trainer(container_id="e" * 64)
    restart["metadata"]["resourceVersion"] = "2"
    node.pods[uid("train")] = restart
    node.limiter._pass()
    assert on(fake_nvml, restarted) == [(0, 8 * GiB)]


def test_the_first_cgroup_that_does_not_enable_a_controller_below_it(
    cgroup2: Path, tmp_path: Path
) -> None:
    """On the real cgroupfs (no dmem below the test's scratch cgroup), then on a tree of
    such files (this host's root enables no controller the test may turn on below it)."""
    leaf = cgroup2 / "a" / "b"
    leaf.mkdir(parents=True)
    assert first_without("dmem", leaf, cgroup2) == cgroup2
    tree = tmp_path / "a" / "b"
    tree.mkdir(parents=True)
    (tmp_path / "cgroup.subtree_control").write_text("memory dmem\n")
    (tmp_path / "a" / "cgroup.subtree_control").write_text("memory\n")
    assert first_without("dmem", tree, tmp_path) == tmp_path / "a"
    (tmp_path / "a" / "cgroup.subtree_control").write_text("dmem\n")
    assert first_without("dmem", tree, tmp_path) is None
    assert first_without("dmem", Path("/elsewhere"), tmp_path) is None


def test_each_container_is_proven_on_its_own_leaf_and_the_pod_says_which_tier_holds_each(
    node: Node, fake_nvml: Any
) -> None:
    """Two declaring containers, each with a process holding 2 GiB as NVML lists it by
    container ID. `train`'s process is in its leaf: the driver charges it there, so the
    driver holds `train`. `helper`'s process is in the pod's cgroup, not its leaf (where the
    pod's total would have charged it and proven the whole pod): its leaf is charged
    nothing, so sampling holds `helper`. One Event says both; the series too."""
    helper_id = "f" * 64
    helper_leaf = node.pod_dir / f"cri-containerd-{helper_id}.scope"
    helper_leaf.mkdir()
    pod = trainer()
    pod["spec"]["containers"].insert(1, {"name": "helper", "resources": {"limits": {RES: "4Gi"}}})
    pod["status"]["containerStatuses"].append(
        {"name": "helper", "containerID": f"containerd://{helper_id}"}
    )
    node.pods[uid("train")] = pod
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        move(sleepers[0].pid, node.leaf)
        move(sleepers[1].pid, node.pod_dir)
        for each in sleepers:
            fake_nvml.state.set_process(0, each.pid, 2 * GiB)
        fake_nvml.write()
        usage = {CID: {node.gpu: 2 * GiB}, helper_id: {node.gpu: 2 * GiB}}
        node.limiter._sampled.container_usage.set(usage)  # type: ignore[attr-defined]
        for _ in range(3):
            node.limiter._pass()
        (said,) = node.recorder.of("VRAMHardLimit")
        assert said.message.startswith("hard limit in place: the pod may allocate at most 12.00")
        assert (
            f"container c: driver-limit, at most 8.00 GiB on {node.gpu}; the driver charges "
            f"2.00 GiB on {node.gpu}, where NVML lists 2.00 GiB for its processes"
        ) in said.message
        assert (
            f"container helper: the driver holds the limit on {node.gpu} but charges nothing"
        ) in said.message
        tiers = {
            (c, tier): node.telemetry.registry.get_sample_value(
                "vram_enforcer_container_tier",
                {"namespace": "ml", "pod": "train", "container": c, "tier": tier},
            )
            for c in ("c", "helper")
            for tier in ("driver-limit", "sampling")
        }
        assert tiers == {
            ("c", "driver-limit"): 1,
            ("c", "sampling"): None,
            ("helper", "driver-limit"): None,
            ("helper", "sampling"): 1,
        }
    finally:
        for each in sleepers:
            each.kill()
            each.wait()
