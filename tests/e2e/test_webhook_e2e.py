"""The webhook registered with the real API server: pods created with the API server's own
client come back mutated and accepted by its validation, denials reach the user, and an
unlabelled namespace is untouched. The certificate is rotated mid-test.

The server is Kubernetes 1.37, with native sidecars, and the webhook runs in
`--sidecar-mode auto`: it must pick `native` by itself.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.e2e.actors import Webhook, default_service_account
from tests.e2e.cluster import ApiServer
from tests.helpers import wait_for

RES = "vram-enforcer.io/vram"


@pytest.fixture(scope="module")
def webhook(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Webhook]:
    w = Webhook(apiserver, tmp_path_factory.mktemp("webhook"))
    try:  # a failed setup must leave neither the process nor the configuration behind
        w.register(admin)
        core = client.CoreV1Api(admin)
        for name, labels in (("ml", {"vram-enforcer.io/inject": "enabled"}), ("plain", {})):
            core.create_namespace(
                client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels))
            )
            default_service_account(core, name)
        yield w
    finally:
        w.close(admin)


def gpu_pod(
    name: str, vram: str = "12Gi", annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "trainer",
                    "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                    "resources": {"limits": {RES: vram, "memory": "16Gi"}},
                }
            ],
        },
    }


def stored(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, Any]:
    """The pod as the API server stores it, as plain JSON."""
    resp = core.read_namespaced_pod(name, namespace, _preload_content=False)
    return json.loads(resp.data)  # type: ignore[no-any-return]


def test_a_pod_that_declares_vram_is_stored_mutated(
    webhook: Webhook, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("ml", gpu_pod("trainer-0"))
    pod = stored(core, "ml", "trainer-0")
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    (side,) = spec["initContainers"]  # 1.37: a native sidecar, chosen by itself
    assert side["name"] == "vram-enforcer" and side["restartPolicy"] == "Always"
    env = {e["name"]: e for e in side["env"]}
    assert json.loads(env["VRAM_ENFORCER_LIMITS"]["value"]) == {"trainer": 12 * 1024**3}
    assert env["VRAM_ENFORCER_SIDECAR_MODE"]["value"] == "native"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert side["securityContext"]["capabilities"] == {"add": ["KILL"], "drop": ["ALL"]}
    trainer_env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert trainer_env["VRAM_LIMIT_BYTES"] == str(12 * 1024**3)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["vram-enforcer-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    # the sidecar's own socket, which the agent connects to: no hostPath
    assert volumes["vram-enforcer-socket"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    assert env["VRAM_ENFORCER_LISTEN"]["value"] == "/run/vram-enforcer/sidecar.sock"
    assert pod["metadata"]["labels"]["vram-enforcer.io/enforced"] == "true"
    assert pod["metadata"]["annotations"]["vram-enforcer.io/injected"] == "true"
    assert "the API server is v1.37" in webhook.log.read_text()


def test_a_denial_reaches_the_user(webhook: Webhook, core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod(
            "ml", gpu_pod("bad-0", annotations={"vram-enforcer.io/action": "explode"})
        )
    assert caught.value.status == 403
    message = json.loads(caught.value.body)["message"]
    assert 'admission webhook "inject.vram-enforcer.io" denied the request' in message
    assert "metadata.annotations['vram-enforcer.io/action']: 'explode' is not an action" in message


def test_pods_elsewhere_or_without_vram_are_untouched(
    webhook: Webhook, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("plain", gpu_pod("outside-0"))
    assert [c["name"] for c in stored(core, "plain", "outside-0")["spec"]["containers"]] == [
        "trainer"
    ]
    web = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-0"},
        "spec": {"containers": [{"name": "web", "image": "nginx"}]},
    }
    core.create_namespaced_pod("ml", web)
    pod = stored(core, "ml", "web-0")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["web"]
    assert "vram-enforcer.io/injected" not in (pod["metadata"].get("annotations") or {})


def debug(core: client.CoreV1Api, pod: str, name: str, **context: Any) -> dict[str, Any]:
    """Add an ephemeral container to `pod` in `ml`, as `kubectl debug` does (an UPDATE of its
    ephemeralcontainers subresource); the pod as stored after."""
    container: dict[str, Any] = {"name": name, "image": "busybox", "targetContainerName": "web"}
    if context:
        container["securityContext"] = context
    present = "ephemeralContainers" in stored(core, "ml", pod)["spec"]
    patch = [
        {"op": "add", "path": "/spec/ephemeralContainers/-", "value": container}
        if present
        else {"op": "add", "path": "/spec/ephemeralContainers", "value": [container]}
    ]
    core.patch_namespaced_pod_ephemeralcontainers(pod, "ml", patch)
    return stored(core, "ml", pod)


def test_an_ephemeral_container_of_an_injected_pod_drops_kill_and_cannot_reach_the_sidecar(
    webhook: Webhook, core: client.CoreV1Api
) -> None:
    """`kubectl debug` goes through pods/ephemeralcontainers, which the API server sends to
    the webhook as an UPDATE (issue 42, item 5): on an injected pod, the debugger is stored
    dropping KILL (with it, a root debugger could open the sidecar's memory while it
    restarts), and a privileged one is denied with the webhook's message. On a pod the
    webhook did not inject, the debugger is stored as sent."""
    web = {"name": "web", "image": "nginx", "resources": {"limits": {RES: "1Gi"}}}
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "debugged-0"}}
    core.create_namespaced_pod("ml", {**body, "spec": {"containers": [web]}})
    pod = debug(core, "debugged-0", "debugger")
    (debugger,) = pod["spec"]["ephemeralContainers"]
    assert debugger["securityContext"] == {"capabilities": {"drop": ["KILL"]}}
    pod = debug(core, "debugged-0", "careful", capabilities={"drop": ["ALL"]})
    assert pod["spec"]["ephemeralContainers"][0] == debugger  # the earlier one as it was
    assert pod["spec"]["ephemeralContainers"][1]["securityContext"] == {
        "capabilities": {"drop": ["ALL"]}
    }
    with pytest.raises(ApiException) as caught:
        debug(core, "debugged-0", "root", privileged=True)
    assert caught.value.status == 403
    message = json.loads(caught.value.body)["message"]
    assert 'admission webhook "inject.vram-enforcer.io" denied the request' in message
    assert (
        "spec.ephemeralContainers['root'].securityContext.privileged: true gives this "
        "container every capability" in message
    )
    plain = {**body, "metadata": {"name": "plain-0"}}
    core.create_namespaced_pod("ml", {**plain, "spec": {"containers": [{**web, "resources": {}}]}})
    (as_sent,) = debug(core, "plain-0", "root", privileged=True)["spec"]["ephemeralContainers"]
    assert as_sent["securityContext"] == {"privileged": True}


def served_certificate(webhook: Webhook) -> bytes:
    """The certificate a new TLS connection to the webhook is shown."""
    context = ssl.create_default_context(cafile=str(webhook.ca[0]))
    with (
        socket.create_connection(("127.0.0.1", webhook.port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return tls.getpeercert(binary_form=True) or b""


def test_pods_keep_being_admitted_across_a_certificate_rotation(
    webhook: Webhook, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod("ml", gpu_pod("before-0"))
    webhook.rotate("webhook-rotated")
    new = ssl.PEM_cert_to_DER_cert(webhook.cert.read_text())
    for i in range(10):  # pods go on being admitted while the certificate changes
        core.create_namespaced_pod("ml", gpu_pod(f"during-{i}"))
    wait_for(lambda: served_certificate(webhook) == new, what="the new certificate to be served")
    core.create_namespaced_pod("ml", gpu_pod("after-0"))
    after = stored(core, "ml", "after-0")["spec"]
    assert [c["name"] for c in after["initContainers"]] == ["vram-enforcer"]
    assert "certificate reloaded" in webhook.log.read_text()
