"""The proof that the driver charges a cgroup's processes to its hard limit, asked one way by
exec and the agent (`edge/charge_proof.py`): binds at once, does not after two reads in a
row that charged nothing, and the count of those reads is kept while its cgroup is."""

from typing import cast

from enforcer.core.hard_limits import EVIDENCE_BYTES, UNCHARGED_READS
from enforcer.core.model import GiB, HeldLimit
from enforcer.edge.charge_proof import ChargeProof, Proof
from enforcer.edge.nvml import Nvml


class Driver:
    """What NVML's memory-limit read returns (the driver's side is the boundary here)."""

    def __init__(self, charged: int) -> None:
        self.charged = charged
        self.asked: list[tuple[str, str]] = []

    def memory_limit(self, gpu: str, cgroup: str) -> HeldLimit:
        self.asked.append((gpu, cgroup))
        return HeldLimit(4 * GiB, 0, self.charged)


def test_a_limit_binds_as_soon_as_the_driver_charges_what_nvml_lists() -> None:
    proof = ChargeProof(cast(Nvml, Driver(charged=GiB)))
    assert proof.read("/pod", {"GPU-0": GiB}) == Proof("GPU-0", True, GiB, GiB)


def test_too_little_to_tell_is_not_asked() -> None:
    driver = Driver(charged=0)
    proof = ChargeProof(cast(Nvml, driver))
    assert proof.read("/pod", {"GPU-0": EVIDENCE_BYTES - 1}) is None
    assert driver.asked == []


def test_a_limit_does_not_bind_after_reads_in_a_row_that_charged_nothing() -> None:
    proof = ChargeProof(cast(Nvml, Driver(charged=0)))
    answers = [proof.read("/pod", {"GPU-0": GiB}) for _ in range(UNCHARGED_READS)]
    assert answers[:-1] == [None] * (UNCHARGED_READS - 1)
    assert answers[-1] == Proof("GPU-0", False, 0, GiB)


def test_the_count_is_kept_while_its_cgroup_is_and_forgotten_after() -> None:
    proof = ChargeProof(cast(Nvml, Driver(charged=0)))
    assert proof.read("/leaf", {"GPU-0": GiB}) is None
    proof.keep({"/leaf"})  # a pass where the container's cgroup is still there
    assert proof.read("/leaf", {"GPU-0": GiB}) is not None
    assert proof.read("/other", {"GPU-0": GiB}) is None
    proof.keep(set())  # the cgroup is gone: its count with it
    assert proof.read("/other", {"GPU-0": GiB}) is None
