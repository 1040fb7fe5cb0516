"""A GPU that NVML cannot read is said after FAULT_PASSES passes in a row, and said back
after as many: one that fails now and then is said nowhere."""

from __future__ import annotations

from enforcer.core.gpu_faults import FAULT_PASSES, Change, Faults, passed

OFF = {"GPU-1": "GPU is lost"}


def test_a_gpu_is_said_unreadable_after_passes_in_a_row_and_readable_after_as_many() -> None:
    faults, said = Faults(), []
    for _ in range(FAULT_PASSES):
        faults, changes = passed(faults, OFF)
        said.extend(changes)
    assert said == [Change("GPU-1", "GPU is lost")] and faults.said == OFF
    for _ in range(FAULT_PASSES - 1):
        faults, changes = passed(faults, {})
        assert changes == ()
    faults, changes = passed(faults, {})
    assert changes == (Change("GPU-1", None),) and faults == Faults()


def test_a_gpu_that_fails_now_and_then_is_never_said() -> None:
    faults = Faults()
    for i in range(10 * FAULT_PASSES):
        faults, changes = passed(faults, OFF if i % FAULT_PASSES else {})
        assert changes == ()
    assert faults.said == {}
