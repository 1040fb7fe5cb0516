"""The chart as Helm renders it (helm-sdkpy's install, against tests/chart/fake_apiserver.py):
a value its programs refuse fails `helm install` with the value's name, before anything is
made; the defaults and other valid values render into arguments that the agent and the
webhook take, as parsed by their own command line (enforcer/cli.py).

Which values: tests/unit/test_chart_schema.py holds the schema to the programs' settings.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from enforcer.cli import build_parser, configure
from enforcer.core.parsing import ConfigError
from tests.chart.fake_apiserver import fake_apiserver
from tests.e2e.helm import CHART, helm

SCHEMA_ERROR = "values don't meet the specifications of the schema"
# Each value the programs refuse (the brief's three first), or the cluster could not live with (a
# budget that blocks every drain), and what the error names.
REFUSED: list[tuple[dict[str, Any], Sequence[str]]] = [
    ({"agent": {"reserve": "500m"}}, ["agent.reserve", '"500m"']),
    ({"agent": {"interval": "5ms"}}, ["agent.interval", '"5ms"']),
    (
        {"webhook": {"kaiAnnotations": True, "draDeviceClass": "gpu.nvidia.com"}},
        ["webhook.kaiAnnotations", "webhook.draDeviceClass (gpu.nvidia.com)"],
    ),
    ({"agent": {"interval": "10000us5ms"}}, ["agent.interval"]),
    ({"agent": {"utilizationInterval": "50ms"}}, ["agent.utilizationInterval", '"50ms"']),
    ({"agent": {"utilizationInterval": "100000us"}}, ["agent.utilizationInterval"]),
    ({"agent": {"resync": "500ms"}}, ["agent.resync", '"500ms"']),
    ({"agent": {"resync": "60"}}, ["agent.resync", '"60"']),
    ({"agent": {"reclaimWatermark": "1.5"}}, ["agent.reclaimWatermark", '"1.5"']),
    ({"agent": {"reserve": "0.1Ki"}}, ["agent.reserve", '"0.1Ki"']),
    ({"agent": {"reserve": "9223372036854775808"}}, ["agent.reserve"]),
    ({"resource": {"unit": "0"}}, ["resource.unit", '"0"']),
    ({"resource": {"unit": "1GB"}}, ["resource.unit", '"1GB"']),
    ({"resource": {"name": "example.kubernetes.io/vram"}}, ["/resource/name"]),
    ({"webhook": {"shmDefault": "64MB"}}, ["webhook.shmDefault", '"64MB"']),
    (
        {"webhook": {"sidecarResources": {"cpu": "-10m"}}},
        ["webhook.sidecarResources.cpu", '"-10m"'],
    ),
    (
        {"webhook": {"sidecarResources": {"memory": "96m"}}},
        ["webhook.sidecarResources.memory", '"96m"'],
    ),
    (
        {"webhook": {"tenants": {"maxGracePeriod": "30"}}},
        ["webhook.tenants.maxGracePeriod", '"30"'],
    ),
    ({"webhook": {"tenants": {"maxCeiling": "80GB"}}}, ["webhook.tenants.maxCeiling"]),
    (
        {"webhook": {"tenants": {"namespaces": {"research": {"maxGracePeriod": "2"}}}}},
        ["webhook.tenants.namespaces.research.maxGracePeriod", '"2"'],
    ),
    (
        {"webhook": {"tenants": {"namespaces": {"research": {"maxCeiling": "40gb"}}}}},
        ["webhook.tenants.namespaces.research.maxCeiling", '"40gb"'],
    ),
    ({"webhook": {"tenants": {"actions": ["explode"]}}}, ["/webhook/tenants/actions/0"]),
    (
        {"webhook": {"podDisruptionBudget": {"minAvailable": 3}}},
        ["webhook.podDisruptionBudget.minAvailable (3)", "webhook.replicas", "e.g. 1"],
    ),
    (
        {"webhook": {"replicas": 3, "podDisruptionBudget": {"minAvailable": "100%"}}},
        ["webhook.podDisruptionBudget.minAvailable (100%)", "keeps 3 of the webhook's 3"],
    ),
    (
        {"webhook": {"port": 9479}},
        ["webhook.port and webhook.metricsPort are both 9479", "Set different ones"],
    ),
    ({"webhook": {"metricsPort": 443}}, ["webhook.metricsPort is 443", "Set another"]),
    (
        {"webhook": {"runtimeClassName": "nvidia"}},
        ["webhook.runtimeClassName (nvidia)", "webhook.gpuExposure: env"],
    ),
    (
        {"webhook": {"gpuExposure": "env", "draDeviceClass": "gpu.nvidia.com"}},
        ["webhook.gpuExposure: env", "webhook.draDeviceClass (gpu.nvidia.com)"],
    ),
    ({"webhook": {"undeclaredGpu": "allow"}}, ["/webhook/undeclaredGpu", "deny"]),
    ({"webhook": {"defaultAction": "audit"}}, ["/webhook/defaultAction", "dry-run"]),
    ({"webhook": {"gpuResources": ["gpu"]}}, ["/webhook/gpuResources/0", "'gpu'"]),
    ({"webhook": {"defaultVram": "8GB"}}, ["webhook.defaultVram", '"8GB"']),
    (  # the webhook refuses to start: default with nothing to give
        {"webhook": {"undeclaredGpu": "default"}},
        ["webhook.undeclaredGpu is default", "Set webhook.defaultVram to a size"],
    ),
    (
        {"webhook": {"tenants": {"namespaces": {"team-a": {"undeclaredGpu": "default"}}}}},
        ["webhook.tenants.namespaces.team-a.undeclaredGpu is default", "webhook.defaultVram"],
    ),
    (  # a values file's whole number past 2^53 is read as another (...788): refused, not changed
        {"image": {"tag": 20240101123456789}},
        ["image.tag: this number reads as 20240101123456788", "Quote it"],
    ),
    (
        {"agent": {"nodeSelector": {"pool": 2**53}}},
        ["agent.nodeSelector.pool: this number reads as 9007199254740992", "Quote it"],
    ),
    ({"agent": {"reserve": 2**60}}, ["agent.reserve: this number reads as", "Quote it"]),
]
VALID: list[dict[str, Any]] = [
    {},
    {  # numbers, as a values file gives them (they reach the templates as float64)
        "image": {"tag": 2**53 - 1},  # the largest whole float64 below which each is exact
        "resource": {"unit": 1},
        "agent": {
            "reserve": 1073741824,
            "utilizationInterval": 0,
            "evictionTimeout": 0,
            "nodeSelector": {"pool": 20240101},
        },
        "webhook": {
            "shmDefault": 1073741824,
            "sidecarResources": {"cpu": 0.5, "memory": 100000000},
            "tenants": {
                "maxGracePeriod": 0,
                "maxCeiling": 85899345920,
                "namespaces": {"research": {"maxCeiling": 42949672960, "maxGracePeriod": 0}},
            },
        },
    },
    {
        "resource": {"unit": "1Gi"},
        "agent": {
            "reserve": "512Mi",
            "reclaimWatermark": "1.5Gi",
            "interval": "1s",
            "utilizationInterval": "0",
            "resync": "1m30s",
            "hardLimits": "off",
        },
        "webhook": {
            "shmDefault": "1Gi",
            "sidecarResources": {"cpu": "0.5", "memory": "128Mi"},
            "tenants": {
                "maxGracePeriod": "0",
                "maxCeiling": "80Gi",
                "namespaces": {
                    "research": {
                        "actions": ["warn"],
                        "maxGracePeriod": "2m",
                        "maxCeiling": "40Gi",
                        "allowOptOut": True,
                    }
                },
            },
        },
    },
    {
        "agent": {
            "reserve": "0",
            "interval": "10ms",
            "utilizationInterval": "100ms",
            "resync": "1s",
        },
        "webhook": {
            "shmDefault": "off",
            "sidecarMode": "container",
            "tenants": {"maxGracePeriod": "100ms"},
        },
    },
    {
        "webhook": {
            "defaultAction": "dry-run",
            "gpuResources": ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb.shared"],
            "undeclaredGpu": "observe",
            "tenants": {
                "actions": ["terminate", "dry-run"],
                "namespaces": {
                    "team-a": {"undeclaredGpu": "default", "defaultVram": "8Gi"},
                    "prod": {"defaultAction": "kill", "undeclaredGpu": "deny"},
                },
            },
        },
    },
    {"webhook": {"undeclaredGpu": "default", "defaultVram": "16Gi"}},
]


def _install(kubeconfig: Path, values: dict[str, Any], fails: bool) -> Any:
    try:
        return helm(
            "install",
            "vram-enforcer",
            str(CHART),
            "vram-enforcer",
            str(kubeconfig),
            json.dumps(values),
            fails=fails,
        )
    except AssertionError as exc:
        if fails:  # its message would be the whole release
            raise AssertionError(f"the chart renders {values}, which its program refuses") from None
        raise AssertionError(f"the chart refuses {values}: {exc}") from None


Renders = Callable[[Sequence[tuple[dict[str, Any], bool]]], list[Any]]


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Renders]:
    """Render several sets of values at once (Helm's client waits between its requests),
    each expected to fail or not: the errors, or the releases."""
    with fake_apiserver(tmp_path_factory.mktemp("chart")) as kubeconfig:

        def run(cases: Sequence[tuple[dict[str, Any], bool]]) -> list[Any]:
            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(lambda case: _install(kubeconfig, *case), cases))

        yield run


def test_a_value_its_program_refuses_fails_the_install_by_name(renders: Renders) -> None:
    errors = renders([(values, True) for values, _ in REFUSED])
    for (values, names), error in zip(REFUSED, errors, strict=True):
        assert all(name in error for name in names), (values, error)
        assert SCHEMA_ERROR in error or "execution error at" in error, error
        # Issue 43, item 12: a sentence, not a kilobyte of regular expression.
        assert len(error) < 600, error


def _arguments(manifest: str) -> dict[str, list[str]]:
    """Each container's arguments, by the mode they run (its first argument)."""
    found = {}
    for doc in yaml.safe_load_all(manifest):
        if doc and doc["kind"] in ("Deployment", "DaemonSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                found[container["args"][0]] = container["args"]
    return found


def _program_refusal(args: list[str]) -> str | None:
    """What the program says of its arguments at start: None when it takes them. The
    agent's NODE_NAME comes from the Downward API."""
    try:
        configure(build_parser(args[0]).parse_args(args), {"NODE_NAME": "gpu-node-1"})
    except ConfigError as exc:
        return str(exc)
    return None


def test_valid_values_render_into_arguments_the_programs_take(renders: Renders) -> None:
    releases = renders([(v, False) for v in VALID])
    for values, release in zip(VALID, releases, strict=True):
        arguments = _arguments(release["manifest"])
        assert set(arguments) == {"agent", "webhook"}
        for args in arguments.values():
            assert _program_refusal(args) is None, (values, args)
        assert "1e+" not in release["manifest"], values  # float64's way of printing
    assert "vram-enforcer:9007199254740991\n" in releases[1]["manifest"]  # digit for digit


WEBHOOK_COMBINATIONS = [
    {
        "runtimeClassName": runtime_class,
        "gpuExposure": exposure,
        "draDeviceClass": dra_class,
        "kaiAnnotations": kai,
    }
    for runtime_class, exposure, dra_class, kai in itertools.product(
        ["", "nvidia"], ["none", "env"], ["", "gpu.nvidia.com"], [False, True]
    )
]


def _webhook_arguments(values: dict[str, Any]) -> list[str]:
    """The webhook's arguments for these four values, as webhook-deployment.yaml writes
    them (the chart may refuse to render them)."""
    args = [
        "webhook",
        "--tls-cert-file=/tls/tls.crt",
        "--tls-key-file=/tls/tls.key",
        "--sidecar-image=vram-enforcer:test",
        f"--gpu-exposure={values['gpuExposure']}",
    ]
    if values["draDeviceClass"]:
        args.append(f"--dra-device-class={values['draDeviceClass']}")
    if values["runtimeClassName"]:
        args.append(f"--runtime-class={values['runtimeClassName']}")
    if values["kaiAnnotations"]:
        args.append("--kai-annotations")
    return args


def test_the_chart_renders_the_webhook_values_it_starts_with_and_no_others(
    renders: Renders,
) -> None:
    refusals = [_program_refusal(_webhook_arguments(v)) for v in WEBHOOK_COMBINATIONS]
    results = renders(
        [
            ({"webhook": values}, refusal is not None)
            for values, refusal in zip(WEBHOOK_COMBINATIONS, refusals, strict=True)
        ]
    )
    assert None in refusals and any(refusals)  # both ways
    for values, refusal, result in zip(WEBHOOK_COMBINATIONS, refusals, results, strict=True):
        if refusal is None:
            assert _program_refusal(_arguments(result["manifest"])["webhook"]) is None, values
        else:  # the chart names each value the webhook's refusal names
            flags = {
                "--runtime-class": "runtimeClassName",
                "--gpu-exposure": "gpuExposure",
                "--kai-annotations": "kaiAnnotations",
            }
            named = [f"webhook.{value}" for flag, value in flags.items() if flag in refusal]
            assert named and all(name in result for name in named), (values, refusal, result)


# The values of the webhook's defaults for an undeclared GPU, which it checks together
# (check_defaults in enforcer/core/tenancy.py): a mode, a size (0 spelt as the docs, a number
# and other quantities), the resource's unit, and a namespace's own.
DEFAULT_COMBINATIONS: list[dict[str, Any]] = [
    {
        "resource": {"unit": unit},
        "webhook": {
            "undeclaredGpu": mode,
            "defaultVram": vram,
            "tenants": {"namespaces": namespaces},
        },
    }
    for mode, vram, unit, namespaces in itertools.product(
        ["deny", "default"],
        ["0Gi", 0, "8Gi", "1500Mi"],
        ["1", "1Gi"],
        [
            {},
            {"ml": {"defaultVram": 0}},
            {"ml": {"undeclaredGpu": "default"}},
            {"ml": {"defaultVram": ".5Gi"}},
        ],
    )
] + [
    {"resource": {"unit": "512Mi"}, "webhook": {"defaultVram": vram}}
    for vram in ["0.0Mi", "1.5Gi", "1.25Gi", "7.875Pi", "8e9", ".5Ki"]
]


def _default_arguments(values: dict[str, Any]) -> list[str]:
    """The webhook's arguments for these values, as the webhook is given them: every value
    as text (a number as its digits), each namespace's as JSON."""
    webhook = values["webhook"]
    namespaces = webhook.get("tenants", {}).get("namespaces", {})
    bounds = {
        ns: {key: str(value) for key, value in given.items()} for ns, given in namespaces.items()
    }
    return [
        "webhook",
        "--tls-cert-file=/tls/tls.crt",
        "--tls-key-file=/tls/tls.key",
        "--sidecar-image=vram-enforcer:test",
        f"--resource-unit={values['resource']['unit']}",
        f"--undeclared-gpu={webhook.get('undeclaredGpu', 'deny')}",
        f"--default-vram={webhook['defaultVram']}",
        f"--namespace-bounds={json.dumps(bounds)}",
    ]


def test_the_chart_renders_the_webhook_defaults_it_starts_with_and_no_others(
    renders: Renders,
) -> None:
    """Issue 43's defaults for an undeclared GPU: a size of zero however spelt (0Gi, a
    number 0 in a namespace, which `default` took for unset), or one that is no whole number
    of resource.unit, made a webhook that refused to start, crash-looping with failurePolicy
    Fail. The chart refuses exactly what the webhook refuses, naming the size it checked."""
    refusals = [_program_refusal(_default_arguments(v)) for v in DEFAULT_COMBINATIONS]
    results = renders(
        [(v, r is not None) for v, r in zip(DEFAULT_COMBINATIONS, refusals, strict=True)]
    )
    assert None in refusals and any(refusals)  # both ways
    for values, refusal, result in zip(DEFAULT_COMBINATIONS, refusals, results, strict=True):
        if refusal is None:
            assert _program_refusal(_arguments(result["manifest"])["webhook"]) is None, values
        else:
            ml = values["webhook"].get("tenants", {}).get("namespaces", {}).get("ml", {})
            own = "'ml'" in refusal and "defaultVram" in ml  # the namespace's own size
            where = "webhook.tenants.namespaces.ml" if own else "webhook"
            assert f"{where}.defaultVram" in result, (values, refusal, result)
            assert "execution error at" in result and len(result) < 600, result


def test_the_sidecar_pod_monitor_of_0_1_0_fails_the_install_naming_what_replaces_it(
    renders: Renders,
) -> None:
    """0.1.0's monitoring.podMonitor scraped the sidecars, which serve no metrics since
    0.2.0 (each node's agent serves its pods'): values that still enable it fail the
    install, naming the fix; disabled, they render, with no PodMonitor."""
    refused, rendered = renders(
        [
            ({"monitoring": {"podMonitor": {"enabled": True}}}, True),
            ({"monitoring": {"podMonitor": {"enabled": False}}}, False),
        ]
    )
    assert "execution error at" in refused and "monitoring.podMonitor is gone" in refused, refused
    assert "monitoring.legacySidecarPodMonitor.enabled=true" in refused, refused
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered["manifest"]) if doc}
    assert "PodMonitor" not in kinds and "Deployment" in kinds


