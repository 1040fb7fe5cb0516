"""The allocation gate on a real GPU: the questions only a GPU answers (the research note's
§9, docs/architecture.md "The allocation gate"). Skipped without a GPU; run it first on
any GPU machine (`bash tests/gpu/offline.sh gate`, about 4 minutes).

Each step is its own test and drives the real `vram-enforcer exec --allocation-gate on -vv
--limit 4Gi --summary ...` around `gate_workload.py`. Unverified driver branches are not
skipped: a failing step is the finding. What each step saw, passed or not, goes to
`.gpu-results/allocation-gate-<driver>.json`, and a summary is printed at the end (run
with -s), to paste into the note.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).with_name("gate_workload.py")
RESULTS = ROOT / ".gpu-results"
LIMIT = "4Gi"
LIMIT_GIB = 4
# The listener's -vv line for each call: "gate: RM_ALLOC/NVOS64 class 0x80 -> not_memory",
# "gate: RM_ALLOC/NVOS64 class 0x40 1073741824 B -> allowed"
TRACE = re.compile(r"gate: (?P<what>.+?)(?: \d+ B)? (?:->|→) (?P<outcome>\w+)")
REFUSED = "refused a GPU allocation of"


def _versions() -> dict[str, Any]:
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        driver, gpu = pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlDeviceGetName(handle)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return {
        "driver": driver,
        "gpu": gpu,
        "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "kernel": os.uname().release,
    }


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {**_versions(), "limit": LIMIT, "steps": {}}
    yield found
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"allocation-gate-{found['driver']}.json"
    path.write_text(json.dumps(found, indent=2) + "\n")
    print(_summary(found, path))


def _summary(found: dict[str, Any], path: Path) -> str:
    steps = found["steps"]
    lines = [
        f"allocation gate on {found['gpu']}, driver {found['driver']} (CUDA "
        f"{found['cuda_driver']}), torch {found['torch']} (CUDA {found['torch_cuda']}), "
        f"kernel {found['kernel']}, --limit {LIMIT}:"
    ]
    for name, step in steps.items():
        said = {k: v for k, v in step.items() if k not in ("passed", "failure", "trace", "log")}
        verdict = "pass" if step["passed"] else f"FAIL ({step.get('failure', '?')})"
        lines.append(f"  {name}: {verdict} {json.dumps(said)}")
        if step.get("trace"):
            lines.append(f"    calls seen by the gate: {json.dumps(step['trace'])}")
    bare, gated = (steps.get(n, {}).get("context_s") for n in ("0 baseline, no gate", "1 trace"))
    if bare is not None and gated is not None:
        lines.append(f"  a context: {bare:.3f} s without the gate, {gated:.3f} s with it")
    lines.append(f"written to {path}")
    return "\n".join(lines)


@contextlib.contextmanager
def step(results: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """One step's record: passed once its asserts hold, else the failure, kept either way."""
    record: dict[str, Any] = {"passed": False}
    results["steps"][name] = record
    try:
        yield record
    except BaseException as exc:
        record["failure"] = "".join(traceback.format_exception_only(exc)).strip()[:500]
        raise
    record["passed"] = True


