"""One pod's garbage is that pod's alone (issue 35, item 8). A node of good pods, and of pods
in a namespace the webhook does not mutate whose container named like the sidecar carries
an environment no webhook wrote (`[` nested 100,000 deep, a portion past decimal's range, a
4,000-digit integer, a quantity where bytes belong): each of them made every pass of the
agent's lender, hard limiter and backstop raise, for every pod of the node. The agent's
consumers run as the agent runs them; each still does its work for the good pods and says
once why each other pod declares nothing; and a lender pass that fails publishes no
lending, so that no sidecar lets its containers borrow on a decision never made. Nor is a
well-formed environment read there (item 8(b)): only in namespaces that opted in."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn, cast

import pytest
from kubernetes import client

from enforcer.core.attribution import PodTerms
from enforcer.core.declaration import ENFORCED, SIDECAR, Declares, of_sidecar
from enforcer.core.lending import Lending
from enforcer.core.model import Device, GiB, ProcessKey, Sample
from enforcer.core.model import ProcessUsage as Usage
from enforcer.core.payloads import Pod
from enforcer.edge.agent_link import AgentLink
from enforcer.edge.kube import api_client
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.namespaces import OptedInNamespaces
from enforcer.edge.nvml import Nvml
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import ServerMetrics, UsageServer
from enforcer.modes import lender as lender_mode
from enforcer.modes.agent import PodSteps
from enforcer.modes.backstop import Backstop
from enforcer.modes.lender import LENDING_HOLD, Lender
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from enforcer.modes.sidecar_units import ContainerAttributor
from tests.helpers import copy_proc_fixture, wait_for
from tests.integration.test_backstop import Recorded, sampling
from tests.integration.test_shared_claims_agent import RecordingNvml
from tests.pods_api import serving
from tests.unit.test_declaration import POISON
from tests.unit.test_shared_claims import uid

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

RES = "vram-enforcer.io/vram"
GPU = "GPU-0"
BURST, OWED = "b" * 64, "c" * 64
KINDS = ("deep", "overflowing portion", "huge integer", "wrong types")
# 32 GiB: the borrower (4 GiB requested, 24 allowed) holds 20; the other pod is owed 14 of
# its 16 and holds 2, so 6 are short with the 2 GiB watermark: the borrower gives them back.
SEEN = Sample(
    1.0,
    (Device(0, GPU, "H100", 32 * GiB, 22 * GiB),),
    (Usage(ProcessKey(1, 1), GPU, 20 * GiB), Usage(ProcessKey(2, 2), GPU, 2 * GiB)),
)
CONTAINERS = {ProcessKey(1, 1): BURST, ProcessKey(2, 2): OWED}
# The namespaces whose pods' sidecar environment the agent reads. The poisoned pods' is
# among them here, so that what they carry is read, and must be read without an error:
# the parsers are total wherever they read (a namespace that has not opted in is read not
# at all: the tests at the end).
READ = frozenset({"ml", "elsewhere"})


def running(
    name: str,
    namespace: str,
    cid: str,
    limits: Mapping[str, str],
    env: Mapping[str, str],
    version: str = "",
) -> Pod:
    """A running pod of one container `c` (ID `cid`) and a container named like the sidecar."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid(name),
        "labels": {ENFORCED: "true"},
    }
    if version:
        meta["resourceVersion"] = version
    spec = {
        "containers": [
            {"name": "c", "resources": {"limits": dict(limits)}},
            {"name": SIDECAR, "env": [{"name": k, "value": v} for k, v in env.items()]},
        ]
    }
    status = {
        "phase": "Running",
        "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid}"}],
    }
    return cast(Pod, {"metadata": meta, "spec": spec, "status": status})


def poisoned(kind: str) -> Pod:
    """In a namespace the webhook does not mutate: nothing there checks what it carries."""
    return running(kind.replace(" ", "-"), "elsewhere", f"{len(kind):064x}", {}, POISON[kind])


