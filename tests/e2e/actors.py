"""The node agent and the sidecar as the end-to-end tests run them: real processes."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, utils

from enforcer.edge.procfs import ProcFs
from tests.e2e.cluster import ISSUER, ApiServer, make_ca, make_serving_cert
from tests.e2e.podsim import SimPod
from tests.fakenvml import FakeGpuState, limit_records
from tests.helpers import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "integration" / "worker.py"
HOST = ProcFs()


def alive(pid: int) -> bool:
    st = HOST.stat(pid)
    return st is not None and st.state != "Z"


class Node:
    """The real agent on this machine, serving the fake GPU (`lib`) or, without it, real NVML."""

    def __init__(self, tmp: Path, lib: Path | None) -> None:
        self.state_file = tmp / "gpu.json"
        self.state = FakeGpuState.single_gpu()
        self.state.write(self.state_file)
        self.socket = tmp / "agent.sock"
        self.lib = lib
        self.log = tmp / "agent.log"
        self.agent: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0  # where the agent serves its /metrics, once started

    def start_agent(self, kubeconfig: Path | None = None, node: str = "") -> None:
        """Without `kubeconfig`, an agent without the API; with it, one that serves each
        sidecar its pod from its watch of `node`'s pods."""
        pods = (
            ["--node-name", node, "--kubeconfig", str(kubeconfig)]
            if kubeconfig
            else ["--no-serve-pods"]
        )
        self.metrics_port = free_port()
        self.agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "enforcer",
                "agent",
                "--no-advertise",
                "--no-labels",
                *pods,
                "--hard-limits",
                "off",
                "--socket",
                str(self.socket),
                "--interval",
                "50ms",
                "--log-format",
                "text",
                "--metrics-port",
                str(self.metrics_port),
                "--metrics-address",
                "127.0.0.1",
            ],
            env={**os.environ, **self.nvml_env()},
            stderr=self.log.open("a"),
        )
        wait_for(self.socket.exists, what="the agent socket")

    def metrics(self) -> str:
        """The agent's /metrics: with the API, every enforced pod's series of its node (the
        sidecars serve none)."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            return str(r.read().decode())

    def nvml_env(self) -> dict[str, str]:
        """What a process needs to see this node's NVML."""
        if self.lib is None:
            return {}
        return {"LD_LIBRARY_PATH": str(self.lib), "FAKE_NVML_STATE": str(self.state_file)}

    def stop_agent(self) -> None:
        assert self.agent is not None
        self.agent.terminate()
        assert self.agent.wait(timeout=10) == 0

    def use(self, usage: dict[int, int | None], device: int = 0) -> None:
        """Set what NVML reports each (host) pid holding on `device`; None: on none."""
        for pid, used in usage.items():
            if used is None:
                self.state.remove_process(pid)
            else:
                self.state.set_process(device, pid, used)
        self.state.write(self.state_file)


