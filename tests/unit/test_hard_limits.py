"""Which cgroup gets which hard limit on which GPU, and what changes when pods come and go."""

import json
from pathlib import Path
from typing import Any

from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import Declaration, Declares
from enforcer.core.dra import DraObjects, DraSettings
from enforcer.core.hard_limits import (
    EVIDENCE_BYTES,
    FRACTIONING_LABEL,
    SOFT_BYTES,
    TOOLKIT,
    UNKNOWN_OWNER,
    Found,
    Target,
    charged,
    first_read,
    fractioned,
    holds,
    owner,
    per_gpu,
    plan,
    pod_limits,
    targets,
)
from enforcer.core.model import (
    Device,
    GiB,
    HeldLimit,
    LimitOutcome,
    LimitResult,
    MiB,
    ProcessKey,
    ProcessUsage,
    Sample,
)
from enforcer.core.owed import Claims, PodOwed, owed, pod_owed

A, B = "a" * 64, "b" * 64
UID = "6b5ab4a6-3e21-4b5d-9a5f-2b1c9d6e4f7a"
H100 = Device(0, "GPU-0", "H100", 80 * GiB, 0)
L4 = Device(1, "GPU-1", "L4", 24 * GiB, 0)
A100 = Device(2, "GPU-2", "A100", 40 * GiB, 0)
MIG = Device(2, "MIG-2a", "1g.5gb", 5 * GiB, 0, parent_uuid="GPU-2")


def test_a_limit_is_capped_at_each_gpus_memory_and_mig_gets_none() -> None:
    assert per_gpu(32 * GiB, [H100, L4]) == {"GPU-0": 32 * GiB, "GPU-1": 24 * GiB}
    assert per_gpu(GiB, [H100, A100, MIG]) == {"GPU-0": GiB}  # GPU-2 is in MIG mode
    assert per_gpu(GiB, [Device(3, "GPU-3", "?", None, None)]) == {}  # size unknown