def node() -> dict[str, Pod]:
    good = [
        running(
            "burst",
            "ml",
            BURST,
            {RES: "4Gi"},
            {"VRAM_ENFORCER_CEILINGS": f'{{"c": {24 * GiB}}}'},
            version="1",
        ),
        running("owed", "ml", OWED, {RES: "16Gi"}, {}, version="1"),
    ]
    return {p["metadata"]["uid"]: p for p in [*good, *map(poisoned, KINDS)]}


def said_once(caplog: pytest.LogCaptureFixture, what: str) -> None:
    """Each poisoned pod said once, with its reason, however many passes went by."""
    for kind in KINDS:
        lines = [
            r.getMessage()
            for r in caplog.records
            if f"elsewhere/{kind.replace(' ', '-')}" in r.getMessage()
        ]
        assert len(lines) == 1, lines
        assert f"{what}declares nothing: VRAM_ENFORCER_" in lines[0], lines[0]


def test_the_lender_still_reclaims_for_the_good_pods(caplog: pytest.LogCaptureFixture) -> None:
    pods, changed = node(), threading.Event()
    lender = Lender(
        NodeView(lambda: pods, lambda: READ, Declares(RES)), changed, 2 * GiB, AgentTelemetry()
    )
    with caplog.at_level(logging.WARNING, "enforcer.modes.lender"):
        for _ in range(3):
            changed.set()  # a change of the node's pods: every pod is read again
            lending = lender(SEEN, lambda: CONTAINERS)
            assert lending is not None and list(lending.reclaims) == [BURST]
            assert lending.reclaims[BURST].shortfall == 6 * GiB
    said_once(caplog, "")


def holding_all_but_burst(pods: dict[str, Pod], telemetry: AgentTelemetry) -> Backstop:
    """The agent's backstop over `pods`, every one silent but `burst`."""
    silent = frozenset(each for each in pods if each != uid("burst"))
    return Backstop(
        NodeView(lambda: pods, lambda: READ, Declares(RES)),
        lambda: silent,
        cast("EventRecorder", Recorded()),
        telemetry,
        ProcFs(),
    )


def hard_limiter(
    pods: dict[str, Pod],
    tmp_path: Path,
    telemetry: AgentTelemetry,
    trusted: frozenset[str] = READ,
) -> tuple[HardLimiter, RecordingNvml]:
    """The agent's hard limiter of `pods` (each with its cgroup under `tmp_path`), on one
    GPU, with the namespaces that opted in, and what it set there."""
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    for each in pods:
        (tmp_path / "kubepods.slice" / f"kubepods-pod{each.replace('-', '_')}.slice").mkdir(
            parents=True
        )
    nvml = RecordingNvml()
    devices = [Device(0, GPU, "H100", 80 * GiB, 0)]
    limiter = HardLimiter(
        cast(Nvml, nvml),
        NodeView(lambda: pods, lambda: trusted, Declares(RES)),
        cast(Any, SimpleNamespace(devices=Latest(devices), container_usage=Latest({}))),
        cast(Any, None),
        telemetry,
        cgroups=(tmp_path, 60.0),
        changed=threading.Event(),
    )
    return limiter, nvml


def test_the_hard_limiter_still_sets_the_good_pods_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pods = node()
    limiter, nvml = hard_limiter(pods, tmp_path, AgentTelemetry())
    with caplog.at_level(logging.WARNING, "enforcer.modes.limiter"):
        for _ in range(3):  # the poisoned pods have no resourceVersion: read on every pass
            limiter._pass()
    # Each good pod's cgroup, held to its ceiling (the borrower) or its limit.
    assert sorted(nvml.set.values()) == [16 * GiB, 24 * GiB]
    assert {cgroup.rsplit("-pod", 1)[1].replace("_", "-") for cgroup, _ in nvml.set} == {
        f"{uid('burst')}.slice",
        f"{uid('owed')}.slice",
    }
    said_once(caplog, "")


