"""The harness itself: a real API server that persists, authorizes and restarts."""

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.e2e.cluster import ApiServer


def test_nodes_and_status_patches(core: client.CoreV1Api) -> None:
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="harness-node")))
    core.patch_node_status(
        "harness-node",
        [{"op": "add", "path": "/status/capacity", "value": {"example.com/thing": "3"}}],
    )
    node = core.read_node("harness-node")
    assert node.status.capacity == {"example.com/thing": "3"}


def test_rbac_is_enforced_for_service_account_tokens(
    apiserver: ApiServer, core: client.CoreV1Api
) -> None:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="harness")))
    core.create_namespaced_service_account(
        "harness", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac = client.RbacAuthorizationV1Api(apiserver.client())
    rbac.create_namespaced_role(
        "harness",
        client.V1Role(
            metadata=client.V1ObjectMeta(name="pod-reader"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list"])],
        ),
    )
    rbac.create_namespaced_role_binding(
        "harness",
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="pod-reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"
            ),
            subjects=[
                client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace="harness")
            ],
        ),
    )
    token = apiserver.token_for("harness", "reader")
    as_reader = client.CoreV1Api(apiserver.client(token))
    assert as_reader.list_namespaced_pod("harness").items == []
    with pytest.raises(ApiException) as info:
        as_reader.list_node()
    assert info.value.status == 403


def test_data_survives_an_api_server_restart(apiserver: ApiServer, core: client.CoreV1Api) -> None:
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="survivor")))
    apiserver.stop()
    apiserver.start()
    assert core.read_node("survivor").metadata.name == "survivor"
