"""A pod in a dry run (`VRAM_ENFORCER_DRY_RUN=true`, as the webhook writes it for the action
`dry-run`) is never enforced, whoever holds it, and says what would have been done (issue
43, item 3): the node agent's backstop, holding it while its sidecar is silent, signals
nothing over its limit, asks for no eviction, and posts `VRAMWouldEnforce` with the usage,
the peak and the limit; it borrows nothing above its request (what it borrowed could not be
taken back); the hard limiter gives it, and a pod in `warn`, no hard limit (the driver's
refusal of an allocation would enforce the limit). Real processes in a real cgroup named as
containerd names a container's, run as a user other than root."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from enforcer.core.declaration import Declares
from enforcer.core.model import Device, GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import ObjectReference, Pod
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.procfs import ProcFs
from enforcer.modes.backstop import Backstop
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import NodeView
from tests.helpers import wait_for
from tests.integration.test_backstop import (
    BORROWING,
    CID,
    NEIGHBOUR_ID,
    SLEEP,
    Recorded,
    declaring,
    gpu,
    in_box,
    lending_node,
    moved_in,
)
from tests.integration.test_shared_claims_agent import RecordingNvml
from tests.unit.test_shared_claims import uid

if TYPE_CHECKING:
    from enforcer.edge.events import EventRecorder

RES = "vram-enforcer.io/vram"
DRY = {"VRAM_ENFORCER_DRY_RUN": "true", "VRAM_ENFORCER_GRACE_PERIOD": "1s"}
# Not root where the test may switch: a tenant's workload, as it runs in most pods.
AS_A_USER = (
    ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups"]
    if os.geteuid() == 0 and shutil.which("setpriv")
    else []
)


def started(box: Path) -> tuple[subprocess.Popen[Any], ProcessKey]:
    """The container's process, in `box`, once it runs the workload itself."""
    worker = in_box(box, [*AS_A_USER, *SLEEP])
    key = moved_in(box, worker)
    wait_for(lambda: ProcFs().cmdline(worker.pid) == " ".join(SLEEP), what="the workload's exec")
    return worker, key


def dry_pod(pod_uid: str, env: dict[str, int]) -> Pod:
    """`declaring`'s pod of container `trainer`, in a dry run."""
    pod = declaring(pod_uid, "trainer-0", "trainer", CID, env)
    (_, sidecar) = pod["spec"]["containers"]
    sidecar["env"] += [{"name": k, "value": v} for k, v in DRY.items()]
    return pod


