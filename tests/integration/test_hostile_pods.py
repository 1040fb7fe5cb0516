"""One pod's garbage is that pod's alone (issue 35, item 8). A node of good pods, and of pods
in a namespace the webhook does not mutate whose container named like the sidecar carries
an environment no webhook wrote (`[` nested 100,000 deep, a portion past decimal's range, a
4,000-digit integer, a quantity where bytes belong): each of them made every pass of the
agent's lender, hard limiter and backstop raise, for every pod of the node. The agent's
consumers run as the agent runs them; each still does its work for the good pods and says
once why each other pod declares nothing; and a lender pass that fails publishes no
lending, so that no sidecar lets its containers borrow on a decision never made."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from enforcer.core.declaration import ENFORCED, SIDECAR
from enforcer.core.model import Device, GiB, ProcessKey, Sample
from enforcer.core.model import ProcessUsage as Usage
from enforcer.core.payloads import Pod
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import NvmlSource
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sources import PidView
from enforcer.edge.tenants import Tenants
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from enforcer.modes.agent import Sampler
from enforcer.modes.backstop import Backstop
from enforcer.modes.lender import Lender
from enforcer.modes.limiter import HardLimiter
from tests.integration.test_backstop import Recorded
from tests.integration.test_shared_claims_agent import RecordingNvml
from tests.unit.test_declaration import POISON
from tests.unit.test_shared_claims import uid

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

RES = "vram-enforcer.io/vram"
GPU = "GPU-0"
BURST, OWED = "b" * 64, "c" * 64
KINDS = ("deep", "overflowing portion", "huge integer", "wrong types")
# 32 GiB: the burster (4 GiB requested, 24 allowed) holds 20; the other pod is owed 14 of
# its 16 and holds 2, so 6 are short with the 2 GiB watermark: the burster gives them back.
SEEN = Sample(1.0, (Device(0, GPU, "H100", 32 * GiB, 22 * GiB),),
              (Usage(ProcessKey(1, 1), GPU, 20 * GiB), Usage(ProcessKey(2, 2), GPU, 2 * GiB)))  # fmt: skip
CONTAINERS = {ProcessKey(1, 1): BURST, ProcessKey(2, 2): OWED}


def running(name: str, namespace: str, cid: str, limits: Mapping[str, str],
            env: Mapping[str, str], version: str = "") -> Pod:  # fmt: skip
    """A running pod of one container `c` (ID `cid`) and a container named like the sidecar."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid(name),
                            "labels": {ENFORCED: "true"}}  # fmt: skip
    if version:
        meta["resourceVersion"] = version
    spec = {"containers": [
        {"name": "c", "resources": {"limits": dict(limits)}},
        {"name": SIDECAR, "env": [{"name": k, "value": v} for k, v in env.items()]},
    ]}  # fmt: skip
    status = {"phase": "Running",
              "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid}"}]}  # fmt: skip
    return cast(Pod, {"metadata": meta, "spec": spec, "status": status})


def poisoned(kind: str) -> Pod:
    """In a namespace the webhook does not mutate: nothing there checks what it carries."""
    return running(kind.replace(" ", "-"), "elsewhere", f"{len(kind):064x}", {}, POISON[kind])


def node() -> dict[str, Pod]:
    good = [
        running("burst", "ml", BURST, {RES: "4Gi"},
                {"VRAM_ENFORCER_CEILINGS": f'{{"c": {24 * GiB}}}'}, version="1"),
        running("owed", "ml", OWED, {RES: "16Gi"}, {}, version="1"),
    ]  # fmt: skip
    return {p["metadata"]["uid"]: p for p in [*good, *map(poisoned, KINDS)]}


def said_once(caplog: pytest.LogCaptureFixture, what: str) -> None:
    """Each poisoned pod said once, with its reason, however many passes went by."""
    for kind in KINDS:
        lines = [r.getMessage() for r in caplog.records
                 if f"elsewhere/{kind.replace(' ', '-')}" in r.getMessage()]  # fmt: skip
        assert len(lines) == 1, lines
        assert f"{what}declares nothing: VRAM_ENFORCER_" in lines[0], lines[0]


