"""Just enough of a Kubernetes API server for `helm install` to render the chart.

helm-sdkpy has no `helm template`: its install wants a cluster (the server's version, its
discovery, Helm's release Secrets) before it renders. This one answers those, takes every
object it is sent and stores nothing, so that the chart tests can render it, see what it
refuses and read the manifest, in a second and without the e2e cluster
(tests/e2e/test_chart_e2e.py installs the chart on a real one).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.2", "platform": "linux/amd64"}

# group/version -> (kind, plural, namespaced): every kind the chart can render, and what
# Helm itself writes (its release Secrets, the namespace it creates).
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("Namespace", "namespaces", False),
        ("Secret", "secrets", True),
        ("ConfigMap", "configmaps", True),
        ("Service", "services", True),
        ("ServiceAccount", "serviceaccounts", True),
    ],
    "apps/v1": [("Deployment", "deployments", True), ("DaemonSet", "daemonsets", True)],
    "policy/v1": [("PodDisruptionBudget", "poddisruptionbudgets", True)],
    "networking.k8s.io/v1": [("NetworkPolicy", "networkpolicies", True)],
    "rbac.authorization.k8s.io/v1": [
        ("ClusterRole", "clusterroles", False),
        ("ClusterRoleBinding", "clusterrolebindings", False),
        ("Role", "roles", True),
        ("RoleBinding", "rolebindings", True),
    ],
    "admissionregistration.k8s.io/v1": [
        ("MutatingWebhookConfiguration", "mutatingwebhookconfigurations", False),
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies", False),
        ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings", False),
    ],
    "cert-manager.io/v1": [("Issuer", "issuers", True), ("Certificate", "certificates", True)],
    "monitoring.coreos.com/v1": [
        ("ServiceMonitor", "servicemonitors", True),
        ("PodMonitor", "podmonitors", True),
    ],
}
_NAMED = re.compile(r"/(?:api|apis/[^/]+)/[^/]+(?:/namespaces/[^/]+)?/[^/]+/[^/?]+")


def _resource_list(group_version: str) -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update"],
            }
            for kind, plural, namespaced in RESOURCES[group_version]
        ],
    }


def _prefixed(group_version: str) -> str:
    return f"apis/{group_version}" if "/" in group_version else f"api/{group_version}"


def _openapi(group_version: str) -> dict[str, Any]:
    """A group's OpenAPI v3 document that says only that PATCH takes `fieldValidation`: the
    client then leaves validation to the server (this one, which accepts everything)."""
    group, _, version = group_version.rpartition("/")
    paths = {
        f"/{plural}": {
            "patch": {
                "x-kubernetes-group-version-kind": {
                    "group": group,
                    "version": version,
                    "kind": kind,
                },
                "parameters": [{"name": "fieldValidation", "in": "query"}],
            }
        }
        for kind, plural, _ in RESOURCES[group_version]
    }
    return {"openapi": "3.0.0", "info": {"title": "fake", "version": "v1"}, "paths": paths}


def _groups() -> dict[str, Any]:
    groups = []
    for group_version in RESOURCES:
        if "/" in group_version:
            group, version = group_version.split("/")
            entry = {"groupVersion": group_version, "version": version}
            groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a render makes dozens of requests."""

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        """The object sent, as stored; Helm sends its release Secrets as protobuf, which
        it does not read back: an empty object stands for those."""
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        json_sent = "json" in (self.headers.get("Content-Type") or "")
        doc: dict[str, Any] = json.loads(data) if json_sent and data else {}
        doc.setdefault("metadata", {}).update(resourceVersion="1", uid="fake")
        return doc

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/version":
            self._send(200, VERSION)
        elif path == "/api":
            self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        elif path == "/apis":
            self._send(200, _groups())
        elif path == "/api/v1" or path.removeprefix("/apis/") in RESOURCES:
            self._send(200, _resource_list(path.removeprefix("/api/").removeprefix("/apis/")))
        elif path == "/openapi/v3":
            self._send(
                200,
                {
                    "paths": {
                        _prefixed(gv): {"serverRelativeURL": f"/openapi/v3/{_prefixed(gv)}"}
                        for gv in RESOURCES
                    }
                },
            )
        elif path.startswith("/openapi/v3/"):
            self._send(200, _openapi(path.removeprefix("/openapi/v3/").split("/", 1)[1]))
        elif _NAMED.fullmatch(path):  # no object exists: Helm creates each one
            self._send(
                404,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                    "message": f"{path} not found",
                },
            )
        else:  # a list (Helm's release history): empty
            self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []})

    def do_POST(self) -> None:
        self._send(201, self._body())

    def do_PUT(self) -> None:
        self._send(200, self._body())

    do_PATCH = do_PUT


@contextmanager
def fake_apiserver(directory: Path) -> Iterator[Path]:
    """Serve on a port of 127.0.0.1 while in the block; yields a kubeconfig for it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [
                    {
                        "name": "fake",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            }
        )
    )
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()
