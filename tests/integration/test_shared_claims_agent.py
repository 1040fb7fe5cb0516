"""The agent's consumers of a ResourceClaim that pods share (issue 35): the lender owes it
once, and the hard limiter puts each pod's part, never the whole, on each pod cgroup. Both
run as the agent runs them, on the claims as last read; NVML is a stand-in that records the
limits it is asked to set, over a cgroup tree made as the kubelet's systemd driver names it."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from enforcer.core.declaration import Declares
from enforcer.core.dra import DraObjects, DraSettings
from enforcer.core.model import (
    Device,
    GiB,
    HeldLimit,
    LimitOutcome,
    LimitResult,
    ProcessKey,
    Sample,
)
from enforcer.core.model import ProcessUsage as Usage
from enforcer.core.payloads import Pod
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.modes.lender import Lender
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import ClaimReads, NodeView
from tests.unit.test_shared_claims import GPUS, RES, SLICE, cid, claim, pod

GPU0 = GPUS["gpu-0"]
SHARING = ["a", "b", "c", "d"]


def never(pod: Any) -> Any:
    """A read of claims that the part under test must not make (the lender takes them as
    last read; the hard limiter reads them again)."""
    raise AssertionError("not read here")


def shared(size: int) -> tuple[dict[str, Pod], DraObjects]:
    """Four pods that name one claim, the API's reservation listing them all, not started."""
    pods = [pod(name, "shared", "Pending") for name in SHARING]
    for p in pods:
        p["status"] = {"phase": "Pending"}
    read = claim("shared", size, *SHARING)
    return {p["metadata"]["uid"]: p for p in pods}, DraObjects({"shared": read}, (SLICE,))


def test_the_lender_owes_a_shared_claim_once() -> None:
    """40 GiB: a borrower (a 4 GiB claim, a 24 GiB ceiling) holds 20, so 20 are free. The
    four pods of a 10 GiB claim are owed 10 there, not 40: the borrower keeps what it holds.
    Of a 24 GiB claim they are owed 24: 6 short with the 2 GiB watermark."""
    borrower = pod("burst", "own")
    env = borrower["spec"]["initContainers"][0]["env"]
    env.append({"name": "VRAM_ENFORCER_CEILINGS", "value": '{"c": 25769803776}'})
    burst = cid("burst")
    own = DraObjects({"own": claim("own", 4 * GiB, "burst")}, (SLICE,))
    seen = Sample(
        1.0,
        (Device(0, GPU0, "H100", 40 * GiB, 20 * GiB),),
        (Usage(ProcessKey(1, 1), GPU0, 20 * GiB),),
    )

    def lender(size: int) -> Lender:
        pods, objects = shared(size)
        everyone = {**pods, borrower["metadata"]["uid"]: borrower}
        read = {**dict.fromkeys(pods, objects), borrower["metadata"]["uid"]: own}
        return Lender(
            NodeView(
                lambda: everyone,
                lambda: frozenset({"ml"}),
                Declares(RES),
                ClaimReads(lambda p: read[p["metadata"]["uid"]], never, DraSettings()),
            ),
            threading.Event(),
            2 * GiB,
            AgentTelemetry(),
        )

    lending = lender(10 * GiB)(seen, lambda: {ProcessKey(1, 1): burst})
    assert lending is not None and lending.reclaims == {}
    assert lending.gpus[0].requested == 4 * GiB + 10 * GiB
    lending = lender(24 * GiB)(seen, lambda: {ProcessKey(1, 1): burst})
    assert lending is not None and list(lending.reclaims) == [burst]
    assert lending.reclaims[burst].shortfall == 6 * GiB


class RecordingNvml:
    """NVML's per-cgroup limits as the limiter calls them: every limit set, recorded."""

    driver_version = "615.00"

    def __init__(self) -> None:
        self.set: dict[tuple[str, str], int] = {}
        self.soft: dict[tuple[str, str], int] = {}

    def set_memory_limit(self, gpu: str, cgroup: str, hard: int, soft: int = 0) -> LimitOutcome:
        self.set[(cgroup, gpu)], self.soft[(cgroup, gpu)] = hard, soft
        return LimitOutcome(LimitResult.SET)

    def memory_limit(self, gpu: str, cgroup: str) -> HeldLimit | None:
        """What was set, as the driver reads it back."""
        hard = self.set.get((cgroup, gpu))
        return None if hard is None else HeldLimit(hard, self.soft[(cgroup, gpu)], 0)

    def clear_memory_limit(self, gpu: str, cgroup: str) -> LimitOutcome:
        self.set.pop((cgroup, gpu), None)
        self.soft.pop((cgroup, gpu), None)
        return LimitOutcome(LimitResult.SET)


def test_each_pod_cgroup_gets_its_part_of_a_shared_claim(tmp_path: Path) -> None:
    """A 10 GiB claim that four pods reserve: each pod's cgroup is held to 2.5 GiB on the
    claim's GPU, so the driver lets the four hold 10 GiB between them, not 40."""
    pods, objects = shared(10 * GiB)
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    kubepods = tmp_path / "kubepods.slice"
    for uid in pods:
        (kubepods / f"kubepods-pod{uid.replace('-', '_')}.slice").mkdir(parents=True)
    nvml = RecordingNvml()
    devices = [Device(0, GPU0, "L4", 24 * GiB, 0)]
    usage: Mapping[str, Mapping[str, int]] = {}
    limiter = HardLimiter(
        cast(Nvml, nvml),
        NodeView(
            lambda: pods,
            lambda: frozenset({"ml"}),
            Declares(RES),
            ClaimReads(never, lambda p: objects, DraSettings()),
        ),
        cast(Any, SimpleNamespace(devices=Latest(devices), container_usage=Latest(usage))),
        cast(Any, None),
        AgentTelemetry(),
        cgroups=(tmp_path, 60.0),
        changed=threading.Event(),
    )
    limiter._pass()  # one pass, as its thread runs it on each change of the pods
    assert sorted(nvml.set.values()) == [10 * GiB // 4] * 4
    assert {gpu for _, gpu in nvml.set} == {GPU0}