class Sidecar:
    def __init__(
        self,
        pod: SimPod,
        node: Node,
        apiserver: ApiServer,
        token: str,
        tmp: Path,
        limits: dict[str, int],
        *flags: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.pod = pod
        self.log = tmp / f"sidecar-{pod.name}.log"
        kubeconfig = apiserver.kubeconfig(token, tmp / f"kubeconfig-{pod.name}")
        self.proc = pod.start(
            "vram-enforcer",
            [
                sys.executable,
                "-m",
                "enforcer",
                "sidecar",
                "--kubeconfig",
                str(kubeconfig),
                "--interval",
                "50ms",
                "--api-access",
                "direct",
                "--log-format",
                "text",
                *flags,
            ],
            env={
                "POD_NAME": pod.name,
                "POD_NAMESPACE": pod.namespace,
                "POD_UID": pod.uid,
                "NODE_NAME": "gpu-node-1",
                "VRAM_ENFORCER_LIMITS": json.dumps(limits),
                "VRAM_ENFORCER_AGENT_SOCKET": str(node.socket),
                "VRAM_ENFORCER_GRACE_PERIOD": "1s",
                **(env or {}),
            },
            stderr=self.log.open("w"),
        )
        wait_for(lambda: "enforcing" in self.text(), timeout=20, what="the sidecar to start")

    def text(self) -> str:
        return self.log.read_text()

    def wait_logged(self, *lines: str) -> None:
        """The log line of an action is written after its signal: a victim can be seen
        dead before the line is there."""
        wait_for(lambda: all(line in self.text() for line in lines), what=f"the log lines {lines}")

    def stop(self) -> int:
        """SIGTERM to the sidecar itself (not to nsenter, which does not forward it)."""
        os.kill(self.pid(), signal.SIGTERM)
        return self.proc.wait(timeout=10)

    def pid(self) -> int:
        """The sidecar's host pid (not nsenter's)."""
        (pid,) = self.pod.host_pids("vram-enforcer")
        return pid


def start_worker(pod: SimPod, container: str, tmp: Path, *extra: str) -> int:
    """A GPU program in `container`; returns its host pid."""
    before = set(pod.host_pids(container))
    report = tmp / f"{container}-{time.monotonic_ns()}.json"
    pod.start(container, [sys.executable, str(WORKER), "--report", str(report), *extra])
    (pid,) = wait_for(
        lambda: (
            set(pod.host_pids(container)) - before
            if report.with_name(report.name + ".main").exists()
            else None
        ),
        what=f"a process in {container}",
    )
    return pid


def default_service_account(core: client.CoreV1Api, namespace: str) -> None:
    """Wait for the ServiceAccount controller (kube-controller-manager) to give a new
    namespace its `default` ServiceAccount, as a pod in it would need."""

    def made() -> bool:
        try:
            core.read_namespaced_service_account("default", namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    wait_for(made, timeout=30, what=f"the default ServiceAccount of {namespace}")


def token_bound_to(core: client.CoreV1Api, pod: client.V1Pod) -> str:
    """A token of the pod's ServiceAccount bound to the pod, as the kubelet mounts it: the
    API server names the pod's node in it (`authentication.kubernetes.io/node-name`)."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[ISSUER],
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
            ),
        )
    )
    account, namespace = pod.spec.service_account_name, pod.metadata.namespace
    return str(
        core.create_namespaced_service_account_token(account, namespace, request).status.token
    )


def namespace_with_sidecar_rbac(
    apiserver: ApiServer, admin: client.ApiClient, namespace: str
) -> str:
    """A namespace whose default ServiceAccount has the shipped sidecar Role (deploy/rbac/sidecar.yaml)
    bound to its group; returns that ServiceAccount's token."""
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    default_service_account(core, namespace)
    text = (ROOT / "deploy" / "rbac" / "sidecar.yaml").read_text().replace("NAMESPACE", namespace)
    for doc in yaml.safe_load_all(text):
        try:
            utils.create_from_dict(admin, doc, namespace=namespace)
        except utils.FailToCreateError as exc:  # the ClusterRole, made for an earlier namespace
            if doc["kind"] != "ClusterRole" or any(e.status != 409 for e in exc.api_exceptions):
                raise
    return apiserver.token_for(namespace, "default")


class Webhook:
    """`vram-enforcer webhook` over HTTPS on loopback, with a CA of its own; `register()`
    makes the API server call it for pods of labelled namespaces, `close()` undoes both."""

    def __init__(self, apiserver: ApiServer, tmp: Path, *flags: str) -> None:
        self.dir = tmp
        self.ca = make_ca(tmp, "webhook-ca")
        self.cert, self.key = make_serving_cert(tmp, self.ca, "webhook")
        self.port = free_port()
        self.log = tmp / "webhook.log"
        kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp / "kubeconfig")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "enforcer",
                "webhook",
                "--tls-cert-file",
                str(self.cert),
                "--tls-key-file",
                str(self.key),
                "--port",
                str(self.port),
                "--address",
                "127.0.0.1",
                "--sidecar-image",
                "ghcr.io/vram-enforcer/vram-enforcer:e2e",
                "--sidecar-mode",
                "auto",
                "--kubeconfig",
                str(kubeconfig),
                "--log-format",
                "text",
                *flags,
            ],
            stderr=self.log.open("w"),
        )
        wait_for(
            lambda: "serving admission reviews" in self.log.read_text(),
            timeout=30,
            what="the webhook",
        )

    def rotate(self, name: str) -> None:
        cert, key = make_serving_cert(self.dir, self.ca, name)
        os.replace(key, self.key)
        os.replace(cert, self.cert)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    def register(self, admin: client.ApiClient, side_effects: str = "None") -> None:
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "vram-enforcer"},
            "webhooks": [
                {
                    "name": "inject.vram-enforcer.io",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.port}/mutate",
                        "caBundle": base64.b64encode(self.ca[0].read_bytes()).decode(),
                    },
                    "rules": [
                        {
                            "operations": ["CREATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["pods"],
                        },
                        {  # as the chart's: `kubectl debug` on an injected pod
                            "operations": ["UPDATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["pods/ephemeralcontainers"],
                        },
                    ],
                    "namespaceSelector": {"matchLabels": {"vram-enforcer.io/inject": "enabled"}},
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": side_effects,
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "IfNeeded",
                    "timeoutSeconds": 5,
                }
            ],
        }
        client.AdmissionregistrationV1Api(admin).create_mutating_webhook_configuration(config)

    def close(self, admin: client.ApiClient) -> None:
        with contextlib.suppress(client.ApiException):
            client.AdmissionregistrationV1Api(admin).delete_mutating_webhook_configuration(
                "vram-enforcer"
            )
        assert self.stop() == 0


