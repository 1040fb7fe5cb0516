"""`vram-enforcer doctor`'s API checks with real ServiceAccount tokens: what RBAC allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client

from tests.e2e.actors import default_service_account, doctor, namespace_with_sidecar_rbac
from tests.e2e.cluster import ApiServer

AGENT_NEEDS = (
    "get nodes, patch nodes, patch nodes/status, list pods, watch pods, delete pods, "
    "patch pods/status, create pods/eviction, list namespaces, watch namespaces, create events, patch events, "
    "list events"
)
NONE_NEEDED = (
    "none needed: a sidecar of --api-access agent (the default) makes no API request: the "
    "node agent reads its pod and posts its Events (the agent's RBAC is checked below); "
    "--api-access direct checks the Role that sidecars of 0.1.0 need"
)


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor run for a sidecar of --api-access direct (through the variable such a sidecar
    has), which needs the Role of deploy/rbac/sidecar.yaml, as sidecars of 0.1.0 do."""
    monkeypatch.setenv("VRAM_ENFORCER_API_ACCESS", "direct")


def test_the_agents_own_rbac_is_all_it_needs_and_the_sidecars_need_none(
    apiserver: ApiServer, agent_rbac: str, tmp_path: Path
) -> None:
    """deploy/rbac/agent.yaml, as doctor in the agent's pod sees it: everything the agent
    asks of the API (its Node, the node's pods, the sidecars' Events) is allowed, and the
    sidecars of 0.2.0 need nothing."""
    code, checks = doctor(apiserver, agent_rbac, "vram-enforcer", tmp_path)
    assert checks["RBAC for the agent"] == {
        "name": "RBAC for the agent",
        "status": "ok",
        "detail": "all it needs is allowed",
        "fix": "",
    }
    assert checks["RBAC for the sidecar"]["status"] == "skip"
    assert checks["RBAC for the sidecar"]["detail"] == NONE_NEEDED
    assert code == 0, checks


def test_a_namespace_with_the_sidecar_role(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path, direct: None
) -> None:
    token = namespace_with_sidecar_rbac(apiserver, admin, "doctor-ok")
    code, checks = doctor(apiserver, token, "doctor-ok", tmp_path)
    assert (
        checks["Kubernetes API"]["status"] == "ok" and "v1.37" in checks["Kubernetes API"]["detail"]
    )
    assert checks["RBAC for the sidecar"] == {
        "name": "RBAC for the sidecar",
        "status": "ok",
        "detail": "all it needs is allowed in namespace doctor-ok",
        "fix": "",
    }
    # The pod's ServiceAccount is not the agent: it may not patch Nodes, and doctor says so.
    agent = checks["RBAC for the agent"]
    assert agent["status"] == "fail" and agent["detail"] == f"this identity may not {AGENT_NEEDS}"
    assert code == 1
    # No DRA driver publishes GPUs in this cluster: node-level mode, and why.
    dra = checks["VRAM per GPU (DRA)"]
    assert dra["status"] == "note" and dra["detail"] == (
        "no ResourceSlice of gpu.nvidia.com publishes a GPU shareable by memory with a 'uuid' "
        "attribute: node-level mode (vram-enforcer.io/vram counted per node) is what this "
        "cluster has"
    )
    assert "--consumable-shares=memory" in dra["fix"]


def test_a_namespace_without_it(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doctor-bare")))
    default_service_account(core, "doctor-bare")
    token = apiserver.token_for("doctor-bare", "default")
    # The sidecars of 0.2.0 need no Role there: nothing to fail for them.
    _, checks = doctor(apiserver, token, "doctor-bare", tmp_path)
    assert checks["RBAC for the sidecar"]["status"] == "skip"
    assert checks["RBAC for the sidecar"]["detail"] == NONE_NEEDED
    # A sidecar of --api-access direct (or of 0.1.0) does.
    monkeypatch.setenv("VRAM_ENFORCER_API_ACCESS", "direct")
    code, checks = doctor(apiserver, token, "doctor-bare", tmp_path)
    sidecar = checks["RBAC for the sidecar"]
    assert code == 1 and sidecar["status"] == "fail"
    assert (
        sidecar["detail"]
        == "this identity may not get pods, create events, patch events in namespace doctor-bare"
    )
    assert "sidecar.namespaces" in sidecar["fix"] and "--api-access agent" in sidecar["fix"]
    dra = checks["VRAM per GPU (DRA)"]
    assert dra["status"] == "note" and dra["detail"].startswith(
        "cannot list ResourceSlices (RBAC forbids 'list' on 'resourceslices'"
    )


def test_an_unreachable_api_server(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://127.0.0.1:1",
                            "insecure-skip-tls-verify": True,
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "doctor",
            "--no-nvml",
            "--no-agent",
            "--kubeconfig",
            str(kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "[FAIL] Kubernetes API: get version failed: the API server is unreachable" in out.stdout
    assert "Traceback" not in out.stderr