def test_the_backstop_still_holds_a_silent_good_pod(caplog: pytest.LogCaptureFixture) -> None:
    """Every sidecar but the borrower's is silent: the good pod among them is held (within its
    limit: nobody is signalled), and each poisoned one is said to be beyond the agent."""
    pods, telemetry = node(), AgentTelemetry()
    backstop = holding_all_but_burst(pods, telemetry)
    with caplog.at_level(logging.WARNING, "enforcer.modes.backstop"):
        for _ in range(3):
            backstop(SEEN, lambda: CONTAINERS, None)
    assert telemetry.registry.get_sample_value("vram_enforcer_pods_held_by_agent") == 1
    assert any(
        "elsewhere" not in r.getMessage()
        and "ml/owed: its sidecar is silent; the agent enforces its limits itself (c 16.00 GiB)"
        in r.getMessage()
        for r in caplog.records
    ), caplog.text
    said_once(caplog, "its sidecar is silent, and the agent cannot hold it: ")


class _Tripping(dict[str, Any]):
    """A pod whose data trips a bug in whatever reads its spec: any bug one pod's data may
    trip in the lender's pass, one that no test of ours knows yet."""

    def get(self, key: str, default: Any = None) -> Any:
        if key == "spec":
            raise RuntimeError("a bug this pod's data trips")
        return super().get(key, default)


def _bug(*args: object) -> NoReturn:
    """A bug in the lender's pass, whatever trips it."""
    raise RuntimeError("a bug in the lender's pass")


