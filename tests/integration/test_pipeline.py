"""One tick of the pipeline against real processes: what is reported, and how loudly."""

from __future__ import annotations

import subprocess

from enforcer.attribution import attribute
from enforcer.metrics import Telemetry
from enforcer.model import Device, ProcessKey, ProcessUsage, Sample, UnitUsage
from enforcer.pipeline import Pipeline, Report
from enforcer.policy import PolicyConfig
from enforcer.procfs import ProcFs
from enforcer.signals import Membership, Signaller, Terminator

GiB = 1024**3
GPU = Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 80 * GiB, 2 * GiB)


class StaleSource:
    """A sample taken while `key` was alive: the process has exited since."""

    def __init__(self, key: ProcessKey) -> None:
        self.key = key

    def sample(self) -> Sample:
        return Sample(0.0, (GPU,), (ProcessUsage(self.key, "GPU-0", 2 * GiB),))

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class OneUnit:
    def attribute(self, sample: Sample) -> tuple[UnitUsage, ...]:
        return attribute(sample, {p.key: "trainer" for p in sample.processes}, {"trainer": GiB})

    def membership(self, unit: str) -> Membership:
        return lambda pid: True

    def label(self, unit: str) -> str:
        return f"container {unit!r}"


def test_a_victim_that_already_exited_is_logged_quietly_not_reported_as_an_event() -> None:
    """Otherwise its Event, aggregated with the real one, would replace "sent SIGTERM"."""
    child = subprocess.Popen(["sleep", "60"])
    key = ProcessKey(child.pid, ProcFs().start_time(child.pid) or -1)
    child.kill()
    child.wait()
    reports: list[Report] = []

    class Collect:
        def report(self, report: Report) -> None:
            reports.append(report)

    terminator = Terminator(Signaller(ProcFs(), protected=frozenset({1})))
    pipeline = Pipeline(
        StaleSource(key), OneUnit(), PolicyConfig(), terminator, [Collect()], Telemetry({})
    )
    try:
        pipeline.tick()
    finally:
        terminator.close()
    (enforced,) = [r for r in reports if str(r.reason) == "VRAMEnforced"]
    assert "it had already exited" in enforced.message
    assert enforced.quiet and enforced.normal
    exceeded = [r for r in reports if str(r.reason) == "VRAMLimitExceeded"]
    assert exceeded and not exceeded[0].quiet
