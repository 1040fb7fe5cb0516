"""What a pod's units are held to (`declared_units`, `claimed_units`): the sidecar's rules,
as pure functions of what its shell read on one tick."""

from decimal import Decimal

from enforcer.core.attribution import (
    PodProcesses,
    PodTerms,
    PodUnits,
    claimed_units,
    declared_units,
    pod_processes,
)
from enforcer.core.declaration import Declaration, Portion
from enforcer.core.dra import Allocations, GpuUnit
from enforcer.core.model import GiB, ProcessKey, ProcessTotal, ProcessUsage, Sample
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


def terms(**ceilings: int) -> PodTerms:
    return PodTerms(Declaration({"trainer": 4 * GiB}, ceilings))


def limits(found: PodUnits) -> dict[str, int]:
    return {u.name: u.limit_bytes for u in found.units}


def borrower(lending: bool) -> PodUnits:
    """A trainer that requests 4Gi and may borrow up to 12Gi, holding 3Gi."""
    usage = sample((TRAINER, "GPU-0", 3 * GiB))
    return declared_units(
        usage,
        seen(),
        terms(trainer=12 * GiB),
        {"trainer": 4 * GiB},
        {"trainer": 12 * GiB},
        lending=lending,
    )


def test_a_container_that_may_borrow_is_held_to_its_ceiling_while_the_agent_lends() -> None:
    lent = borrower(lending=True)
    assert limits(lent)["trainer"] == 12 * GiB
    assert lent.requests == {"trainer": 4 * GiB}  # what a reclaim takes it back to


def test_a_container_that_may_borrow_is_held_to_its_request_while_the_agent_does_not_lend() -> None:
    held = borrower(lending=False)
    assert limits(held)["trainer"] == 4 * GiB
    assert held.requests == {"trainer": 4 * GiB}  # still a borrower: a ceiling is declared


def test_a_container_that_declares_nothing_is_held_to_0_unless_undeclared_ones_are_allowed() -> (
    None
):
    usage = sample((HELPER, "GPU-0", GiB))
    strict = declared_units(usage, seen(), terms(), {"trainer": 4 * GiB}, {}, lending=False)
    assert limits(strict) == {"trainer": 4 * GiB, "helper": 0}
    allowed = PodTerms(Declaration({"trainer": 4 * GiB}), undeclared_allowed=True)
    lax = declared_units(usage, seen(), allowed, {"trainer": 4 * GiB}, {}, lending=False)
    assert limits(lax) == {"trainer": 4 * GiB}


def test_a_portion_not_counted_yet_is_not_checked_rather_than_held_to_0() -> None:
    portion = PodTerms(
        Declaration({"trainer": 4 * GiB}, portions={"helper": Portion(Decimal("0.5"))})
    )
    found = declared_units(
        sample((HELPER, "GPU-0", 30 * GiB)),
        seen(),
        portion,
        {"trainer": 4 * GiB},
        {},
        lending=False,
    )
    assert "helper" not in limits(found)


def test_a_container_spread_over_gpus_is_held_and_owed_per_gpu() -> None:
    spread = PodTerms(Declaration({"trainer": 4 * GiB}, {"trainer": 8 * GiB}, gpus={"trainer": 2}))
    usage = sample((TRAINER, "GPU-0", 3 * GiB), (TRAINER, "GPU-1", GiB))
    found = declared_units(
        usage, seen(), spread, {"trainer": 4 * GiB}, {"trainer": 8 * GiB}, lending=True
    )
    assert {n: b for n, b in limits(found).items() if "@" in n} == {
        "trainer@GPU-0": 4 * GiB,
        "trainer@GPU-1": 4 * GiB,
    }
    assert found.requests == {"trainer@GPU-0": 2 * GiB, "trainer@GPU-1": 2 * GiB}


def test_an_unproven_process_puts_the_whole_pod_in_a_unit_that_is_never_signalled() -> None:
    usage = sample((TRAINER, "GPU-0", GiB), (STRANGER, "GPU-0", 2 * GiB))
    found = declared_units(usage, seen(STRANGER), terms(), {"trainer": 4 * GiB}, {}, False)
    pod = {u.name: u for u in found.units}[POD_UNIT]
    assert not pod.enforceable
    assert {p.key for p in pod.processes} == {TRAINER, STRANGER}
    assert pod.limit_bytes == 4 * GiB  # the sum of what the pod's containers are held to
    proven = declared_units(usage, seen(), terms(), {"trainer": 4 * GiB}, {}, False)
    assert POD_UNIT not in limits(proven)


def test_the_pods_unit_counts_the_ceilings_while_the_agent_lends() -> None:
    usage = sample((STRANGER, "GPU-0", GiB))
    found = declared_units(
        usage,
        seen(STRANGER),
        terms(trainer=12 * GiB),
        {"trainer": 4 * GiB},
        {"trainer": 12 * GiB},
        lending=True,
    )
    assert limits(found)[POD_UNIT] == 12 * GiB


def test_a_containers_init_is_named_on_its_unit() -> None:
    init = ProcessTotal(ProcessKey(7, 70), 0, (), "python train.py")
    found = declared_units(
        sample((TRAINER, "GPU-0", GiB)),
        seen(inits={"trainer": init}),
        terms(),
        {"trainer": 4 * GiB},
        {},
        lending=False,
    )
    units = {u.name: u for u in found.units}
    assert units["trainer"].init_process == init and units["helper"].init_process is None


def claim(limit: int, gpu: str = "GPU-0", *containers: str) -> Allocations:
    return Allocations((GpuUnit(gpu, containers or ("trainer",), limit, ()),))


def test_with_dra_a_claim_is_raised_to_the_ceiling_only_while_the_agent_lends() -> None:
    usage = sample((TRAINER, "GPU-0", 3 * GiB))
    lent = claimed_units(usage, seen(), terms(trainer=12 * GiB), claim(4 * GiB), lending=True)
    assert limits(lent)["trainer@GPU-0"] == 12 * GiB
    assert lent.requests == {"trainer@GPU-0": 4 * GiB}
    held = claimed_units(usage, seen(), terms(trainer=12 * GiB), claim(4 * GiB), lending=False)
    assert (limits(held)["trainer@GPU-0"], held.requests) == (4 * GiB, {})


def test_with_dra_usage_on_a_gpu_no_claim_gives_is_held_to_0() -> None:
    usage = sample((TRAINER, "GPU-1", GiB), (HELPER, "GPU-0", GiB))
    found = claimed_units(usage, seen(), terms(), claim(4 * GiB), lending=False)
    assert limits(found) == {"trainer@GPU-0": 4 * GiB, "trainer@GPU-1": 0, "helper@GPU-0": 0}
    allowed = PodTerms(Declaration({"trainer": 4 * GiB}), undeclared_allowed=True)
    lax = claimed_units(usage, seen(), allowed, claim(4 * GiB), lending=False)
    assert limits(lax) == {"trainer@GPU-0": 4 * GiB, "trainer@GPU-1": 0}  # trainer declared


def test_with_dra_no_container_is_enforced_until_the_claims_are_read() -> None:
    usage = sample((TRAINER, "GPU-0", 9 * GiB), (HELPER, "GPU-0", GiB))
    everyone = PodTerms(Declaration({"trainer": 4 * GiB}), spec_containers=("trainer", "helper"))
    found = claimed_units(usage, seen(), everyone, None, lending=True)
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
