"""`vram-enforcer demo` end to end: the real CLI in a subprocess, `exec`'s real enforcement
and signals, the grower as a real child process, and only the GPU simulated. No fake
libnvidia-ml.so either: the demo must need no NVML at all."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from enforcer.core.exec_summary import ExecSummary, SummaryEvent
from enforcer.core.model import GiB, LimitResult, MiB
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings.demo import LIMIT, DemoSettings
from enforcer.edge.nvml import NvmlQueryError
from enforcer.edge.simulated_gpu import LABEL, UUID, SimulatedNvml
from enforcer.modes import demo
from enforcer.workloads import grower

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Demo:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in (self.stdout + self.stderr).splitlines() if line.strip()]

    @property
    def grower_pid(self) -> int:
        pids = {int(m[1]) for m in re.finditer(r"grower \(pid (\d+)\)", self.stdout)}
        assert len(pids) == 1, self.stdout
        return pids.pop()


def run_demo(*flags: str) -> Demo:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "demo", "--interval", "20ms", *flags],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Demo(out.returncode, out.stdout, out.stderr)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize(
    ("action", "signum"), [("terminate", signal.SIGTERM), ("kill", signal.SIGKILL)]
)
def test_the_grower_is_stopped_over_its_limit_and_every_line_says_simulated(
    action: str, signum: signal.Signals
) -> None:
    d = run_demo("--action", action)
    assert d.returncode == 0, d.stderr  # it showed what it is for: a `&&` chain goes on
    assert all(LABEL in line for line in d.lines), d.lines
    pid = d.grower_pid
    assert gone(pid)
    assert "done" not in d.stdout  # stopped before it reached its peak and exited by itself
    (enforced,) = [line for line in d.stderr.splitlines() if f"sent {signum.name}" in line]
    assert re.search(
        r"the command tree uses (1\.25|1\.50) GiB of its 1\.00 GiB VRAM limit "
        r"\(1[25]\d%\); sent SIG\w+ to pid (\d+) ",
        enforced,
    )[2] == str(pid)  # type: ignore[index]
    assert enforced.startswith(f"vram-enforcer: warning: {LABEL} the command tree uses")
    assert "enforcing a 1.00 GiB limit on pid" in d.stderr  # exec's own start line
    last = d.stderr.splitlines()[-1]
    assert "the grower went over its 1.00 GiB limit" in last
    assert f"exit status {128 + signum} ({signum.name})" in last
    assert "vram-enforcer exec --limit 4Gi -- python train.py" in last


def test_a_grower_within_its_limit_is_left_alone_after_the_enforcer_saw_its_usage() -> None:
    d = run_demo("--limit", "1536Mi")  # exactly its peak: at the limit, not over it
    assert d.returncode == 0, d.stderr
    assert all(LABEL in line for line in d.lines), d.lines
    # The enforcer saw it at its peak: the warning at 90% of the limit says so.
    assert (
        f"{LABEL} the command tree uses 1.50 GiB of its 1.50 GiB VRAM limit (100%), above "
        "the 90% warning threshold"
    ) in d.stderr
    assert "sent SIG" not in d.stderr
    assert "done, exiting with 1536 MiB" in d.stdout  # it ran to its own end
    last = d.stderr.splitlines()[-1]
    assert (
        "the grower stayed within its 1.50 GiB limit (exec saw the command tree hold "
        "1.50 GiB at most) and was left alone: exit status 0"
    ) in last


def test_a_demo_in_which_nothing_was_enforced_fails_and_says_so() -> None:
    """exec saw the grower over its limit and it ran to its end: whatever let it through
    (a sample too late, a policy that signals nothing), the demo did not show enforcement."""
    over = SummaryEvent("VRAMLimitExceeded", 1.1, "the command tree uses 1.25 GiB of ...")
    ran = ExecSummary(
        command=("grower",),
        limit_bytes=GiB,
        action="terminate",
        dry_run=False,
        exit_status=0,
        started=True,
        peak_bytes=1536 * MiB,
        events=(over,),
    )
    shown, line = demo.outcome(ran, outgrows=True)
    assert not shown
    assert line.startswith("nothing was enforced: the grower should have been stopped over its")
    assert "ended with exit status 0, not by the enforcer" in line
    # Seen only under its limit, where it should have outgrown it: not shown either.
    unseen = ExecSummary(("grower",), GiB, "warn", False, 0, True, peak_bytes=512 * MiB)
    assert demo.outcome(unseen, outgrows=True)[0] is False
    assert demo.outcome(unseen, outgrows=False)[0] is True  # a limit it fits in
    assert demo.outcome(replace(unseen, peak_bytes=None), outgrows=False)[0] is False


def test_the_help_says_it_is_simulated_and_what_to_run_on_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "demo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "simulated GPU" in out.stdout
    assert "vram-enforcer exec --limit 4Gi -- python train.py" in out.stdout
    assert "exit status" in out.stdout


def test_the_limits_help_names_the_growers_peak() -> None:
    assert f"{grower.PEAK // MiB}Mi" in LIMIT.help
    assert grower.LABEL == LABEL


def test_the_simulated_gpu_lists_live_processes_and_frees_those_that_exited(
    tmp_path: Path,
) -> None:
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / str(os.getpid())).write_text(f"{GiB}\n")
    (tmp_path / exited.stdout.strip()).write_text(f"{2 * GiB}\n")
    (tmp_path / f".{os.getpid()}.tmp").write_text("half a numb")
    snap = SimulatedNvml(tmp_path).snapshot()
    assert [(p.pid, p.device_uuid, p.used_bytes) for p in snap.processes] == [
        (os.getpid(), UUID, GiB)
    ]
    assert [(d.uuid, d.used_bytes) for d in snap.devices] == [(UUID, GiB)]
    assert not (tmp_path / exited.stdout.strip()).exists()  # freed, as a driver does


def test_the_simulated_gpu_has_no_hard_limits_and_says_so_when_unreadable(tmp_path: Path) -> None:
    gpu = SimulatedNvml(tmp_path / "missing")
    with pytest.raises(NvmlQueryError, match="simulated GPU"):
        gpu.snapshot()
    for outcome in (
        gpu.set_memory_limit(UUID, "/sys/fs/cgroup/x", GiB),
        gpu.clear_memory_limit(UUID, "/sys/fs/cgroup/x"),
        gpu.memory_limit(UUID, "/sys/fs/cgroup/x"),
    ):
        assert getattr(outcome, "result", None) is LimitResult.UNSUPPORTED


def test_the_grower_without_its_directory_says_so_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "enforcer.workloads.grower", str(tmp_path / "missing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1
    assert f"cannot write to {tmp_path / 'missing'}" in out.stderr


def test_no_directory_for_the_simulated_gpu_is_one_labelled_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(**_: object) -> None:
        raise PermissionError(13, "Permission denied", "/tmp")

    monkeypatch.setattr("tempfile.TemporaryDirectory", refused)
    with caplog.at_level(logging.INFO):
        status = demo.run(DemoSettings(GiB, PolicyConfig(), 0.1))
    assert status == 2
    (record,) = caplog.records
    assert record.getMessage().startswith(f"{LABEL} cannot create a directory for the simulated")
    assert "set TMPDIR" in record.getMessage()