def workload(mode: str, gate: bool = True, alloc_conf: str | None = None) -> dict[str, Any]:
    """`gate_workload.py MODE`, under `exec --allocation-gate on` or bare: its JSON lines
    merged, exec's summary and exit, and the gate's calls counted from the -vv lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    summary = RESULTS / f"summary-{mode}-{alloc_conf or 'default'}.json"
    RESULTS.mkdir(exist_ok=True)
    summary.unlink(missing_ok=True)
    command = [sys.executable, str(WORKLOAD), mode]
    if gate:
        command = [
            *(sys.executable, "-m", "enforcer", "exec", "--allocation-gate", "on", "-vv"),
            *("--limit", LIMIT, "--summary", str(summary), "--", *command),
        ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )
    said: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            said.update(json.loads(line))
    trace = Counter(
        f"{m['what']} -> {m['outcome']}" for m in map(TRACE.search, done.stderr.splitlines()) if m
    )
    return {
        **said,
        "exit": done.returncode,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "refusal_lines": sum(REFUSED in line for line in done.stderr.splitlines()),
        "trace": dict(trace),
        "log": done.stderr[-4000:],
    }


def _kept(record: dict[str, Any], ran: dict[str, Any]) -> None:
    """What a gated run says, into the step's record (the log's tail only on failure)."""
    summary = ran.pop("summary") or {}
    record.update(ran)
    record["tier"] = summary.get("tier")
    record["signal"] = summary.get("signal")
    record["gate_summary"] = summary.get("allocation_gate")


def _refused_and_recovered(record: dict[str, Any]) -> None:
    """PyTorch got its OutOfMemoryError from the gate near the limit, and went on."""
    assert record["tier"] == "allocation-gate", record["log"]
    assert record.get("error") == "OutOfMemoryError", record
    assert 1 <= record["grown_gib"] <= LIMIT_GIB, record
    assert record["refusal_lines"] >= 1
    assert record.get("recovered") is True, record
    assert record["signal"] is None and record["exit"] == 0


def test_step0_without_the_gate_the_gpu_fills(results: dict[str, Any]) -> None:
    """The baseline: the context's time, and out-of-memory at the GPU's own size."""
    with step(results, "0 baseline, no gate") as record:
        record.update(workload("grow", gate=False))
        assert record.get("error") == "OutOfMemoryError", record
        assert record["grown_gib"] > LIMIT_GIB


def test_step1_what_cuda_issues_through_the_gate(results: dict[str, Any]) -> None:
    """The calls a context, a 256 MiB tensor, empty_cache and mem_get_info make, by
    escape, class and outcome (data: not asserted beyond the run itself)."""
    with step(results, "1 trace") as record:
        _kept(record, workload("trace"))
        assert record["exit"] == 0 and record["tier"] == "allocation-gate", record["log"]
        assert record["trace"], "no -vv line of the gate's: " + record["log"]


@pytest.mark.parametrize(
    ("name", "alloc_conf"),
    [
        ("2 caching allocator (cudaMalloc)", None),
        ("3 expandable segments (cuMemCreate)", "expandable_segments:True"),
        ("4 cudaMallocAsync pools", "backend:cudaMallocAsync"),
    ],
)
def test_steps2_to_4_pytorch_gets_out_of_memory_and_recovers(
    results: dict[str, Any], name: str, alloc_conf: str | None
) -> None:
    with step(results, name) as record:
        _kept(record, workload("grow", alloc_conf=alloc_conf))
        _refused_and_recovered(record)


def test_step5_the_driver_api_returns_out_of_memory(results: dict[str, Any]) -> None:
    """cuMemAlloc_v2 and cuMemCreate past the limit: CUDA_ERROR_OUT_OF_MEMORY (2)."""
    with step(results, "5 driver API") as record:
        _kept(record, workload("driver"))
        assert record["tier"] == "allocation-gate", record["log"]
        assert record.get("cu_mem_alloc", "").startswith("2 "), record
        assert record.get("cu_mem_create", "").startswith("2 "), record


def test_step7_managed_memory_is_not_gated(results: dict[str, Any]) -> None:
    """The documented gap: managed memory gets its pages without an allocation call, so
    the gate refuses nothing (sampling may still stop the workload: recorded)."""
    with step(results, "7 managed memory") as record:
        _kept(record, workload("managed"))
        assert record["tier"] == "allocation-gate", record["log"]
        assert record.get("managed_alloc", "").startswith("0 "), record
        assert record["refusal_lines"] == 0


def test_settle_nvml_shows_an_allocation_and_its_free(results: dict[str, Any]) -> None:
    """How long after the call NVML's per-process figure shows 1 GiB, and drops after the
    free: the gate's SETTLE (core/alloc_gate.py, 50 ms) and its recheck depend on it."""
    with step(results, "settle") as record:
        record.update(workload("settle", gate=False))
        assert record.get("listed") is True, record
        assert record.get("appear_ms") is not None and record.get("vanish_ms") is not None