def doctor(
    apiserver: ApiServer, token: str, namespace: str, tmp: Path
) -> tuple[int, dict[str, Any]]:
    kubeconfig = apiserver.kubeconfig(token, tmp / f"kubeconfig-{namespace}")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "doctor",
            "--no-nvml",
            "--no-agent",
            "--json",
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            namespace,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)}


def records(agent: AgentProcess, cgroup: Path) -> dict[str, tuple[int, int]]:
    """GPU -> (soft, hard) of the last limit the agent set on `cgroup`."""
    last: dict[str, tuple[int, int]] = {}
    for r in limit_records(agent.state_file):
        if r["cgroup"] == str(cgroup) and r["pid"] == agent.proc.pid:
            last[r["device"]] = (r["soft"], r["hard"])
    return last


def apply_agent_rbac(apiserver: ApiServer, admin: client.ApiClient) -> str:
    """deploy/rbac/agent.yaml, applied as an operator would; returns a token for its
    ServiceAccount."""
    client.CoreV1Api(admin).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name="vram-enforcer"))
    )
    for doc in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "agent.yaml").read_text()):
        utils.create_from_dict(admin, doc)
    return apiserver.token_for("vram-enforcer", "vram-enforcer-agent")


class AgentProcess:
    def __init__(
        self,
        apiserver: ApiServer,
        token: str,
        node: str,
        tmp: Path,
        lib: Path,
        *flags: str,
        state: FakeGpuState | None = None,
    ) -> None:
        """The agent on two 80 GiB GPUs (or `state`), advertising on `node`."""
        self.state_file = tmp / "gpu.json"
        if state is None:
            state = FakeGpuState.single_gpu()
            state.add_device()
        state.write(self.state_file)
        self.state = state  # change it, then write it to state_file, for what NVML shows next
        self.log_path = tmp / "agent.log"
        self.port = free_port()
        kubeconfig = apiserver.kubeconfig(token, tmp / "kubeconfig")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "enforcer",
                "agent",
                "--node-name",
                node,
                "--kubeconfig",
                str(kubeconfig),
                "--socket",
                str(tmp / "agent.sock"),
                "--resync",
                "1s",
                "--reserve",
                "1Gi",
                "--log-format",
                "text",
                "--metrics-port",
                str(self.port),
                "--metrics-address",
                "127.0.0.1",
                *flags,
            ],
            env={
                **os.environ,
                "LD_LIBRARY_PATH": str(lib),
                "FAKE_NVML_STATE": str(self.state_file),
            },
            stderr=self.log_path.open("w"),
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def counter(self, series: str) -> float:
        """A counter's value from the agent's /metrics (0 before it has one)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return 0.0
        found = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
        return float(found[1]) if found else 0.0

    def wait_for_more(self, series: str, more: int, timeout: float = 30.0) -> None:
        """Wait until `series` has grown by `more`: proof that the agent did that much."""
        start = self.counter(series)
        wait_for(
            lambda: self.counter(series) >= start + more,
            timeout=timeout,
            what=f"{more} more of {series}",
        )

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=15)
