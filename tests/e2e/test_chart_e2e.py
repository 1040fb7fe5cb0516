"""The Helm chart, linted and installed by the real Helm engine (helm-sdkpy, Helm v4) on the
real API server: the objects it creates, what its ServiceAccounts may and may not do, and a
pod mutated through the chart's own webhook configuration, Service and certificate, served
by `vram-enforcer webhook` run here with the chart's own arguments.

Helm: tests/e2e/helm.py. The same chart on a real node, its webhook and sidecars in pods:
test_cluster_e2e.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from enforcer.core.last_enforcement import Enforced, condition, status_patch
from enforcer.core.reasons import Reason
from enforcer.edge.kube import POD_STATUS, STRATEGIC_MERGE_PATCH, Forbidden, KubeError, call
from enforcer.edge.kube import access_allowed as allowed
from tests.e2e.actors import default_service_account, token_bound_to
from tests.e2e.cluster import OLDEST, ApiServer, oldest_apiserver_binary
from tests.e2e.helm import CHART, helm
from tests.helpers import configured, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
# Not "vram-enforcer": test_agent_e2e applies deploy/rbac/agent.yaml's ClusterRole of that name.
RELEASE, NAMESPACE, OPTED_IN = "vram-enforcer-e2e", "vram-chart", "chart-ml"


def host_ip() -> str | None:
    """An address of this machine that an Endpoints object may name (not loopback)."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out.stdout)
    return found[1] if found else None


def install(apiserver: ApiServer, admin: client.ApiClient, tmp: Path) -> Path:
    """The chart installed as RELEASE, with OPTED_IN opted in; returns the admin kubeconfig
    (the rendered manifest is left beside it, as manifest.yaml)."""
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp / "kubeconfig")
    core = client.CoreV1Api(admin)
    core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(
                name=OPTED_IN, labels={"vram-enforcer.io/inject": "enabled"}
            )
        )
    )
    values = {
        "image": {"tag": "e2e"},
        "sidecar": {"namespaces": [OPTED_IN]},
        "webhook": {"logFormat": "text"},
    }
    release = helm("install", RELEASE, str(CHART), NAMESPACE, str(kubeconfig), json.dumps(values))
    (tmp / "manifest.yaml").write_text(release["manifest"])
    return kubeconfig


