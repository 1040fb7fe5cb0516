"""The agent's reader of the kubelet's pod-resources API, over a real gRPC socket: a
kubelet stand-in (the outermost boundary) that answers `List`, then goes away."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.pod_resources import PodResources
from tests.helpers import wait_for
from tests.kubelet import Kubelet, reply


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[tuple[PodResources, threading.Event, Path]]:
    changed = threading.Event()
    socket = tmp_path / "kubelet.sock"
    found = PodResources(socket, changed, AgentTelemetry())
    yield found, changed, socket
    found.stop.set()
    found.join(timeout=5)


def test_each_pod_change_reads_the_kubelet_again_and_a_failure_keeps_the_last_read(
    reader: tuple[PodResources, threading.Event, Path], caplog: pytest.LogCaptureFixture
) -> None:
    found, changed, socket = reader
    kubelet = Kubelet(socket)
    found.start()
    wait_for(lambda: found.last is not None, what="the first read")
    assert found.last == {("ml", "serve-0", "server"): {"nvidia.com/gpu": ("GPU-a::0",)}}
    kubelet.answer = reply("GPU-b::3")
    changed.set()  # the pod watch saw a change
    wait_for(
        lambda: found.last == {("ml", "serve-0", "server"): {"nvidia.com/gpu": ("GPU-b::3",)}},
        what="the read after the change",
    )
    kept = found.last
    kubelet.stop()  # the kubelet restarts
    with caplog.at_level(logging.WARNING):
        changed.set()
        wait_for(
            lambda: "cannot read the kubelet's pod resources" in caplog.text,
            what="the failure said",
        )
    assert found.last is kept  # the reclaims go on with what was last read
