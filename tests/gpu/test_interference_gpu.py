"""`vram-enforcer interference` on a real GPU with the built-in PyTorch workloads: each one
runs under exec within its declared limit, a real CUDA out-of-memory error is one line and
status 3, and the whole built-in set is measured alone and in pairs. Skipped without a
GPU and PyTorch (tests/gpu/conftest.py).

The figures are printed (`pytest -s`): times, start-up, peaks and the report, to record
in docs/performance.md.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from enforcer.core.interference.workloads import BUILTINS
from enforcer.core.model import MiB
from enforcer.workloads import EXIT_OUT_OF_MEMORY


def test_each_builtin_runs_on_the_gpu_within_its_declared_limit(tmp_path: Path) -> None:
    for name, builtin in BUILTINS.items():
        summary = tmp_path / f"{name}.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "enforcer",
                "exec",
                "--limit",
                str(builtin.limit_bytes),
                "--interval",
                "50ms",
                "--summary",
                str(summary),
                "--",
                sys.executable,
                "-m",
                "enforcer.workloads",
                name,
                "--scale",
                "0.1",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        doc = json.loads(summary.read_text())
        print(
            f"{name}: {done.stdout.strip()}; exec: {doc['wall_seconds']:.2f} s, "
            f"peak {doc['peak_bytes'] / MiB:.0f} MiB of {builtin.limit_bytes / MiB:.0f}"
        )
        assert done.returncode == 0, done.stderr
        assert doc["events"] == [], doc["events"]  # never over its declared limit
        assert doc["peak_bytes"] > 256 * MiB  # at least a CUDA context: the GPU was used


def test_a_real_cuda_out_of_memory_is_one_line_and_status_3() -> None:
    asks_too_much = (
        "import sys; from enforcer.workloads import kernels; "
        "from enforcer.workloads.__main__ import main; "
        "kernels.WORKLOADS['copy'] = lambda torch, device: torch.empty(2**50, device=device); "
        "sys.exit(main(['copy', '--steps', '1']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", asks_too_much], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == EXIT_OUT_OF_MEMORY, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("python -m enforcer.workloads copy: out of memory: CUDA out of memory")


def test_the_builtin_set_is_measured_alone_and_in_pairs_on_one_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "interference",
            "--builtin",
            ",".join(BUILTINS),
            "--builtin-scale",
            "0.25",
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--gpu",
            "0",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(done.stdout)
    print(done.stderr)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert [r for r in report["runs"] if r["outcome"] != "ok"] == []
    for cell in report["cells"]:
        assert cell["peak_bytes"] > 256 * MiB, cell
        assert cell["neighbour"] is None or cell["slowdown"] > 0.8, cell
    # Each built-in timed its steps itself, so the start-up does not dilute the figures.
    assert [w["timing"] for w in report["workloads"]] == ["section"] * len(BUILTINS)
    # The two runs of each pair began their work together (the start gate), although
    # PyTorch's start-up differs by seconds between them (1.4 ms apart on an H100; 7.1 s
    # before the gate).
    began: dict[int, list[float]] = {}
    for run in report["runs"]:
        if run["neighbour"] is not None:
            began.setdefault(run["round"], []).append(run["section_start_monotonic"])
    assert all(max(b) - min(b) < 0.5 for b in began.values()), began
    cells = {(c["workload"], c["neighbour"]): c for c in report["cells"]}
    # Two compute-bound kernels time-sliced on the same SMs: each takes about twice as long.
    assert cells[("matmul", "matmul")]["slowdown"] > 1.5
    if importlib.util.find_spec("matplotlib"):
        assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
