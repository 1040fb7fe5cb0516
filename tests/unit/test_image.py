"""What the Dockerfile holds, checked without building it: its import smoke test runs on
this checkout, and its pins agree with pyproject.toml (the image itself is built from it
by tests/e2e/build-image.sh in .ci/run, and the e2e cluster runs it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _dockerfile_pins() -> dict[str, str]:
    """The runtime pins of the Dockerfile's venv step (name -> version), by canonical name."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    step = re.search(r"python -m venv /opt/venv \\\n(.*?)\n\n", dockerfile, re.S)
    assert step, "the Dockerfile's runtime dependency step is gone"
    pins = re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"', step.group(1))
    return {canonicalize_name(name): version for name, version in pins}


def _runtime_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(line) for line in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in found}


def test_the_dockerfile_pins_exactly_the_runtime_dependencies_of_pyproject() -> None:
    """A dependency added to pyproject.toml and not to the Dockerfile broke the image's
    build once (grpcio) while every test passed: the two lists are compared here."""
    pins, required = _dockerfile_pins(), _runtime_requirements()
    assert sorted(pins) == sorted(required), (
        f"only in the Dockerfile: {sorted(set(pins) - set(required))}; "
        f"only in pyproject.toml: {sorted(set(required) - set(pins))}"
    )
    outside = {name: pins[name] for name, r in required.items() if pins[name] not in r.specifier}
    assert not outside, f"pins outside pyproject.toml's bounds: {outside} ({required})"


def test_the_dockerfile_copies_every_file_the_wheel_is_built_from() -> None:
    """The readme and the license files that pyproject.toml names are built into the wheel,
    and setuptools refuses to build without them: a file named there and not copied breaks
    the image's build while every other test passes."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [project["readme"]] + [
        str(path.relative_to(ROOT))
        for pattern in project["license-files"]
        for path in sorted(ROOT.glob(pattern)) or [ROOT / pattern]
    ]
    copied = {
        source.rstrip("/")
        for line in re.findall(r"^COPY (?!--)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
        for source in line.split()
    }
    assert {"pyproject.toml", "enforcer"} <= copied, copied
    missing = [name for name in named if not (ROOT / name).is_file() or name not in copied]
    assert not missing, f"named by pyproject.toml, not in the checkout or not copied: {missing}"
