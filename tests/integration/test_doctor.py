"""`vram-enforcer doctor` as a user runs it: against the fake NVML and a real agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.modes.doctor import Check, render
from tests.helpers import wait_for
from tests.kubelet import Kubelet


def doctor(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "enforcer", "doctor", "--no-api", *flags],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.fixture
def agent(fake_nvml: Any, tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "enforcer", "agent", "--no-advertise", "--no-labels", "--no-serve-pods", "--hard-limits", "off", "--socket", str(sock)],
        env={**os.environ, **fake_nvml.env()}, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(sock.exists, what="the agent socket")
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def test_everything_reachable_passes(fake_nvml: Any, agent: Path) -> None:
    out = doctor(fake_nvml.env(), "--agent-socket", str(agent))
    assert out.returncode == 0, out.stdout
    assert (
        "[ok  ] NVML: driver 550.54.15, 1 device(s) [0: NVIDIA H100 80GB HBM3 (80.00 GiB)]"
        in out.stdout
    )
    assert (
        "[ok  ] agent socket: 1 GPU(s); 0 GPU process(es) visible to this PID namespace"
        in out.stdout
    )
    assert "[ok  ] PID namespace: the host's" in out.stdout
    assert "[skip] Kubernetes API: not asked for" in out.stdout
    assert out.stdout.rstrip().endswith("all checks passed")
    # A driver before R615: sampling alone, which is said, and is no failure.
    assert (
        "[note] enforcement tier: sampling only: GPU-00000000-fake-4000-8000-000000000000: the "
        "NVIDIA driver 550.54.15 cannot hold a cgroup to a GPU memory limit (Not Supported); "
        "drivers from R615 can" in out.stdout
    )
    assert "fix: allocations past a limit succeed" in out.stdout


def test_the_tier_on_an_r615_driver_is_hard_limits(fake_nvml: Any) -> None:
    """Asked with NVML's Get call on doctor's own cgroup, which the fake answers as an R615
    driver would; nothing is set."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.add_device()
    fake_nvml.state.enable_mig(1, [{"uuid": "MIG-x", "total_bytes": 40 * 1024**3}])
    fake_nvml.write()
    out = doctor(fake_nvml.env(), "--json", "--no-agent")
    (tier,) = [c for c in json.loads(out.stdout) if c["name"] == "enforcement tier"]
    assert tier["status"] == "ok", tier
    assert tier["detail"].startswith(
        "hard limits (driver 615.43.02, cgroup v2) on 1 GPU(s), with sampling as the backstop"
    )
    assert "GPU-00000001-fake-4000-8000-000000000001 in MIG mode" in tier["detail"]
    assert fake_nvml.limit_records() == []


def test_a_lost_gpu_fails_the_nvml_check_and_names_it(fake_nvml: Any) -> None:
    fake_nvml.state.add_device()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST", device_index=1)
    fake_nvml.write()
    out = doctor(fake_nvml.env(), "--json", "--no-agent")
    assert out.returncode == 1
    (nvml,) = [c for c in json.loads(out.stdout) if c["name"] == "NVML"]
    assert nvml["status"] == "fail"
    assert "2 device(s)" in nvml["detail"]
    assert "GPU GPU-00000001-fake-4000-8000-000000000001 (index 1) cannot be read" in nvml["detail"]
    assert nvml["fix"] == "the other GPUs are enforced; drain the node and reset the GPU"


def test_missing_pieces_fail_with_a_fix_and_exit_1(tmp_path: Path) -> None:
    out = doctor(
        {
            "LD_LIBRARY_PATH": str(tmp_path),
            "VRAM_ENFORCER_AGENT_SOCKET": str(tmp_path / "none.sock"),
        },
        "--json",
    )
    assert out.returncode == 1
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["agent socket"]["status"] == "fail"
    assert checks["agent socket"]["detail"] == f"{tmp_path / 'none.sock'} does not exist"
    assert "is the node agent (DaemonSet) running on this node" in checks["agent socket"]["fix"]
    assert "Traceback" not in out.stderr


def test_a_socket_that_is_not_the_agent(tmp_path: Path) -> None:
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("")
    out = doctor({}, "--no-nvml", "--agent-socket", str(not_a_socket))
    assert out.returncode == 1
    assert f"[FAIL] agent socket: {not_a_socket}: [Errno 111] Connection refused" in out.stdout


def test_in_a_sidecar_that_the_agent_connects_to_it_says_where_to_look(tmp_path: Path) -> None:
    """`kubectl exec POD -c vram-enforcer -- vram-enforcer doctor` in a sidecar of this
    release: it has no agent socket to try (the agent connects to it), which is no fault."""
    env = {"VRAM_ENFORCER_AGENT_SOCKET": str(tmp_path / "none.sock"),
           "VRAM_ENFORCER_LISTEN": "/run/vram-enforcer/sidecar.sock"}  # fmt: skip
    out = doctor(env, "--no-nvml", "--no-api", "--json")
    assert out.returncode == 0, out.stdout
    (check,) = [c for c in json.loads(out.stdout) if c["name"] == "agent socket"]
    assert check["status"] == "note" and "/run/vram-enforcer/sidecar.sock" in check["detail"]
    assert "vram_enforcer_source_up" in check["fix"]


def test_the_kubelets_pod_resources_answer_or_say_why_not(tmp_path: Path) -> None:
    """Which GPU a device plugin gave each container: the kubelet answers (the stand-in of
    its gRPC socket), is absent (no socket: a note, not a fault, e.g. in a pod), or a file
    there is not the kubelet (a fault, with a fix)."""
    socket = tmp_path / "kubelet.sock"
    kubelet = Kubelet(socket)
    try:
        out = doctor({}, "--no-nvml", "--no-agent", "--pod-resources-socket", str(socket), "--json")
    finally:
        kubelet.stop()
    (check,) = [c for c in json.loads(out.stdout) if c["name"] == "kubelet pod resources"]
    assert check["status"] == "ok", check
    assert check["detail"].startswith("answers: of this node's containers, 1 with nvidia.com/gpu;")
    missing = doctor(
        {}, "--no-nvml", "--no-agent", "--pod-resources-socket", str(tmp_path / "none.sock")
    )
    assert missing.returncode == 0, missing.stdout
    assert f"[note] kubelet pod resources: no socket at {tmp_path / 'none.sock'}" in missing.stdout
    not_it = tmp_path / "file"
    not_it.write_text("")
    broken = doctor({}, "--no-nvml", "--pod-resources-socket", str(not_it), "--json")
    (check,) = [c for c in json.loads(broken.stdout) if c["name"] == "kubelet pod resources"]
    assert check["status"] == "fail" and "is the kubelet running" in check["fix"]
    assert "Traceback" not in broken.stderr


def test_render() -> None:
    text = render(
        [
            Check("A", "ok", "fine"),
            Check("B", "fail", "broken", "do this"),
            Check("C", "skip", "not asked"),
        ]
    )
    assert text.splitlines() == ["[ok  ] A: fine", "[FAIL] B: broken", "       fix: do this", "[skip] C: not asked",
                                 "1 check(s) failed"]  # fmt: skip
