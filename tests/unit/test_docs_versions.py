"""The versions the docs state are the ones the code, the chart and CI pin: a release, a
new Kubernetes floor or a new helm in CI that leaves a sentence behind fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from enforcer import __version__

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "vram-enforcer"
E2E = ROOT / "tests" / "e2e"


def _readers() -> dict[str, str]:
    paths = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        CHART / "README.md",
        CHART / "values.yaml",
        *sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file()),
    ]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def _pinned(path: Path, pattern: str) -> str:
    (found,) = re.findall(pattern, path.read_text())
    return str(found)


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_the_release_is_the_same_wherever_it_is_said() -> None:
    release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert __version__ == chart["version"] == chart["appVersion"] == release
    said = {
        (where, tag)
        for where, text in _readers().items()
        for tag in re.findall(r"vram-enforcer:(\d+\.\d+\.\d+)\b", text)
        + re.findall(r"appVersion \((\d+\.\d+\.\d+)\)", text)
    }
    assert len(said) >= 3
    assert sorted((w, t) for w, t in said if t != release) == []


def test_the_kubernetes_versions_said_are_the_floor_and_the_ones_ci_runs() -> None:
    newest = _pinned(E2E / "cluster.py", r'\nVERSION = "([\d.]+)"')
    oldest = _pinned(E2E / "cluster.py", r'\nOLDEST = "([\d.]+)"')
    build = E2E / "build-kubernetes.sh"
    assert _pinned(build, r"VRAM_ENFORCER_K8S_VERSION:-([\d.]+)") == newest
    assert _pinned(build, r"VRAM_ENFORCER_K8S_OLDEST:-([\d.]+)") == oldest
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert floor == f">={_minor(oldest)}.0-0"
    wrong, floors = [], []
    for where, text in _readers().items():
        # a Kubernetes release to the patch is one CI ran
        for version in re.findall(r"\b1\.[2-9]\d\.\d+\b", text):
            if version not in (newest, oldest):
                wrong.append((where, version))
        said = re.findall(r"(1\.\d+)(?:\s+or\s+later)?\s+\(the\s+chart's\s+floor\)", text)
        said += re.findall(r"Kubernetes ≥ (1\.\d+) \| the chart's `kubeVersion`", text)
        floors += [(where, f) for f in said]
    assert len(floors) >= 3  # the README, install.md, examples/README.md
    assert sorted(wrong + [(w, f) for w, f in floors if f != _minor(oldest)]) == []


def test_the_helm_that_ci_runs_is_the_one_said() -> None:
    helm = _minor(_pinned(E2E / "build-helm.sh", r"VRAM_ENFORCER_HELM_VERSION:-([\d.]+)"))
    said = {
        (where, _minor(version))
        for where, text in _readers().items()
        for version in re.findall(r"\bhelm (3\.\d+(?:\.\d+)?)", text, re.IGNORECASE)
    }
    assert len(said) >= 2
    assert sorted((w, v) for w, v in said if v != helm) == []
