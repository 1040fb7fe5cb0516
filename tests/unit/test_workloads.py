"""The built-in workloads' command line without PyTorch (CI cannot install it): the
arguments are checked first; no PyTorch, no CUDA GPU and out of memory are each one line
and a status of its own. A stand-in holds the little of PyTorch that `main` touches; the
workloads run for real in tests/gpu/test_interference_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from enforcer.core.interference import outcomes, workloads
from enforcer.workloads import (
    EXIT_NO_DEVICE,
    EXIT_NO_TORCH,
    EXIT_OUT_OF_MEMORY,
    GO_ENV,
    READY_ENV,
    TIMING_ENV,
    kernels,
)
from enforcer.workloads.__main__ import main
from tests.helpers import wait_for


def test_workload_arguments_are_checked_before_pytorch_is_looked_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["gemm"],
        ["copy", "--steps", "0"],
        ["copy", "--steps", "2", "--scale", "2"],
        ["copy", "--scale", "-1"],
        ["copy", "--device", "tpu"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
    assert "'0' is not a whole number of steps" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is here")
def test_a_workload_without_pytorch_says_so_with_its_own_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["matmul", "--device", "cpu"]) == EXIT_NO_TORCH
    err = capsys.readouterr().err
    assert err.startswith("python -m enforcer.workloads matmul: PyTorch is not installed for ")
    assert "https://pytorch.org/get-started/locally/" in err


class _OutOfMemoryError(RuntimeError):
    """Stands for torch.cuda.OutOfMemoryError."""


@pytest.fixture
def stub_torch(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The little of PyTorch that `main` and `kernels.run` touch; the workloads themselves
    are replaced by each test (the real ones run in tests/gpu)."""
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        synchronize=lambda device: None,
        OutOfMemoryError=_OutOfMemoryError,
    )
    torch = types.SimpleNamespace(
        __version__="2.x",
        cuda=cuda,
        manual_seed=lambda seed: None,
        device=lambda name: types.SimpleNamespace(type=name),
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_a_workload_runs_its_steps_and_says_how_long_they_took(
    stub_torch: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    done: list[int] = []
    monkeypatch.setitem(kernels.WORKLOADS, "matmul", lambda torch, device: done.append)
    assert main(["matmul", "--steps", "3"]) == 0
    assert done == [0, 1, 2]
    assert capsys.readouterr().out.startswith("matmul: 3 steps on cuda in ")
    done.clear()
    assert main(["matmul", "--scale", "0.001", "--device", "cpu"]) == 0
    assert done == [0]  # never fewer than one step


def test_a_workload_writes_the_section_it_timed_for_interference_after_its_start_up(
    stub_torch: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    assert TIMING_ENV == workloads.TIMING_ENV  # the package keeps its own copy of the name

    def set_up(torch: object, device: object) -> Callable[[int], None]:
        time.sleep(0.2)  # the start-up: data, a model
        return lambda i: time.sleep(0.05)

    monkeypatch.setitem(kernels.WORKLOADS, "matmul", set_up)
    monkeypatch.setenv(TIMING_ENV, str(tmp_path / "timing.json"))
    began = time.monotonic()
    assert main(["matmul", "--steps", "2"]) == 0
    ended = time.monotonic()
    doc = json.loads((tmp_path / "timing.json").read_text())
    section, problem = outcomes.read_section(doc, began, ended)
    assert problem == "" and section is not None
    assert section[0] >= began + 0.2  # after the start-up, whose sleep it does not count
    assert section[1] - section[0] >= 0.1  # both steps


def test_in_a_pair_a_workload_says_it_is_set_up_and_starts_its_steps_only_at_the_gate(
    stub_torch: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    assert (READY_ENV, GO_ENV) == (workloads.READY_ENV, workloads.GO_ENV)
    ready, go, timing = tmp_path / "run.ready", tmp_path / "round.go", tmp_path / "t.json"
    seen: dict[str, float] = {}

    def set_up(torch: object, device: object) -> Callable[[int], None]:
        assert not ready.exists()  # not before its start-up is over
        return lambda i: seen.setdefault("first step", time.monotonic())

    def open_the_gate() -> None:
        wait_for(ready.exists, timeout=10, what="the workload to say it is set up")
        time.sleep(0.3)  # its neighbour's start-up takes longer
        seen["go"] = time.monotonic()
        go.touch()

    monkeypatch.setitem(kernels.WORKLOADS, "matmul", set_up)
    for name, path in ((READY_ENV, ready), (GO_ENV, go), (TIMING_ENV, timing)):
        monkeypatch.setenv(name, str(path))
    gatekeeper = threading.Thread(target=open_the_gate)
    gatekeeper.start()
    assert main(["matmul", "--steps", "1"]) == 0
    gatekeeper.join()
    assert seen["first step"] >= seen["go"]
    assert json.loads(timing.read_text())["start_monotonic"] >= seen["go"]  # timed from go


def test_a_section_that_cannot_be_written_is_one_line_and_the_work_still_counts(
    stub_torch: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setitem(kernels.WORKLOADS, "matmul", lambda torch, device: lambda i: None)
    monkeypatch.setenv(TIMING_ENV, str(tmp_path / "missing" / "timing.json"))
    assert main(["matmul", "--steps", "1"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m enforcer.workloads: cannot write the timed section to ")
    assert line.endswith("No such file or directory")


def test_out_of_memory_is_one_line_and_a_status_of_its_own(
    stub_torch: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def allocate(torch: object, device: object) -> None:
        raise _OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")

    monkeypatch.setitem(kernels.WORKLOADS, "copy", allocate)
    assert main(["copy"]) == EXIT_OUT_OF_MEMORY
    assert capsys.readouterr().err == (
        "python -m enforcer.workloads copy: out of memory: "
        "CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    )


def test_no_cuda_gpu_is_a_status_of_its_own(
    stub_torch: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    stub_torch.cuda.is_available = lambda: False
    assert main(["infer"]) == EXIT_NO_DEVICE
    assert "PyTorch 2.x sees no CUDA GPU; use --device cpu" in capsys.readouterr().err