def pod(ceilings: dict[str, int] | None = None, **status: Any) -> dict[str, Any]:
    """A pod as the webhook admits it: its sidecar's env carries the ceilings."""
    env = [{"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps(ceilings)}] if ceilings else []
    return {
        "metadata": {"uid": UID, "namespace": "ml", "name": "train"},
        "spec": {
            "initContainers": [
                {"name": "fetch", "resources": {"limits": {"vram-enforcer.io/vram": "1Gi"}}}
            ],
            "containers": [
                {"name": "trainer", "resources": {"limits": {"vram-enforcer.io/vram": "8Gi"}}},
                {"name": "vram-enforcer", "env": env},
            ],
        },
        "status": status,
    }


def vram(p: Any, resource: str = "vram-enforcer.io/vram") -> PodOwed:
    """The pod as the agent's hard limiter reads it."""
    return pod_owed(
        p, Declares(resource, 1, "vram-enforcer"), opted_in={"ml"}, basis=None, claims=None
    )


def declared(
    limits: dict[str, int],
    ids: dict[str, str],
    ceilings: dict[str, int] | None = None,
    gpus: dict[str, int] | None = None,
) -> PodOwed:
    """A pod that declares `limits` (its requests), with the ceilings above them."""
    what = Declaration(limits, ceilings or {}, gpus=gpus or {})
    return PodOwed(UID, "ml", "train", ids, what, owed(what, None, None))


def test_a_pods_declaration_and_current_container_ids() -> None:
    running = {"containerStatuses": [{"name": "trainer", "containerID": f"containerd://{A}"}]}
    got = vram(pod(**running))
    assert (got.uid, got.namespace, got.name, dict(got.ids)) == (UID, "ml", "train", {"trainer": A})
    assert {str(o.unit): (o.request, o.ceiling) for o in got.owed.units} == {
        "fetch": (GiB, GiB),
        "trainer": (8 * GiB, 8 * GiB),
    }
    assert pod_limits(got, [H100]) == {"GPU-0": 9 * GiB}
    assert vram(pod(), "example.com/other").owed.units == ()  # nothing of ours
    assert targets([vram({"spec": pod()["spec"]})], {UID: "/k/pod"}, {}) == {}  # no uid


def test_targets_are_the_pod_cgroup_and_the_cgroups_named_by_its_status() -> None:
    p = declared({"trainer": 8 * GiB, "fetch": GiB}, {"trainer": A})
    # Before the pod's cgroup exists, nothing; then the pod's total at once.
    assert targets([p], {}, {}) == {}
    assert targets([p], {UID: "/k/pod"}, {}) == {
        "/k/pod": Target("/k/pod", "ml", "train", UID, "", 9 * GiB)
    }
    # A container's cgroup counts only under the ID that the pod's status gives it: the
    # directory of another ID (a restart the status does not show yet) gets nothing.
    found = targets([p], {UID: "/k/pod"}, {UID: {A: "/k/pod/a", B: "/k/pod/b"}})
    assert found["/k/pod/a"] == Target("/k/pod/a", "ml", "train", UID, "trainer", 8 * GiB)
    assert set(found) == {"/k/pod", "/k/pod/a"}
    # A directory named after the container ID under another pod proves nothing.
    assert set(targets([p], {UID: "/k/pod"}, {"other-uid": {A: "/k/x/a"}})) == {"/k/pod"}


def test_a_container_that_may_borrow_is_held_to_its_ceiling_and_nothing_is_reserved() -> None:
    """The hard limit is the ceiling, or the driver would refuse what the agent lends. No
    soft limit: it is a `dmem.min` reservation the driver adds to every ancestor and leaves
    behind when the runtime deletes the cgroup (NVIDIA's MPS v3 page)."""
    running = {"containerStatuses": [{"name": "trainer", "containerID": f"containerd://{A}"}]}
    got = vram(pod({"trainer": 20 * GiB}, **running))
    assert {str(o.unit): (o.request, o.ceiling) for o in got.owed.units} == {
        "fetch": (GiB, GiB),
        "trainer": (8 * GiB, 20 * GiB),
    }
    found = targets([got], {UID: "/k/pod"}, {UID: {A: "/k/pod/a"}})
    assert found["/k/pod"].limit_bytes == 21 * GiB
    assert found["/k/pod/a"] == Target("/k/pod/a", "ml", "train", UID, "trainer", 20 * GiB)
    assert SOFT_BYTES == 0
    # A ceiling not above the request borrows nothing: exactly what it was before.
    same = vram(pod({"trainer": 8 * GiB}, **running))
    assert same == vram(pod(**running))


def test_a_limit_spread_over_gpus_is_one_share_on_each_gpu_never_the_sum() -> None:
    """KAI's gpu-fraction-num-devices: 2 gives trainer 4Gi on each of two GPUs (8Gi in
    all): the driver holds its cgroup to 4Gi on each GPU, and the pod's to 4Gi + 1Gi."""
    p = declared({"trainer": 8 * GiB, "fetch": GiB}, {"trainer": A}, gpus={"trainer": 2})
    found = targets([p], {UID: "/k/pod"}, {UID: {A: "/k/pod/a"}})
    assert found["/k/pod"].limit_bytes == 5 * GiB
    assert found["/k/pod/a"] == Target("/k/pod/a", "ml", "train", UID, "trainer", 4 * GiB)
    borrowing = declared(
        {"trainer": 8 * GiB}, {"trainer": A}, {"trainer": 16 * GiB}, {"trainer": 2}
    )
    ceiling = targets([borrowing], {UID: "/k/pod"}, {UID: {A: "/k/pod/a"}})
    assert (ceiling["/k/pod/a"].limit_bytes, ceiling["/k/pod"].limit_bytes) == (8 * GiB, 8 * GiB)


def test_plan_sets_what_differs_and_clears_only_its_own_limits() -> None:
    pod_t = Target("/k/pod", "ml", "train", UID, "", 9 * GiB)
    box = Target("/k/pod/a", "ml", "train", UID, "trainer", 8 * GiB)
    wanted = {t.cgroup: t for t in (pod_t, box)}
    first = plan(wanted, [H100, L4], {}, {"/k/pod", "/k/pod/a"})
    assert sorted((t.cgroup, gpu, b) for t, gpu, b in first.set) == [
        ("/k/pod", "GPU-0", 9 * GiB),
        ("/k/pod", "GPU-1", 9 * GiB),
        ("/k/pod/a", "GPU-0", 8 * GiB),
        ("/k/pod/a", "GPU-1", 8 * GiB),
    ]
    applied = {(t.cgroup, gpu): b for t, gpu, b in first.set}
    assert plan(wanted, [H100, L4], applied, {"/k/pod", "/k/pod/a"}).set == ()
    # The container restarted: its old cgroup is gone (forget), the pod went on (nothing).
    after = plan({"/k/pod": pod_t}, [H100, L4], applied, {"/k/pod"})
    assert (after.set, after.clear) == ((), ())
    assert sorted(after.forget) == [("/k/pod/a", "GPU-0"), ("/k/pod/a", "GPU-1")]
    # The pod left the node while its cgroup lingers: our limits are cleared, and only ours.
    gone = plan({}, [H100], {("/k/pod", "GPU-0"): 9 * GiB}, {"/k/pod", "/k/other"})
    assert gone.clear == (("/k/pod", "GPU-0"),) and gone.forget == ()
    # A value NVML rejected is not sent again; a new value is.
    rejected = {("/k/pod", "GPU-0", 9 * GiB)}
    assert plan({"/k/pod": pod_t}, [H100], {}, {"/k/pod"}, rejected).set == ()
    bigger = Target("/k/pod", "ml", "train", UID, "", 10 * GiB)
    assert len(plan({"/k/pod": bigger}, [H100], {}, {"/k/pod"}, rejected).set) == 1
    # A limit someone else set is never written, whatever it is.
    assert plan({"/k/pod": bigger}, [H100], {}, {"/k/pod"}, foreign={("/k/pod", "GPU-0")}).set == ()


def test_a_first_read_tells_no_limit_our_own_and_someone_elses() -> None:
    """Read before the first write: nothing there is ours to set; our own value (within the
    driver's rounding) is adopted; the pod cgroup's limit, read through a leaf without dmem
    files, is no one else's; anything else is foreign."""
    want = 8 * GiB
    assert first_read(None, want) is Found.FREE
    assert first_read(HeldLimit(want, 0, 0), want) is Found.OURS
    assert first_read(HeldLimit(want - MiB, 0, 0), want) is Found.OURS  # whole MiB, rounded
    assert first_read(HeldLimit(want, 4 * GiB, 0), want) is Found.OURS  # an older release's
    assert first_read(HeldLimit(6 * GiB, 0, 0), want) is Found.FOREIGN
    assert first_read(HeldLimit(9 * GiB, 0, 0), want, inherited=9 * GiB) is Found.FREE
    assert first_read(HeldLimit(9 * GiB, 0, 0), want, inherited=10 * GiB) is Found.FOREIGN
    # Where NVIDIA's hook sets the cgroup, even our own value is its: never adopted.
    assert first_read(HeldLimit(want, 0, 0), want, adopt=False) is Found.FOREIGN
    assert first_read(None, want, adopt=False) is Found.FREE


def test_a_set_holds_only_when_read_back_as_set_with_soft_0() -> None:
    assert holds(HeldLimit(8 * GiB, 0, GiB), 8 * GiB)
    assert not holds(HeldLimit(8 * GiB, GiB, 0), 8 * GiB)  # a reservation: not ours
    assert not holds(HeldLimit(4 * GiB, 0, 0), 8 * GiB)  # below usage, ignored; or overwritten
    assert not holds(None, 8 * GiB)  # not taken at all (a read-only mount)
    assert not holds(LimitOutcome(LimitResult.FAILED), 8 * GiB)


def test_a_foreign_limits_owner_is_the_toolkit_where_the_container_gives_its_hook_the_env() -> None:
    assert owner({"NVIDIA_GPU_MEMORY_LIMIT", "PATH"}) == TOOLKIT
    assert owner(set()) == UNKNOWN_OWNER


def test_gpu_fractioning_serves_a_pod_of_nvfractions_on_a_node_its_mps_daemon_labelled() -> None:
    nv = {"nvidia.com/container.c.gpu-memory.request": "4Gi"}
    labelled = {FRACTIONING_LABEL: "615"}
    assert fractioned(nv, labelled)
    assert not fractioned(nv, {})  # KAI's annotations alone: KAI schedules, nobody holds
    assert not fractioned({"gpu-memory": "4096"}, labelled)  # KAI's own form: not served


def test_dra_claims_become_hard_limits_on_the_allocated_gpu_only() -> None:
    """A DRA pod (the real scheduler's objects, tests/fixtures/dra): its container gets its
    claim's 4Gi on gpu-0's GPU, the pod cgroup the same total there, and nothing elsewhere:
    the DRA driver shows the container that GPU only, and sampling holds it to 0 on others."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "dra"
    dra_pod, claim, slice_ = (
        json.loads((fixtures / f"{n}.json").read_text()) for n in ("pod", "claim", "slice")
    )
    dra_pod["status"]["containerStatuses"] = [{"name": "c", "containerID": f"containerd://{A}"}]
    objects = DraObjects({claim["metadata"]["name"]: claim}, (slice_,))
    dra = Declares("vram-enforcer.io/vram")

    def read(ceilings: dict[str, int] | None = None, found: DraObjects = objects) -> PodOwed:
        """The pod as the hard limiter reads it, the webhook's ceilings in its sidecar."""
        env = [{"name": "VRAM_ENFORCER_LIMITS_FROM", "value": "dra"}]
        if ceilings:
            env.append({"name": "VRAM_ENFORCER_CEILINGS", "value": json.dumps(ceilings)})
        dra_pod["spec"]["initContainers"] = [{"name": "vram-enforcer", "env": env}]
        namespace = {dra_pod["metadata"]["namespace"]}
        claims = Claims(found, DraSettings(), {})
        return pod_owed(dra_pod, dra, opted_in=namespace, basis=None, claims=claims)

    got = read()
    gpu0 = "GPU-00000000-aaaa-bbbb-cccc-000000000000"
    assert [(o.unit.gpu, o.ceiling) for o in got.owed.units] == [(gpu0, 4 * GiB)]
    devices = [Device(0, gpu0, "L4", 24 * GiB, 0), Device(1, "GPU-other", "L4", 24 * GiB, 0)]
    uid = dra_pod["metadata"]["uid"]
    wanted = targets([got], {uid: "/pod"}, {uid: {A: "/pod/a"}})
    assert plan(wanted, devices, {}, {"/pod", "/pod/a"}).set == (
        (wanted["/pod"], gpu0, 4 * GiB),
        (wanted["/pod/a"], gpu0, 4 * GiB),
    )
    assert pod_limits(got, devices) == {gpu0: 4 * GiB}  # what the VRAMHardLimit Event waits for
    assert read(found=DraObjects({}, (slice_,))).owed.units == ()  # its claim not read
    # With a ceiling (the sidecar's env, by container): the hard limit is the ceiling on the
    # claim's GPU, for the container and its pod alike.
    bursting = read({"c": 10 * GiB})
    assert pod_limits(bursting, devices) == {gpu0: 10 * GiB}
    wanted = targets([bursting], {uid: "/pod"}, {uid: {A: "/pod/a"}})
    assert [t.gpu_limits for t in wanted.values()] == [((gpu0, 10 * GiB),)] * 2


def test_a_limit_is_proven_to_bind_only_by_what_the_driver_charges_to_it() -> None:
    """The driver's own count against what NVML lists for the cgroup's processes: at least
    half of it proves the limit binds them; nothing, that it does not; too little listed,
    or a count in between (a process gone between the two reads), proves nothing yet."""
    assert charged(EVIDENCE_BYTES - 1, 0) is None  # a process without a context yet
    assert charged(2 * GiB, 2 * GiB + 300 * 2**20) is True  # the driver's own reserve
    assert charged(2 * GiB, GiB) is True
    assert charged(2 * GiB, 0) is False
    assert charged(2 * GiB, GiB - 1) is None


def test_usage_by_container_sums_its_processes_per_gpu() -> None:
    sample = Sample(
        0.0,
        (),
        (
            ProcessUsage(ProcessKey(1, 1), "GPU-0", GiB),
            ProcessUsage(ProcessKey(2, 2), "GPU-0", GiB),
            ProcessUsage(ProcessKey(2, 2), "GPU-1", 3 * GiB),
            ProcessUsage(ProcessKey(3, 3), "GPU-0", None),
            ProcessUsage(ProcessKey(4, 4), "GPU-0", GiB),  # in no container
        ),
    )
    containers = {ProcessKey(1, 1): A, ProcessKey(2, 2): A, ProcessKey(3, 3): B}
    assert usage_by_container(sample, containers) == {A: {"GPU-0": 2 * GiB, "GPU-1": 3 * GiB}}