@pytest.fixture(scope="module")
def installed(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    kubeconfig = install(apiserver, admin, tmp_path_factory.mktemp("chart"))
    default_service_account(client.CoreV1Api(admin), OPTED_IN)  # for its token's RBAC checks
    yield kubeconfig
    helm(
        "uninstall", RELEASE, NAMESPACE, str(kubeconfig)
    )  # the webhook must not outlive this module


def test_the_chart_lints_clean() -> None:
    result = helm("lint", str(CHART))
    assert result["Errors"] is None
    assert [m for m in result["Messages"] if m["Severity"] >= 2] == []  # no warnings or errors


def test_bad_values_are_refused_by_name(apiserver: ApiServer, tmp_path: Path) -> None:
    """By the schema (a value's type, a word, a name), or by the templates (a quantity's or
    a duration's form: a sentence with an example, issue 43 item 12)."""
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    for values, field in (
        ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
        ({"resource": {"unit": "1 GiB"}}, "unit"),
        ({"agent": {"reserve": "512MB"}}, "reserve"),
        ({"sidecar": {"namespaces": ["ML_Team"]}}, "namespaces"),
        ({"agent": {"podResources": {"path": "var/lib/kubelet"}}}, "path"),
        ({"webhook": {"replica": 2}}, "replica"),
    ):
        error = helm(
            "install",
            "bad",
            str(CHART),
            "vram-bad",
            str(kubeconfig),
            json.dumps(values),
            fails=True,
        )
        refused = "values don't meet the specifications of the schema" in error or (
            "execution error at" in error and "e.g." in error
        )
        assert refused and field in error, error


def test_the_webhook_objects(installed: Path, admin: client.ApiClient) -> None:
    config = client.AdmissionregistrationV1Api(admin).read_mutating_webhook_configuration(RELEASE)
    (hook,) = config.webhooks
    assert hook.admission_review_versions == ["v1"] and hook.side_effects == "None"
    assert (hook.timeout_seconds, hook.reinvocation_policy, hook.failure_policy) == (
        5,
        "IfNeeded",
        "Fail",
    )
    assert hook.namespace_selector.match_labels == {"vram-enforcer.io/inject": "enabled"}
    # The chart's own pods are told by their namespace, which a tenant cannot set; not by a
    # label of the pod's, which it can.
    assert hook.namespace_selector.match_expressions[0].to_dict() == {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": [NAMESPACE],
    }
    assert hook.object_selector is None or not hook.object_selector.match_expressions
    assert (hook.client_config.service.name, hook.client_config.service.path) == (
        "vram-enforcer-e2e-webhook",
        "/mutate",
    )
    secret = client.CoreV1Api(admin).read_namespaced_secret(
        "vram-enforcer-e2e-webhook-tls", NAMESPACE
    )
    assert (
        base64.b64encode(
            hook.client_config.ca_bundle
            if isinstance(hook.client_config.ca_bundle, bytes)
            else base64.b64decode(hook.client_config.ca_bundle)
        ).decode()
        == secret.data["ca.crt"]
    )
    apps = client.AppsV1Api(admin)
    deployment = apps.read_namespaced_deployment("vram-enforcer-e2e-webhook", NAMESPACE)
    assert deployment.spec.replicas == 2
    assert (
        deployment.spec.template.spec.containers[0].image
        == "ghcr.io/vram-enforcer/vram-enforcer:e2e"
    )
    assert deployment.spec.template.spec.affinity.pod_anti_affinity is not None
    webhook = deployment.spec.template.spec.containers[0]
    # A busy replica is given as long to answer its probes as the API server gives a review.
    assert webhook.readiness_probe.timeout_seconds == webhook.liveness_probe.timeout_seconds == 5
    # No API access at all: sidecarMode auto is resolved by the chart, for this 1.37 server.
    assert deployment.spec.template.spec.automount_service_account_token is False
    assert "--sidecar-mode=native" in deployment.spec.template.spec.containers[0].args
    service = client.CoreV1Api(admin).read_namespaced_service(
        "vram-enforcer-e2e-webhook", NAMESPACE
    )
    assert [(p.name, p.port) for p in service.spec.ports] == [("https", 443), ("metrics", 9479)]
    pdb = client.PolicyV1Api(admin).read_namespaced_pod_disruption_budget(
        "vram-enforcer-e2e-webhook", NAMESPACE
    )
    assert pdb.spec.min_available == 1


def test_the_agent_objects(installed: Path, admin: client.ApiClient) -> None:
    ds = client.AppsV1Api(admin).read_namespaced_daemon_set("vram-enforcer-e2e-agent", NAMESPACE)
    spec = ds.spec.template.spec
    assert spec.host_pid is True
    (agent,) = spec.containers
    env = {e.name: e.value for e in agent.env}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert agent.env[0].value_from.field_ref.field_path == "spec.nodeName"
    assert spec.node_selector == {"nvidia.com/gpu.present": "true"}
    assert agent.security_context.capabilities.add == [
        "SYS_PTRACE",
        "KILL",
    ]  # and root: see agent.yaml
    assert agent.security_context.capabilities.drop == ["ALL"]
    assert agent.security_context.seccomp_profile.type == "RuntimeDefault"
    # Reads and signals every peer, whatever its AppArmor profile or SELinux level.
    assert agent.security_context.app_armor_profile.type == "Unconfined"
    assert agent.security_context.se_linux_options.type == "spc_t"
    liveness = agent.liveness_probe.http_get
    assert (liveness.path, liveness.port) == ("/healthz", "metrics")
    assert spec.volumes[0].host_path.path == "/run/vram-enforcer"
    # The host's cgroup tree, read-write as the driver needs it (issue 44, item 6), where
    # --cgroup-root says (hard limits, by default).
    assert spec.volumes[1].host_path.path == "/sys/fs/cgroup"
    mount = next(m for m in agent.volume_mounts if m.name == spec.volumes[1].name)
    assert (mount.mount_path, mount.read_only) == ("/host/sys/fs/cgroup", None)
    assert "--cgroup-root=/host/sys/fs/cgroup" in agent.args
    # The kubelet's pod-resources directory, read-only: which GPU a device plugin gave whom.
    assert spec.volumes[2].host_path.path == "/var/lib/kubelet/pod-resources"
    mount = next(m for m in agent.volume_mounts if m.name == spec.volumes[2].name)
    assert (mount.mount_path, mount.read_only) == ("/host/pod-resources", True)
    assert "--pod-resources-socket=/host/pod-resources/kubelet.sock" in agent.args
    assert "--utilization-interval=1s" in agent.args
    # The rendered arguments are ones the agent's own command line accepts.
    rendered = configured(list(agent.args), {"NODE_NAME": "gpu-node-1"})
    assert rendered.utilization_interval == 1.0
    assert rendered.gpu_resources == ("nvidia.com/gpu", "nvidia.com/gpu.shared")
    shipped = yaml.safe_load_all((ROOT / "deploy" / "rbac" / "agent.yaml").read_text())
    rules = next(d for d in shipped if d["kind"] == "ClusterRole")["rules"]
    role = client.RbacAuthorizationV1Api(admin).read_cluster_role("vram-enforcer-e2e-agent")
    assert [
        {"apiGroups": r.api_groups, "resources": r.resources, "verbs": r.verbs} for r in role.rules
    ] == rules


def test_without_hard_limits_the_agent_gets_no_cgroup_mount_and_still_watches_pods(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    """Hard limits off: no cgroup mount; the kubelet's pod resources off: no mount of
    them. The agent still watches its node's pods (each sidecar gets its own from it), so
    it keeps its token and the rules for that."""
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    values = {
        "agent": {
            "hardLimits": "off",
            "advertise": False,
            "labels": False,
            "podResources": {"enabled": False},
        }
    }
    helm(
        "install",
        "vram-enforcer-soft",
        str(CHART),
        "vram-soft",
        str(kubeconfig),
        json.dumps(values),
    )
    try:
        ds = client.AppsV1Api(admin).read_namespaced_daemon_set(
            "vram-enforcer-soft-agent", "vram-soft"
        )
        spec = ds.spec.template.spec
        assert [v.host_path.path for v in spec.volumes] == ["/run/vram-enforcer"]
        assert "--hard-limits=off" in spec.containers[0].args
        assert not any(a.startswith("--cgroup-root") for a in spec.containers[0].args)
        assert "--pod-resources-socket=" in spec.containers[0].args  # not read
        assert spec.automount_service_account_token is True
        role = client.RbacAuthorizationV1Api(admin).read_cluster_role("vram-enforcer-soft-agent")
        assert {res for r in role.rules for res in r.resources} == {
            "nodes",
            "nodes/status",
            "pods",
            "pods/status",
            "pods/eviction",
            "namespaces",
            "events",
            "resourceclaims",
            "resourceslices",
        }
    finally:
        helm("uninstall", "vram-enforcer-soft", "vram-soft", str(kubeconfig))


def test_dra_mode_gives_the_webhook_and_the_sidecars_what_they_need(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    opted_in = "chart-dra-ml"
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=opted_in)))
    default_service_account(core, opted_in)
    values = {
        "webhook": {"draDeviceClass": "gpu.nvidia.com"},
        "sidecar": {"namespaces": [opted_in]},
        "agent": {"enabled": False},
    }
    helm(
        "install", "vram-enforcer-dra", str(CHART), "vram-dra", str(kubeconfig), json.dumps(values)
    )
    try:
        config = client.AdmissionregistrationV1Api(admin).read_mutating_webhook_configuration(
            "vram-enforcer-dra"
        )
        assert config.webhooks[0].side_effects == "None"  # templates are made outside admission
        spec = (
            client.AppsV1Api(admin)
            .read_namespaced_deployment("vram-enforcer-dra-webhook", "vram-dra")
            .spec.template.spec
        )
        assert "--dra-device-class=gpu.nvidia.com" in spec.containers[0].args
        assert "--dra-drivers=gpu.nvidia.com" in spec.containers[0].args
        assert spec.automount_service_account_token is True
        webhook = apiserver.client(apiserver.token_for("vram-dra", "vram-enforcer-dra-webhook"))
        for ns in (opted_in, "default"):  # any namespace may be labelled
            assert allowed(webhook, "create", "resourceclaimtemplates", ns, group="resource.k8s.io")
            assert allowed(webhook, "get", "resourceclaimtemplates", ns, group="resource.k8s.io")
            # from the pending pods it marked, in namespaces that opted in
            assert allowed(webhook, "list", "pods", ns) and allowed(webhook, "watch", "pods", ns)
        assert allowed(webhook, "get", "namespaces")
        for verb, resource in (
            ("delete", "resourceclaimtemplates"),
            ("get", "resourceclaims"),
            ("get", "secrets"),
            ("patch", "pods"),
        ):
            group = "resource.k8s.io" if resource.startswith("resource") else ""
            assert not allowed(webhook, verb, resource, opted_in, group=group), (verb, resource)
        sidecar = apiserver.client(apiserver.token_for(opted_in, "default"))
        assert allowed(sidecar, "get", "resourceclaims", opted_in, group="resource.k8s.io")
        assert allowed(sidecar, "list", "resourceslices", group="resource.k8s.io")
        assert not allowed(sidecar, "list", "resourceclaims", opted_in, group="resource.k8s.io")
        assert not allowed(sidecar, "delete", "resourceslices", group="resource.k8s.io")
    finally:
        helm("uninstall", "vram-enforcer-dra", "vram-dra", str(kubeconfig))
    rbac = client.RbacAuthorizationV1Api(admin)
    assert not [
        r.metadata.name for r in rbac.list_cluster_role().items if "-dra-" in r.metadata.name
    ]