def test_a_pod_whose_data_trips_a_bug_in_the_lender_is_left_out_and_the_others_lent_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One bad object never stops the handling of the others (found by review of issue 42's
    change: a bug one pod's data tripped failed the whole pass, and after LENDING_HOLD every
    borrower of the node was held to its request): that pod alone is left out, the bug
    counted and the pod said once, and the borrower is still reclaimed from for the good
    pod's request, on every pass."""
    telemetry, pods, changed = AgentTelemetry(), node(), threading.Event()
    lender = Lender(
        NodeView(lambda: pods, lambda: READ, Declares(RES)), changed, 2 * GiB, telemetry
    )
    pods[uid("tripping")] = cast(Pod, _Tripping(running("tripping", "ml", "f" * 64, {}, {})))
    failed = telemetry.unexpected.labels("lending")
    with caplog.at_level(logging.ERROR, "enforcer.modes.lender"):
        for _ in range(3):
            lending = lender(SEEN, lambda: CONTAINERS)
            assert lending is not None and list(lending.reclaims) == [BURST]
            changed.set()  # read again each pass: the bad pod fails each read
    assert failed._value.get() == 3
    said = [
        r.getMessage() for r in caplog.records if "reading what it is owed failed" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith("pod ml/tripping:"), said


def test_a_pod_whose_data_trips_a_bug_in_the_hard_limiter_or_the_backstop_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lender's test above, for the agent's two other loops over the node's pods
    (found reading issue 42's change: one guard covered the limiter's whole pass, and the
    backstop's silent pods, so one pod's bug left every pod unlimited, or every silent pod
    after it unheld): that pod alone is left out, counted and said once."""
    pods, telemetry = node(), AgentTelemetry()
    pods[uid("tripping")] = cast(Pod, _Tripping(running("tripping", "ml", "f" * 64, {}, {})))
    limiter, nvml = hard_limiter(pods, tmp_path, telemetry)
    backstop = holding_all_but_burst(pods, telemetry)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            limiter._pass()
            backstop(SEEN, lambda: CONTAINERS, None)
    assert sorted(nvml.set.values()) == [16 * GiB, 24 * GiB]  # the good pods' limits
    assert telemetry.registry.get_sample_value("vram_enforcer_pods_held_by_agent") == 1
    for loop in ("hard-limiter", "backstop"):
        assert telemetry.unexpected.labels(loop)._value.get() == 3, loop
        said = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("pod ml/tripping:") and f'loop="{loop}"' in r.getMessage()
        ]
        assert len(said) == 1, (loop, said)


class _Fresh:
    """The sampler's NVML source: SEEN, as a new sample on each pass, the borrower's process
    seen from this process's PID namespace (where its sidecar's client is, here)."""

    def __init__(self) -> None:
        self.at = 1.0
        mine = (ProcFs().pid_ns(os.getpid()) or 0, 1)
        borrower, other = SEEN.processes
        self.processes = (replace(borrower, namespaces=(mine,)), other)

    def sample(self) -> Sample:
        self.at += 1.0
        return replace(SEEN, sampled_at=self.at, processes=self.processes)


def test_a_failed_lender_pass_keeps_lending_for_a_bounded_time_and_holds_nobody_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42, item 8: a pass that failed published no lending, so every sidecar at once
    held its borrowers to their requests: one bug SIGTERMed every borrower of the node. Now
    the agent still lends for LENDING_HOLD after its last good pass, and asks nothing new,
    so the borrower's sidecar (its real client of the agent's socket and its real
    attributor) holds it to its ceiling; only once the passes have failed that long is
    lending withdrawn, and the borrower held to its request (a neighbour's request goes
    unmet no longer than that). Each is said once, each failed pass counted. (A bug one
    pod's data trips fails no pass: that pod alone is left out, the test below.)"""
    telemetry = AgentTelemetry()
    metrics = ServerMetrics(telemetry.requests, telemetry.connections, telemetry.unexpected)
    server = UsageServer(tmp_path / "agent.sock", ProcFs(), metrics, stale_after=60.0)
    server.start()
    pods, changed, now = node(), threading.Event(), [100.0]
    lender = Lender(
        NodeView(lambda: pods, lambda: READ, Declares(RES)),
        changed,
        2 * GiB,
        telemetry,
        clock=lambda: now[0],
    )
    source = _Fresh()
    sampler = sampling(source, server, telemetry, lambda: CONTAINERS, PodSteps(lender))
    link = AgentLink(str(tmp_path / "agent.sock"), stale_after=60.0)
    # The borrower's sidecar: 4 GiB requested, up to 24 while the agent lends; its pod's
    # container `c` is pid 12 of the fixture's /proc (container 7777...).
    seen_by_sidecar = {
        "status": {"containerStatuses": [{"name": "c", "containerID": f"containerd://{'7' * 64}"}]}
    }
    sidecar = ContainerAttributor(
        ProcFs(copy_proc_fixture("pod", tmp_path / "proc")),
        cast(Any, SimpleNamespace(pod=seen_by_sidecar, error=None, refresh=lambda: None)),
        PodTerms(of_sidecar({"c": 4 * GiB}, {"c": 24 * GiB}, {}, {}, claims=False)),
        want_init=False,
        lending=lambda: link.lending,
    )
    own = Sample(1.0, SEEN.devices, (Usage(ProcessKey(12, 500100), GPU, 20 * GiB),))
    failed = telemetry.unexpected.labels("lending")

    def borrower_held_to() -> int:
        """One NVML pass, as the sampler's thread runs it, and the borrower's sidecar's
        tick on the reply it pushes: what the sidecar holds the borrower to."""
        sampler._pass()
        wait_for(
            lambda: isinstance(got := link.sample(), Sample) and got.sampled_at == source.at,
            what="the pass's reply",
        )
        (unit,) = [u for u in sidecar.attribute(own) if u.name == "c"]
        return unit.limit_bytes

    try:
        with caplog.at_level(logging.INFO, "enforcer.modes.lender"):
            assert borrower_held_to() == 24 * GiB and list(link.reclaims) == [BURST]
            monkeypatch.setattr(lender_mode, "decide", _bug)
            now[0] += 1.0
            assert borrower_held_to() == 24 * GiB  # still lent, at once: nobody is held
            assert link.reclaims == {}  # and nothing new is asked
            now[0] += LENDING_HOLD - 1.5
            assert borrower_held_to() == 24 * GiB  # within the bound
            now[0] += 1.0
            assert borrower_held_to() == 4 * GiB  # past it: lending withdrawn
            assert borrower_held_to() == 4 * GiB and failed._value.get() == 4
            monkeypatch.undo()
            assert borrower_held_to() == 24 * GiB and list(link.reclaims) == [BURST]
    finally:
        link.close()
        server.close()
    said = [r.getMessage() for r in caplog.records if r.name == "enforcer.modes.lender"]
    assert sum("a pass of the lender failed" in m for m in said) == 1, said
    assert sum("lending is withdrawn" in m for m in said) == 1, said
    assert sum("succeed again" in m for m in said) == 1, said


