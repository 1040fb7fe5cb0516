"""What a pod's units are held to (`pod_units`, over what `owed` says each is owed): the
sidecar's rules, as pure functions of what its shell read on one tick."""

from decimal import Decimal

from enforcer.core.attribution import (
    PodProcesses,
    PodUnits,
    pod_processes,
    pod_units,
)
from enforcer.core.declaration import Declaration, Portion
from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import GiB, ProcessKey, ProcessTotal, ProcessUsage, Sample
from enforcer.core.owed import owed
from enforcer.core.pod import ContainerRef
from enforcer.core.units import POD_UNIT

TRAINER, HELPER, STRANGER = ProcessKey(12, 120), ProcessKey(50, 500), ProcessKey(60, 600)
CONTAINERS = (ContainerRef("trainer", "containers"), ContainerRef("helper", "containers"))


def sample(*usage: tuple[ProcessKey, str, int]) -> Sample:
    return Sample(0.0, (), tuple(ProcessUsage(key, gpu, used) for key, gpu, used in usage))


def seen(*stranger: ProcessKey, inits: dict[str, ProcessTotal] | None = None) -> PodProcesses:
    """The trainer's and the helper's processes, proven; any `stranger`, not."""
    return PodProcesses(
        {TRAINER: "python train.py", HELPER: "helper", **dict.fromkeys(stranger, "sh")},
        {TRAINER: "trainer", HELPER: "helper"},
        CONTAINERS,
        inits or {},
    )


def declared(**ceilings: int) -> Declaration:
    return Declaration({"trainer": 4 * GiB}, ceilings)


def held(
    usage: Sample,
    what: Declaration,
    *,
    lending: bool,
    pod: PodProcesses | None = None,
    claimed: Allocations | None = None,
    allowed: bool = False,
) -> PodUnits:
    """The tick's units, as the sidecar (or the backstop) makes them."""
    return pod_units(usage, pod or seen(), owed(what, claimed, None), allowed, lending)


def limits(found: PodUnits) -> dict[str, int]:
    return {u.name: u.limit_bytes for u in found.units}


def borrower(lending: bool) -> PodUnits:
    """A trainer that requests 4Gi and may borrow up to 12Gi, holding 3Gi."""
    return held(sample((TRAINER, "GPU-0", 3 * GiB)), declared(trainer=12 * GiB), lending=lending)


def test_a_container_that_may_borrow_is_held_to_its_ceiling_while_the_agent_lends() -> None:
    lent = borrower(lending=True)
    assert limits(lent)["trainer"] == 12 * GiB
    assert lent.requests == {"trainer": 4 * GiB}  # what a reclaim takes it back to


def test_a_container_that_may_borrow_is_held_to_its_request_while_the_agent_does_not_lend() -> None:
    kept = borrower(lending=False)
    assert limits(kept)["trainer"] == 4 * GiB
    assert kept.requests == {"trainer": 4 * GiB}  # still a borrower: a ceiling is declared


def test_a_container_that_declares_nothing_is_held_to_0_unless_undeclared_ones_are_allowed() -> (
    None
):
    usage = sample((HELPER, "GPU-0", GiB))
    strict = held(usage, declared(), lending=False)
    assert limits(strict) == {"trainer": 4 * GiB, "helper": 0}
    lax = held(usage, declared(), lending=False, allowed=True)
    assert limits(lax) == {"trainer": 4 * GiB}


def test_a_portion_not_counted_yet_is_not_checked_rather_than_held_to_0() -> None:
    portion = Declaration({"trainer": 4 * GiB}, portions={"helper": Portion(Decimal("0.5"))})
    found = held(sample((HELPER, "GPU-0", 30 * GiB)), portion, lending=False)
    assert "helper" not in limits(found)


def test_a_container_spread_over_gpus_is_held_and_owed_per_gpu() -> None:
    """KAI's gpu-fraction-num-devices: 2 gives the trainer one share (2Gi, up to 4Gi) on each
    of the two GPUs where it holds most, never the sum on one; on a third GPU it is owed
    nothing, and held to 0. The helper, not spread, keeps its sum over GPUs."""
    spread = Declaration(
        {"trainer": 4 * GiB, "helper": 8 * GiB}, {"trainer": 8 * GiB}, gpus={"trainer": 2}
    )
    usage = sample(
        (TRAINER, "GPU-0", 3 * GiB),
        (TRAINER, "GPU-1", GiB),
        (TRAINER, "GPU-2", 512 * 2**20),
        (HELPER, "GPU-0", 3 * GiB),
        (HELPER, "GPU-1", 3 * GiB),
    )
    found = held(usage, spread, lending=True)
    assert {u.name: (u.used_bytes, u.limit_bytes, u.device_uuid) for u in found.units} == {
        "trainer@GPU-0": (3 * GiB, 4 * GiB, "GPU-0"),
        "trainer@GPU-1": (GiB, 4 * GiB, "GPU-1"),
        "trainer@GPU-2": (512 * 2**20, 0, "GPU-2"),
        "helper": (6 * GiB, 8 * GiB, None),
    }
    assert found.requests == {"trainer@GPU-0": 2 * GiB, "trainer@GPU-1": 2 * GiB}
    # Held to its request while the agent does not lend: 2Gi on each, and 3Gi on one is over.
    assert limits(held(usage, spread, lending=False))["trainer@GPU-0"] == 2 * GiB


