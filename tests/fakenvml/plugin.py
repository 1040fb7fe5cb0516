"""pytest fixtures for the fake NVML: the built library, and a per-test fake GPU.

In-process use relies on one fact of glibc: `dlopen("libnvidia-ml.so.1")` returns an
already-loaded library whose SONAME matches. So the fake is loaded by full path before
pynvml looks, and the real pynvml then finds it without any change. Subprocesses get it
through LD_LIBRARY_PATH instead (`FakeNvml.env()`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakenvml import LIBRARY, FakeGpuState, build_fake_nvml, limit_records

BUILD_DIR = Path(__file__).resolve().parents[2] / ".build" / "fakenvml"


class FakeNvml:
    """One test's fake GPU: edit `state`, then `write()` to make the library see it."""

    def __init__(self, lib_dir: Path, state_file: Path) -> None:
        self.lib_dir = lib_dir
        self.state_file = state_file
        self.state = FakeGpuState.single_gpu()

    def write(self) -> None:
        self.state.write(self.state_file)

    def limit_records(self) -> list[dict[str, Any]]:
        """The per-cgroup limits set so far, by any process using this fake GPU."""
        return limit_records(self.state_file)

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should load the fake instead of a driver."""
        return {"LD_LIBRARY_PATH": str(self.lib_dir), "FAKE_NVML_STATE": str(self.state_file)}


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Path:
    lib_dir = build_fake_nvml(BUILD_DIR)
    ctypes.CDLL(str(lib_dir / LIBRARY), mode=ctypes.RTLD_GLOBAL)
    return lib_dir


@pytest.fixture
def fake_nvml(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    fake = FakeNvml(fake_nvml_lib, tmp_path / "fake-gpu.json")
    fake.write()
    monkeypatch.setenv("FAKE_NVML_STATE", str(fake.state_file))
    yield fake
    _shutdown_leftover_sessions()


def _shutdown_leftover_sessions() -> None:
    """A test that failed mid-way may leave pynvml initialised; the next test starts clean."""
    import pynvml

    while True:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            return