# --- A sidecar's environment is read only in the namespaces that opted in (item 8(b)) ----
#
# Well-formed, what a tenant writes into a container named like the sidecar, in a namespace
# the webhook does not mutate: the forger declares 16 GiB the scheduler never counted
# (holding 1, it would be owed 15), the greedy pod gives itself a ceiling of 24 GiB above
# the 2 its resources declare, and a policy of `warn`. 32 GiB: the borrower (4 GiB
# requested, 24 allowed) holds 12; the owed pod holds its 8; 5 are free.
FORGER, GREEDY = "d" * 64, "e" * 64
FORGED = Sample(
    1.0,
    (Device(0, GPU, "H100", 32 * GiB, 27 * GiB),),
    (
        Usage(ProcessKey(1, 1), GPU, 12 * GiB),
        Usage(ProcessKey(2, 2), GPU, 8 * GiB),
        Usage(ProcessKey(3, 3), GPU, 1 * GiB),
        Usage(ProcessKey(4, 4), GPU, 6 * GiB),
    ),
)
FORGED_CONTAINERS = {
    ProcessKey(1, 1): BURST,
    ProcessKey(2, 2): OWED,
    ProcessKey(3, 3): FORGER,
    ProcessKey(4, 4): GREEDY,
}
WARN = {"VRAM_ENFORCER_ACTION": "warn"}


def forged_node() -> dict[str, Pod]:
    pods = [
        running(
            "burst",
            "ml",
            BURST,
            {RES: "4Gi"},
            {"VRAM_ENFORCER_CEILINGS": f'{{"c": {24 * GiB}}}'},
            version="1",
        ),
        running("owed", "ml", OWED, {RES: "8Gi"}, {}, version="1"),
        running(
            "forger",
            "elsewhere",
            FORGER,
            {},
            {"VRAM_ENFORCER_LIMITS": f'{{"c": {16 * GiB}}}', **WARN},
            version="1",
        ),
        running(
            "greedy",
            "elsewhere",
            GREEDY,
            {RES: "2Gi"},
            {"VRAM_ENFORCER_CEILINGS": f'{{"c": {24 * GiB}}}', **WARN},
            version="1",
        ),
    ]
    return {p["metadata"]["uid"]: p for p in pods}


NOT_OPTED_IN = (
    "namespace 'elsewhere' is not labelled vram-enforcer.io/inject=enabled (or is "
    "the agent's own), so the webhook never wrote its sidecar's environment"
)