def test_service_accounts_can_do_what_they_need_and_no_more(
    installed: Path, apiserver: ApiServer
) -> None:
    agent = apiserver.client(apiserver.token_for(NAMESPACE, "vram-enforcer-e2e-agent"))
    assert allowed(agent, "get", "nodes") and allowed(agent, "patch", "nodes")
    assert allowed(agent, "patch", "nodes", subresource="status")
    # Hard limits (on by default): this node's pods by a list and a watch, and their Events.
    assert allowed(agent, "list", "pods") and allowed(agent, "watch", "pods")
    assert allowed(agent, "create", "events", OPTED_IN) and allowed(agent, "patch", "events")
    assert allowed(agent, "list", "events", OPTED_IN)  # has a restarted agent said it already?
    # Which namespaces opted in: only their pods' sidecar environment is read.
    assert allowed(agent, "list", "namespaces") and allowed(agent, "watch", "namespaces")
    # A pod whose budgets refuse its eviction for long is deleted (the chart's policy holds
    # the agent to its own node's enforced pods: the test below).
    assert allowed(agent, "delete", "pods", OPTED_IN)
    for verb, resource in (
        ("list", "nodes"),
        ("delete", "nodes"),
        ("get", "secrets"),
        ("get", "pods"),
        ("deletecollection", "pods"),
        ("delete", "events"),
    ):
        assert not allowed(
            agent, verb, resource, namespace=NAMESPACE if resource != "nodes" else None
        ), (verb, resource)
    sidecar = apiserver.client(apiserver.token_for(OPTED_IN, "default"))
    assert allowed(sidecar, "get", "pods", OPTED_IN)
    assert allowed(sidecar, "create", "events", OPTED_IN) and allowed(
        sidecar, "patch", "events", OPTED_IN
    )
    for verb, resource, ns in (
        ("list", "pods", OPTED_IN),
        ("delete", "pods", OPTED_IN),
        ("get", "secrets", OPTED_IN),
        ("get", "pods", NAMESPACE),
        ("create", "events", "default"),
        ("get", "nodes", None),
    ):
        assert not allowed(sidecar, verb, resource, ns), (verb, resource, ns)
    webhook = apiserver.client(apiserver.token_for(NAMESPACE, "vram-enforcer-e2e-webhook"))
    assert not allowed(webhook, "get", "pods", OPTED_IN) and not allowed(
        webhook, "get", "secrets", NAMESPACE
    )


ENFORCED = "vram-enforcer.io/enforced"


def test_no_pod_outside_the_opted_in_namespaces_carries_the_marks_of_an_injected_one(
    installed: Path, admin: client.ApiClient
) -> None:
    """What makes a pod the webhook's to the agent: a namespace that opted in, the enforced
    label and a container named vram-enforcer. The webhook sees no other namespace: there,
    the chart's policy refuses a pod created with the label or such a container, and the
    label added later (issue 42: a pod made to look injected before its namespace opted in
    was served as injected once it did, its forged environment read as the webhook's)."""
    core = client.CoreV1Api(admin)

    def pod(name: str, labels: dict[str, str], container: str = "c") -> dict[str, Any]:
        spec = {"containers": [{"name": container, "image": "x"}]}
        return {"metadata": {"name": name, "labels": labels}, "spec": spec}

    def refused_with(body: dict[str, Any], words: str) -> bool:
        try:
            core.create_namespaced_pod("default", body)
        except client.ApiException as exc:
            return exc.status == 403 and words in json.loads(exc.body)["message"]
        core.delete_namespaced_pod(body["metadata"]["name"], "default", grace_period_seconds=0)
        return False

    try:
        wait_for(  # the API server loads a new policy within a few seconds
            lambda: refused_with(pod("marks-label", {ENFORCED: "true"}), "marks the pods"),
            timeout=30,
            what="the policy to be in force",
        )
        assert refused_with(pod("marks-sidecar", {}, "vram-enforcer"), "rename it")
        core.create_namespaced_pod("default", pod("marks-plain", {"app": "x"}))
        with pytest.raises(client.ApiException) as info:
            core.patch_namespaced_pod(
                "marks-plain", "default", {"metadata": {"labels": {ENFORCED: "true"}}}
            )
        assert (
            info.value.status == 403 and "marks the pods" in json.loads(info.value.body)["message"]
        )
        core.patch_namespaced_pod("marks-plain", "default", {"metadata": {"labels": {"b": "y"}}})
    finally:
        for stale in core.list_namespaced_pod("default").items:
            if stale.metadata.name.startswith("marks-"):
                core.delete_namespaced_pod(stale.metadata.name, "default", grace_period_seconds=0)


def label_enforced(core: client.CoreV1Api, ns: str, name: str) -> None:
    """Label a pod enforced, as the webhook does, in a namespace just patched to opt in: the
    injected-marks policy's view of namespaces lags the patch by a moment, and refuses the
    label until it has seen it (a failure seen once in CI)."""

    def labelled() -> bool:
        try:
            core.patch_namespaced_pod(name, ns, {"metadata": {"labels": {ENFORCED: "true"}}})
        except client.ApiException as exc:
            if exc.status == 403 and "marks the pods" in json.loads(exc.body)["message"]:
                return False
            raise
        return True

    wait_for(labelled, timeout=30, what=f"{name} labelled enforced")


