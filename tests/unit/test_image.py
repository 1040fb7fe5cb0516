"""The image's build-time smoke test runs here too: a renamed module fails CI, not the
image build (CI has no container engine)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dockerfile_smoke_test_passes_on_this_checkout() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    match = re.search(r'&& (python -c "[^"]+")', dockerfile)
    assert match, "the Dockerfile's import smoke test is gone"
    argv = shlex.split(match.group(1))
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # nothing ran on import (python -m enforcer's main included)