def test_a_forged_sidecar_environment_is_read_only_once_its_namespace_opts_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not opted in, the forger declares nothing and the greedy pod borrows nothing: nobody
    is reclaimed from, and each is said once. Once their namespace is labelled (the same
    pods, unchanged), the forger is owed 15 GiB and the borrower is reclaimed for it; the
    greedy pod, in `warn` now that its environment is read, still borrows nothing (a pod
    only reported on is owed its request alone)."""
    pods, changed = forged_node(), threading.Event()
    trusted: list[frozenset[str] | None] = [None]
    lender = Lender(
        NodeView(lambda: pods, lambda: trusted[0], Declares(RES)),
        changed,
        2 * GiB,
        AgentTelemetry(),
    )
    # Before the namespaces are listed, no declaration but the resources' is known: nobody
    # is asked for memory back, whatever the pods would declare.
    assert lender(FORGED, lambda: FORGED_CONTAINERS) == Lending()
    trusted[0] = frozenset({"ml"})
    with caplog.at_level(logging.WARNING, "enforcer.modes.lender"):
        for _ in range(3):
            changed.set()
            lending = lender(FORGED, lambda: FORGED_CONTAINERS)
            assert lending is not None and lending.reclaims == {}
    assert lending is not None
    (gpu,) = lending.gpus
    assert {s.unit: (s.request, s.ceiling) for s in gpu.shares} == {
        "ml/burst/c": (4 * GiB, 24 * GiB),
        "ml/owed/c": (8 * GiB, 8 * GiB),
        "elsewhere/greedy/c": (2 * GiB, 2 * GiB),
    }
    said = [r.getMessage() for r in caplog.records if "elsewhere/" in r.getMessage()]
    assert said == [
        f"pod elsewhere/forger declares nothing: {NOT_OPTED_IN}: VRAM_ENFORCER_LIMITS not read",
        f"pod elsewhere/greedy borrows nothing: {NOT_OPTED_IN}: VRAM_ENFORCER_CEILINGS not read",
    ], said
    trusted[0] = frozenset({"ml", "elsewhere"})  # labelled: the next pass reads them
    lending = lender(FORGED, lambda: FORGED_CONTAINERS)
    assert lending is not None and BURST in lending.reclaims
    assert lending.reclaims[BURST].owed_to == ("a container of another namespace",)
    (gpu,) = lending.gpus
    assert {s.unit: s.ceiling for s in gpu.shares}["elsewhere/greedy/c"] == 2 * GiB


def test_the_hard_limiter_reads_a_sidecar_environment_only_where_its_namespace_opted_in(
    tmp_path: Path,
) -> None:
    """The forger gets no limit (it declares nothing), the greedy pod its resources' 2 GiB,
    not its forged ceiling; once the namespace opts in, the same pods are read again: both
    are in `warn` there, only reported on, and so get no hard limit (the greedy pod's is
    cleared)."""
    pods = forged_node()
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    cgroups = {each: f"kubepods-pod{each.replace('-', '_')}.slice" for each in pods}
    for each in cgroups.values():
        (tmp_path / "kubepods.slice" / each).mkdir(parents=True)
    nvml = RecordingNvml()
    devices = [Device(0, GPU, "H100", 80 * GiB, 0)]
    trusted: list[frozenset[str] | None] = [None]
    limiter = HardLimiter(
        cast(Nvml, nvml),
        NodeView(lambda: pods, lambda: trusted[0], Declares(RES)),
        cast(Any, SimpleNamespace(devices=Latest(devices), container_usage=Latest({}))),
        cast(Any, None),
        AgentTelemetry(),
        cgroups=(tmp_path, 60.0),
        changed=threading.Event(),
    )

    def limits() -> dict[str, int]:
        """Pod name -> the limit on its pod's cgroup."""
        name = {cgroups[u]: p["metadata"]["name"] for u, p in pods.items()}
        return {name[cg.rsplit("/", 1)[1]]: limit for (cg, _), limit in nvml.set.items()}

    limiter._pass()
    assert nvml.set == {}  # the namespaces not listed yet: nothing set (or cleared)
    trusted[0] = frozenset({"ml"})
    limiter._pass()
    assert limits() == {"burst": 24 * GiB, "owed": 8 * GiB, "greedy": 2 * GiB}
    trusted[0] = frozenset({"ml", "elsewhere"})
    limiter._pass()
    assert limits() == {"burst": 24 * GiB, "owed": 8 * GiB}


def test_a_pod_in_dry_run_gets_no_hard_limit_where_the_webhook_wrote_it(tmp_path: Path) -> None:
    """A pod rolled out in dry-run (the webhook's `VRAM_ENFORCER_DRY_RUN=true`) is only
    reported on: a driver's limit would refuse its allocations, and no excursion would ever
    be seen. Where the webhook never wrote it (a namespace not opted in), the same variable
    is not believed: its resources' limit holds."""
    rehearsal = {"VRAM_ENFORCER_ACTION": "terminate", "VRAM_ENFORCER_DRY_RUN": "true"}
    pods = {
        p["metadata"]["uid"]: p
        for p in (
            running("owed", "ml", OWED, {RES: "8Gi"}, {}, version="1"),
            running("rollout", "ml", BURST, {RES: "4Gi"}, rehearsal, version="1"),
            running("forged", "elsewhere", GREEDY, {RES: "2Gi"}, rehearsal, version="1"),
        )
    }
    limiter, nvml = hard_limiter(pods, tmp_path, AgentTelemetry(), frozenset({"ml"}))
    limiter._pass()
    cgroup = {f"kubepods-pod{u.replace('-', '_')}.slice": p for u, p in pods.items()}
    limits = {
        cgroup[cg.rsplit("/", 1)[1]]["metadata"]["name"]: v for (cg, _), v in nvml.set.items()
    }
    assert limits == {"owed": 8 * GiB, "forged": 2 * GiB}