def test_the_agent_may_delete_and_evict_only_the_enforced_pods_of_its_own_node(
    installed: Path, admin: client.ApiClient, apiserver: ApiServer
) -> None:
    """The agent may delete pods (the backstop's last resort, once a pod's budgets have
    refused its eviction for --eviction-timeout) and evict them, and RBAC cannot hold a
    DaemonSet to its own node: the chart's policies do. A delete: from the node that the
    agent's token names (bound to its pod, as the kubelet mounts it; the API server names
    the pod's node in it, on by default from 1.30), of a pod labelled enforced, in a
    namespace that opted in. An eviction, which deletes its pod without a DELETE's
    admission: in a namespace that opted in, by the pod's UID, with a grace period of a
    second at least. Another node's pod, a pod not labelled enforced, a namespace that no
    longer opts in, a token bound to no pod, an eviction elsewhere or with no grace:
    refused."""
    core = client.CoreV1Api(admin)
    agent_sa, ns = f"{RELEASE}-agent", "vap-fenced"

    def pod(name: str, node: str) -> dict[str, Any]:
        spec = {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}
        return {"metadata": {"name": name}, "spec": spec}

    for node in ("vap-gpu-a", "vap-gpu-b"):
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    # The pods are made before their namespace opts in (the webhook, not running here,
    # would be asked to review them), then labelled once it has: as the webhook labels
    # the pods it injects.
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    for name, node in (
        ("vap-mine", "vap-gpu-a"),
        ("vap-theirs", "vap-gpu-b"),
        ("vap-unlabelled", "vap-gpu-a"),
        ("vap-evicted", "vap-gpu-a"),
        ("vap-left", "vap-gpu-a"),
    ):
        core.create_namespaced_pod(ns, pod(name, node))
    core.create_namespaced_pod("default", pod("vap-elsewhere", "vap-gpu-a"))
    core.patch_namespace(ns, {"metadata": {"labels": {"vram-enforcer.io/inject": "enabled"}}})
    for name in ("vap-mine", "vap-theirs", "vap-evicted", "vap-left"):
        label_enforced(core, ns, name)
    agent_pod = core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": "vap-agent"},
            "spec": {
                "nodeName": "vap-gpu-a",
                "serviceAccountName": agent_sa,
                "containers": [{"name": "agent", "image": "x"}],
            },
        },
    )
    agent = client.CoreV1Api(apiserver.client(token_bound_to(core, agent_pod)))
    unbound = client.CoreV1Api(apiserver.client(apiserver.token_for(NAMESPACE, agent_sa)))

    def refused(call: Any, words: str) -> bool:
        try:
            call()
        except client.ApiException as exc:
            return exc.status == 403 and words in json.loads(exc.body)["message"]
        return False

    def evict(name: str, namespace: str, grace: int | None = 30, dry: bool = False) -> Any:
        """`dry`: a dry run, which admission judges as the real one but which deletes
        nothing: a probe that the policy is in force may be repeated (a real eviction let
        through before it is leaves its pod terminating, and the API server admits no
        delete of a pod whose graceful deletion is pending: the probe would never see a
        refusal)."""
        uid = core.read_namespaced_pod(name, namespace).metadata.uid
        options = client.V1DeleteOptions(
            grace_period_seconds=grace, preconditions=client.V1Preconditions(uid=uid)
        )
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace), delete_options=options
        )
        if dry:
            return lambda: agent.create_namespaced_pod_eviction(
                name, namespace, body, dry_run="All"
            )
        return lambda: agent.create_namespaced_pod_eviction(name, namespace, body)

    try:
        wait_for(  # the API server loads a new policy within a few seconds
            lambda: refused(evict("vap-elsewhere", "default", dry=True), "only in the namespaces"),
            timeout=30,
            what="the agent's eviction policy to be in force",
        )
        assert refused(evict("vap-evicted", ns, grace=0), "a grace period of at least")
        for name, api, names in (
            ("vap-theirs", agent, "its token names node vap-gpu-a"),
            ("vap-unlabelled", agent, "its token names node vap-gpu-a"),
            ("vap-mine", unbound, "its token names no node"),
        ):
            with pytest.raises(client.ApiException) as info:
                api.delete_namespaced_pod(name, ns, grace_period_seconds=30)
            assert info.value.status == 403, name
            message = json.loads(info.value.body)["message"]
            assert "may delete only the enforced pods of its own node" in message, message
            assert names in message, message
        deleting = agent.delete_namespaced_pod("vap-mine", ns, grace_period_seconds=30)
        assert deleting.metadata.deletion_grace_period_seconds == 30  # no kubelet: it stays
        evict("vap-evicted", ns)()
        evicted = core.read_namespaced_pod("vap-evicted", ns)
        assert evicted.metadata.deletion_grace_period_seconds == 30
        core.patch_namespace(ns, {"metadata": {"labels": {"vram-enforcer.io/inject": None}}})
        # Probed by dry runs: a delete let through before the API server saw the label go
        # leaves the pod terminating, and no later delete of it is admitted, nor refused.
        wait_for(
            lambda: refused(
                lambda: agent.delete_namespaced_pod(
                    "vap-left", ns, grace_period_seconds=30, dry_run="All"
                ),
                "in the namespaces that opted in",
            ),
            timeout=30,
            what="a namespace that no longer opts in to be fenced off",
        )
        assert refused(
            lambda: agent.delete_namespaced_pod("vap-left", ns, grace_period_seconds=30),
            "in the namespaces that opted in",
        )
    finally:
        for namespace in (ns, "default"):
            for stale in core.list_namespaced_pod(namespace).items:
                if stale.metadata.name.startswith("vap-"):
                    core.delete_namespaced_pod(
                        stale.metadata.name, namespace, grace_period_seconds=0
                    )
        core.delete_namespaced_pod("vap-agent", NAMESPACE, grace_period_seconds=0)
        core.delete_namespace(ns)
        for node in ("vap-gpu-a", "vap-gpu-b"):
            core.delete_node(node)