def test_an_unproven_process_puts_the_whole_pod_in_a_unit_that_is_never_signalled() -> None:
    usage = sample((TRAINER, "GPU-0", GiB), (STRANGER, "GPU-0", 2 * GiB))
    found = held(usage, declared(), lending=False, pod=seen(STRANGER))
    pod = {u.name: u for u in found.units}[POD_UNIT]
    assert not pod.enforceable
    assert {p.key for p in pod.processes} == {TRAINER, STRANGER}
    assert pod.limit_bytes == 4 * GiB  # the sum of what the pod's containers are held to
    proven = held(usage, declared(), lending=False)
    assert POD_UNIT not in limits(proven)


def test_the_pods_unit_counts_the_ceilings_while_the_agent_lends() -> None:
    usage = sample((STRANGER, "GPU-0", GiB))
    found = held(usage, declared(trainer=12 * GiB), lending=True, pod=seen(STRANGER))
    assert limits(found)[POD_UNIT] == 12 * GiB


def test_a_containers_init_is_named_on_its_unit() -> None:
    init = ProcessTotal(ProcessKey(7, 70), 0, (), "python train.py")
    usage = sample((TRAINER, "GPU-0", GiB))
    found = held(usage, declared(), lending=False, pod=seen(inits={"trainer": init}))
    units = {u.name: u for u in found.units}
    assert units["trainer"].init_process == init and units["helper"].init_process is None


def claim(limit: int, gpu: str = "GPU-0", *containers: str) -> Allocations:
    return Allocations((GpuUnit(gpu, containers or ("trainer",), limit, ()),))


def in_dra_mode(**ceilings: int) -> Declaration:
    """What a DRA pod's sidecar declares: the ceilings above its claims."""
    return Declaration(ceilings=ceilings, claims=True)


def test_with_dra_a_claim_is_raised_to_the_ceiling_only_while_the_agent_lends() -> None:
    usage = sample((TRAINER, "GPU-0", 3 * GiB))
    lent = held(usage, in_dra_mode(trainer=12 * GiB), lending=True, claimed=claim(4 * GiB))
    assert limits(lent)["trainer@GPU-0"] == 12 * GiB
    assert lent.requests == {"trainer@GPU-0": 4 * GiB}
    kept = held(usage, in_dra_mode(trainer=12 * GiB), lending=False, claimed=claim(4 * GiB))
    assert (limits(kept)["trainer@GPU-0"], kept.requests) == (4 * GiB, {"trainer@GPU-0": 4 * GiB})


def test_with_dra_usage_on_a_gpu_no_claim_gives_is_held_to_0() -> None:
    usage = sample((TRAINER, "GPU-1", GiB), (HELPER, "GPU-0", GiB))
    found = held(usage, in_dra_mode(), lending=False, claimed=claim(4 * GiB))
    assert limits(found) == {"trainer@GPU-0": 4 * GiB, "trainer@GPU-1": 0, "helper@GPU-0": 0}
    lax = held(usage, in_dra_mode(), lending=False, claimed=claim(4 * GiB), allowed=True)
    assert limits(lax) == {"trainer@GPU-0": 4 * GiB, "trainer@GPU-1": 0}  # trainer claims


def test_with_dra_no_container_is_enforced_until_the_claims_are_read() -> None:
    """Until then the sidecar has every container unresolved (`ContainerAttributor`)."""
    usage = sample((TRAINER, "GPU-0", 9 * GiB), (HELPER, "GPU-0", GiB))
    unread = Allocations(unresolved=frozenset({"trainer", "helper"}))
    found = held(usage, in_dra_mode(), lending=True, claimed=unread)
    assert found.units == () and found.requests == {}


def test_a_process_belongs_to_a_container_only_by_an_id_in_the_pods_status() -> None:
    by_id = {"7" * 64: CONTAINERS[0]}
    read = {
        TRAINER: ("7" * 64, "python train.py"),
        HELPER: ("4" * 64, "helper"),
        STRANGER: (None, "sh"),
    }
    processes = pod_processes(read, by_id, {})
    assert processes.container_of == {TRAINER: "trainer"}
    assert set(processes.cmdlines) == {TRAINER, HELPER, STRANGER} and processes.unproven
    assert not pod_processes({TRAINER: read[TRAINER]}, by_id, {}).unproven
