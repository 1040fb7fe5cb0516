"""`vram-enforcer doctor`'s API checks with real ServiceAccount tokens: what RBAC allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kubernetes import client

from tests.e2e.actors import default_service_account, doctor, namespace_with_sidecar_rbac
from tests.e2e.cluster import ApiServer


def test_a_namespace_with_the_sidecar_role(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    token = namespace_with_sidecar_rbac(apiserver, admin, "doctor-ok")
    code, checks = doctor(apiserver, token, "doctor-ok", tmp_path)
    assert (
        checks["Kubernetes API"]["status"] == "ok" and "v1.37" in checks["Kubernetes API"]["detail"]
    )
    assert checks["RBAC for the sidecar"] == {"name": "RBAC for the sidecar", "status": "ok",
                                              "detail": "all it needs is allowed in namespace doctor-ok", "fix": ""}  # fmt: skip
    # The pod's ServiceAccount is not the agent: it may not patch Nodes, and doctor says so.
    agent = checks["RBAC for the agent"]
    assert (
        agent["status"] == "fail"
        and agent["detail"] == "this identity may not get nodes, patch nodes, patch nodes/status"
    )
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
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doctor-bare")))
    default_service_account(core, "doctor-bare")
    code, checks = doctor(
        apiserver, apiserver.token_for("doctor-bare", "default"), "doctor-bare", tmp_path
    )
    sidecar = checks["RBAC for the sidecar"]
    assert code == 1 and sidecar["status"] == "fail"
    assert (
        sidecar["detail"]
        == "this identity may not get pods, create events, patch events in namespace doctor-bare"
    )
    assert "sidecar.namespaces" in sidecar["fix"]
    dra = checks["VRAM per GPU (DRA)"]
    assert dra["status"] == "note" and dra["detail"].startswith(
        "cannot list ResourceSlices (RBAC forbids 'list' on 'resourceslices'"
    )


def test_an_unreachable_api_server(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "enforcer", "doctor", "--no-nvml", "--no-agent", "--kubeconfig", str(kubeconfig)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert "[FAIL] Kubernetes API: get version failed: the API server is unreachable" in out.stdout
    assert "Traceback" not in out.stderr