def test_the_agent_may_set_only_its_condition_and_only_on_its_own_nodes_enforced_pods(
    installed: Path, admin: client.ApiClient, apiserver: ApiServer
) -> None:
    """The agent keeps a pod's last enforcement as its condition vram-enforcer.io/Enforced
    (issue 43, item 5), with `patch` on pods/status, which RBAC grants on every pod and for
    every field of its status. The chart's policy holds it to that condition, on the
    enforced pods of the node its pod-bound token names, in a namespace that opted in:
    merged by type, the condition leaves the pod's other conditions as they were. Another
    node's pod, a pod not labelled enforced, a token bound to no pod, and a change of any
    other condition, of the pod's IP, of its labels or of its finalizers: refused."""
    core = client.CoreV1Api(admin)
    agent_sa, ns = f"{RELEASE}-agent", "cond-fenced"
    for node in ("cond-gpu-a", "cond-gpu-b"):
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    for name, node in (
        ("cond-mine", "cond-gpu-a"),
        ("cond-theirs", "cond-gpu-b"),
        ("cond-unlabelled", "cond-gpu-a"),
    ):
        spec = {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}
        core.create_namespaced_pod(ns, {"metadata": {"name": name}, "spec": spec})
        ready = {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}
        core.patch_namespaced_pod_status(name, ns, {"status": {"conditions": [ready]}})
    core.patch_namespace(ns, {"metadata": {"labels": {"vram-enforcer.io/inject": "enabled"}}})
    for name in ("cond-mine", "cond-theirs"):
        label_enforced(core, ns, name)
    agent_pod = core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": "cond-agent"},
            "spec": {
                "nodeName": "cond-gpu-a",
                "serviceAccountName": agent_sa,
                "containers": [{"name": "agent", "image": "x"}],
            },
        },
    )
    agent = apiserver.client(token_bound_to(core, agent_pod))
    unbound = apiserver.client(apiserver.token_for(NAMESPACE, agent_sa))
    ours = condition(Enforced(Reason.ENFORCED, "c"), "2026-11-29T03:12:05Z")

    def patch(api: client.ApiClient, name: str, body: dict[str, Any]) -> Any:
        return call(
            api,
            "PATCH",
            POD_STATUS,
            "pods/status",
            body=body,
            params={"namespace": ns, "name": name},
            deadline=10,
            patch=STRATEGIC_MERGE_PATCH,
        )

    def refused(api: client.ApiClient, name: str, body: dict[str, Any], words: str) -> bool:
        try:
            patch(api, name, body)
        except Forbidden as exc:
            return words in str(exc)
        return False

    def uid(name: str) -> str:
        return str(core.read_namespaced_pod(name, ns).metadata.uid)

    try:
        wait_for(  # the API server loads a new policy within a few seconds
            lambda: refused(
                agent,
                "cond-theirs",
                status_patch(uid("cond-theirs"), ours),
                "its token names node cond-gpu-a",
            ),
            timeout=30,
            what="the agent's condition policy to be in force",
        )
        for name, api, words in (
            ("cond-unlabelled", agent, "its token names node cond-gpu-a"),
            ("cond-mine", unbound, "its token names no node"),
        ):
            assert refused(api, name, status_patch(uid(name), ours), words), name
        only = "may change only the vram-enforcer.io/Enforced condition"
        ready = {"type": "Ready", "status": "True", "reason": "forged"}
        for forged in (
            {"status": {"conditions": [ours, ready]}},
            {"status": {"podIP": "10.0.0.66", "podIPs": [{"ip": "10.0.0.66"}]}},
            {"metadata": {"labels": {"team": "other"}}, "status": {"conditions": [ours]}},
            # Named by no field list: the metadata is compared whole (issue 43's review).
            {"metadata": {"finalizers": ["example.com/held"]}, "status": {"conditions": [ours]}},
        ):
            assert refused(agent, "cond-mine", forged, only), forged
        patch(agent, "cond-mine", status_patch(uid("cond-mine"), ours))
        kept = core.read_namespaced_pod_status("cond-mine", ns).status.conditions
        assert sorted((c.type, c.status, c.reason) for c in kept) == [
            ("Ready", "False", "ContainersNotReady"),  # merged by type, in any order
            ("vram-enforcer.io/Enforced", "True", "VRAMEnforced"),
        ]
        # A newcomer of the same name is not the pod enforced: its UID refuses the patch.
        with pytest.raises(KubeError):
            patch(agent, "cond-mine", status_patch("not-its-uid", ours))
    finally:
        for stale in core.list_namespaced_pod(ns).items:
            core.delete_namespaced_pod(stale.metadata.name, ns, grace_period_seconds=0)
        core.delete_namespaced_pod("cond-agent", NAMESPACE, grace_period_seconds=0)
        core.delete_namespace(ns)
        for node in ("cond-gpu-a", "cond-gpu-b"):
            core.delete_node(node)


