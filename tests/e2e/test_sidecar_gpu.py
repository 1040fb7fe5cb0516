"""The whole product on a real GPU: real NVML in the agent, real CUDA programs (PyTorch) in
a pod's containers, the sidecar against the real API server. Skipped without a GPU."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from enforcer.core.model import GiB
from tests.e2e.actors import Node, Sidecar, alive, namespace_with_sidecar_rbac
from tests.e2e.cluster import ApiServer
from tests.e2e.podsim import SimPod
from tests.gpu.probe import why_no_gpu
from tests.helpers import wait_for

ALLOC = Path(__file__).resolve().parents[1] / "gpu" / "alloc.py"
NAMESPACE = "gpu-real"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu())),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("node"), lib=None)
    n.start_agent()
    yield n
    n.stop_agent()


def test_a_real_cuda_process_over_its_containers_limit_is_caught(
    node: Node, apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    token = namespace_with_sidecar_rbac(apiserver, admin, NAMESPACE)
    core = client.CoreV1Api(admin)
    pod = SimPod(core, NAMESPACE, "llm-0", ["trainer", "server", "vram-enforcer"])
    try:
        side = Sidecar(
            pod, node, apiserver, token, tmp_path, {"trainer": 2 * GiB, "server": 4 * GiB}
        )
        trainer_log, server_log = tmp_path / "trainer.out", tmp_path / "server.out"
        # The server stays at 1 GiB (plus its CUDA context); the trainer grows to 6 GiB.
        server = pod.start(
            "server", [sys.executable, str(ALLOC), "256", "4", "120"], stdout=server_log.open("w")
        )
        wait_for(lambda: "allocated 1024" in server_log.read_text(), timeout=60, what="server")
        trainer = pod.start(
            "trainer", [sys.executable, str(ALLOC), "256", "24", "60"], stdout=trainer_log.open("w")
        )
        assert trainer.wait(timeout=90) != 0, "the trainer was never stopped"
        allocated = [
            ln for ln in trainer_log.read_text().splitlines() if ln.startswith("allocated")
        ]
        print("trainer got to", allocated[-1], "\n", side.text())
        assert int(allocated[-1].split()[1]) <= 2048 + 256, "caught within one step of the limit"
        side.wait_logged(
            "container 'trainer' uses", "of its 2.00 GiB VRAM limit", "sent SIGTERM to pid"
        )
        assert server.poll() is None and all(alive(p) for p in pod.host_pids("server"))
        enforced = wait_for(
            lambda: [
                e for e in core.list_namespaced_event(NAMESPACE).items if e.reason == "VRAMEnforced"
            ],
            what="the VRAMEnforced event",
        )
        assert enforced[0].involved_object.field_path == "spec.containers{trainer}"
        assert side.stop() == 0
    finally:
        pod.close()
