"""Fixtures shared by the whole suite."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.helpers import scratch_cgroup

pytest_plugins = ["tests.fakenvml.plugin"]

# CI runs the same examples every time, so that a result never depends on luck; a run on a
# developer's machine explores new ones (and hypothesis keeps any failure it finds).
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def cgroup2() -> Iterator[Path]:
    """A fresh, empty cgroup v2 directory of this test's own (see `scratch_cgroup`)."""
    with scratch_cgroup() as path:
        yield path