def test_the_lender_still_reclaims_for_the_good_pods(caplog: pytest.LogCaptureFixture) -> None:
    pods, changed = node(), threading.Event()
    lender = Lender(lambda: pods, changed, (RES, 1), SIDECAR, 2 * GiB, AgentTelemetry())
    with caplog.at_level(logging.WARNING, "enforcer.modes.lender"):
        for _ in range(3):
            changed.set()  # a change of the node's pods: every pod is read again
            lending = lender(SEEN, lambda: CONTAINERS)
            assert lending is not None and list(lending.reclaims) == [BURST]
            assert lending.reclaims[BURST].shortfall == 6 * GiB
    said_once(caplog, "")


def test_the_hard_limiter_still_sets_the_good_pods_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pods = node()
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    for each in pods:
        (tmp_path / "kubepods.slice" / f"kubepods-pod{each.replace('-', '_')}.slice").mkdir(
            parents=True
        )
    nvml = RecordingNvml()
    devices = [Device(0, GPU, "H100", 80 * GiB, 0)]
    limiter = HardLimiter(
        cast(Nvml, nvml), lambda: pods, lambda: devices, dict, cast(Any, None), AgentTelemetry(),
        cgroup_root=tmp_path, resource=(RES, 1), scan_every=60.0, changed=threading.Event(),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, "enforcer.modes.limiter"):
        for _ in range(3):  # the poisoned pods have no resourceVersion: read on every pass
            limiter._pass()
    # Each good pod's cgroup, held to its ceiling (the burster) or its limit.
    assert sorted(nvml.set.values()) == [16 * GiB, 24 * GiB]
    assert {cgroup.rsplit("-pod", 1)[1].replace("_", "-") for cgroup, _ in nvml.set} == {
        f"{uid('burst')}.slice", f"{uid('owed')}.slice"}  # fmt: skip
    said_once(caplog, "")


def test_the_backstop_still_holds_a_silent_good_pod(caplog: pytest.LogCaptureFixture) -> None:
    """Every sidecar but the burster's is silent: the good pod among them is held (within its
    limit: nobody is signalled), and each poisoned one is said to be beyond the agent."""
    pods, telemetry = node(), AgentTelemetry()
    silent = frozenset(each for each in pods if each != uid("burst"))
    backstop = Backstop(lambda: pods, lambda: silent, (RES, 1), SIDECAR,
                        cast("EventRecorder", Recorded()), telemetry, ProcFs())  # fmt: skip
    with caplog.at_level(logging.WARNING, "enforcer.modes.backstop"):
        for _ in range(3):
            backstop(SEEN, lambda: CONTAINERS)
    assert telemetry.registry.get_sample_value("vram_enforcer_pods_held_by_agent") == 1
    assert any("elsewhere" not in r.getMessage() and "ml/owed: its sidecar is silent; the agent "
               "enforces its limits itself (c 16.00 GiB)" in r.getMessage()
               for r in caplog.records), caplog.text  # fmt: skip
    said_once(caplog, "its sidecar is silent, and the agent cannot hold it: ")


class _Given:
    """The sampler's NVML source: this pass's sample."""

    def sample(self) -> Sample:
        return SEEN


class _Counted:
    """The sampler's count of each GPU process's container."""

    def count(self, sample: Sample) -> dict[str, int]:
        return {}

    def containers(self) -> dict[ProcessKey, str]:
        return CONTAINERS


def test_a_lender_pass_that_fails_publishes_no_lending(tmp_path: Path) -> None:
    """The replies said `lending: true` from a decision the lender never made: a failed pass
    became "nobody is asked", and the next passes decided on the tenants from before it."""
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=60.0)
    broken = threading.Event()
    pods = node()

    def listed() -> dict[str, Pod]:
        if broken.is_set():
            raise RuntimeError("a bug in the lender's pass")
        return pods

    changed = threading.Event()
    sampler = Sampler(cast(NvmlSource, _Given()), server, telemetry, 1.0, threading.Event(),
                      cast(Tenants, _Counted()))  # fmt: skip
    sampler.lender = Lender(listed, changed, (RES, 1), SIDECAR, 2 * GiB, telemetry)
    view = PidView(ProcFs(), 4026531001, 1)

    def lending() -> bool:
        sampler._pass()  # one NVML pass, as the sampler's thread runs it
        return b'"lending":true' in server.reply(view)

    try:
        assert lending()
        broken.set()
        changed.set()
        assert not lending()  # the pass that failed
        assert not lending()  # and no decision on the tenants from before it
        assert telemetry.node.lending == ()
        broken.clear()
        assert lending()
    finally:
        server.close()
