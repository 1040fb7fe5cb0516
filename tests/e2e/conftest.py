"""Fixtures for the end-to-end tests against a real kube-apiserver.

Without the binary (`bash tests/e2e/build-kubernetes.sh` builds it) these tests are
skipped, unless VRAM_ENFORCER_E2E=required, as in CI, where a missing server is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.e2e.actors import apply_agent_rbac
from tests.e2e.cluster import ApiServer, apiserver_binary, etcd_binary

ROOT = Path(__file__).resolve().parents[2]
# The tests of the shared cluster play the kubelet, which sends no heartbeats (see
# ApiServer.start_controller_manager).
PLAYED_KUBELET = ("node-lifecycle-controller",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def apiserver() -> Iterator[ApiServer]:
    binary, etcd = apiserver_binary(), etcd_binary()
    if binary is None or etcd is None:
        reason = "kube-apiserver or etcd missing: run bash tests/e2e/build-kubernetes.sh"
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    server = ApiServer(binary, etcd)
    try:
        server.start()
        server.start_controller_manager(without=PLAYED_KUBELET)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def admin(apiserver: ApiServer) -> client.ApiClient:
    return apiserver.client()


@pytest.fixture
def core(admin: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(admin)


@pytest.fixture(scope="session")
def agent_rbac(apiserver: ApiServer, admin: client.ApiClient) -> str:
    """The shipped RBAC, applied as an operator would; returns a token for its ServiceAccount."""
    return apply_agent_rbac(apiserver, admin)
