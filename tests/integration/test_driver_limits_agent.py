"""The agent's driver limits against the fake NVML and real cgroups: a Set that does not
read back is not counted as held (issue 44, item 3)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from enforcer.core.declaration import SIDECAR, Declares
from enforcer.core.model import Device, GiB, HeldLimit, LimitResult
from enforcer.core.payloads import Pod
from enforcer.edge.driver_tier import apply
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from tests.unit.test_shared_claims import uid

RES = "vram-enforcer.io/vram"
CID = "d" * 64


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


def trainer(env: dict[str, str] | None = None) -> Pod:
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
        "containerStatuses": [{"name": "c", "containerID": f"containerd://{CID}"}],
    }
    meta = {"name": "train", "namespace": "ml", "uid": uid("train"), "resourceVersion": "1"}
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
    recorder, telemetry = Recorder(), AgentTelemetry()
    nvml = Nvml()
    nvml.init()
    limiter = HardLimiter(
        nvml,
        NodeView(lambda: pods, lambda: frozenset({"ml"}), Declares(RES)),
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
    return Node(limiter, pods, recorder, telemetry, pod_dir, leaf, gpu)


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