def test_the_backstop_takes_no_forged_policy_outside_the_namespaces_that_opted_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every sidecar is silent. The greedy pod is held to what its resources declare, with
    the sidecar's defaults (`terminate`), not the `warn` it wrote; the forger, declaring
    nothing, is said to be beyond the agent's hold. Before the namespaces are listed, nobody
    is held. (The processes' pids are not theirs: no signal reaches any.)"""
    pods, telemetry = forged_node(), AgentTelemetry()
    trusted: list[frozenset[str] | None] = [None]
    backstop = Backstop(
        NodeView(lambda: pods, lambda: trusted[0], Declares(RES)),
        lambda: frozenset(pods),
        cast("EventRecorder", Recorded()),
        telemetry,
        ProcFs(),
    )
    with caplog.at_level(logging.WARNING):
        backstop(FORGED, lambda: FORGED_CONTAINERS, None)
        assert telemetry.registry.get_sample_value("vram_enforcer_pods_held_by_agent") == 0
        assert caplog.records == []
        trusted[0] = frozenset({"ml"})
        for _ in range(3):
            backstop(FORGED, lambda: FORGED_CONTAINERS, None)
    assert telemetry.registry.get_sample_value("vram_enforcer_pods_held_by_agent") == 3
    messages = [r.getMessage() for r in caplog.records]
    greedy = [m for m in messages if "6.00 GiB of its 2.00 GiB" in m]
    assert greedy[0].endswith("(300%); enforcing (terminate)"), greedy
    said = sorted(m for m in messages if "elsewhere/" in m)
    assert said == [
        "pod elsewhere/forger: its sidecar is silent, and the agent cannot hold it: declares "
        f"nothing: {NOT_OPTED_IN}: VRAM_ENFORCER_LIMITS not read",
        "pod elsewhere/greedy: its sidecar is silent; the agent enforces its limits itself "
        "(c 2.00 GiB)",
    ], said


def namespace(name: str, labelled: bool = True) -> dict[str, Any]:
    labels = {"kubernetes.io/metadata.name": name}
    if labelled:
        labels["vram-enforcer.io/inject"] = "enabled"
    return {"metadata": {"name": name, "uid": f"ns-{name}", "labels": labels}}


def test_the_lender_reads_what_the_agents_watch_of_the_namespaces_lists(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent's watch of the namespaces labelled vram-enforcer.io/inject=enabled, against
    a stand-in API server: before its first list the lender asks nobody anything; the
    agent's own namespace is never read, labelled or not; a namespace labelled later is
    read from its event on, and one whose label is taken away is no longer."""
    pods, changed = forged_node(), threading.Event()
    with serving([]) as api:
        api.namespaces = [json.dumps(namespace(n)).encode() for n in ("ml", "vram-enforcer")]
        config = client.Configuration()
        config.host, config.proxy = api.url, None
        watched = OptedInNamespaces(api_client(config), "vram-enforcer", (changed,))
        lender = Lender(
            NodeView(lambda: pods, watched.names, Declares(RES)),
            changed,
            2 * GiB,
            AgentTelemetry(),
        )

        def reclaimed() -> list[str]:
            lending = lender(FORGED, lambda: FORGED_CONTAINERS)
            assert lending is not None
            return list(lending.reclaims)

        assert watched.names() is None and reclaimed() == []
        watched.start()
        try:
            wait_for(lambda: watched.names() == frozenset({"ml"}), what="the list")
            assert api.queries[0] == (
                "/api/v1/namespaces",
                {"labelSelector": "vram-enforcer.io/inject=enabled", "limit": "500"},
            )
            assert reclaimed() == []
            wait_for(api.watching.is_set, what="the watch")
            api.send("ADDED", namespace("elsewhere"))
            wait_for(lambda: watched.names() == frozenset({"ml", "elsewhere"}), what="the label")
            assert BURST in reclaimed()  # the forger is owed its 16 GiB
            api.send("MODIFIED", namespace("elsewhere", labelled=False))
            wait_for(lambda: watched.names() == frozenset({"ml"}), what="the label taken away")
            assert reclaimed() == []
        finally:
            watched.close()
            watched.join(timeout=10)
    assert not watched.is_alive()
