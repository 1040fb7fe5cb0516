"""The allocation gate's benchmark measures what it says (bench/gate_bench.py): each kind of
call is answered as its row claims, the stand-in's "driver" mode, which the overshoot
arm reads, holds exactly what the gate let go on, and the overshoot's gate arm runs exec
on the gate's tier."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gate_bench
from bench.common import ROOT
from enforcer.core.gate_budget import Budget
from enforcer.edge.gate_listener import Outcome
from tests.fakenvml import FakeGpuState, build_fake_nvml

GIB = 1 << 30
HERE = Path(__file__).parent
WENT_ON = f"-1/{errno.ENOTTY}/0xffffffff"  # /dev/null's answer, the status untouched


@pytest.mark.parametrize("kind", sorted(gate_bench.KINDS))
def test_each_kind_of_the_cost_arm_is_answered_as_its_row_says(kind: str) -> None:
    step, outcome = gate_bench.KINDS[kind]
    row = gate_bench.gated(step, 30)
    assert row["outcomes"] == {outcome: 30}
    assert row["answers"] == {"0/0/0x51" if outcome == Outcome.REFUSED else WENT_ON: 30}
    assert row["p50_us"] > 0 and row["listener_cpu_us_per_call"] > 0


def test_the_flood_arm_reads_the_flood_at_its_budget_once_its_burst_is_spent() -> None:
    """The flood's figures are past its burst: read at its rate (with slack for the
    window's edges), another container's calls timed, and passes made meanwhile."""
    row = gate_bench.flood_arm(True, Budget(rate=100.0, burst=50))
    assert 0 < row["flood_calls_per_s"] <= 2 * 100, row
    assert row["p50_us"] > 0 and row["passes"] > 0, row


def test_the_filtered_arm_is_never_notified() -> None:
    row = gate_bench.gated(gate_bench.UNGATED, 30)
    assert row["outcomes"] == {} and row["answers"] == {WENT_ON: 30}


def _held(state_file: Path) -> dict[int, int]:
    state = FakeGpuState(json.loads(state_file.read_text()))
    return {p["pid"]: p["used_bytes"] for p in state.devices[0]["compute_processes"]}


def _state(tmp_path: Path) -> dict[str, str]:
    state_file = tmp_path / "gpu.json"
    FakeGpuState.single_gpu().write(state_file)
    return {**os.environ, "FAKE_NVML_STATE": str(state_file)}


def test_the_standin_holds_in_the_fake_nvml_what_went_on(tmp_path: Path) -> None:
    env = _state(tmp_path)
    step = f"size={GIB},rate={1 << 50},upto={3 * GIB},driver=1"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "rm_standin.py"), step],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    line = json.loads(out)
    assert (line["calls"], line["let_go"], line["refused"]) == (3, 3 * GIB, 0)
    assert line["counts"] == {WENT_ON: 3}
    assert _held(Path(env["FAKE_NVML_STATE"])) == {proc.pid: 3 * GIB}


def test_under_the_gate_the_standin_stops_at_the_refusal_and_holds_nothing_for_it(
    tmp_path: Path,
) -> None:
    env = _state(tmp_path)
    step = f"size={GIB},rate={1 << 50},upto={8 * GIB},driver=1"
    done = subprocess.run(
        [sys.executable, str(HERE / "gate_host.py"), str(4 * GIB), str(7 * GIB // 2), step],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    line, host = (json.loads(raw) for raw in done.stdout.splitlines())
    assert (line["calls"], line["let_go"], line["refused"]) == (1, 0, 1)
    assert host == {"outcomes": ["refused"], "exit": 0}
    assert _held(Path(env["FAKE_NVML_STATE"])) == {}


def test_the_overshoot_gate_arm_runs_exec_on_the_gate_tier(tmp_path: Path) -> None:
    """Through the plain CLI the stand-in's /dev/null is no NVIDIA device and exec falls back
    to sampling: the arm would measure sampling under the gate's name."""
    lib_dir = build_fake_nvml(ROOT / ".build" / "fakenvml")
    trial = gate_bench.overshoot_trial(lib_dir, tmp_path / "trial", "on", "")
    assert trial["tier"] == "allocation-gate", (tmp_path / "trial" / "exec.log").read_text()
    assert trial["judged"] > 0
