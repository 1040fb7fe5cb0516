"""The real Helm engine for the e2e tests: helm-sdkpy (Helm v4) in a Python >= 3.12
virtualenv (`.venv-helm`, made by .ci/run; or HELM_PYTHON), driven by
tests/chart/helm_driver.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "vram-enforcer"


def helm_python() -> Path | None:
    explicit = os.environ.get("HELM_PYTHON")
    found = Path(explicit) if explicit else ROOT / ".venv-helm" / "bin" / "python"
    return found if found.exists() else None


def helm(*args: str, fails: bool = False) -> Any:
    """Run one helm_driver.py verb; its JSON result, or its error text when `fails`. Skips
    (fails under VRAM_ENFORCER_E2E=required) without helm-sdkpy."""
    python = helm_python()
    if python is None:
        reason = "no helm-sdkpy: bash .ci/run makes .venv-helm (Python >= 3.12), or set HELM_PYTHON"
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    out = subprocess.run(
        [str(python), str(ROOT / "tests" / "chart" / "helm_driver.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if fails:
        assert out.returncode != 0, out.stdout
        return out.stderr
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
