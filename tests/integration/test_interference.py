"""`vram-enforcer interference` end to end on the CPU: the real CLI in a subprocess, every
run under the real `exec`, the fake libnvidia-ml.so, and stand-in workloads
(`standin.py`) with known profiles.

The timing assertions do not depend on luck. A "contended" stand-in takes an exclusive
flock on a shared file for each of its sleep slices, as a time-sliced GPU serves one
context at a time: two of them side by side take about twice as long (1.8x here),
asserted above 1.4x, which holds even if one starts 0.3 s after the other. An
"independent" one only sleeps: next to anything it takes as long as alone, asserted
below 1.3x. Sleeping needs no CPU, so a loaded machine changes neither.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.interference.outcomes import MARKS, Outcome
from enforcer.core.model import GiB, MiB
from tests.helpers import wait_for

STANDIN = Path(__file__).with_name("standin.py")
PNG = b"\x89PNG\r\n\x1a\n"


def standin(name: str, limit: str, *flags: str) -> list[str]:
    """`--workload NAME:LIMIT:COMMAND` for a stand-in with these flags."""
    return ["--workload", f"{name}:{limit}:{shlex.join([sys.executable, str(STANDIN), *flags])}"]


@dataclass
class Measured:
    """One `vram-enforcer interference --output DIR` run, and what it wrote."""

    returncode: int
    stdout: str
    stderr: str
    output: Path

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.output / "report.json").read_text())  # type: ignore[no-any-return]

    def cell(self, workload: str, neighbour: str | None) -> dict[str, Any]:
        return next(
            c
            for c in self.report["cells"]
            if (c["workload"], c["neighbour"]) == (workload, neighbour)
        )

    def runs(self, workload: str) -> list[dict[str, Any]]:
        return [r for r in self.report["runs"] if r["workload"] == workload]


def command(output: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "enforcer", "interference", "--output", str(output), *flags]


def measure(gpu: Any, tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Measured:
    out = subprocess.run(
        command(tmp / "out", *flags),
        env={**os.environ, **gpu.env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return Measured(out.returncode, out.stdout, out.stderr, tmp / "out")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_contended_pair_slows_down_independent_ones_do_not_and_warmups_are_left_out(
    fake_nvml: Any, tmp_path: Path
) -> None:
    contended = ("--contend", str(tmp_path / "gpu.lock"), "--slices", "50")
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "2",
        "--warmup",
        "1",
        # Its first run is 1 s slower (a cold start), which the warm-up must absorb.
        *standin(
            "contended",
            "1Gi",
            *contended,
            "--gpu-bytes",
            str(512 * MiB),
            "--cold",
            str(tmp_path / "warm"),
            "--cold-extra",
            "1",
        ),
        *standin("independent", "1Gi", "--slices", "30"),
    )
    assert m.returncode == 0, m.stderr
    runs = m.report["runs"]
    assert Counter(r["phase"] for r in runs) == {"warmup": 2, "solo": 4, "pair": 12}
    assert all(r["outcome"] == "ok" for r in runs), runs
    alone = m.cell("contended", None)
    (cold,) = [r for r in m.runs("contended") if r["phase"] == "warmup"]
    assert cold["seconds"] > max(alone["seconds"]) + 0.8  # measured, and left out
    assert len(alone["seconds"]) == 2

    assert m.cell("contended", "contended")["slowdown"] > 1.4
    assert len(m.cell("contended", "contended")["seconds"]) == 4  # both copies, twice
    for workload, neighbour in [
        ("contended", "independent"),
        ("independent", "contended"),
        ("independent", "independent"),
    ]:
        assert m.cell(workload, neighbour)["slowdown"] < 1.3, (workload, neighbour)
    assert alone["peak_bytes"] == 512 * MiB  # as exec sampled it, through the fake NVML
    assert m.cell("contended", "independent")["peak_bytes"] == 512 * MiB
    assert m.cell("independent", None)["peak_bytes"] == 0
    assert m.report["stability"]["metric"] == "(max - min) / median"
    assert m.report["stability"]["largest"]["spread"] >= 0

    table = m.stdout.splitlines()
    assert table[0].startswith("2 workloads: each alone and next to each (itself included), ")
    assert "18 of 18 runs" in table[0]
    assert [line.split()[0] for line in table[2:5]] == ["workload", "contended", "independent"]
    assert "Stability: spread = (max - min) / median of a cell's repetitions." in m.stdout
    md = (m.output / "report.md").read_text()
    assert "| workload | limit | alone | next to contended | next to independent |" in md
    assert len(list((m.output / "runs").glob("*.summary.json"))) == 18  # each run under exec
    if importlib.util.find_spec("matplotlib"):
        assert (m.output / "heatmap.png").read_bytes()[:8] == PNG


def shared(mine: tuple[float, float], other: tuple[float, float]) -> float:
    """The share of `mine` that `other` overlaps, worked out here from the run records."""
    return max(0.0, min(mine[1], other[1]) - max(mine[0], other[0])) / (mine[1] - mine[0])


def test_a_workload_that_times_its_work_is_measured_without_its_start_up(
    fake_nvml: Any, tmp_path: Path
) -> None:
    """0.5 s of start-up, then 30 slices of the contended 'GPU' (0.6 s alone, about twice
    that paired). By whole commands, start-up included, its slowdown would be about 1.4x;
    by the section it timed, about 1.8x. The other writes a section that is not one, and
    keeps the fake GPU's SMs 40% busy for 2 s: long enough for exec's utilisation reads
    (twice a second; a process is known from the second read that lists it)."""
    contended = ("--contend", str(tmp_path / "gpu.lock"), "--slices", "30")
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "0",
        *standin("timed", "1Gi", *contended, "--startup", "0.5", "--section"),
        *standin(
            "garbled",
            "1Gi",
            "--slices",
            "100",
            "--section-text",
            "0.5 1.2",
            "--gpu-bytes",
            str(256 * MiB),
            "--sm",
            "40",
            "--mem",
            "10",
        ),
    )
    assert m.returncode == 0, m.stderr
    assert [w["timing"] for w in m.report["workloads"]] == ["section", "command"]
    for run in m.runs("timed"):
        assert run["section_problem"] == ""
        assert run["start_monotonic"] + 0.5 <= run["section_start_monotonic"]
        assert run["section_end_monotonic"] <= run["end_monotonic"]
    alone, paired = m.cell("timed", None), m.cell("timed", "timed")
    assert alone["seconds"] == [m.runs("timed")[0]["section_seconds"]]
    assert paired["slowdown"] > 1.6
    # the same runs measured by whole commands: start-up in both pulls the ratio toward 1
    (solo,) = [r["seconds"] for r in m.runs("timed") if r["neighbour"] is None]
    both = [r["seconds"] for r in m.runs("timed") if r["neighbour"] == "timed"]
    assert len(both) == 2
    assert paired["slowdown"] > statistics.median(both) / solo + 0.1
    # overlap is between the two copies' sections (their start-ups differ under load)
    a, b = [
        (r["section_start_monotonic"], r["section_end_monotonic"])
        for r in m.runs("timed")
        if r["neighbour"] == "timed"
    ]
    assert paired["overlap"] == pytest.approx(statistics.median([shared(a, b), shared(b, a)]))
    assert paired["overlap"] > 0.5  # the lock kept them running side by side
    assert (
        "Times are the section the workload timed itself (its work, after its start-up) "
        "for timed; exec's time of the whole command, start-up included for garbled." in m.stdout
    )
    assert (
        "garbled's figures are exec's times of the whole command, start-up included: it timed "
        "its own section in only 0 of its 4 good run(s). In 4 run(s), the "
        'VRAM_ENFORCER_TIMING_FILE file it wrote is not {"start_monotonic": S, '
        '"end_monotonic": E}, on CLOCK_MONOTONIC.'
    ) in m.stdout
    assert len(list((m.output / "runs").glob("*.timing.json"))) == 8  # every run
    garbled = m.cell("garbled", None)
    assert (garbled["sm_percent"], garbled["memory_percent"]) == (40, 10)
    assert m.cell("timed", None)["sm_percent"] is None  # it holds no GPU memory
    row = next(line for line in m.stdout.splitlines() if line.startswith("garbled "))
    assert "256.00 MiB SM 40%" in row


def test_with_the_start_gate_a_pair_starts_its_work_together_whatever_its_start_ups(
    fake_nvml: Any, tmp_path: Path
) -> None:
    """`slow` takes 1.5 s to start up and `quick` none; each then works 0.4 s. Started
    together, quick's work is over before slow's begins: they never ran side by side.
    Through the gate, both begin when both are set up. Measured once without the gate
    first, so that the test shows the gate is what lines them up."""
    workloads = (
        *standin("slow", "1Gi", "--startup", "1.5", "--section", "--slices", "20"),
        *standin("quick", "1Gi", "--section", "--slices", "20"),
    )
    for gated in (False, True):
        flags = ("--start-gate",) if gated else ()
        m = measure(
            fake_nvml, tmp_path / str(gated), "--repeat", "1", "--warmup", "0", *flags, *workloads
        )
        assert m.returncode == 0, m.stderr
        (quick,) = [r for r in m.runs("quick") if r["neighbour"] == "slow"]
        (slow,) = [r for r in m.runs("slow") if r["neighbour"] == "quick"]
        began = quick["section_start_monotonic"], slow["section_start_monotonic"]
        if not gated:
            assert m.cell("quick", "slow")["overlap"] == 0, began
            assert "~ quick next to slow ran alongside it for 0% of its time" in m.stdout
        else:
            assert abs(began[0] - began[1]) < 0.1, began
            assert m.cell("quick", "slow")["overlap"] > 0.9
            assert m.cell("slow", "quick")["overlap"] > 0.9
            assert "~" not in m.stdout
            # quick was held until slow was set up: no sooner than 1.5 s after slow's run
            # began (not quick's: the two runs start a moment apart on a busy machine)
            assert quick["section_start_monotonic"] > slow["start_monotonic"] + 1.5
        # a run alone is never held: nothing to wait for (held, it would wait for a gate
        # nobody opens until its timeout; the bound leaves a loaded machine's start-up room)
        (alone,) = [r for r in m.runs("quick") if r["neighbour"] is None]
        assert alone["section_start_monotonic"] < alone["start_monotonic"] + 5.0
        assert not list((m.output / "runs").glob("*.ready")) + list(
            (m.output / "runs").glob("*.go")
        )  # the gate's files are gone with their round


def test_over_the_limit_out_of_memory_and_failures_are_cells_and_the_rest_is_measured(
    fake_nvml: Any, tmp_path: Path
) -> None:
    env = tmp_path / "env.json"
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--gpu",
        "1",
        *standin("fine", "1Gi", "--slices", "10", "--env", str(env)),
        # 3 GiB on the fake GPU against a 1 GiB limit; it would sleep 4 s if left alone.
        *standin("greedy", "1Gi", "--slices", "200", "--gpu-bytes", str(3 * GiB)),
        *standin("crash", "2Gi", "--oom"),
        *standin("broken", "1Gi", "--fail"),
    )
    assert m.returncode == 0, m.stderr
    assert json.loads(env.read_text()) == {
        "CUDA_VISIBLE_DEVICES": "1",
        "NVIDIA_VISIBLE_DEVICES": "1",
    }
    names = ["fine", "greedy", "crash", "broken"]
    for neighbour in names:
        fine = m.cell("fine", neighbour)
        assert fine["outcomes"] == {"ok": 2 if neighbour == "fine" else 1}
        assert fine["slowdown"] is not None
    for workload, outcome, detail in [
        ("greedy", "over-limit", "went over its 1.00 GiB limit; exec stopped it"),
        ("crash", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("broken", "failed", "exit status 3: the input file is missing"),
    ]:
        for neighbour in [None, *names]:
            cell = m.cell(workload, neighbour)
            assert set(cell["outcomes"]) == {outcome}, cell
            assert cell["slowdown"] is None
            assert [p["detail"] for p in cell["problems"]] == [detail]
        line = f"  - {workload} {MARKS[Outcome(outcome)]} (alone 1/1, next to fine 1/1, "
        assert line in m.stdout, m.stdout
    for run in m.runs("greedy"):
        assert run["seconds"] < 3 and run["peak_bytes"] == 3 * GiB  # stopped early
        summary = json.loads(Path(run["log"]).with_suffix(".summary.json").read_text())
        assert [e["reason"] for e in summary["events"]] == ["VRAMLimitExceeded", "VRAMEnforced"]
    row = next(line for line in m.stdout.splitlines() if line.startswith("greedy "))
    assert row.split()[3:6] == ["OVER", "1/1", "3.00"]


def test_a_run_past_its_timeout_is_stopped_and_reported(fake_nvml: Any, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--timeout",
        "4s",  # the quick one's 0.6 s, however slow a loaded machine starts it
        *standin("quick", "1Gi", "--slices", "5"),
        *standin("stuck", "1Gi", "--slices", "3000", "--pids", str(pids)),
    )
    assert m.returncode == 0, m.stderr
    for neighbour in (None, "quick", "stuck"):
        assert set(m.cell("stuck", neighbour)["outcomes"]) == {"timeout"}
    assert m.cell("quick", "stuck")["outcomes"] == {"ok": 1}
    assert m.cell("stuck", None)["problems"][0]["detail"] == "still running after --timeout 4s"
    assert "stuck is still running after --timeout; sending it SIGTERM" in m.stderr
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 4  # alone, next to quick, and two copies next to itself
    assert not any(alive(pid) for pid in started)


def test_an_interrupt_stops_the_runs_and_writes_what_was_measured_marked_partial(
    fake_nvml: Any, tmp_path: Path
) -> None:
    pids, stderr = tmp_path / "pids", tmp_path / "stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            command(
                tmp_path / "out",
                "--repeat",
                "2",
                "--warmup",
                "0",
                *standin("quick", "1Gi", "--slices", "3"),
                *standin("slow", "1Gi", "--slices", "1000", "--pids", str(pids)),
            ),
            env={**os.environ, **fake_nvml.env()},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        wait_for(lambda: "[1/10] quick alone" in stderr.read_text(), what="the first round")
        slow = int(wait_for(lambda: pids.exists() and pids.read_text().strip(), what="slow"))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr.read_text()
    wait_for(lambda: not alive(slow), what="the stand-in to be stopped")
    assert "stopped by SIGINT after 1 of 16 runs; the report covers those" in stderr.read_text()
    assert out.startswith("2 workloads") and "PARTIAL: the measurement was interrupted" in out
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["partial"] is True
    assert [(r["workload"], r["outcome"]) for r in doc["runs"]] == [
        ("quick", "ok"),
        ("slow", "interrupted"),
    ]
    quick = next(c for c in doc["cells"] if (c["workload"], c["neighbour"]) == ("quick", None))
    assert quick["median_seconds"] is not None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--workload", "a:4GB:true", "--workload", "b:1Gi:true"],
            "--workload a: LIMIT: '4GB' is not a quantity; use a Kubernetes quantity",
        ),
        (
            ["--workload", "a:1Gi:true", "--workload", "a:2Gi:false"],
            "--workload: 'a' is the name of two workloads; give each its own name",
        ),
        (["--workload", "a:1Gi:true"], "gives 1 workload(s), and a pair needs two"),
        (["--workload", "a b:1Gi:true", "--workload", "c:1Gi:true"], "has the name 'a b'"),
        (
            ["--builtin", "matmul,gemm"],
            "--builtin: 'matmul,gemm' names 'gemm', which is not built in",
        ),
        (["--builtin", "matmul,copy", "--repeat", "0"], "--repeat: '0' is not a whole number"),
        (
            ["--builtin", "matmul,copy", "--max-spread", "0.1"],
            "--max-spread: '0.1' is not a percentage",
        ),
    ],
)
def test_bad_input_is_one_line_that_names_the_fix_and_status_2(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    out = subprocess.run(
        command(tmp_path / "out", *flags), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("vram-enforcer interference: error: ") and message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is here")
def test_builtins_without_pytorch_refuse_before_running_anything(tmp_path: Path) -> None:
    out = subprocess.run(
        command(tmp_path / "out", "--builtin", "matmul,copy"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--builtin matmul,copy: the built-in workloads need PyTorch" in out.stderr
    assert "pip install torch" in out.stderr
    assert out.stdout == ""


def test_without_matplotlib_everything_but_the_heatmap_is_written(
    fake_nvml: Any, tmp_path: Path
) -> None:
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "0",
        *standin("a", "1Gi", "--slices", "3"),
        *standin("b", "1Gi", "--slices", "3"),
        env={"PYTHONPATH": os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])},
    )
    assert m.returncode == 0, m.stderr
    assert m.report["cells"] and (m.output / "report.md").exists()
    assert not (m.output / "heatmap.png").exists()
    assert (
        "vram-enforcer: warning: heatmap.png was not written: matplotlib is not installed; "
        "pip install matplotlib (or, in the vram-enforcer checkout this was installed from, "
        "pip install '.[report]')"
    ) in m.stderr.splitlines()


def test_where_exec_cannot_start_it_refuses_before_any_run_and_says_why(
    fake_nvml: Any, tmp_path: Path
) -> None:
    """Every run goes through exec: without NVML (here, a driver that is not loaded),
    `--builtin-device cpu` or not, nothing can be measured. One line says why, status 2."""
    fake_nvml.state.data["init_error"] = "DRIVER_NOT_LOADED"
    fake_nvml.write()
    pids = tmp_path / "pids"
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "0",
        *standin("a", "1Gi", "--slices", "3", "--pids", str(pids)),
        *standin("b", "1Gi", "--slices", "3", "--pids", str(pids)),
    )
    assert m.returncode == 2, m.stderr
    (line,) = m.stderr.splitlines()
    assert line.startswith(
        "vram-enforcer: error: every run goes through vram-enforcer exec, which cannot start here: "
    )
    assert "the NVIDIA kernel driver is not loaded" in line
    assert "vram-enforcer demo" in line  # what shows the enforcement without a GPU
    assert m.stdout == ""
    assert not pids.exists()  # no workload ran


def test_when_no_run_goes_well_it_says_why_and_exits_3(fake_nvml: Any, tmp_path: Path) -> None:
    m = measure(
        fake_nvml,
        tmp_path,
        "--repeat",
        "1",
        "--warmup",
        "1",
        *standin("a", "1Gi", "--fail"),
        *standin("b", "1Gi", "--fail"),
    )
    assert m.returncode == 3, m.stderr
    assert m.stdout.startswith("2 workloads")  # the report is still printed, and written
    assert m.report["cells"]
    assert m.stderr.splitlines()[-1] == (
        "vram-enforcer: error: not one of the 8 measured runs went well (8 failed), so the "
        "report has no figure; the first: a (exit status 3: the input file is missing)"
    )
