"""What a container is owed on a GPU is one answer (issue 42, item 3): the lender, the hard
limiter, the backstop and the sidecar each run as they run in the agent and in the pod, and
agree, on a node of every kind of pod, on each container's request and ceiling on each GPU
it uses. A KAI share spread over two GPUs is owed one share on the GPU it uses, never the
sum (it was owed 80 GiB there, and a neighbour's borrowing was taken back for memory nobody
may use)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from enforcer.core.declaration import SIDECAR, Declares, portion_basis
from enforcer.core.dra import DraObjects, DraSettings
from enforcer.core.lending import Lending
from enforcer.core.model import Device, GiB, MiB, ProcessKey, Sample, UnitUsage
from enforcer.core.model import ProcessUsage as Usage
from enforcer.core.payloads import Pod
from enforcer.core.settings import resolve
from enforcer.core.settings.sidecar import DECLARED, sidecar_settings
from enforcer.core.units import Unit
from enforcer.edge.latest import Latest
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.nvml import Nvml
from enforcer.edge.procfs import ProcFs
from enforcer.modes.backstop import Backstop
from enforcer.modes.lender import Lender
from enforcer.modes.limiter import HardLimiter
from enforcer.modes.node_view import ClaimReads, NodeView
from enforcer.modes.sidecar_units import ContainerAttributor, DraReads, pod_terms
from tests.helpers import copy_proc_fixture
from tests.integration.test_backstop import Recorded
from tests.integration.test_shared_claims_agent import RecordingNvml, never
from tests.unit.test_shared_claims import GPUS, RES, SLICE, cid, claim, uid
from tests.unit.test_shared_claims import pod as claiming

G0, G1 = GPUS["gpu-0"], GPUS["gpu-1"]
H100 = 80 * GiB  # as NVML shows each GPU here: KAI counts a share of 81,900 MiB
SHARE = int(81900 * MiB // MiB * 0.5) * MiB  # half a GPU, as KAI counts it: 40,950 MiB
READ = frozenset({"ml"})
# Where the sidecar's /proc fixture has the pod's container `c` (pid 12) and itself.
WORKLOAD, SIDECAR_ID, WORKER = "7" * 64, "5" * 64, ProcessKey(12, 500100)


def declaring(name: str, env: Mapping[str, object], resource: str | None = None) -> Pod:
    """A running pod of one container `c` and the webhook's sidecar: declared by its
    resources (and their bytes in the sidecar's environment, as the webhook writes them), or
    by the sidecar's environment alone (KAI's annotations, frozen there at admission)."""
    limits = {RES: resource} if resource else {}
    variables = [
        {"name": k, "value": v if isinstance(v, str) else json.dumps(v)} for k, v in env.items()
    ]
    return cast(
        Pod,
        {
            "metadata": {"name": name, "namespace": "ml", "uid": uid(name), "resourceVersion": "1"},
            "spec": {
                "containers": [{"name": "c", "resources": {"limits": limits}}],
                "initContainers": [{"name": SIDECAR, "env": variables}],
            },
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid(name)}"}],
            },
        },
    )


def dra(name: str, claim_name: str, size: int, ceiling: int | None = None) -> Pod:
    """A pod of the webhook's DRA mode whose container `c` declared `size`, now its claim,
    with a ceiling above it in its sidecar's environment."""
    made = claiming(name, claim_name)
    env = made["spec"]["initContainers"][0]["env"]
    env.append({"name": "VRAM_ENFORCER_LIMITS", "value": json.dumps({"c": size})})
    if ceiling is not None:
        env.append({"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps({"c": ceiling})})
    return made


PORTIONS = "VRAM_ENFORCER_PORTIONS"
# The node: each pod, what its container holds on each GPU, and what it is owed there.
TABLE: dict[str, tuple[Pod, dict[str, int], dict[str, tuple[int, int]]]] = {
    "plain": (
        declaring("plain", {"VRAM_ENFORCER_LIMITS": {"c": 8 * GiB}}, "8Gi"),
        {G0: 2 * GiB},
        {G0: (8 * GiB, 8 * GiB)},
    ),
    "burst": (
        declaring(
            "burst",
            {"VRAM_ENFORCER_LIMITS": {"c": 4 * GiB}, "VRAM_ENFORCER_CEILINGS": {"c": 24 * GiB}},
            "4Gi",
        ),
        {G0: 6 * GiB},
        {G0: (4 * GiB, 24 * GiB)},
    ),
    "kai": (  # gpu-fraction 0.25, its limit 0.5
        declaring(
            "kai",
            {"VRAM_ENFORCER_LIMITS": {}, PORTIONS: {"c": {"request": "0.25", "ceiling": "0.5"}}},
        ),
        {G1: 3 * GiB},
        {G1: (SHARE // 2 // MiB * MiB, SHARE)},
    ),
    "wide": (  # gpu-fraction 0.5 on gpu-fraction-num-devices 2
        declaring(
            "wide",
            {
                "VRAM_ENFORCER_LIMITS": {},
                PORTIONS: {"c": {"request": "1.0"}},
                "VRAM_ENFORCER_GPUS": {"c": 2},
            },
        ),
        {G0: 5 * GiB, G1: GiB},
        {G0: (SHARE, SHARE), G1: (SHARE, SHARE)},
    ),
    # One 16 GiB claim on gpu-1 that two pods share: 8 GiB each.
    "left": (dra("left", "shared", 16 * GiB), {G1: GiB}, {G1: (8 * GiB, 8 * GiB)}),
    "right": (dra("right", "shared", 16 * GiB), {G1: GiB}, {G1: (8 * GiB, 8 * GiB)}),
    "dburst": (dra("dburst", "own", 4 * GiB, 12 * GiB), {G0: 2 * GiB}, {G0: (4 * GiB, 12 * GiB)}),
}
PODS = {pod["metadata"]["uid"]: pod for pod, _, _ in TABLE.values()}
SHARED = claim("shared", 16 * GiB, "left", "right", device="gpu-1")
CLAIMS = {
    uid("left"): DraObjects({"shared": SHARED}, (SLICE,)),
    uid("right"): DraObjects({"shared": SHARED}, (SLICE,)),
    uid("dburst"): DraObjects({"own": claim("own", 4 * GiB, "dburst")}, (SLICE,)),
}
DEVICES = tuple(
    Device(i, gpu, "H100", H100, sum(held.get(gpu, 0) for _, held, _ in TABLE.values()))
    for i, gpu in enumerate((G0, G1))
)
KEYS = {name: ProcessKey(1000 + i, 1) for i, name in enumerate(TABLE)}
SAMPLE = Sample(
    1.0,
    DEVICES,
    tuple(
        Usage(KEYS[name], gpu, b) for name, (_, held, _) in TABLE.items() for gpu, b in held.items()
    ),
)
CONTAINERS = {KEYS[name]: cid(name) for name in TABLE}

Owed = dict[tuple[str, str], tuple[int, int]]  # (pod, GPU) -> (request, ceiling)


def node(reads: ClaimReads) -> NodeView:
    return NodeView(lambda: PODS, lambda: READ, Declares(RES), reads)


def lent() -> tuple[Lending, Owed]:
    """The lender's pass over the node, and what each GPU's view owes each container."""
    lender = Lender(
        node(ClaimReads(lambda p: CLAIMS[p["metadata"]["uid"]], never, DraSettings())),
        threading.Event(),
        2 * GiB,
        AgentTelemetry(),
    )
    lending = lender(SAMPLE, lambda: CONTAINERS)
    assert lending is not None and lending.reclaims == {}  # the node has room for everyone
    found = {
        (Unit.of(s.unit).pod.split("/")[1], g.uuid): (s.request, s.ceiling)
        for g in lending.gpus
        for s in g.shares
    }
    return lending, found


def held_as(units: tuple[UnitUsage, ...], requests: Mapping[str, int], pod: str) -> Owed:
    """A pipeline's units of one pod while the agent lends: each held to its ceiling, and
    taken back to its request; one over all its GPUs on the one GPU it uses here."""
    only = next(iter(TABLE[pod][1])) if len(TABLE[pod][1]) == 1 else ""
    return {
        (pod, u.device_uuid or only): (requests.get(u.name, u.limit_bytes), u.limit_bytes)
        for u in units
        if Unit.of(u.name).containers == ("c",)  # the sidecar's own is held to 0, and empty
    }


def sidecars(tmp_path: Path) -> Owed:
    """Each pod's own sidecar, from the settings the webhook wrote into it (and, with DRA,
    its pod's claims as the agent sends them), seeing its pod's processes alone."""
    found: Owed = {}
    for name, (pod, held, _) in TABLE.items():
        env = {e["name"]: e["value"] for e in pod["spec"]["initContainers"][0]["env"]}
        downward = {"POD_NAME": name, "POD_NAMESPACE": "ml", "POD_UID": uid(name)}
        settings = sidecar_settings(resolve(DECLARED, {}, {**env, **downward}))
        mine = json.loads(json.dumps(pod))  # as it sees itself: in its fixture's /proc
        mine["status"]["containerStatuses"] = [
            {"name": "c", "containerID": f"containerd://{WORKLOAD}"},
            {"name": SIDECAR, "containerID": f"containerd://{SIDECAR_ID}"},
        ]
        claims = functools.partial(CLAIMS.get, uid(name))  # as the agent sends them
        attributor = ContainerAttributor(
            ProcFs(copy_proc_fixture("pod", tmp_path / name)),
            cast(Any, SimpleNamespace(pod=mine, error=None, refresh=lambda: None)),
            pod_terms(settings),
            want_init=False,
            dra=DraReads(settings.dra, claims, lambda text: None) if settings.dra else None,
            lending=lambda: True,
        )
        own = Sample(1.0, DEVICES, tuple(Usage(WORKER, gpu, b) for gpu, b in held.items()))
        found |= held_as(attributor.attribute(own), attributor.requests, name)
    return found


def backstop(lending: Lending) -> Owed:
    """The agent's backstop holding every pod (each sidecar silent), on the lender's pass."""
    held = Backstop(
        node(ClaimReads(lambda p: CLAIMS[p["metadata"]["uid"]], never, DraSettings())),
        lambda: frozenset(PODS),
        cast(Any, Recorded()),
        AgentTelemetry(),
        ProcFs(),
    )
    held(SAMPLE, lambda: CONTAINERS, lending)
    found: Owed = {}
    for name, (pod, _, _) in TABLE.items():
        pipeline = held._held[pod["metadata"]["uid"]]  # each pod's, as its tick left it
        units = pipeline._pipeline.last_units
        found |= held_as(units, pipeline._attributor.requests, name)
    return found


def hard_limits(tmp_path: Path) -> dict[tuple[str, str], int]:
    """The hard limiter's pass: each container's cgroup and its hard limit (the ceiling) on
    each GPU it uses; never a soft limit (a reservation that outlives the cgroup)."""
    tmp_path.mkdir()
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    dirs = {}
    for name in TABLE:
        pod_dir = tmp_path / "kubepods.slice" / f"kubepods-pod{uid(name).replace('-', '_')}.slice"
        dirs[name] = pod_dir / f"cri-containerd-{cid(name)}.scope"
        dirs[name].mkdir(parents=True)
    nvml = RecordingNvml()
    limiter = HardLimiter(
        cast(Nvml, nvml),
        node(ClaimReads(never, lambda p: CLAIMS[p["metadata"]["uid"]], DraSettings())),
        cast(Any, SimpleNamespace(devices=Latest(list(DEVICES)), container_usage=Latest({}))),
        cast(Any, None),
        AgentTelemetry(),
        cgroups=(tmp_path, 60.0),
        changed=threading.Event(),
    )
    limiter._pass()
    assert set(nvml.soft.values()) == {0}
    return {
        (name, gpu): hard
        for (cgroup, gpu), hard in nvml.set.items()
        for name, (_, held, _) in TABLE.items()
        if cgroup == str(dirs[name]) and gpu in held
    }


def test_the_lender_the_hard_limiter_the_backstop_and_the_sidecar_owe_each_container_alike(
    tmp_path: Path,
) -> None:
    assert portion_basis(DEVICES) == 81900 * MiB
    owed: Owed = {(name, gpu): at for name, (_, _, on) in TABLE.items() for gpu, at in on.items()}
    lending, by_lender = lent()
    assert by_lender == owed
    assert sidecars(tmp_path / "sidecars") == owed
    assert backstop(lending) == owed
    assert hard_limits(tmp_path / "cgroups") == {key: at[1] for key, at in owed.items()}


# --- a share of KAI's over two GPUs, used on one ------------------------------------------

NEIGHBOUR = TABLE["burst"][0]


@pytest.mark.parametrize(
    ("others", "reclaimed"),
    [(0, False), (20 * GiB, True)],
    ids=["room-for-its-share", "short-of-its-share"],
)
def test_a_kai_share_over_two_gpus_used_on_one_is_owed_one_share_there(
    others: int, reclaimed: bool
) -> None:
    """`gpu-fraction: 0.5` on `gpu-fraction-num-devices: 2`, holding 10 GiB on one 80 GiB
    GPU beside a borrower (a 4 GiB request, a 24 GiB ceiling) that holds 24: 46 GiB free
    with nothing else there. The share is owed 40,950 MiB less the 10 GiB it holds, about
    30 GiB, and 2 GiB of watermark: the borrower keeps what it holds (owed the whole 80 GiB
    sum there, the share made it give back 20 GiB). With 20 GiB more held by processes of no
    pod, the share is short of what it is owed, and the borrower gives back."""
    wide = TABLE["wide"][0]
    pods = {p["metadata"]["uid"]: p for p in (wide, NEIGHBOUR)}
    one = Device(0, G0, "H100", H100, 34 * GiB + others)
    seen = Sample(
        1.0,
        (one, Device(1, G1, "H100", H100, 0)),
        (Usage(KEYS["wide"], G0, 10 * GiB), Usage(KEYS["burst"], G0, 24 * GiB)),
    )
    lender = Lender(
        NodeView(lambda: pods, lambda: READ, Declares(RES)),
        threading.Event(),
        2 * GiB,
        AgentTelemetry(),
    )
    lending = lender(seen, lambda: {KEYS["wide"]: cid("wide"), KEYS["burst"]: cid("burst")})
    assert lending is not None
    assert bool(lending.reclaims) is reclaimed
    (gpu,) = [g for g in lending.gpus if g.uuid == G0]
    shares = {s.unit: (s.request, s.used) for s in gpu.shares}
    assert shares[f"ml/wide/c@{G0}"] == (SHARE, 10 * GiB)
    assert sum(s.owed for s in gpu.shares) == SHARE - 10 * GiB
    if reclaimed:
        (reclaim,) = lending.reclaims.values()
        assert reclaim.victim.unit == "ml/burst/c" and reclaim.owed_to == ("ml/wide/c",)
