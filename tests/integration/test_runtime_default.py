"""The allowlist the allocation gate's profile keeps is containerd's RuntimeDefault, as
containerd's source says it today (issue 45, step 2): enforcer/core/runtime_default.py is
generated from it, and this fails when the two differ (regenerate with
tests/runtime_default/generate.sh) or when the e2e node's containerd is another version."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from enforcer.core import runtime_default

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_runtime_default_is_containerds_own() -> None:
    if shutil.which("go") is None:
        pytest.skip("needs Go and the Go module proxy (tests/runtime_default/generate.sh)")
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "runtime_default" / "generate.sh"), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CONTAINERD_VERSION": runtime_default.CONTAINERD_VERSION},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["containerd"] == runtime_default.CONTAINERD_VERSION
    assert tuple(found["capabilities"]) == runtime_default.CAPABILITIES
    for goarch, profile in runtime_default.PROFILES.items():
        assert found[goarch] == profile, f"{goarch}: run tests/runtime_default/generate.sh"


def test_the_e2e_node_runs_the_containerd_it_was_taken_from() -> None:
    script = (ROOT / "tests" / "e2e" / "build-kubernetes.sh").read_text()
    found = re.search(r"CONTAINERD=\$\{VRAM_ENFORCER_CONTAINERD_VERSION:-([0-9.]+)\}", script)
    assert found is not None
    assert found.group(1) == runtime_default.CONTAINERD_VERSION
