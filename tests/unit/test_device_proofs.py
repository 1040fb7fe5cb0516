"""The sampler's looks at processes' open files, off its thread: a look that does not come
back (a file on a hung mount) costs its own process's proof, never the pass, and at most a
few threads are left behind in such looks."""

from __future__ import annotations

import logging
import threading

import pytest

from enforcer.core.model import ProcessKey
from enforcer.edge.device_proofs import DeviceProofs
from tests.helpers import wait_for

HUNG, OTHER, THIRD = ProcessKey(10, 1), ProcessKey(20, 1), ProcessKey(30, 1)


def _looking() -> list[threading.Thread]:
    """The threads in looks (each ends once the queue is empty, its answer given)."""
    return [t for t in threading.enumerate() if t.name == "device-proof"]


class Looks:
    """Each look proves its process at once, but those of `hung`, which wait until
    `release` is set, as a read on a hung mount waits in the kernel."""

    def __init__(self, *hung: ProcessKey, holds: bool = True) -> None:
        self.hung = set(hung)
        self.holds = holds
        self.release = threading.Event()
        self.started: list[ProcessKey] = []
        self.ended: list[ProcessKey] = []

    def __call__(self, key: ProcessKey) -> bool:
        self.started.append(key)
        if key in self.hung:
            self.release.wait()
        self.ended.append(key)
        return self.holds


def test_a_look_that_does_not_come_back_costs_its_own_process_not_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    looks, now = Looks(HUNG), [0.0]
    proofs = DeviceProofs(looks, stuck_after=1.0, clock=lambda: now[0])
    try:
        assert proofs.proven({HUNG, OTHER}) == set()  # asked: the looks start, off this thread
        wait_for(lambda: looks.started == [HUNG], what="the first look")
        assert proofs.proven({HUNG, OTHER}) == set()  # the other waits its turn, for now
        now[0] += 1.0  # the look has not come back within 1s: another thread takes the rest
        wait_for(lambda: OTHER in proofs.proven({HUNG, OTHER}), what="the other's proof")
        assert looks.started == [HUNG, OTHER]  # the hung one was not looked at twice
        stuck = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(stuck) == 1 and stuck[0].startswith("pid 10: a look at its open files")
        looks.release.set()  # the mount answers again: the look comes back, and counts
        wait_for(lambda: proofs.proven({HUNG}) == {HUNG}, what="the hung one's proof")
    finally:
        looks.release.set()


def test_past_the_most_stuck_looks_no_look_starts_until_one_comes_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    looks, now = Looks(HUNG, OTHER), [0.0]
    proofs = DeviceProofs(looks, stuck_after=1.0, most_stuck=2, clock=lambda: now[0])
    try:
        proofs.proven({HUNG})
        wait_for(lambda: looks.started == [HUNG], what="the first look")
        now[0] += 1.0
        proofs.proven({HUNG, OTHER})
        wait_for(lambda: looks.started == [HUNG, OTHER], what="the second look")
        now[0] += 1.0
        for _ in range(3):  # two threads left behind: the third waits, said once
            assert proofs.proven({HUNG, OTHER, THIRD}) == set()
        assert looks.started == [HUNG, OTHER]
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and said[0].startswith("2 looks at processes' open files")
        looks.release.set()  # a thread comes back, and takes the third
        wait_for(lambda: THIRD in proofs.proven({THIRD}), what="the third's proof")
    finally:
        looks.release.set()


def test_what_is_no_longer_listed_is_not_looked_at() -> None:
    looks, now = Looks(HUNG), [0.0]
    proofs = DeviceProofs(looks, stuck_after=1.0, clock=lambda: now[0])
    try:
        proofs.proven({HUNG, OTHER})
        wait_for(lambda: looks.started == [HUNG], what="the first look")
        proofs.proven({HUNG})  # the other left NVML's list meanwhile
        now[0] += 1.0
        proofs.proven({HUNG})
        looks.release.set()
        wait_for(lambda: proofs.proven({HUNG}) == {HUNG}, what="the hung one's proof")
        assert looks.started == [HUNG]
    finally:
        looks.release.set()


def test_a_process_that_a_look_did_not_prove_is_looked_at_again_a_second_later() -> None:
    """Not on every pass: one that holds no device (or hides it) would have its open files
    read ten times a second, a cost of its choosing."""
    looks, now = Looks(holds=False), [0.0]
    proofs = DeviceProofs(looks, clock=lambda: now[0])
    assert proofs.proven({OTHER}) == set()
    wait_for(lambda: looks.ended == [OTHER] and not _looking(), what="the first look's end")
    for _ in range(5):  # the sampler's passes within the second
        assert proofs.proven({OTHER}) == set()
        now[0] += 0.19
    assert looks.started == [OTHER]
    now[0] += 0.05
    proofs.proven({OTHER})
    wait_for(lambda: looks.ended == [OTHER, OTHER], what="the second look")
