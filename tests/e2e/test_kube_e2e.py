"""`kube.request`, the one path every API call takes, against the real API server."""

from __future__ import annotations

import pytest
from kubernetes import client

from enforcer.kube import POD, KubeError, call, request


@pytest.fixture(scope="module")
def pod(admin: client.ApiClient) -> dict[str, str]:
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": "kube-request"}})
    core.create_namespaced_pod("kube-request", {
        "metadata": {"name": "p", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}})  # fmt: skip
    return {"namespace": "kube-request", "name": "p"}


def test_an_object_comes_back_as_the_json_the_server_sent(
    admin: client.ApiClient, pod: dict[str, str]
) -> None:
    got = request(admin, "GET", POD, params=pod)
    typed = admin.sanitize_for_serialization(
        client.CoreV1Api(admin).read_namespaced_pod("p", "kube-request")
    )
    assert got["metadata"]["uid"] == typed["metadata"]["uid"]
    assert got["spec"]["containers"][0]["name"] == "c"
    assert got["kind"] == "Pod"  # the typed client's models drop nothing we read, nor do we


def test_a_json_patch_is_sent_as_one(admin: client.ApiClient, pod: dict[str, str]) -> None:
    ops = [{"op": "add", "path": "/metadata/labels/patched", "value": "yes"}]
    got = request(admin, "PATCH", POD, params=pod, body=ops)
    assert got["metadata"]["labels"] == {"app": "x", "patched": "yes"}


def test_a_missing_object_is_an_error_that_names_it(
    admin: client.ApiClient, pod: dict[str, str]
) -> None:
    with pytest.raises(KubeError) as raised:
        call(admin, "GET", POD, "pods",
             params={**pod, "name": "absent"}, deadline=1.0)  # fmt: skip
    assert str(raised.value) == 'get pods failed: HTTP 404 Not Found: pods "absent" not found'