@contextlib.contextmanager
def mutate_through_the_chart(admin: client.ApiClient, kubeconfig: Path, tmp: Path) -> Iterator[Any]:
    """Serve the chart's webhook here, with the chart's own arguments and certificate, point
    the chart's Service at it, and create a pod that declares VRAM in OPTED_IN; the pod as
    stored (JSON), while the webhook serves (the API server asks it about the pod's
    ephemeral containers too, and refuses what it cannot ask about)."""
    ip = host_ip()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address for the webhook's Endpoints")
    core = client.CoreV1Api(admin)
    secret = core.read_namespaced_secret("vram-enforcer-e2e-webhook-tls", NAMESPACE)
    (tmp / "tls.crt").write_bytes(base64.b64decode(secret.data["tls.crt"]))
    (tmp / "tls.key").write_bytes(base64.b64decode(secret.data["tls.key"]))
    deployment = client.AppsV1Api(admin).read_namespaced_deployment(
        "vram-enforcer-e2e-webhook", NAMESPACE
    )
    port = free_port()
    args = [
        a.replace("/tls/", f"{tmp}/")
        for a in deployment.spec.template.spec.containers[0].args
        if not a.startswith(("--port=", "--metrics-port="))
    ]
    log = tmp / "webhook.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "enforcer",
            *args,
            f"--port={port}",
            f"--address={ip}",
            f"--kubeconfig={kubeconfig}",
        ],
        stderr=log.open("w"),
    )
    try:
        wait_for(
            lambda: "serving admission reviews" in log.read_text(), timeout=30, what="the webhook"
        )
        # What the endpoint controllers would write for a webhook pod at ip:port: an
        # EndpointSlice, which the API server reads from 1.33 on (kubernetes/kubernetes#129837),
        # or before that Endpoints.
        minor = int(client.VersionApi(admin).get_code().minor.rstrip("+"))
        if minor >= 33:
            client.DiscoveryV1Api(core.api_client).create_namespaced_endpoint_slice(
                NAMESPACE,
                {
                    "metadata": {
                        "name": "vram-enforcer-e2e-webhook-local",
                        "labels": {"kubernetes.io/service-name": "vram-enforcer-e2e-webhook"},
                    },
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
                    "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
                },
            )
        else:
            core.create_namespaced_endpoints(
                NAMESPACE,
                {
                    "metadata": {"name": "vram-enforcer-e2e-webhook"},
                    "subsets": [
                        {"addresses": [{"ip": ip}], "ports": [{"name": "https", "port": port}]}
                    ],
                },
            )
        pod = {
            "metadata": {"name": "trainer-0"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "trainer",
                        "image": "pytorch",
                        "resources": {"limits": {"vram-enforcer.io/vram": "6Gi"}},
                    }
                ],
            },
        }
        core.create_namespaced_pod(OPTED_IN, pod)
        yield json.loads(
            core.read_namespaced_pod("trainer-0", OPTED_IN, _preload_content=False).data
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text()


def assert_mutated(stored: Any) -> None:
    assert [c["name"] for c in stored["spec"]["containers"]] == ["trainer"]
    (side,) = stored["spec"]["initContainers"]  # native: what sidecarMode auto is
    assert side["name"] == "vram-enforcer" and side["restartPolicy"] == "Always"
    assert side["image"] == "ghcr.io/vram-enforcer/vram-enforcer:e2e"
    assert {"name": "VRAM_ENFORCER_LIMITS", "value": '{"trainer":6442450944}'} in side["env"]
    assert stored["spec"]["shareProcessNamespace"] is True


def assert_the_sidecar_cannot_be_changed(admin: client.ApiClient) -> None:
    """The chart's ValidatingAdmissionPolicy: a tenant who may patch its pods cannot swap the
    sidecar's image of the injected pod trainer-0, nor change our annotations or label; its
    own container's image it may change."""
    core = client.CoreV1Api(admin)
    swap = [{"op": "replace", "path": "/spec/initContainers/0/image", "value": "evil"}]

    def refused() -> bool:  # the API server loads a new policy within a few seconds
        try:  # asked as a dry run: while the policy is not loaded yet, nothing changes
            core.patch_namespaced_pod("trainer-0", OPTED_IN, swap, dry_run="All")
        except client.ApiException as exc:
            return exc.status == 403
        return False

    wait_for(refused, timeout=30, what="the injected-pods policy to be in force")
    denied = {
        "the sidecar's image": [
            {"op": "replace", "path": "/spec/initContainers/0/image", "value": "busybox"}
        ],
        "an annotation of ours": [
            {"op": "add", "path": "/metadata/annotations/vram-enforcer.io~1action", "value": "warn"}
        ],
        "the injected annotation": [
            {"op": "remove", "path": "/metadata/annotations/vram-enforcer.io~1injected"}
        ],
        "the enforced label": [
            {"op": "remove", "path": "/metadata/labels/vram-enforcer.io~1enforced"}
        ],
    }
    for what, patch in denied.items():
        with pytest.raises(client.ApiException) as info:
            core.patch_namespaced_pod("trainer-0", OPTED_IN, patch)
        assert info.value.status == 403, what
        assert "of an injected pod cannot change" in json.loads(info.value.body)["message"], what
    allowed = [
        {"op": "replace", "path": "/spec/containers/0/image", "value": "pytorch:2"},
        {"op": "add", "path": "/metadata/annotations/team", "value": "vision"},
    ]
    stored = core.patch_namespaced_pod("trainer-0", OPTED_IN, allowed)
    assert stored.spec.containers[0].image == "pytorch:2"
    assert stored.spec.init_containers[0].image == "ghcr.io/vram-enforcer/vram-enforcer:e2e"


def entering(api: client.ApiClient, container: str, how: str = "exec") -> tuple[int, str]:
    """The API server's answer to an exec (or attach) into `container` of trainer-0: its
    status and message. The pod is on no node, so one that admission lets through fails
    after it, with 400 ("does not have a host assigned")."""
    core = client.CoreV1Api(api)
    try:
        if how == "attach":
            core.connect_post_namespaced_pod_attach(
                "trainer-0", OPTED_IN, container=container, stdout=True
            )
        else:
            core.connect_post_namespaced_pod_exec(
                "trainer-0", OPTED_IN, command=["true"], container=container, stdout=True
            )
    except client.ApiException as exc:
        return exc.status, str(json.loads(exc.body or "{}").get("message", exc.body))
    return 200, ""


def assert_the_sidecar_cannot_be_entered(admin: client.ApiClient) -> None:
    """The chart's second policy: a tenant who may exec and attach (as Kubernetes' `edit`
    role allows; granted here by a Role of its own, since `edit` is filled in by the
    controller manager, which the oldest server runs without) cannot exec or attach into
    the sidecar's container of the injected pod trainer-0, where a process could take the
    sidecar's socket; into the pod's own container it may, and so may a cluster
    administrator (system:masters) into the sidecar. Nobody adds an ephemeral container
    that targets the sidecar; one that targets the pod's own container is added."""
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(
        OPTED_IN,
        {
            "metadata": {"name": "tenant-exec"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods/exec", "pods/attach"],
                    "verbs": ["create", "get"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        OPTED_IN,
        {
            "metadata": {"name": "tenant-exec"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "tenant-exec",
            },
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "tenant"}
            ],
        },
    )
    tenant = client.ApiClient(admin.configuration)
    tenant.set_default_header("Impersonate-User", "tenant")
    wait_for(
        lambda: entering(tenant, "vram-enforcer")[0] == 403,
        timeout=30,
        what="the sidecar-exec policy to be in force",
    )
    for how in ("exec", "attach"):
        status, message = entering(tenant, "vram-enforcer", how)
        assert status == 403, (how, message)
        assert "exec and attach into the vram-enforcer container are refused" in message, how
        status, message = entering(tenant, "trainer", how)
        assert status == 400 and "does not have a host assigned" in message, (how, message)
    status, message = entering(admin, "vram-enforcer")
    assert status == 400 and "does not have a host assigned" in message, message
    core = client.CoreV1Api(admin)

    def debug(target: str) -> Any:
        """Add the pod's first ephemeral container, targeting `target`."""
        container = {"name": f"debug-{target}", "image": "busybox", "targetContainerName": target}
        patch = [{"op": "add", "path": "/spec/ephemeralContainers", "value": [container]}]
        return core.patch_namespaced_pod_ephemeralcontainers("trainer-0", OPTED_IN, patch)

    with pytest.raises(client.ApiException) as info:
        debug("vram-enforcer")
    assert info.value.status == 403, info.value.body
    # The webhook's denial: the API server asks it first (the chart's policy, its second
    # guard, says the same where the webhook is not asked, `failurePolicy: Ignore`)
    message = json.loads(info.value.body)["message"]
    assert "targetContainerName: 'vram-enforcer' is the enforcer's sidecar" in message, message
    stored = debug("trainer")
    assert [e.target_container_name for e in stored.spec.ephemeral_containers] == ["trainer"]
    # The chart's webhook is asked for ephemeral containers too: this one drops KILL.
    (debugger,) = stored.spec.ephemeral_containers
    assert debugger.security_context.capabilities.drop == ["KILL"]


def assert_the_policy_guards_ephemeral_containers_without_the_webhook(
    admin: client.ApiClient,
) -> None:
    """With the webhook passed by (down, `failurePolicy: Ignore`), the chart's policy is
    the second guard of trainer-0: an ephemeral container that targets the sidecar, or
    keeps KILL, is refused all the same."""
    hooks = client.AdmissionregistrationV1Api(admin)
    core = client.CoreV1Api(admin)
    ignore = [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}]
    fail = [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Fail"}]
    hooks.patch_mutating_webhook_configuration(RELEASE, ignore)
    try:
        refused = {
            "the sidecar targeted": {"targetContainerName": "vram-enforcer"},
            "KILL kept": {"targetContainerName": "trainer"},
        }
        for i, (what, fields) in enumerate(refused.items()):
            container = {"name": f"unguarded-{i}", "image": "busybox", **fields}
            patch = [{"op": "add", "path": "/spec/ephemeralContainers/-", "value": container}]

            def message(patch: list[dict[str, Any]] = patch, what: str = what) -> str | None:
                # the API server reads the webhook's new failurePolicy within moments
                try:
                    core.patch_namespaced_pod_ephemeralcontainers("trainer-0", OPTED_IN, patch)
                except client.ApiException as exc:
                    if exc.status == 403:
                        return str(json.loads(exc.body)["message"])
                    return None
                pytest.fail(f"{what}: the ephemeral container was added")

            said = wait_for(message, timeout=30, what=f"{what}: the policy's refusal")
            assert "ValidatingAdmissionPolicy" in said, (what, said)
            expected = "cannot target the vram-enforcer" if i == 0 else "must drop KILL"
            assert expected in said, (what, said)
    finally:
        hooks.patch_mutating_webhook_configuration(RELEASE, fail)


def test_a_pod_is_mutated_through_the_charts_own_webhook(
    installed: Path, admin: client.ApiClient, tmp_path: Path
) -> None:
    with mutate_through_the_chart(admin, installed, tmp_path) as stored:
        assert_mutated(stored)
        assert_the_sidecar_cannot_be_changed(admin)
        assert_the_sidecar_cannot_be_entered(admin)
    assert_the_policy_guards_ephemeral_containers_without_the_webhook(admin)


def test_the_oldest_supported_kubernetes_takes_the_chart_and_its_webhook(
    apiserver: ApiServer, tmp_path: Path
) -> None:
    """The chart's kubeVersion floor, OLDEST: the chart installs on that kube-apiserver and
    its webhook mutates a pod there as on the current one. (`apiserver` only for its
    skip-or-fail check: this server is its own.)"""
    binary = oldest_apiserver_binary()
    if binary is None:
        reason = f"no kube-apiserver {OLDEST}: run tests/e2e/build-kubernetes.sh"
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={OLDEST.rsplit('.', 1)[0]}.0-0"
    with ApiServer(binary) as server:
        server.start()
        admin = server.client()
        assert client.VersionApi(admin).get_code().git_version == f"v{OLDEST}"
        kubeconfig = install(server, admin, tmp_path)
        with mutate_through_the_chart(admin, kubeconfig, tmp_path) as stored:
            assert_mutated(stored)
            assert_the_sidecar_cannot_be_changed(admin)
            assert_the_sidecar_cannot_be_entered(admin)


def test_an_upgrade_keeps_the_self_signed_certificate(
    installed: Path, admin: client.ApiClient
) -> None:
    core = client.CoreV1Api(admin)
    before = core.read_namespaced_secret("vram-enforcer-e2e-webhook-tls", NAMESPACE).data
    values = {
        "image": {"tag": "e2e-2"},
        "sidecar": {"namespaces": [OPTED_IN]},
        "webhook": {"logFormat": "text"},
    }
    helm("upgrade", RELEASE, str(CHART), NAMESPACE, str(installed), json.dumps(values))
    assert core.read_namespaced_secret("vram-enforcer-e2e-webhook-tls", NAMESPACE).data == before
    deployment = client.AppsV1Api(admin).read_namespaced_deployment(
        "vram-enforcer-e2e-webhook", NAMESPACE
    )
    assert (
        deployment.spec.template.spec.containers[0].image
        == "ghcr.io/vram-enforcer/vram-enforcer:e2e-2"
    )


CERT_MANAGER_CRDS = [("issuers", "Issuer"), ("certificates", "Certificate")]


def test_cert_manager_mode_renders_an_issuer_a_certificate_and_the_ca_injection(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    """cert-manager itself does not run here: its two CRDs stand in, so the objects can be stored."""
    stand_in_crds(admin, "cert-manager.io", CERT_MANAGER_CRDS)
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    values = {"webhook": {"tls": {"mode": "cert-manager"}}, "agent": {"enabled": False}}
    helm("install", "vram-enforcer-cm", str(CHART), "vram-cm", str(kubeconfig), json.dumps(values))
    try:
        custom = client.CustomObjectsApi(admin)
        cert = custom.get_namespaced_custom_object(
            "cert-manager.io", "v1", "vram-cm", "certificates", "vram-enforcer-cm-webhook"
        )
        assert cert["spec"]["secretName"] == "vram-enforcer-cm-webhook-tls"
        assert "vram-enforcer-cm-webhook.vram-cm.svc" in cert["spec"]["dnsNames"]
        assert cert["spec"]["issuerRef"] == {
            "name": "vram-enforcer-cm-webhook-selfsigned",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        issuer = custom.get_namespaced_custom_object(
            "cert-manager.io", "v1", "vram-cm", "issuers", "vram-enforcer-cm-webhook-selfsigned"
        )
        assert issuer["spec"] == {"selfSigned": {}}
        config = client.AdmissionregistrationV1Api(admin).read_mutating_webhook_configuration(
            "vram-enforcer-cm"
        )
        assert (
            config.metadata.annotations["cert-manager.io/inject-ca-from"]
            == "vram-cm/vram-enforcer-cm-webhook"
        )
        assert not config.webhooks[0].client_config.ca_bundle  # cert-manager's cainjector fills it
        secrets = client.CoreV1Api(admin).list_namespaced_secret("vram-cm").items
        assert "vram-enforcer-cm-webhook-tls" not in [
            s.metadata.name for s in secrets
        ]  # cert-manager makes it
    finally:
        helm("uninstall", "vram-enforcer-cm", "vram-cm", str(kubeconfig))


def stand_in_crds(admin: client.ApiClient, group: str, kinds: list[tuple[str, str]]) -> None:
    """CRDs that accept any object of these kinds: their operators do not run here."""
    for plural, kind in kinds:
        client.ApiextensionsV1Api(admin).create_custom_resource_definition(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{group}"},
                "spec": {
                    "group": group,
                    "scope": "Namespaced",
                    "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    ],
                },
            }
        )
    wait_for(
        lambda: all(_served(admin, group, plural) for plural, _ in kinds), what=f"the {group} CRDs"
    )


def test_monitoring_objects_and_the_dashboard(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    stand_in_crds(
        admin,
        "monitoring.coreos.com",
        [("servicemonitors", "ServiceMonitor"), ("podmonitors", "PodMonitor")],
    )
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    values = {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "legacySidecarPodMonitor": {"enabled": True},
            "grafanaDashboard": {"enabled": True},
        },
        "webhook": {"failurePolicy": "Ignore"},
    }
    helm(
        "install", "vram-enforcer-mon", str(CHART), "vram-mon", str(kubeconfig), json.dumps(values)
    )
    try:
        custom = client.CustomObjectsApi(admin)
        sm = custom.get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", "vram-mon", "servicemonitors", "vram-enforcer-mon"
        )
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        # Each agent serves every enforced pod of its node: the series' namespace, pod and
        # container are theirs, not the agent's target's.
        assert sm["spec"]["endpoints"] == [
            {"port": "metrics", "interval": "30s", "honorLabels": True}
        ]
        monitors = custom.list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", "vram-mon", "podmonitors"
        )["items"]
        (pm,) = monitors  # the sidecars of 0.1.0's only, while an upgrade replaces them
        assert pm["metadata"]["name"] == "vram-enforcer-mon-legacy-sidecars"
        assert pm["spec"]["selector"] == {"matchLabels": {"vram-enforcer.io/enforced": "true"}}
        (endpoint,) = pm["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "vram-metrics"  # the port name 0.1.0 injected
        # Only the counters that no agent serves for those pods: nothing counted twice.
        assert endpoint["metricRelabelings"] == [
            {
                "sourceLabels": ["__name__"],
                "action": "keep",
                "regex": "vram_enforcer_(actions|reclaims|signals_refused)_total",
            }
        ]
        cm = client.CoreV1Api(admin).read_namespaced_config_map(
            "vram-enforcer-mon-dashboard", "vram-mon"
        )
        assert cm.metadata.labels["grafana_dashboard"] == "1"
        dashboard = json.loads(cm.data["vram-enforcer.json"])
        exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", ()))
        for metric in (
            "vram_enforcer_container_used_bytes",
            "vram_enforcer_container_limit_bytes",
            "vram_enforcer_actions_total",
            "vram_enforcer_gpu_total_bytes",
            "vram_enforcer_container_gpu_sm_utilization_ratio",
            "vram_enforcer_gpu_tenants",
            "vram_enforcer_pods_unguarded",
        ):
            assert metric in exprs
    finally:
        helm("uninstall", "vram-enforcer-mon", "vram-mon", str(kubeconfig))


def _served(api: client.ApiClient, group: str, plural: str) -> bool:
    try:
        client.CustomObjectsApi(api).list_namespaced_custom_object(group, "v1", "default", plural)
    except client.exceptions.ApiException:
        return False
    return True


def checkov_findings(manifest: Path) -> set[tuple[str, str]]:
    """(check id, component) of each check that checkov 3.3 fails on a rendered chart."""
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    if not checkov.exists():
        reason = "no checkov: bash .ci/run makes .venv-checkov"
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    out = subprocess.run(
        [
            str(checkov),
            "-f",
            str(manifest),
            "--framework",
            "kubernetes",
            "--quiet",
            "--compact",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    report = report[0] if isinstance(report, list) else report
    found = set()
    for check in report["results"]["failed_checks"]:
        component = re.search(r"-(agent|webhook)\b", check["resource"])
        assert component, check["resource"]
        found.add((check["check_id"], component[1]))
    return found


def documented_findings(hardened: bool) -> set[tuple[str, str]]:
    """The table in docs/security.md: each check that stays, on which objects."""
    text = (ROOT / "docs" / "security.md").read_text()
    found = set()
    for check, objects, with_hardening in re.findall(
        r"^\| (CKV2?_K8S_\d+) \([^)]*\) \| ([a-z, ]+) \| (stays|fixed) \|", text, re.MULTILINE
    ):
        if not hardened or with_hardening == "stays":
            found |= {(check, o.strip()) for o in objects.split(",")}
    return found


def test_checkov_finds_what_security_md_lists(installed: Path, tmp_path: Path) -> None:
    """Every finding is explained in docs/security.md, and every explanation is still needed."""
    assert checkov_findings(installed.with_name("manifest.yaml")) == documented_findings(False)


def test_with_network_policies_and_a_digest_only_the_intrinsic_findings_stay(
    apiserver: ApiServer, admin: client.ApiClient, tmp_path: Path
) -> None:
    kubeconfig = apiserver.kubeconfig(apiserver.admin_token, tmp_path / "kubeconfig")
    values = {
        "image": {"digest": "sha256:" + "0" * 64},
        "networkPolicy": {"enabled": True},
        "webhook": {"sidecarMode": "native"},
    }
    release = helm(
        "install", "hardened", str(CHART), "vram-hardened", str(kubeconfig), json.dumps(values)
    )
    try:
        (tmp_path / "manifest.yaml").write_text(release["manifest"])
        assert checkov_findings(tmp_path / "manifest.yaml") == documented_findings(True)
        policies = client.NetworkingV1Api(admin).list_namespaced_network_policy("vram-hardened")
        webhook = next(p for p in policies.items if p.metadata.name.endswith("-webhook"))
        https, metrics = webhook.spec.ingress
        assert https._from is None and [p.port for p in https.ports] == ["https"]
        selector = metrics._from[0].namespace_selector.match_labels
        assert selector == {"kubernetes.io/metadata.name": "monitoring"}
        deployment = client.AppsV1Api(admin).read_namespaced_deployment(
            "hardened-vram-enforcer-webhook", "vram-hardened"
        )
        (container,) = deployment.spec.template.spec.containers
        assert container.image == "ghcr.io/vram-enforcer/vram-enforcer@sha256:" + "0" * 64
        assert "--sidecar-mode=native" in container.args
    finally:
        helm("uninstall", "hardened", "vram-hardened", str(kubeconfig))
