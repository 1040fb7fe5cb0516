"""Fixtures shared by the whole suite."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import scratch_cgroup

pytest_plugins = ["tests.fakenvml.plugin"]


@pytest.fixture
def cgroup2() -> Iterator[Path]:
    """A fresh, empty cgroup v2 directory of this test's own (see `scratch_cgroup`)."""
    with scratch_cgroup() as path:
        yield path
