"""Helpers shared by the benchmarks: processes, /proc figures, metrics scraping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1024**3


def enforcer_argv(*args: str) -> list[str]:
    """`python -m enforcer ARGS`, run by $VRAM_BENCH_RUNTIME (`run.py --runtime`) if set.

    The benchmarks themselves need the dev extras, and one of them (kubernetes-validate) is
    imported by the kubernetes client whenever it is installed. A venv with only
    `pip install .` measures the footprint that ships.
    """
    return [os.environ.get("VRAM_BENCH_RUNTIME") or sys.executable, "-m", "enforcer", *args]


def release_and_collect(callers: list[subprocess.Popen[str]]) -> list[float]:
    """Start every waiting caller at once ("go"), then gather the figures each prints."""
    for p in callers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    figures: list[float] = []
    for p in callers:
        assert p.stdout is not None
        figures += json.loads(p.stdout.readline())
    return figures


def scrape(port: int) -> dict[str, float]:
    """Metric name -> value, summed over label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name = series.partition("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def cluster_missing() -> str | None:
    """Why the real control plane with a real node and the chart (Helm) cannot run here."""
    from tests.e2e.helm import helm_python
    from tests.e2e.node import missing

    if reason := missing():
        return reason
    if helm_python() is None:
        return "needs helm-sdkpy: bash .ci/run makes .venv-helm"
    return None
