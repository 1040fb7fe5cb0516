"""Ticks of the pipeline with the real attributor, signaller and terminator, against real
processes: what is reported, how loudly, and that a failing tick does not end enforcement.

The usage source is the one stand-in, at the boundary: it replays samples, as the agent's
socket delivers a sample taken before a process exited, or fails as a buggy source would.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator

import pytest

from enforcer.core.model import Device, ProcessKey, ProcessUsage, Sample
from enforcer.core.policy import PolicyConfig
from enforcer.edge.metrics import Telemetry
from enforcer.edge.procfs import ProcFs
from enforcer.edge.signals import Signaller, Terminator
from enforcer.modes.exec import TreeAttributor
from enforcer.modes.pipeline import Pipeline, Report

GiB = 1024**3
GPU = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, 2 * GiB)
PROC = ProcFs()


class Replay:
    """Each tick takes the next step: a sample to return, or an exception to raise."""

    def __init__(self, *steps: Sample | Exception) -> None:
        self.steps = list(steps)

    def sample(self) -> Sample:
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        pass


def using(key: ProcessKey, used: int) -> Sample:
    return Sample(0.0, (GPU,), (ProcessUsage(key, GPU.uuid, used),))


class Collect:
    def __init__(self) -> None:
        self.reports: list[Report] = []

    def report(self, report: Report) -> None:
        self.reports.append(report)

    def reasons(self) -> list[str]:
        return [str(r.reason) for r in self.reports]


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[bytes], ProcessKey]]:
    """A process of our own tree: TreeAttributor counts it (we are its root)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc, ProcessKey(proc.pid, PROC.start_time(proc.pid) or -1)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def pipeline(source: Replay, reporter: Collect, telemetry: Telemetry) -> Pipeline:
    terminator = Terminator(Signaller(PROC, protected=frozenset({1})))
    attributor = TreeAttributor(PROC, "trainer", GiB)
    return Pipeline(source, attributor, PolicyConfig(), terminator, [reporter], telemetry)


def test_a_victim_that_already_exited_is_logged_quietly_not_reported_as_an_event(
    child: tuple[subprocess.Popen[bytes], ProcessKey],
) -> None:
    """Otherwise its Event, aggregated with the real one, would replace "sent SIGTERM"."""
    proc, key = child
    reporter = Collect()
    # First seen alive and under its limit; then a sample taken before it exited says over.
    ticks = pipeline(Replay(using(key, GiB // 2), using(key, 2 * GiB)), reporter, Telemetry({}))
    ticks.tick()
    assert [u.used_bytes for u in ticks.last_units] == [GiB // 2]  # the tick saw it
    proc.kill()
    proc.wait()
    ticks.tick()
    (enforced,) = [r for r in reporter.reports if str(r.reason) == "VRAMEnforced"]
    assert "it had already exited" in enforced.message
    assert enforced.quiet and enforced.normal
    exceeded = [r for r in reporter.reports if str(r.reason) == "VRAMLimitExceeded"]
    assert exceeded and not exceeded[0].quiet


def test_a_tick_that_fails_is_reported_and_the_next_one_enforces(
    child: tuple[subprocess.Popen[bytes], ProcessKey], caplog: pytest.LogCaptureFixture
) -> None:
    proc, key = child
    reporter, telemetry = Collect(), Telemetry({})
    ticks = pipeline(Replay(RuntimeError("a bug"), using(key, 2 * GiB)), reporter, telemetry)
    with caplog.at_level(logging.ERROR):
        ticks.tick()
    assert "unexpected error in the tick loop" in caplog.text and "a bug" in caplog.text
    assert telemetry.unexpected.labels("tick")._value.get() == 1
    ticks.tick()
    assert proc.wait(timeout=5) == -15
    assert "VRAMEnforced" in reporter.reasons()