def test_a_silent_pod_in_a_dry_run_is_never_signalled_nor_evicted_and_says_what_would_be(
    cgroup2: Path,
) -> None:
    """Held by the backstop over its limit for longer than its grace period: one
    `VRAMWouldEnforce` (with the usage, the most it held since it went over, the limit and
    the SIGTERM it would have sent), counted as a dry-run action, and the process alive."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    worker, key = started(box)
    try:
        pod = dry_pod("u", {"VRAM_ENFORCER_LIMITS": GiB})
        recorder, evicted = Recorded(), []

        def evict(about: ObjectReference, why: str, grace: int) -> None:
            evicted.append(why)

        backstop = Backstop(
            NodeView(lambda: {"u": pod}, lambda: frozenset({"team"}), Declares(RES)),
            lambda: frozenset({"u"}),
            cast("EventRecorder", recorder),
            AgentTelemetry(),
            ProcFs(),
            evict,
        )
        deadline = time.monotonic() + 1.5  # past the grace period a SIGKILL would follow
        while time.monotonic() < deadline:
            sample = Sample(0.0, (), (ProcessUsage(key, "GPU-a", 2 * GiB),))
            backstop(sample, lambda: {key: CID}, None)  # the sampler's passes
            time.sleep(0.05)
        (unit,) = backstop._held["u"]._pipeline.last_units  # the backstop saw its usage
        assert (unit.used_bytes, unit.limit_bytes) == (2 * GiB, GiB)
        assert worker.poll() is None and evicted == []
        assert recorder.reasons == ["VRAMLimitExceeded", "VRAMWouldEnforce"], recorder.messages
        exceeded, would = recorder.messages
        assert exceeded.endswith("dry run: it would be enforced (terminate); nothing is signalled")
        assert would == (
            "container 'trainer' (held by the node agent while the pod's sidecar is silent) uses "
            "2.00 GiB of its 1.00 GiB VRAM limit (200%), 2.00 GiB at most since it went over; "
            f"dry run, so nothing was signalled: would have sent SIGTERM to pid {key.pid}, which "
            "holds 2.00 GiB, then SIGKILL after 1s had it not exited"
        )
        counted = backstop.counts["u"].actions.counts()
        assert (counted["dry-run"], counted["terminate"], counted["kill"]) == (1, 0, 0), counted
    finally:
        worker.kill()
        worker.wait()


def test_a_pod_in_a_dry_run_borrows_nothing_above_its_request(
    cgroup2: Path, tmp_path: Path
) -> None:
    """The borrower of `test_backstop`'s reclaim, in a dry run: what it borrowed could not
    be taken back, and its neighbour, enforced, would go without its request. So its
    ceiling is its request: the lender lends it nothing, and the backstop holding it, with
    the GPU far from short, says what would have been done at its request (a would-be
    enforcement, not a reclaim), and signals nothing."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    worker, key = started(box)
    try:
        with lending_node(dry_pod("u", BORROWING), key, tmp_path) as agent:
            agent.source.now = gpu(key, 0)  # 12 GiB free: nobody is short
            for _ in range(3):
                agent.sampler._pass()  # one NVML pass, as the sampler's thread runs it
            (unit,) = agent.backstop._held["u"]._pipeline.last_units  # it saw its usage
            assert (unit.name, unit.used_bytes, unit.limit_bytes) == ("trainer", 3 * GiB, GiB)
            assert agent.recorder.reasons == ["VRAMLimitExceeded", "VRAMWouldEnforce"], (
                agent.recorder.messages
            )
            _, would = agent.recorder.messages
            assert "uses 3.00 GiB of its 1.00 GiB VRAM limit" in would, would
            assert (
                f"dry run, so nothing was signalled: would have sent SIGTERM to pid {key.pid}"
                in would
            )
            time.sleep(0.2)  # a SIGTERM sent would have ended it by now
            assert worker.poll() is None
            assert not any(agent.backstop.counts["u"].reclaims.counts().values())
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == -signal.SIGKILL  # ours, at the end


def test_the_hard_limiter_sets_no_hard_limit_on_a_pod_only_reported_on(tmp_path: Path) -> None:
    """Its neighbour, enforced, gets its limit; the pod in a dry run none, nor the one in
    `warn` (the driver's refusal would enforce what they only report)."""
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    dry, wet, warn = uid("dry"), uid("wet"), uid("warn")
    warning = declaring(warn, "warner", "trainer", "c" * 64, {"VRAM_ENFORCER_LIMITS": 2 * GiB})
    warning["spec"]["containers"][1]["env"].append(
        {"name": "VRAM_ENFORCER_ACTION", "value": "warn"}
    )
    pods = {
        warn: warning,
        dry: dry_pod(dry, {"VRAM_ENFORCER_LIMITS": 2 * GiB}),
        wet: declaring(wet, "serve", "server", NEIGHBOUR_ID, {"VRAM_ENFORCER_LIMITS": 3 * GiB}),
    }
    slices = {u: f"kubepods-pod{u.replace('-', '_')}.slice" for u in pods}
    for each, pod in pods.items():
        pod["metadata"]["resourceVersion"] = "1"
        (tmp_path / "kubepods.slice" / slices[each]).mkdir(parents=True)
    nvml = RecordingNvml()
    devices = [Device(0, "GPU-a", "H100", 80 * GiB, 0)]
    limiter = HardLimiter(
        cast(Nvml, nvml),
        NodeView(lambda: pods, lambda: frozenset({"team"}), Declares(RES)),
        cast(Any, SimpleNamespace(devices=Latest(devices), container_usage=Latest({}))),
        cast(Any, None),
        AgentTelemetry(),
        cgroups=(tmp_path, 60.0),
        changed=threading.Event(),
    )
    limiter._pass()
    assert {cg.rsplit("/", 1)[1]: b for (cg, _), b in nvml.set.items()} == {slices[wet]: 3 * GiB}