def _containers(manifest: str) -> dict[str, dict[str, Any]]:
    """Each workload's first container, by its component (agent, webhook)."""
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["spec"]["template"]["spec"][
            "containers"
        ][0]
        for doc in yaml.safe_load_all(manifest)
        if doc and doc["kind"] in ("DaemonSet", "Deployment")
    }


def test_the_probes_ask_what_no_pod_can_keep_from_answering_and_the_policy_is_opt_in(
    renders: Renders,
) -> None:
    """Issue 42, item 6: any pod can reach these ports. The probes ask /healthz (/readyz),
    which the servers answer at once whoever else holds connections; the NetworkPolicy stays
    off unless asked for (values.yaml says why), and NOTES say what that leaves open."""
    default, enabled = renders([({}, False), ({"networkPolicy": {"enabled": True}}, False)])
    agent = _containers(default["manifest"])["agent"]
    for probe in (agent["readinessProbe"], agent["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert probe["timeoutSeconds"] == 5
    webhook = _containers(default["manifest"])["webhook"]
    assert webhook["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert webhook["readinessProbe"]["httpGet"]["path"] == "/readyz"
    policies = [
        doc
        for doc in yaml.safe_load_all(enabled["manifest"])
        if doc and doc["kind"] == "NetworkPolicy"
    ]
    assert not any(
        doc and doc["kind"] == "NetworkPolicy" for doc in yaml.safe_load_all(default["manifest"])
    )
    assert "networkPolicy.enabled is false" in default["info"]["notes"]
    assert "networkPolicy.enabled is false" not in enabled["info"]["notes"]
    (agent_policy,) = [p for p in policies if p["metadata"]["name"].endswith("agent")]
    assert agent_policy["spec"]["ingress"] == [
        {
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        }
    ]


def _kinds(manifest: str) -> list[str]:
    return [doc["kind"] for doc in yaml.safe_load_all(manifest) if doc]


def test_the_webhook_budget_lets_a_node_drain(renders: Renders) -> None:
    """Issue 43, item 7: one replica gets no PodDisruptionBudget (minAvailable: 1 of 1
    blocked every drain of its node); with more, the budget keeps fewer than all (a count,
    a count as text, or a percentage); a budget that keeps all is refused (REFUSED)."""
    one, three, as_text, percent = renders(
        [
            ({"webhook": {"replicas": 1}}, False),
            ({"webhook": {"replicas": 3, "podDisruptionBudget": {"minAvailable": 2}}}, False),
            ({"webhook": {"podDisruptionBudget": {"minAvailable": "1"}}}, False),
            ({"webhook": {"replicas": 3, "podDisruptionBudget": {"minAvailable": "50%"}}}, False),
        ]
    )
    assert "PodDisruptionBudget" not in _kinds(one["manifest"])
    for release, kept in ((three, 2), (as_text, 1), (percent, "50%")):
        (budget,) = [
            doc
            for doc in yaml.safe_load_all(release["manifest"])
            if doc and doc["kind"] == "PodDisruptionBudget"
        ]
        assert budget["spec"]["minAvailable"] == kept


def test_the_agent_condition_fence_holds_the_whole_status_and_metadata(renders: Renders) -> None:
    """The agent's `patch pods/status` is fenced to its condition (the policy
    <release>-agent-conditions). It compared the status fields it named, and left the
    others (resourceClaimStatuses, resize, observedGeneration, ...) and the finalizers free:
    now every key of the status but the conditions, and of the metadata but what the API
    server writes itself, is compared, both ways, whatever fields a Kubernetes has. (No CEL
    evaluator here: tests/e2e/test_chart_e2e.py runs the policy in a real API server.)"""
    (release,) = renders([({}, False)])
    (policy,) = [
        doc
        for doc in yaml.safe_load_all(release["manifest"])
        if doc
        and doc["kind"] == "ValidatingAdmissionPolicy"
        and doc["metadata"]["name"].endswith("-agent-conditions")
    ]
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["status"] == "has(object.status) ? dyn(object.status) : {}"
    assert variables["oldStatus"] == "has(oldObject.status) ? dyn(oldObject.status) : {}"
    assert variables["metadata"] == "dyn(object.metadata)"
    assert variables["oldMetadata"] == "dyn(oldObject.metadata)"
    fence = " ".join(policy["spec"]["validations"][1]["expression"].split())
    assert fence.startswith("variables.newOthers == variables.oldOthers && ")
    for new, old, own in (
        ("variables.status", "variables.oldStatus", "['conditions']"),
        ("variables.metadata", "variables.oldMetadata", "['resourceVersion', 'managedFields']"),
    ):
        assert f"&& {new}.all(k, k in {own} || (k in {old} && {new}[k] == {old}[k])) &&" in fence
        assert f"&& {old}.all(k, k in {own} || k in {new})" in fence
    # No field named one by one: what the fence names of a status is the conditions only.
    names = set(re.findall(r"[oO]bject\.status\.(\w+)", yaml.safe_dump(policy["spec"])))
    assert names == {"conditions"}, names


def test_the_agent_mounts_the_hosts_cgroup_tree_read_write_only_for_hard_limits(
    renders: Renders,
) -> None:
    """Issue 44, item 6: NVML opens the cgroup's directory in the agent's mount namespace
    and the driver writes the cgroup's `dmem.*` files and its ancestors' (NVIDIA's MPS v3
    page), which a read-only mount refuses. Hard limits off: no cgroup tree at all."""
    on, off = renders([({}, False), ({"agent": {"hardLimits": "off"}}, False)])

    def cgroup_mounts(release: Any) -> list[dict[str, Any]]:
        agent = _containers(release["manifest"])["agent"]
        return [m for m in agent["volumeMounts"] if m["name"] == "cgroup"]

    assert cgroup_mounts(on) == [{"name": "cgroup", "mountPath": "/host/sys/fs/cgroup"}]
    assert "--cgroup-root=/host/sys/fs/cgroup" in _containers(on["manifest"])["agent"]["args"]
    assert cgroup_mounts(off) == []
    assert "/sys/fs/cgroup" not in off["manifest"]


def test_the_allocation_gate_is_off_by_default_and_on_sets_both_programs_and_the_mount(
    renders: Renders,
) -> None:
    """Issue 45, step 2: one value turns it on for the webhook (which names the profile)
    and the agent (which writes it under the kubelet's seccomp root, mounted at the host's
    path, and listens); off, neither has a flag or the mount. The programs take what it
    renders (`_program_refusal`)."""
    off, on, forced = renders(
        [
            ({}, False),
            ({"allocationGate": {"enabled": True, "kubeletRoot": "/var/lib/k0s/kubelet"}}, False),
            ({"allocationGate": {"enabled": True, "unprovenDrivers": True}}, False),
        ]
    )
    for release, gated in ((off, False), (on, True), (forced, True)):
        arguments = _arguments(release["manifest"])
        assert ("--allocation-gate=on" in arguments["agent"]) is gated
        assert ("--allocation-gate=on" in arguments["webhook"]) is gated
        unproven = "--allocation-gate-unproven" in arguments["agent"]
        assert unproven is (release is forced)
        assert all(_program_refusal(args) is None for args in arguments.values())
    assert "--kubelet-root=/var/lib/k0s/kubelet" in _arguments(on["manifest"])["agent"]
    where = "/var/lib/k0s/kubelet/seccomp/vram-enforcer"
    agent = _containers(on["manifest"])["agent"]
    assert {"name": "seccomp", "mountPath": where} in agent["volumeMounts"]
    assert "seccomp/vram-enforcer" not in off["manifest"]
    assert "allocation gate is on" not in off["info"]["notes"]
    notes = on["info"]["notes"]  # what a restart and a stop do, and how to turn it off
    assert (
        "lets its allocation calls go on" in notes
        and "leaves the plain profile" in notes
        and "set allocationGate.enabled=false, then let the gated pods end or restart" in notes
    )
    (errors,) = renders([({"allocationGate": {"kubeletRoot": "var/lib/kubelet"}}, True)])
    assert "kubeletRoot" in errors
