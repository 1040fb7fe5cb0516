"""The webhook's mutation over realistic pods: each patch is applied with jsonpatch and the
result validated against the Kubernetes 1.29 OpenAPI schema (kubernetes-validate)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from enforcer.core.admission import (
    INJECTED,
    TOKEN_DIR,
    AdmissionSettings,
    BadReview,
    Denied,
    claim_template,
    format_quantity,
    mutate,
    review,
    sidecar_mode_for,
    templates_named,
)
from enforcer.core.declaration import Portion, parse_portions
from enforcer.core.model import Action
from enforcer.core.policy import PolicyConfig
from enforcer.core.tenancy import ALL_ACTIONS, REPORT_ONLY, Bounds, Tenancy

GiB = 1024**3
RES = "vram-enforcer.io/vram"
NATIVE = AdmissionSettings("ghcr.io/vram-enforcer/vram-enforcer:0.2.0", "native", RES, 1)
CONTAINER = AdmissionSettings("ghcr.io/vram-enforcer/vram-enforcer:0.2.0", "container", RES, 1)


def gpu(name: str, vram: str | None = "12Gi", **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3", **extra}
    if vram is not None:
        c.setdefault("resources", {}).setdefault("limits", {})[RES] = vram
    return c


def pod(
    *containers: dict[str, Any],
    init: list[dict[str, Any]] | None = None,
    name: str | None = "trainer-0",
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ml"}
    if name:
        meta["name"] = name
    if annotations:
        meta["annotations"] = annotations
    body: dict[str, Any] = {"containers": list(containers), **spec}
    if init:
        body["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": body}


def applied(
    p: dict[str, Any], settings: AdmissionSettings = NATIVE, namespace: str = ""
) -> dict[str, Any]:
    ops = mutate(p, settings, namespace)
    out: dict[str, Any] = jsonpatch.apply_patch(p, ops)
    kubernetes_validate.validate(out, "1.29", strict=True)
    return out


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# On every container of a pod the webhook mutates: no reservation through the toolkit's hook.
SOFT_0 = {"NVIDIA_GPU_MEMORY_REQUEST": "0"}


def sidecar_of(out: dict[str, Any]) -> dict[str, Any]:
    spec = out["spec"]
    (found,) = [
        c
        for c in spec.get("initContainers", []) + spec["containers"]
        if c["name"] == "vram-enforcer"
    ]
    return found


def test_a_bare_pod_gets_the_sidecar_first_among_init_containers() -> None:
    out = applied(pod(gpu("trainer")))
    spec = out["spec"]
    assert spec["shareProcessNamespace"] is True
    side = spec["initContainers"][0]
    assert side["name"] == "vram-enforcer" and side["restartPolicy"] == "Always"
    assert side["command"] == ["vram-enforcer", "sidecar"]
    env = env_of(side)
    assert json.loads(env["VRAM_ENFORCER_LIMITS"]) == {"trainer": 12 * GiB}
    assert env["VRAM_ENFORCER_CONTAINERS"] == "trainer"  # without the API: the only one
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["VRAM_ENFORCER_SIDECAR_MODE"] == "native"
    sc = side["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Its own socket, which the agent connects to: no hostPath, which `baseline` forbids.
    assert env["VRAM_ENFORCER_LISTEN"] == "/run/vram-enforcer/sidecar.sock"
    assert "VRAM_ENFORCER_AGENT_SOCKET" not in env
    # ... and no API token: an empty directory where ServiceAccount admission would mount one.
    assert side["volumeMounts"] == [
        {"name": "vram-enforcer-socket", "mountPath": "/run/vram-enforcer"},
        {
            "name": "vram-enforcer-no-token",
            "readOnly": True,
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
        },
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["vram-enforcer-socket"] == {
        "name": "vram-enforcer-socket",
        "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"},
    }
    assert volumes["vram-enforcer-no-token"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Ki"}
    assert not any("hostPath" in v for v in spec["volumes"])
    # The workload starts once the sidecar listens (it has closed itself to the workload by
    # then): the probe succeeds only when the socket exists.
    probe = side["startupProbe"]
    assert probe["periodSeconds"] == 1 and probe["exec"]["command"][:2] == ["python", "-c"]
    trainer = spec["containers"][0]
    assert env_of(trainer) == {
        "VRAM_LIMIT_BYTES": str(12 * GiB),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        **SOFT_0,
    }
    assert {"name": "vram-enforcer-shm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    assert volumes["vram-enforcer-shm"]["emptyDir"] == {"medium": "Memory"}  # no memory limit: none
    assert out["metadata"]["annotations"][INJECTED] == "true"
    assert out["metadata"]["labels"]["vram-enforcer.io/enforced"] == "true"


def test_a_deployments_pod_with_generate_name_and_no_name() -> None:
    p = pod(
        gpu(
            "server",
            "8Gi",
            resources={
                "limits": {RES: "8Gi", "memory": "32Gi", "cpu": "4"},
                "requests": {RES: "8Gi", "memory": "32Gi", "cpu": "4"},
            },
        ),
        name=None,
    )
    p["metadata"]["generateName"] = "vllm-7d9f8c6b5-"
    p["metadata"]["labels"] = {"app": "vllm", "pod-template-hash": "7d9f8c6b5"}
    p["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "vllm-7d9f8c6b5",
            "uid": "2d1c3b4a-0000-4000-8000-000000000001",
            "controller": True,
        }
    ]
    out = applied(p)
    assert out["metadata"]["labels"]["app"] == "vllm"
    assert env_of(sidecar_of(out))["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    shm = next(v for v in out["spec"]["volumes"] if v["name"] == "vram-enforcer-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_a_job_pod_in_container_mode_appends_the_sidecar() -> None:
    p = pod(gpu("train", "20Gi"), restartPolicy="Never")
    out = applied(p, CONTAINER)
    assert [c["name"] for c in out["spec"]["containers"]] == ["train", "vram-enforcer"]
    assert "restartPolicy" not in out["spec"]["containers"][1]
    assert "initContainers" not in out["spec"]
    assert env_of(out["spec"]["containers"][1])["VRAM_ENFORCER_SIDECAR_MODE"] == "container"


def test_init_containers_that_declare_vram_are_limited_too() -> None:
    warmup = gpu("compile-kernels", "4Gi")
    out = applied(pod(gpu("trainer"), init=[warmup]))
    names = [c["name"] for c in out["spec"]["initContainers"]]
    assert names == ["vram-enforcer", "compile-kernels"]  # the enforcer runs before them
    limits = json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"])
    assert limits == {"compile-kernels": 4 * GiB, "trainer": 12 * GiB}
    assert env_of(sidecar_of(out))["VRAM_ENFORCER_CONTAINERS"] == "compile-kernels,trainer"
    assert env_of(out["spec"]["initContainers"][1])["VRAM_LIMIT_BYTES"] == str(4 * GiB)


def test_existing_volumes_env_and_shm_mounts_are_kept() -> None:
    trainer = gpu(
        "trainer",
        env=[
            {"name": "XLA_PYTHON_CLIENT_PREALLOCATE", "value": "true"},
            {"name": "VRAM_LIMIT_BYTES", "value": "1"},
        ],
        volumeMounts=[
            {"name": "dshm", "mountPath": "/dev/shm/"},
            {"name": "data", "mountPath": "/data"},
        ],
    )
    helper = {
        "name": "logger",
        "image": "busybox",
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    p = pod(
        trainer,
        helper,
        volumes=[
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        ],
    )
    out = applied(p)
    t, h = out["spec"]["containers"]
    env = env_of(t)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"  # the user's choice stands
    assert env["VRAM_LIMIT_BYTES"] == str(12 * GiB)  # ours is authoritative
    assert [e["name"] for e in t["env"]].count("VRAM_LIMIT_BYTES") == 1
    assert [m["mountPath"] for m in t["volumeMounts"]] == ["/dev/shm/", "/data"]  # has its own
    assert {"name": "vram-enforcer-shm", "mountPath": "/dev/shm"} in h["volumeMounts"]
    assert env_of(h) == SOFT_0  # declares no VRAM
    assert [v["name"] for v in out["spec"]["volumes"]][:2] == ["dshm", "data"]


def test_several_gpu_containers_each_get_their_own_limit() -> None:
    out = applied(pod(gpu("a", "10Gi"), gpu("b", "2Gi"), gpu("c", None)))
    assert json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"]) == {
        "a": 10 * GiB,
        "b": 2 * GiB,
    }
    assert "VRAM_LIMIT_BYTES" not in env_of(out["spec"]["containers"][2])


def test_a_pod_that_declares_nothing_is_untouched() -> None:
    assert mutate(pod({"name": "web", "image": "nginx"}), NATIVE) == []


def test_opting_out_is_denied_unless_the_operator_allows_it() -> None:
    out = pod(gpu("trainer"), annotations={"vram-enforcer.io/inject": "false"})
    with pytest.raises(
        Denied,
        match=r"metadata.annotations\['vram-enforcer.io/inject'\]: 'false' "
        r"is not allowed in namespace 'ml': a pod that declares VRAM is held to it",
    ):
        mutate(out, NATIVE, "ml")
    research = Tenancy(Bounds(), {"research": Bounds(allow_opt_out=True)})
    lenient = dataclasses.replace(NATIVE, tenancy=research)
    assert mutate(out, lenient, "research") == []
    with pytest.raises(Denied):
        mutate(out, lenient, "ml")
    everywhere = dataclasses.replace(NATIVE, tenancy=Tenancy(Bounds(allow_opt_out=True)))
    assert mutate(out, everywhere, "ml") == []


@pytest.mark.parametrize(
    ("annotation", "value", "message"),
    [
        (
            "action",
            "warn",
            "'warn' is not allowed in namespace 'ml'; the operator allows: terminate, kill, restart",
        ),
        (
            "grace-period",
            "31s",
            "'31s' is longer than the 30s allowed in namespace 'ml'; use at most 30s",
        ),
        ("grace-period", "9" * 400 + "s", "is too long; a duration is at most 2562047h"),
    ],
)
def test_a_pod_cannot_loosen_enforcement_past_the_operators_bounds(
    annotation: str, value: str, message: str
) -> None:
    p = pod(gpu("trainer"), annotations={f"vram-enforcer.io/{annotation}": value})
    with pytest.raises(
        Denied, match=re.escape(f"metadata.annotations['vram-enforcer.io/{annotation}']")
    ) as info:
        mutate(p, NATIVE, "ml")
    assert message in str(info.value)
    loose = Tenancy(Bounds(), {"ml": Bounds(actions=ALL_ACTIONS, max_grace_period=60)})
    if "is too long" not in message:  # within the namespace's own bounds, it is admitted
        out = jsonpatch.apply_patch(p, mutate(p, dataclasses.replace(NATIVE, tenancy=loose), "ml"))
        assert (
            env_of(sidecar_of(out))[f"VRAM_ENFORCER_{annotation.upper().replace('-', '_')}"]
            == value
        )


def test_an_injected_annotation_does_not_skip_injection() -> None:
    forged = pod(gpu("trainer"), annotations={INJECTED: "true"})
    out = applied(forged)
    assert sidecar_of(out)["image"] == NATIVE.sidecar_image


def test_a_forged_sidecar_its_volumes_and_an_unshared_namespace_are_replaced_by_ours() -> None:
    """Nothing a pod says proves it enforced: every part of the mutation is asserted again,
    in place. A pod that carries a sidecar of our image but set to warn, in the wrong list,
    with a socket that is not the agent's and no shared PID namespace, gets ours."""
    genuine = applied(pod(gpu("trainer")))
    forged = copy.deepcopy(genuine)
    side = forged["spec"]["initContainers"].pop(0)
    side["env"] = [{"name": "VRAM_ENFORCER_ACTION", "value": "warn"}]
    side["securityContext"] = {"runAsUser": 1000}
    del side["restartPolicy"]
    forged["spec"]["containers"].append(side)
    forged["spec"]["shareProcessNamespace"] = False
    for volume in forged["spec"]["volumes"]:
        if volume["name"] == "vram-enforcer-socket":
            volume.clear()
            volume.update({"name": "vram-enforcer-socket", "emptyDir": {}})
    out = applied(forged)
    assert out["spec"]["shareProcessNamespace"] is True
    assert sidecar_of(out) == sidecar_of(genuine)
    assert out["spec"]["initContainers"][0]["name"] == "vram-enforcer"
    assert [c["name"] for c in out["spec"]["containers"]] == ["trainer"]
    assert out["spec"]["volumes"] == genuine["spec"]["volumes"]
    assert mutate(out, NATIVE) == []


def test_a_sidecar_the_pod_declared_after_its_own_init_containers_is_moved_first() -> None:
    """A native sidecar runs only once the init containers before it have: a pod that
    names its own `vram-enforcer` third would run two init containers unwatched."""
    genuine = applied(pod(gpu("trainer")))
    forged = copy.deepcopy(genuine)
    side = forged["spec"]["initContainers"].pop(0)
    setup = [{"name": n, "image": "x", "resources": {"limits": {RES: "1Gi"}}} for n in ("a", "b")]
    forged["spec"]["initContainers"] = [*setup, side]
    out = applied(forged)
    assert [c["name"] for c in out["spec"]["initContainers"]] == ["vram-enforcer", "a", "b"]
    assert sidecar_of(out)["image"] == sidecar_of(genuine)["image"]
    assert mutate(out, NATIVE) == []


def test_a_container_named_like_the_sidecar_with_another_image_is_denied() -> None:
    with pytest.raises(Denied, match="a container is already named 'vram-enforcer'"):
        mutate(pod(gpu("trainer"), {"name": "vram-enforcer", "image": "evil"}), NATIVE)


def test_requests_alone_count_as_declaring() -> None:
    c = {"name": "t", "image": "x", "resources": {"requests": {RES: "1Gi"}}}
    with pytest.raises(
        Exception, match=r"requests\['vram-enforcer.io/vram'\] is set but limits is not"
    ):
        mutate(pod(c), NATIVE)


def test_resource_unit_scales_the_limit_and_refuses_fractions() -> None:
    gb = AdmissionSettings("img", "native", "ggaman.com/vram", GiB)
    c = {"name": "t", "image": "x", "resources": {"limits": {"ggaman.com/vram": "3"}}}
    out = applied(pod(c), gb)
    assert json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"]) == {"t": 3 * GiB}
    c["resources"]["limits"]["ggaman.com/vram"] = "1500m"
    with pytest.raises(
        Exception,
        match=r"'1500m' is not a whole number of 1073741824-byte units; use a whole number, e.g. 2",
    ):
        mutate(pod(c), gb)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"spec": {"hostPID": True}},
            "spec.hostPID: true cannot be combined with the shared process namespace",
        ),
        (
            {"annotations": {"vram-enforcer.io/action": "explode"}},
            "metadata.annotations['vram-enforcer.io/action']: 'explode' is not an action; use one of: terminate, kill, restart, warn",
        ),
        (
            {"annotations": {"vram-enforcer.io/grace-period": "5"}},
            "metadata.annotations['vram-enforcer.io/grace-period']: '5' is not a duration; use a duration with a unit, such as 100ms, 5s, 1m30s or 2h (did you mean 5s?)",
        ),
        (
            {"annotations": {"vram-enforcer.io/warn-at": "0.9"}},
            "metadata.annotations['vram-enforcer.io/warn-at']: '0.9' is not a percentage",
        ),
        (
            {"annotations": {"vram-enforcer.io/shm-size": "lots"}},
            "metadata.annotations['vram-enforcer.io/shm-size']: 'lots' is not a quantity",
        ),
        (
            {"requests": "8Gi"},
            "spec.containers['trainer'].resources: requests['vram-enforcer.io/vram'] '8Gi' differs from limits '12Gi'",
        ),
        (
            {"limit": "12GB"},
            "'12GB' is not a quantity; use a Kubernetes quantity such as 4Gi, 512Mi, 8G or 4294967296 (bytes) (did you mean 12Gi",
        ),
        ({"limit": "0.5"}, "is not a whole number of bytes"),
        ({"second": "vram-enforcer"}, "a container is already named 'vram-enforcer'"),
    ],
)
def test_denials_name_the_field_the_value_and_the_fix(change: dict[str, Any], message: str) -> None:
    c = gpu("trainer", change.get("limit", "12Gi"))
    if "requests" in change:
        c["resources"]["requests"] = {RES: change["requests"]}
    containers = [c] + ([{"name": change["second"], "image": "x"}] if "second" in change else [])
    p = pod(*containers, annotations=change.get("annotations"), **change.get("spec", {}))
    out = review(admission_review(p), NATIVE)
    assert out.result == "denied"
    response = out.review["response"]
    assert response["allowed"] is False
    assert message in response["status"]["message"]


def test_annotations_become_the_sidecars_settings() -> None:
    out = applied(
        pod(
            gpu("t"),
            annotations={
                "vram-enforcer.io/action": "restart",
                "vram-enforcer.io/grace-period": "30s",
                "vram-enforcer.io/warn-at": "80%",
                "vram-enforcer.io/shm-size": "2Gi",
            },
        )
    )
    env = env_of(sidecar_of(out))
    assert (
        env["VRAM_ENFORCER_ACTION"],
        env["VRAM_ENFORCER_GRACE_PERIOD"],
        env["VRAM_ENFORCER_WARN_AT"],
    ) == ("restart", "30s", "80%")
    shm = next(v for v in out["spec"]["volumes"] if v["name"] == "vram-enforcer-shm")
    assert shm["emptyDir"]["sizeLimit"] == "2Gi"


def test_the_sidecar_takes_no_port_and_the_metrics_port_annotation_is_ignored_with_a_warning() -> (
    None
):
    """The agent serves every pod's metrics: the sidecar listens on no port, so a pod that
    declares every port from 9477 is admitted, and 0.1.0's annotation is said to do nothing
    (kubectl prints the warning), never denied."""
    busy = gpu("t", ports=[{"containerPort": p} for p in range(9477, 9490)])
    side = sidecar_of(applied(pod(busy)))
    assert "ports" not in side and "VRAM_ENFORCER_METRICS_PORT" not in env_of(side)
    assert "warnings" not in review(admission_review(pod(busy)), NATIVE).review["response"]
    for value in ("9100", "http"):
        annotated = pod(gpu("t"), annotations={"vram-enforcer.io/metrics-port": value})
        out = review(admission_review(annotated), NATIVE)
        assert out.result == "patched" and "ports" not in sidecar_of(applied(annotated))
        (warning,) = out.review["response"]["warnings"]
        assert warning.startswith(
            "metadata.annotations['vram-enforcer.io/metrics-port'] is "
            "ignored: since 0.2.0 the sidecar serves no metrics"
        )
    # A pod the webhook leaves alone is told nothing.
    plain = pod({"name": "t", "image": "x"}, annotations={"vram-enforcer.io/metrics-port": "1"})
    assert "warnings" not in review(admission_review(plain), NATIVE).review["response"]


def test_shm_off_and_no_framework_env() -> None:
    s = AdmissionSettings("img", "native", RES, 1, framework_env=False, shm_default="off")
    out = applied(pod(gpu("t")), s)
    assert env_of(out["spec"]["containers"][0]) == {"VRAM_LIMIT_BYTES": str(12 * GiB), **SOFT_0}
    assert "volumeMounts" not in out["spec"]["containers"][0]


def test_toolkit_memory_limits_are_whole_mib_per_gpu_with_soft_0() -> None:
    """Read by the NVIDIA container toolkit's apply-cuda-memory-limits hook, which sets
    nothing unless both are there, soft = the request and hard = the limit in MiB, one
    value on each of the container's GPUs. Soft is 0: the driver adds a soft limit to every
    ancestor as a reservation that outlives the container's cgroup."""
    s = AdmissionSettings("img", "native", RES, 1, toolkit_limits=True)
    odd = gpu("odd", str(12 * GiB + 5))
    out = applied(pod(gpu("t"), odd, gpu("cpu-only", None)), s)
    t, o, c = out["spec"]["containers"][:3]
    assert (env_of(t)["NVIDIA_GPU_MEMORY_REQUEST"], env_of(t)["NVIDIA_GPU_MEMORY_LIMIT"]) == (
        "0",
        "12288",
    )
    assert env_of(o)["NVIDIA_GPU_MEMORY_LIMIT"] == "12288"  # rounded down: never above it
    assert env_of(c) == SOFT_0
    assert mutate(out, s) == []  # a second pass changes nothing
    default = applied(pod(gpu("t")))  # off by default: the hook fails containers on old drivers
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in env_of(default["spec"]["containers"][0])


def test_a_share_spread_over_gpus_is_one_share_in_the_toolkits_limit() -> None:
    """KAI's gpu-fraction-num-devices: 2 GPUs with 2048 MiB on each. The hook applies the one
    value on each GPU: the sum (4096) would let the container hold twice its share."""
    s = dataclasses.replace(KAI, toolkit_limits=True)
    p = pod(gpu("main", None), annotations={"gpu-memory": "2048", "gpu-fraction-num-devices": "2"})
    main = applied(p, s)["spec"]["containers"][0]
    assert env_of(main)["VRAM_LIMIT_BYTES"] == str(4 * GiB)  # what the workload is told: all
    assert (env_of(main)["NVIDIA_GPU_MEMORY_REQUEST"], env_of(main)["NVIDIA_GPU_MEMORY_LIMIT"]) == (
        "0",
        "2048",
    )


TENANTS_OWN = [
    {"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": "81920"},
    {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "81920"},
    {"name": "KEEP", "value": "1"},
    {"name": "NVIDIA_GPU_MEMORY_LIMIT", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "81920"},
]


@pytest.mark.parametrize("toolkit", [True, False])
def test_no_container_sets_its_own_limit_through_the_toolkits_hook(toolkit: bool) -> None:
    """A tenant that writes the hook's variables into its pod would have NVIDIA's hook set
    its GPU limit at 80 GiB before the agent sees the container, and the agent defers to a
    limit it did not set. Every container of a pod the webhook mutates, declaring or not,
    init containers too, gets the webhook's values or none: every copy of the tenant's goes
    (the kubelet gives a container the last of a name)."""
    s = AdmissionSettings("img", "native", RES, 1, toolkit_limits=toolkit)

    def owning(c: dict[str, Any]) -> dict[str, Any]:
        return {**c, "env": copy.deepcopy(TENANTS_OWN)}

    p = pod(
        owning(gpu("t")),
        owning(gpu("helper", None)),
        init=[owning(gpu("warmup", "1Gi"))],
    )
    out = applied(p, s)
    spec = out["spec"]
    wanted = {"t": "12288", "helper": None, "warmup": "1024"} if toolkit else {}
    for c in spec["initContainers"] + spec["containers"]:
        if c["name"] == "vram-enforcer":
            continue
        limits = [e for e in c["env"] if e["name"].startswith("NVIDIA_GPU_MEMORY_")]
        soft = [{"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": "0"}]
        if wanted.get(c["name"]) is None:
            assert limits == soft, c["name"]
        else:
            assert limits == [
                *soft,
                {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": wanted[c["name"]]},
            ], c["name"]
        assert env_of(c)["KEEP"] == "1"  # the rest of its environment is its own
    assert mutate(out, s) == []  # a second pass changes nothing


@pytest.mark.parametrize("toolkit", [True, False])
def test_no_reservation_reaches_the_toolkits_hook_from_env_from_or_the_image(toolkit: bool) -> None:
    """The hook sets soft = NVIDIA_GPU_MEMORY_REQUEST, the `dmem.min` reservation the
    driver adds to every ancestor and that leaks when the runtime deletes the cgroup: a
    crash-looping container given it by `envFrom` or its image would reserve without bound.
    A container's `env` wins over both, so every container the webhook mutates, whatever it
    declares and with the flag on or off, gets exactly one soft 0 there, and no hard limit
    but ours."""
    s = AdmissionSettings("img", "native", RES, 1, toolkit_limits=toolkit)
    from_config = {"envFrom": [{"configMapRef": {"name": "tenant-hook-values"}}]}
    p = pod(
        {**gpu("t"), **from_config},
        {**gpu("helper", None), **from_config},
        init=[{**gpu("warmup", None), **from_config}],
    )
    spec = applied(p, s)["spec"]
    for c in spec["initContainers"] + spec["containers"]:
        if c["name"] == "vram-enforcer":
            continue
        hook = [e for e in c["env"] if e["name"].startswith("NVIDIA_GPU_MEMORY_")]
        assert hook[0] == {"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": "0"}, c["name"]
        ours = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "12288"}]
        assert hook[1:] == (ours if toolkit and c["name"] == "t" else []), c["name"]
        assert c["envFrom"] == from_config["envFrom"]  # the rest of it stays the tenant's


def test_a_debugging_container_sets_no_limit_of_its_own_through_the_toolkits_hook() -> None:
    """`kubectl debug` adds an ephemeral container with a GPU given by its environment (the
    NVIDIA runtime's NVIDIA_VISIBLE_DEVICES) to an injected pod: it gets none of the hook's
    variables."""
    added = {**debugger(), "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    added["env"] += copy.deepcopy(TENANTS_OWN)
    doc = ephemeral_review(INJECTED_POD, added)
    out = review(doc, NATIVE)
    ops = json.loads(base64.b64decode(out.review["response"]["patch"]))
    (debug,) = jsonpatch.apply_patch(doc["request"]["object"], ops)["spec"]["ephemeralContainers"]
    assert env_of(debug) == {"NVIDIA_VISIBLE_DEVICES": "all", "KEEP": "1", **SOFT_0}


def test_gpu_exposure_env_and_runtime_class() -> None:
    s = AdmissionSettings("img", "native", RES, 1, gpu_exposure="env", runtime_class="nvidia")
    plugin = gpu("plugin")
    plugin["resources"]["limits"]["nvidia.com/gpu"] = "1"
    out = applied(pod(gpu("t"), gpu("cpu-only", None), plugin), s)
    env = env_of(out["spec"]["containers"][0])
    assert (
        env["NVIDIA_VISIBLE_DEVICES"] == "all"
        and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    )
    assert env_of(out["spec"]["containers"][1]) == SOFT_0
    # The device plugin's assignment stands for a container that asks for nvidia.com/gpu.
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(out["spec"]["containers"][2])
    assert out["spec"]["runtimeClassName"] == "nvidia"


def test_the_sidecar_gets_no_token_whether_or_not_the_pod_mounts_one() -> None:
    for automount in (True, False):
        out = service_account_admission(
            applied(pod(gpu("t"), automountServiceAccountToken=automount))
        )
        (mount,) = [m for m in sidecar_of(out)["volumeMounts"] if m["mountPath"] == TOKEN_DIR]
        assert mount["name"] == "vram-enforcer-no-token", automount
        assert not any(
            "projected" in v and v["name"].startswith("vram-enforcer")
            for v in out["spec"]["volumes"]
        )
        workload = {m["mountPath"]: m["name"] for m in out["spec"]["containers"][0]["volumeMounts"]}
        assert workload.get(TOKEN_DIR) == ("kube-api-access-x7k2p" if automount else None)


def test_a_second_pass_changes_nothing() -> None:
    once = applied(pod(gpu("t")))
    assert mutate(once, NATIVE) == []


def test_the_patch_is_made_at_the_paths_it_changes_with_keys_escaped() -> None:
    """The patch is built as the pod is changed, one operation at each path that changes,
    never as a diff of the whole pod; a map or list that is absent (or null) is added whole.
    `/` and `~` in a key are escaped (RFC 6901), and the pod as sent is never written."""
    p = pod(gpu("trainer", env=None), annotations={"example.com/team": "a"})
    ops = mutate(p, NATIVE)
    assert [(op["op"], op["path"]) for op in ops] == [
        ("add", "/spec/shareProcessNamespace"),
        ("add", "/spec/containers/0/securityContext"),  # {"capabilities": {"drop": ["KILL"]}}
        ("replace", "/spec/containers/0/env"),  # null: replaced with our variables
        ("add", "/spec/containers/0/env/1"),
        ("add", "/spec/containers/0/env/2"),
        ("add", "/spec/containers/0/env/3"),  # soft 0 for the toolkit's hook
        ("add", "/spec/volumes"),
        ("add", "/spec/containers/0/volumeMounts"),
        ("add", "/spec/volumes/1"),
        ("add", "/spec/volumes/2"),
        ("add", "/spec/initContainers"),
        ("add", "/metadata/annotations/vram-enforcer.io~1injected"),
        ("add", "/metadata/labels"),
    ]
    assert p == pod(gpu("trainer", env=None), annotations={"example.com/team": "a"})
    # DRA: the resource leaves the container's limits by its name.
    odd = dataclasses.replace(DRA, resource_name="example.com/v~ram")
    c = {
        "name": "t",
        "image": "x",
        "resources": {"limits": {"example.com/v~ram": "1Gi", "cpu": "1"}},
    }
    ops = mutate(pod(c), odd)
    assert {
        "op": "remove",
        "path": "/spec/containers/0/resources/limits/example.com~1v~0ram",
    } in ops
    assert jsonpatch.apply_patch(pod(c), ops)["spec"]["containers"][0]["resources"] == {
        "limits": {"cpu": "1"},
        "claims": [{"name": "vram-t"}],
    }


def test_a_declaring_pod_of_3_mib_costs_a_review_about_what_decoding_it_does() -> None:
    """A diff of the whole pod (`jsonpatch.make_patch`) took about 20 times the CPU of
    decoding it: 0.9 s for this pod here, 5 s in the report of issue 35, so a few creates
    at once starved admission. The review is linear in the pod now, and copies only the
    maps and lists it changes."""
    padding = [{"name": f"PAD_{i:06}", "value": "x" * 8} for i in range(69_800)]
    body = json.dumps(admission_review(pod(gpu("trainer", env=padding)))).encode()
    assert 3 * 2**20 - 2**16 < len(body) <= 3 * 2**20  # the API server's limit
    doc = json.loads(body)

    def cpu(work: Callable[[], object]) -> float:
        spent = []
        for _ in range(3):
            started = time.process_time()
            work()
            spent.append(time.process_time() - started)
        return min(spent)

    decoding = cpu(lambda: json.loads(body))
    reviewing = cpu(lambda: review(doc, NATIVE))
    assert reviewing < 3 * decoding, f"{reviewing:.3f} s against {decoding:.3f} s to decode"
    assert review(doc, NATIVE).result == "patched"
    assert doc == json.loads(body)  # read, never written


def test_what_the_webhook_writes_is_read_back_by_the_sidecars_own_parser() -> None:
    """The sidecar's environment is read with the sidecar's settings parser before the pod
    is admitted: what the two would disagree on is denied, not a pod whose sidecar refuses
    to start. (`auto` is resolved when the webhook starts, never written.)"""
    broken = dataclasses.replace(NATIVE, sidecar_mode="auto")
    with pytest.raises(
        Denied,
        match=re.escape(
            "the sidecar would refuse its settings as this pod's metadata.annotations and spec "
            "make them: VRAM_ENFORCER_SIDECAR_MODE: 'auto' is not a choice"
        ),
    ):
        mutate(pod(gpu("t")), broken)


def test_two_containers_named_like_the_sidecar_are_denied() -> None:
    """Never an earlier pass's (a pod's container names are unique), and each would be one
    more operation in the patch: 40,000 of them, in 3 MiB, made a patch of 2.8 MB."""
    forged = {"name": "vram-enforcer", "image": NATIVE.sidecar_image}
    with pytest.raises(
        Denied,
        match=re.escape(
            "spec: 2 containers are named 'vram-enforcer', the name of the enforcer's sidecar; a "
            "pod's container names are unique: remove them"
        ),
    ):
        mutate(pod(gpu("t"), forged, init=[forged]), NATIVE)


def admission_review(obj: Any, operation: str = "CREATE", kind: str = "Pod") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "namespace": "ml",
            "object": obj,
        },
    }


def test_a_review_carries_a_base64_json_patch() -> None:
    p = pod(gpu("t"))
    out = review(admission_review(p), NATIVE)
    response = out.review["response"]
    assert out.result == "patched"
    assert (
        out.review["apiVersion"] == "admission.k8s.io/v1"
        and out.review["kind"] == "AdmissionReview"
    )
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    assert jsonpatch.apply_patch(copy.deepcopy(p), ops)["spec"]["shareProcessNamespace"] is True


@pytest.mark.parametrize(
    ("doc", "result"),
    [
        (admission_review(pod(gpu("t")), operation="UPDATE"), "skipped"),
        (admission_review({"metadata": {}}, kind="Deployment"), "skipped"),
        ({**admission_review(pod(gpu("t"))), "apiVersion": "admission.k8s.io/v1beta1"}, "invalid"),
        (admission_review(["not", "a", "pod"]), "invalid"),
    ],
)
def test_other_reviews(doc: dict[str, Any], result: str) -> None:
    out = review(doc, NATIVE)
    assert out.result == result
    assert out.review["response"]["uid"] == doc["request"]["uid"]
    assert "patch" not in out.review["response"]


@pytest.mark.parametrize("doc", [None, [], {}, {"request": {}}, {"request": {"uid": 7}}, "x"])
def test_no_uid_is_a_bad_review(doc: object) -> None:
    with pytest.raises(BadReview):
        review(doc, NATIVE)


def test_format_quantity_and_versions() -> None:
    assert format_quantity(8 * GiB) == "8Gi"
    assert format_quantity(1536 * 1024**2) == "1536Mi"
    assert format_quantity(1000) == "1000"
    assert sidecar_mode_for("v1.29.3") == "native"
    assert sidecar_mode_for("v1.30.0-eks-1234") == "native"
    assert sidecar_mode_for("v1.28.9+k3s1") == "container"
    assert sidecar_mode_for("v1.20.2") == "container"
    with pytest.raises(ValueError, match="cannot read a Kubernetes version"):
        sidecar_mode_for("unknown")


# --- DRA mode: declared VRAM becomes a claim placed per GPU --------------------------------

DRA = dataclasses.replace(NATIVE, dra_class="gpu.nvidia.com")


def applied_dra(p: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = jsonpatch.apply_patch(p, mutate(p, DRA))
    kubernetes_validate.validate(out, "1.36", strict=True)  # resourceClaims by template name
    return out


def test_dra_mode_turns_the_declaration_into_a_claim_from_the_template_of_its_size() -> None:
    trainer = gpu("trainer", "16Gi")
    trainer["resources"]["limits"]["cpu"] = "2"
    trainer["resources"]["requests"] = {RES: "16Gi", "cpu": "1"}
    out = applied_dra(pod(trainer, gpu("helper", "512Mi"), gpu("plain", None)))
    spec = out["spec"]
    assert spec["resourceClaims"] == [
        {"name": "vram-trainer", "resourceClaimTemplateName": "vram-enforcer-16gi"},
        {"name": "vram-helper", "resourceClaimTemplateName": "vram-enforcer-512mi"},
    ]
    first, second, plain = spec["containers"]
    # the extended resource is gone (the scheduler places by the claim); the rest stays
    assert first["resources"] == {
        "limits": {"cpu": "2"},
        "requests": {"cpu": "1"},
        "claims": [{"name": "vram-trainer"}],
    }
    assert second["resources"] == {"claims": [{"name": "vram-helper"}]}
    assert "resources" not in plain
    assert env_of(first)["VRAM_LIMIT_BYTES"] == str(16 * GiB)
    sidecar = env_of(sidecar_of(out))
    assert sidecar["VRAM_ENFORCER_LIMITS_FROM"] == "dra"
    # how the sidecar tells a GPU allocation: the webhook's own settings, passed on
    assert (
        sidecar["VRAM_ENFORCER_DRA_DRIVERS"],
        sidecar["VRAM_ENFORCER_DRA_UUID_ATTRIBUTE"],
        sidecar["VRAM_ENFORCER_DRA_CAPACITY"],
    ) == ("gpu.nvidia.com", "uuid", "memory")
    other = dataclasses.replace(DRA, dra_drivers=("gpu.example.com", "b.example.com"))
    out = jsonpatch.apply_patch(trainer_pod := pod(gpu("t", "1Gi")), mutate(trainer_pod, other))
    assert env_of(sidecar_of(out))["VRAM_ENFORCER_DRA_DRIVERS"] == "gpu.example.com,b.example.com"


def test_dra_mode_turns_a_declaration_of_0_into_no_claim() -> None:
    """0 asks for no GPU: a claim of 0 bytes would still be given a share of one."""
    out = applied_dra(pod(gpu("trainer", "16Gi"), gpu("none", "0")))
    assert out["spec"]["resourceClaims"] == [
        {"name": "vram-trainer", "resourceClaimTemplateName": "vram-enforcer-16gi"}
    ]
    assert out["spec"]["containers"][1]["resources"] == {"limits": {RES: "0"}}  # fits any node
    assert json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"]) == {
        "trainer": 16 * GiB,
        "none": 0,
    }
    assert mutate(out, DRA) == []  # and a second pass, which finds only the claim, agrees


def test_dra_mode_enforces_pods_with_claims_made_by_hand() -> None:
    by_hand = pod(
        {"name": "app", "image": "x", "resources": {"claims": [{"name": "gpu"}]}},
        resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "my-16gi"}],
    )
    out = applied_dra(by_hand)
    assert out["spec"]["resourceClaims"] == by_hand["spec"]["resourceClaims"]  # as written
    assert env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS_FROM"] == "dra"
    assert out["spec"]["shareProcessNamespace"] is True
    assert mutate(by_hand, NATIVE) == []  # per-node mode: claims are not ours


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("pod", "x", "spec.resourceClaims"),
        ("pod", ["x"], "spec.resourceClaims[0]"),
        ("container", "y", "spec.containers['app'].resources.claims"),
        ("container", [3], "spec.containers['app'].resources.claims[0]"),
    ],
)
def test_dra_mode_denies_claims_of_the_wrong_shape_naming_the_field(
    where: str, value: object, field: str
) -> None:
    """DRA mode adds to both lists: a string there once crashed the review (HTTP 500, which
    `failurePolicy: Ignore` admits unenforced)."""
    app: dict[str, Any] = gpu("app", "4Gi")
    p = pod(app)
    if where == "pod":
        p["spec"]["resourceClaims"] = value
    else:
        app["resources"]["claims"] = value
    with pytest.raises(Denied, match=re.escape(f"{field}: ")):
        mutate(p, DRA)


def test_the_templates_a_stored_pod_names_and_what_they_claim() -> None:
    """Made from pods the API holds, never from what an admission request says."""
    stored = applied_dra(pod(gpu("a", "16Gi"), gpu("b", "16Gi"), gpu("c", "1Gi"), gpu("d", "0")))
    names = [t["metadata"]["name"] for t in templates_named(stored, DRA)]  # type: ignore[index]
    assert names == ["vram-enforcer-1gi", "vram-enforcer-16gi"]  # one per size; none for 0
    assert {t["metadata"]["namespace"] for t in templates_named(stored, DRA)} == {"ml"}  # type: ignore[index]
    assert templates_named(stored, NATIVE) == []
    by_hand = pod(
        {"name": "x", "image": "x", "resources": {"claims": [{"name": "g"}]}},
        resourceClaims=[{"name": "g", "resourceClaimTemplateName": "mine-16gi"}],
    )
    assert templates_named(by_hand, DRA) == []  # not ours to make
    template = claim_template("ml", 16 * GiB, DRA)
    kubernetes_validate.validate(template, "1.36", strict=True)
    (request,) = template["spec"]["spec"]["devices"]["requests"]  # type: ignore[index]
    assert request == {
        "name": "vram",
        "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "capacity": {"requests": {"memory": "16Gi"}},
        },
    }


def service_account_admission(p: dict[str, Any]) -> dict[str, Any]:
    """What the API server's ServiceAccount admission does, and does again after a webhook
    changed the pod: a projected token volume, mounted into every container."""
    out = copy.deepcopy(p)
    spec = out["spec"]
    if spec.get("automountServiceAccountToken") is False:
        return out
    if not any(v["name"].startswith("kube-api-access-") for v in spec.get("volumes", [])):
        spec.setdefault("volumes", []).append(
            {
                "name": "kube-api-access-x7k2p",
                "projected": {
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}
                    ]
                },
            }
        )
    for c in spec.get("initContainers", []) + spec["containers"]:
        mounts = c.setdefault("volumeMounts", [])
        if not any(
            m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in mounts
        ):
            mounts.append(
                {
                    "name": "kube-api-access-x7k2p",
                    "readOnly": True,
                    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                }
            )
    return out


def test_service_account_admission_finds_nothing_to_add_after_the_webhook() -> None:
    """The API server runs its own mutating plugins again after a webhook changed the pod,
    and calls the webhook again if they changed it (reinvocationPolicy IfNeeded). The
    sidecar's empty mount at the token's path leaves ServiceAccount admission nothing to
    add: one review per pod, not two (found by the creation-storm benchmark)."""
    once = applied(service_account_admission(pod(gpu("t"))))
    assert service_account_admission(once) == once
    assert mutate(once, NATIVE) == []
    # ... and nothing a pod adds to the sidecar of its own, such as code mounted over ours
    forged = copy.deepcopy(once)
    forged["spec"]["volumes"].append({"name": "mine", "emptyDir": {}})
    sidecar_of(forged)["volumeMounts"].append({"name": "mine", "mountPath": "/opt/venv"})
    sidecar_of(forged)["envFrom"] = [{"configMapRef": {"name": "warn-please"}}]
    assert sidecar_of(applied(forged)) == sidecar_of(once)


BURSTY = dataclasses.replace(NATIVE, tenancy=Tenancy(Bounds(max_ceiling=40 * GiB)))
CEILING = "vram-enforcer.io/vram-ceiling"


def test_a_ceiling_goes_to_the_sidecar_and_tells_the_workload_both_amounts() -> None:
    s = dataclasses.replace(BURSTY, toolkit_limits=True)
    out = applied(pod(gpu("trainer", "4Gi"), annotations={CEILING: "16Gi"}), s)
    side, trainer = env_of(sidecar_of(out)), env_of(out["spec"]["containers"][0])
    assert json.loads(side["VRAM_ENFORCER_CEILINGS"]) == {"trainer": 16 * GiB}
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {"trainer": 4 * GiB}  # the request
    assert trainer["VRAM_LIMIT_BYTES"] == str(16 * GiB)
    assert trainer["VRAM_REQUEST_BYTES"] == str(4 * GiB)
    # The container toolkit's hook: soft 0 (the agent lends and reclaims), hard = the
    # ceiling (MiB).
    assert (trainer["NVIDIA_GPU_MEMORY_REQUEST"], trainer["NVIDIA_GPU_MEMORY_LIMIT"]) == (
        "0",
        "16384",
    )
    assert mutate(out, s) == []  # a second pass changes nothing


def test_ceilings_by_name_and_one_equal_to_the_request_borrows_nothing() -> None:
    p = pod(
        gpu("a", "4Gi"), gpu("b", "8Gi"), gpu("cpu", None), annotations={CEILING: "a=10Gi, b=8Gi"}
    )
    side = env_of(sidecar_of(applied(p, BURSTY)))
    assert json.loads(side["VRAM_ENFORCER_CEILINGS"]) == {"a": 10 * GiB}
    # No annotation: exactly what a pod got before ceilings existed.
    plain = applied(pod(gpu("a", "4Gi")), BURSTY)
    assert "VRAM_ENFORCER_CEILINGS" not in env_of(sidecar_of(plain))
    assert "VRAM_REQUEST_BYTES" not in env_of(plain["spec"]["containers"][0])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "2Gi",
            "'trainer': '2Gi' is below the container's request of 4.00 GiB (its resources.limits)",
        ),
        (
            "41Gi",
            "is above what is allowed in namespace 'ml': the operator allows ceilings up to 40.00 GiB",
        ),
        ("lots", "'trainer': 'lots' is not a quantity"),
        ("", "is empty; use 20Gi (a pod with one container that declares VRAM)"),
        (
            "server=8Gi",
            "names container 'server', which declares no VRAM; a ceiling is for a container that declares it (trainer)",
        ),
        ("trainer=8Gi,trainer=9Gi", "'trainer=9Gi' is given twice"),
        ("trainer=8Gi,server", "'server' is not name=quantity"),
    ],
)
def test_bad_ceilings_are_denied_naming_the_annotation_the_value_and_the_fix(
    value: str, message: str
) -> None:
    with pytest.raises(Denied, match=re.escape(f"metadata.annotations[{CEILING!r}]")) as info:
        mutate(pod(gpu("trainer", "4Gi"), annotations={CEILING: value}), BURSTY, "ml")
    assert message in str(info.value)


def test_borrowing_is_off_until_the_operator_allows_it_and_one_value_needs_one_container() -> None:
    with pytest.raises(Denied, match="the operator allows no borrowing above requests"):
        mutate(pod(gpu("trainer", "4Gi"), annotations={CEILING: "8Gi"}), NATIVE, "ml")
    two = pod(gpu("a", "4Gi"), gpu("b", "4Gi"), annotations={CEILING: "8Gi"})
    with pytest.raises(Denied, match=r"names no container, and 2 containers declare VRAM \(a, b\)"):
        mutate(two, BURSTY, "ml")
    research = Tenancy(Bounds(), {"research": Bounds(max_ceiling=80 * GiB)})
    out = mutate(
        pod(gpu("trainer", "4Gi"), annotations={CEILING: "80Gi"}),
        dataclasses.replace(NATIVE, tenancy=research),
        "research",
    )
    assert out


def test_in_dra_mode_the_claim_is_the_request_and_the_ceiling_goes_to_the_sidecar() -> None:
    """The scheduler counts the claim (the request) per GPU; the ceiling, on that GPU, is
    frozen into the sidecar's environment as in node mode, and bounded the same way."""
    bursty_dra = dataclasses.replace(BURSTY, dra_class="gpu.nvidia.com")
    p = pod(gpu("trainer", "4Gi"), annotations={CEILING: "8Gi"})
    out: dict[str, Any] = jsonpatch.apply_patch(p, mutate(p, bursty_dra, "ml"))
    assert out["spec"]["resourceClaims"] == [
        {"name": "vram-trainer", "resourceClaimTemplateName": "vram-enforcer-4gi"}
    ]
    side = env_of(sidecar_of(out))
    assert json.loads(side["VRAM_ENFORCER_CEILINGS"]) == {"trainer": 8 * GiB}
    assert side["VRAM_ENFORCER_LIMITS_FROM"] == "dra"
    told = env_of(out["spec"]["containers"][0])
    assert (told["VRAM_LIMIT_BYTES"], told["VRAM_REQUEST_BYTES"]) == (str(8 * GiB), str(4 * GiB))
    assert mutate(out, bursty_dra, "ml") == []  # a second pass, from the claim, agrees
    with pytest.raises(Denied, match=r"is below the container's request of 4\.00 GiB"):
        mutate(pod(gpu("trainer", "4Gi"), annotations={CEILING: "2Gi"}), bursty_dra, "ml")
    with pytest.raises(Denied, match="the operator allows no borrowing above requests"):
        mutate(p, DRA, "ml")


KAI = dataclasses.replace(NATIVE, kai_annotations=True)
KAI_BURSTY = dataclasses.replace(BURSTY, kai_annotations=True)


def test_kais_annotations_declare_when_the_operator_says_so() -> None:
    """A KAI pod as its users write it: no resource of ours, a share in annotations. The
    webhook freezes the share into the sidecar's environment (annotations can be patched
    later) and tells the workload its limit in bytes where it is known."""
    p = pod(gpu("main", None), gpu("helper", None), annotations={"gpu-memory": "2048"})
    assert mutate(p, NATIVE) == []  # off (the default): exactly as before
    out = applied(p, KAI)
    side = env_of(sidecar_of(out))
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {"main": 2 * GiB}
    assert "VRAM_ENFORCER_PORTIONS" not in side and "VRAM_ENFORCER_CEILINGS" not in side
    assert env_of(out["spec"]["containers"][0])["VRAM_LIMIT_BYTES"] == str(2 * GiB)
    assert "VRAM_LIMIT_BYTES" not in env_of(out["spec"]["containers"][1])
    assert out["spec"]["shareProcessNamespace"] is True
    assert mutate(out, KAI) == []  # a second pass changes nothing


def test_a_kai_fraction_is_frozen_as_a_portion_and_its_limit_as_a_ceiling() -> None:
    annotations = {
        "gpu-fraction": "0.5",
        "gpu-fraction.limit": "0.8",
        "gpu-fraction-container-name": "helper",
    }
    p = pod(gpu("main", None), gpu("helper", None), annotations=annotations)
    with pytest.raises(
        Denied,
        match=r"\['gpu-fraction.limit'\]: '0.8' is above what is allowed "
        "in namespace 'ml': the operator allows no borrowing",
    ):
        mutate(p, KAI, "ml")
    out = applied(p, KAI_BURSTY)
    side = env_of(sidecar_of(out))
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {}
    assert json.loads(side["VRAM_ENFORCER_PORTIONS"]) == {
        "helper": {"request": "0.5", "ceiling": "0.8"}
    }
    # Its bytes depend on the GPU it gets: the workload is not told a number here.
    assert "VRAM_LIMIT_BYTES" not in env_of(out["spec"]["containers"][1])
    # The sidecar reads back exactly what was frozen.
    portions = parse_portions(side["VRAM_ENFORCER_PORTIONS"], "VRAM_ENFORCER_PORTIONS")
    assert portions == {"helper": Portion(Decimal("0.5"), Decimal("0.8"))}


def test_kai_limits_in_bytes_are_bounded_as_ceilings_are() -> None:
    req, lim = (
        "nvidia.com/container.main.gpu-memory.request",
        "nvidia.com/container.main.gpu-memory.limit",
    )
    p = pod(gpu("main", None), annotations={req: "4Gi", lim: "41Gi"})
    with pytest.raises(
        Denied,
        match=re.escape(
            f"metadata.annotations[{lim!r}]: '41Gi' is above what is allowed in namespace 'ml'"
        ),
    ):
        mutate(p, KAI_BURSTY, "ml")
    p["metadata"]["annotations"][lim] = "16Gi"
    side = env_of(sidecar_of(applied(p, KAI_BURSTY)))
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {"main": 4 * GiB}
    assert json.loads(side["VRAM_ENFORCER_CEILINGS"]) == {"main": 16 * GiB}


@pytest.mark.parametrize(
    ("p", "message"),
    [
        (
            pod(gpu("main", "4Gi"), annotations={"gpu-memory": "2048"}),
            "container 'main' declares vram-enforcer.io/vram in its resources.limits, and KAI "
            "Scheduler's annotations declare a GPU share too",
        ),
        (
            pod(gpu("main", None), annotations={"gpu-memory": "2048", CEILING: "8Gi"}),
            "give its limit with KAI's (gpu-memory.limit, gpu-fraction.limit)",
        ),
        (
            pod(gpu("main", None), annotations={"gpu-fraction": "1.5"}),
            "metadata.annotations['gpu-fraction']: '1.5' is not a portion of a GPU above 0 and below 1",
        ),
    ],
)
def test_kai_declarations_that_cannot_be_enforced_are_denied(
    p: dict[str, Any], message: str
) -> None:
    with pytest.raises(Denied) as info:
        mutate(p, KAI_BURSTY, "ml")
    assert message in str(info.value)


def test_a_kai_share_the_sidecar_could_not_read_back_exactly_is_denied_naming_it() -> None:
    """`gpu-fraction: "1e-999999999"` was admitted and written as `0E-1000026` (the share
    times its GPUs, rounded to decimal's 28 digits), which the sidecar and the agent refuse:
    a pod that never starts, or runs unenforced. A share has at most 20 digits after the
    point, so that it is written exactly."""
    p = pod(gpu("main", None), annotations={"gpu-fraction": "1e-999999999"})
    with pytest.raises(
        Denied,
        match=re.escape(
            "metadata.annotations['gpu-fraction']: '1e-999999999' has more than 20 digits after "
            'the point; give a portion above 0 and below 1 with at most 20, e.g. "0.5"'
        ),
    ):
        mutate(p, KAI)
    # Rounded, this share would reach its limit, which the sidecar refuses too.
    p["metadata"]["annotations"] = {"gpu-fraction": "0." + "4" * 31, "gpu-fraction.limit": "0.5"}
    with pytest.raises(Denied, match=r"'gpu-fraction'.* has more than 20 digits after the point"):
        mutate(p, KAI_BURSTY)
    # The most digits, on the most GPUs: read back exactly.
    share = "0." + "4" * 20
    p["metadata"]["annotations"] = {
        "gpu-fraction": share,
        "gpu-fraction.limit": "0.5",
        "gpu-fraction-num-devices": "9999",
    }
    side = env_of(sidecar_of(applied(p, KAI_BURSTY)))
    portions = parse_portions(side["VRAM_ENFORCER_PORTIONS"], "VRAM_ENFORCER_PORTIONS")
    assert portions == {"main": Portion(Decimal(share) * 9999, Decimal("0.5") * 9999)}
    assert json.loads(side["VRAM_ENFORCER_GPUS"]) == {"main": 9999}  # one share on each


def test_a_pod_that_declares_nothing_may_not_carry_a_container_named_like_the_sidecar() -> None:
    """The node agent reads what a KAI pod declares from its sidecar's environment, which
    only the webhook writes: a pod that declares nothing cannot bring a sidecar of its own."""
    forged = {
        "name": "vram-enforcer",
        "image": NATIVE.sidecar_image,
        "env": [{"name": "VRAM_ENFORCER_LIMITS", "value": '{"main": 1}'}],
    }
    message = (
        r"a container is named 'vram-enforcer', the name of the enforcer's sidecar, in "
        "a pod that declares no VRAM; rename it"
    )
    with pytest.raises(Denied, match=r"spec.initContainers: " + message):
        mutate(pod(gpu("main", None), init=[forged]), KAI)
    with pytest.raises(Denied, match=r"spec.containers: " + message):
        mutate(pod(gpu("main", None), forged), NATIVE)


def test_a_pod_that_opts_out_may_not_carry_a_container_named_like_the_sidecar() -> None:
    """Issue 42, item 2: where the operator lets pods opt out, a declaring pod that does is
    admitted as it is, and the node agent reads a container named like the sidecar as the
    webhook's own (in an opted-in namespace): its own `vram-enforcer` declared a 1 TiB
    ceiling. The opt-out stands; the name does not."""
    forged = {
        "name": "vram-enforcer",
        "image": NATIVE.sidecar_image,
        "env": [{"name": "VRAM_ENFORCER_CEILINGS", "value": '{"trainer": 1099511627776}'}],
    }
    lenient = dataclasses.replace(NATIVE, tenancy=Tenancy(Bounds(allow_opt_out=True)))
    opted_out = {"vram-enforcer.io/inject": "false"}
    message = (
        "a container is named 'vram-enforcer', the name of the enforcer's sidecar, in a pod "
        "that opts out of it (metadata.annotations['vram-enforcer.io/inject']: 'false'); "
        "rename it"
    )
    for field, p in (
        ("containers", pod(gpu("trainer"), forged, annotations=opted_out)),
        ("initContainers", pod(gpu("trainer"), init=[forged], annotations=opted_out)),
    ):
        with pytest.raises(Denied, match=re.escape(f"spec.{field}: {message}")):
            mutate(p, lenient, "ml")
    assert mutate(pod(gpu("trainer"), annotations=opted_out), lenient, "ml") == []


def test_no_ephemeral_container_is_named_like_the_sidecar_in_a_pod_the_webhook_admits() -> None:
    """The API server refuses ephemeral containers in a create; the webhook does not rely
    on it for the one name the node agent trusts."""
    forged = {"name": "vram-enforcer", "image": NATIVE.sidecar_image}
    with pytest.raises(Denied, match=r"spec.ephemeralContainers: a container is named"):
        mutate(pod({"name": "web", "image": "nginx"}, ephemeralContainers=[forged]), NATIVE)


# --- The workload kept out of its sidecar, and under its label (issue 42, items 4 and 5) ----


def security(c: dict[str, Any], **context: Any) -> dict[str, Any]:
    return {**c, "securityContext": context}


def test_every_other_container_drops_kill_keeping_what_it_drops_and_adds() -> None:
    """The sidecar holds KILL alone, and the kernel lets a process of its uid ptrace it
    (open its memory read-write) only while it holds every capability the sidecar holds
    (`cap_ptrace_access_check`): the sidecar is not dumpable only ~100 ms after it starts,
    so without this a root workload could take it over at each restart."""
    p = pod(
        gpu("trainer"),
        security(gpu("server", None), capabilities={"drop": ["NET_RAW"], "add": ["NET_ADMIN"]}),
        security(gpu("hardened", None), runAsUser=1000, capabilities={"drop": ["all"]}),
        security(gpu("careful", None), capabilities={"drop": ["kill"]}),
        init=[gpu("setup", None), {**gpu("proxy", None), "restartPolicy": "Always"}],
    )
    out = applied(p)
    capabilities = {
        c["name"]: c.get("securityContext", {}).get("capabilities")
        for c in out["spec"]["initContainers"] + out["spec"]["containers"]
    }
    assert capabilities == {
        "vram-enforcer": {"drop": ["ALL"], "add": ["KILL"]},
        "setup": {"drop": ["KILL"]},
        "proxy": {"drop": ["KILL"]},
        "trainer": {"drop": ["KILL"]},
        "server": {"drop": ["NET_RAW", "KILL"], "add": ["NET_ADMIN"]},
        "hardened": {"drop": ["all"]},
        "careful": {"drop": ["kill"]},
    }
    hardened = next(c for c in out["spec"]["containers"] if c["name"] == "hardened")
    assert hardened["securityContext"]["runAsUser"] == 1000
    assert mutate(out, NATIVE) == []  # a second pass changes nothing
    # In container mode, the sidecar beside them keeps its own.
    side = sidecar_of(applied(p, CONTAINER))
    assert side["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}


@pytest.mark.parametrize(
    ("context", "message"),
    [
        (
            {"privileged": True},
            "spec.containers['trainer'].securityContext.privileged: true gives this container "
            "every capability, CAP_SYS_PTRACE among them",
        ),
        (
            {"capabilities": {"add": ["NET_ADMIN", "SYS_PTRACE"]}},
            "spec.containers['trainer'].securityContext.capabilities.add: 'SYS_PTRACE' would "
            "let this container read and write the memory of the vram-enforcer sidecar",
        ),
        ({"capabilities": {"add": ["cap_sys_ptrace"]}}, "add: 'cap_sys_ptrace' would let"),
        (
            {"capabilities": {"add": ["ALL"]}},
            "add: 'ALL' adds every capability, CAP_SYS_PTRACE among them",
        ),
        ({"capabilities": {"add": ["all"]}}, "add: 'all' adds every capability"),
        (
            {"capabilities": {"add": ["KILL"], "drop": ["ALL"]}},
            "add: 'KILL' is the one capability that the vram-enforcer sidecar holds: the kernel "
            "lets a process of the sidecar's uid read and write its memory when it holds every "
            "capability the sidecar holds",
        ),
        ({"capabilities": {"add": ["Cap_Kill"]}}, "add: 'Cap_Kill' is the one capability"),
    ],
)
def test_what_would_let_a_container_ptrace_the_sidecar_is_denied_naming_the_field(
    context: dict[str, Any], message: str
) -> None:
    for p in (
        pod(security(gpu("trainer"), **context)),
        pod(gpu("main"), init=[security(gpu("trainer", None), **context)]),
    ):
        with pytest.raises(Denied) as info:
            mutate(p, NATIVE)
        text = str(info.value).replace("spec.initContainers", "spec.containers")
        assert message in text and text.endswith(("Remove it", "unprivileged)")), text


def test_privileged_false_and_harmless_capabilities_are_admitted() -> None:
    c = security(gpu("trainer"), privileged=False, capabilities={"add": ["IPC_LOCK", "SYS_NICE"]})
    out = applied(pod(c))
    assert out["spec"]["containers"][0]["securityContext"] == {
        "privileged": False,
        "capabilities": {"add": ["IPC_LOCK", "SYS_NICE"], "drop": ["KILL"]},
    }


LOCALHOST = {"type": "Localhost", "localhostProfile": "lsb_release"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"container": {"appArmorProfile": LOCALHOST}},
            "spec.containers['trainer'].securityContext.appArmorProfile.type: 'Localhost' puts "
            "this container under another AppArmor profile than the runtime's default; the "
            "vram-enforcer sidecar signals the pod's processes under the runtime's default "
            "profile, which another profile may refuse (EPERM), and VRAM enforcement would "
            "stop there. Remove it (or use type RuntimeDefault)",
        ),
        (
            {"container": {"appArmorProfile": {"type": "Unconfined"}}},
            "appArmorProfile.type: 'Unconfined' puts this container under another",
        ),
        (
            {"pod": {"appArmorProfile": LOCALHOST}},
            "spec.securityContext.appArmorProfile.type: 'Localhost' puts every container of "
            "the pod, the sidecar too, under another AppArmor profile",
        ),
        (
            {
                "annotations": {
                    "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"
                }
            },
            "metadata.annotations['container.apparmor.security.beta.kubernetes.io/trainer']: "
            "'unconfined' puts container 'trainer' under another AppArmor profile than the "
            "runtime's default",
        ),
        (
            {
                "annotations": {
                    "container.apparmor.security.beta.kubernetes.io/vram-enforcer": "localhost/x"
                }
            },
            "'localhost/x' puts container 'vram-enforcer' under another AppArmor profile",
        ),
        (
            {"container": {"seLinuxOptions": {"level": "s0:c1,c2"}}},
            "spec.containers['trainer'].securityContext.seLinuxOptions: level 's0:c1,c2' are "
            "not the pod's (none, spec.securityContext.seLinuxOptions): the runtime would run "
            "this container under an SELinux label of its own",
        ),
        (
            {
                "pod": {"seLinuxOptions": {"level": "s0:c1,c2", "type": "container_t"}},
                "container": {"seLinuxOptions": {"type": "container_t"}},
            },
            "seLinuxOptions: type 'container_t' are not the pod's (level 's0:c1,c2', type "
            "'container_t', spec.securityContext.seLinuxOptions)",
        ),
        (
            {"pod": {"seLinuxOptions": {"type": "container_t", "level": ""}}},
            "spec.securityContext.seLinuxOptions: type 'container_t' names no level: the "
            "runtime then gives each container a level of its own",
        ),
    ],
)
def test_another_security_label_than_the_sidecars_is_denied_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    """The runtime's default AppArmor profile signals and reads only peers under itself, and
    SELinux keeps a level from signalling another: a container under another label than its
    sidecar's would be out of its reach (issue 42, item 4)."""
    p = pod(
        security(gpu("trainer"), **change.get("container", {})),
        annotations=change.get("annotations"),
        securityContext=change.get("pod", {}),
    )
    with pytest.raises(Denied) as info:
        mutate(p, NATIVE)
    assert message in str(info.value)


def test_the_sidecars_own_labels_are_admitted_and_the_sidecar_names_none() -> None:
    """RuntimeDefault, named or not, and the pod's SELinux options repeated; /proc unmasked
    opens no way into the sidecar (the kernel's ptrace checks do not read the mount). The
    sidecar names no AppArmor profile: the kubelet refuses a pod that names one, even
    RuntimeDefault, on a node without AppArmor."""
    options = {"level": "s0:c123,c456", "type": "container_t"}
    p = pod(
        security(
            gpu("trainer"),
            appArmorProfile={"type": "RuntimeDefault"},
            seLinuxOptions=options,
            procMount="Unmasked",
        ),
        security(gpu("server", None), seLinuxOptions={"user": ""}),
        annotations={"container.apparmor.security.beta.kubernetes.io/server": "runtime/default"},
        securityContext={"appArmorProfile": {"type": "RuntimeDefault"}, "seLinuxOptions": options},
        hostUsers=False,
    )
    out = jsonpatch.apply_patch(p, mutate(p, NATIVE))
    kubernetes_validate.validate(out, "1.31", strict=True)  # appArmorProfile: 1.30 on
    side = sidecar_of(out)["securityContext"]
    assert "appArmorProfile" not in side and "seLinuxOptions" not in side


# An injected pod, as stored, to which `kubectl debug` adds ephemeral containers.
INJECTED_POD = applied(
    pod(gpu("trainer"), securityContext={"seLinuxOptions": {"level": "s0:c1,c2"}})
)


def ephemeral_review(stored: dict[str, Any], *added: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview of an UPDATE of `stored`'s ephemeralcontainers subresource."""
    updated = copy.deepcopy(stored)
    updated["spec"].setdefault("ephemeralContainers", []).extend(added)
    doc = admission_review(updated, operation="UPDATE")
    doc["request"].update(subResource="ephemeralcontainers", oldObject=stored)
    return doc


def debugger(name: str = "debugger", **context: Any) -> dict[str, Any]:
    c = {"name": name, "image": "busybox", "targetContainerName": "trainer"}
    return security(c, **context) if context else c


def test_an_ephemeral_container_added_to_an_injected_pod_drops_kill() -> None:
    """`kubectl debug` adds a container to a running pod through a subresource of its own,
    which the webhook skipped: a root debugger with KILL could take over the sidecar at
    its next restart. Ones added before are left as they are (the API server refuses any
    change to them, so an upgrade must not make one)."""
    earlier = copy.deepcopy(INJECTED_POD)
    earlier["spec"]["ephemeralContainers"] = [debugger("before")]
    doc = ephemeral_review(earlier, debugger(), debugger("careful", capabilities={"drop": ["ALL"]}))
    out = review(doc, NATIVE)
    assert out.result == "patched"
    ops = json.loads(base64.b64decode(out.review["response"]["patch"]))
    soft_0 = [{"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": "0"}]
    assert ops == [
        {
            "op": "add",
            "path": "/spec/ephemeralContainers/1/securityContext",
            "value": {"capabilities": {"drop": ["KILL"]}},
        },
        {"op": "add", "path": "/spec/ephemeralContainers/1/env", "value": soft_0},
        {"op": "add", "path": "/spec/ephemeralContainers/2/env", "value": soft_0},
    ]
    again = jsonpatch.apply_patch(doc["request"]["object"], ops)
    assert (
        review(ephemeral_review(earlier, *again["spec"]["ephemeralContainers"][1:]), NATIVE).result
        == "skipped"
    )


@pytest.mark.parametrize(
    ("added", "message"),
    [
        (
            debugger(privileged=True),
            "spec.ephemeralContainers['debugger'].securityContext.privileged: true gives this "
            "container every capability",
        ),
        (
            debugger(capabilities={"add": ["SYS_PTRACE"]}),
            "spec.ephemeralContainers['debugger'].securityContext.capabilities.add: "
            "'SYS_PTRACE' would let this container read and write the memory",
        ),
        (debugger(capabilities={"add": ["KILL"]}), "add: 'KILL' is the one capability"),
        (
            debugger(appArmorProfile={"type": "Unconfined"}),
            "spec.ephemeralContainers['debugger'].securityContext.appArmorProfile.type: "
            "'Unconfined' puts this container under another AppArmor profile",
        ),
        (
            debugger(seLinuxOptions={"level": "s0:c3,c4"}),
            "seLinuxOptions: level 's0:c3,c4' are not the pod's (level 's0:c1,c2', "
            "spec.securityContext.seLinuxOptions)",
        ),
        (
            {**debugger(), "targetContainerName": "vram-enforcer"},
            "spec.ephemeralContainers['debugger'].targetContainerName: 'vram-enforcer' is the "
            "enforcer's sidecar",
        ),
        (
            debugger("vram-enforcer"),
            "spec.ephemeralContainers['vram-enforcer']: 'vram-enforcer' is the name of the "
            "enforcer's sidecar; name the ephemeral container otherwise",
        ),
    ],
)
def test_an_ephemeral_container_that_could_reach_into_the_sidecar_is_denied(
    added: dict[str, Any], message: str
) -> None:
    out = review(ephemeral_review(INJECTED_POD, added), NATIVE)
    assert out.result == "denied"
    assert message in out.review["response"]["status"]["message"]


def test_ephemeral_containers_of_pods_the_webhook_did_not_inject_are_left_alone() -> None:
    """Judged by the pod as stored: the request's own copy of the rest of the pod is the
    requester's to write (the API server keeps only its ephemeral containers)."""
    plain = pod({"name": "web", "image": "nginx"})
    assert review(ephemeral_review(plain, debugger(privileged=True)), NATIVE).result == "skipped"
    # ... but none may be named like the sidecar, which the agent would trust.
    assert review(ephemeral_review(plain, debugger("vram-enforcer")), NATIVE).result == "denied"
    # A request that hides the sidecar in its copy of the pod changes nothing.
    doc = ephemeral_review(INJECTED_POD, debugger(privileged=True))
    doc["request"]["object"]["spec"]["initContainers"] = []
    assert review(doc, NATIVE).result == "denied"
    # Without the stored pod, nothing can be judged.
    del doc["request"]["oldObject"]
    assert review(doc, NATIVE).result == "invalid"


@pytest.mark.parametrize("volume", ["vram-enforcer-socket", "vram-enforcer-no-token"])
def test_no_container_but_the_sidecar_mounts_its_volumes(volume: str) -> None:
    """The sidecar's socket is in an emptyDir no other container mounts: a workload that
    mounted it by name (it validates: the API server validates after the mutation) could
    take the socket away or flood it with connections; an ephemeral container the same
    (found by review of issue 42's change)."""
    mounting = {"name": volume, "mountPath": "/x"}
    with pytest.raises(Denied) as denied:
        mutate(pod(gpu("trainer", volumeMounts=[mounting])), NATIVE)
    assert str(denied.value).startswith(
        f"spec.containers['trainer'].volumeMounts[0].name: {volume!r} is the vram-enforcer "
        "sidecar's own volume"
    )
    out = review(ephemeral_review(INJECTED_POD, {**debugger(), "volumeMounts": [mounting]}), NATIVE)
    assert out.result == "denied"
    message = out.review["response"]["status"]["message"]
    assert message.startswith("spec.ephemeralContainers['debugger'].volumeMounts[0].name:")


# A container that asks for a GPU and declares no VRAM (issue 43, item 1).


def on_gpu(name: str, resource: str = "nvidia.com/gpu", part: str = "limits") -> dict[str, Any]:
    """A container as users write one for a time-sliced GPU: a GPU, and no VRAM declared."""
    return gpu(name, None, resources={part: {resource: "1"}})


def undeclared(mode: str, **bounds: Any) -> AdmissionSettings:
    """The pod's namespace 'ml' handles such containers as `mode` says; elsewhere: deny."""
    ml = Bounds(undeclared_gpu=mode, **bounds)
    return dataclasses.replace(NATIVE, tenancy=Tenancy(Bounds(), {"ml": ml}))


@pytest.mark.parametrize(
    ("p", "field"),
    [
        (pod(on_gpu("trainer")), "spec.containers['trainer'].resources.limits['nvidia.com/gpu']"),
        (  # time-slicing's renamed resource, asked for in requests only
            pod(on_gpu("trainer", "nvidia.com/gpu.shared", "requests")),
            "spec.containers['trainer'].resources.requests['nvidia.com/gpu.shared']",
        ),
        (  # beside a container that declares: it would be held to 0 and killed on first use
            pod(gpu("server"), init=[on_gpu("warmup")]),
            "spec.initContainers['warmup'].resources.limits['nvidia.com/gpu']",
        ),
    ],
)
def test_a_gpu_container_that_declares_no_vram_is_denied_by_default(
    p: dict[str, Any], field: str
) -> None:
    with pytest.raises(Denied) as info:
        mutate(p, NATIVE, "ml")
    name = field.split("'")[1]
    assert str(info.value) == (
        f"{field}: '1' asks for a GPU, and container {name!r} declares no VRAM, which is not "
        "allowed in namespace 'ml': a GPU shared with other pods needs each one's limit. "
        "Declare the most GPU memory it may use in its resources.limits, e.g. "
        "vram-enforcer.io/vram: 8Gi (the operator chooses with the webhook's --undeclared-gpu "
        "or --namespace-bounds)"
    )
    units = dataclasses.replace(NATIVE, resource_unit=GiB)  # the example in units
    with pytest.raises(Denied, match=r"e\.g\. vram-enforcer\.io/vram: 8 \("):
        mutate(p, units, "ml")


def test_what_is_no_gpu_and_pods_left_alone_are_not_denied() -> None:
    assert mutate(pod({"name": "web", "image": "nginx"}), NATIVE, "ml") == []
    assert mutate(pod(on_gpu("t", "amd.com/gpu")), NATIVE, "ml") == []  # not in the list
    none = gpu("t", None, resources={"limits": {"nvidia.com/gpu": "0"}})
    assert mutate(pod(none), NATIVE, "ml") == []  # 0 asks for no GPU
    amd = dataclasses.replace(NATIVE, gpu_resources=("amd.com/gpu",))
    with pytest.raises(Denied, match=r"amd\.com/gpu"):
        mutate(pod(on_gpu("t", "amd.com/gpu")), amd, "ml")
    # where the operator lets pods opt out, one that does is left alone
    p = pod(on_gpu("t"), annotations={"vram-enforcer.io/inject": "false"})
    assert mutate(p, undeclared("deny", allow_opt_out=True), "ml") == []
    with pytest.raises(Denied, match="declares no VRAM"):
        mutate(p, NATIVE, "ml")


def test_observe_admits_such_a_pod_as_before() -> None:
    observe = undeclared("observe")
    assert mutate(pod(on_gpu("trainer")), observe, "ml") == []
    # beside a container that declares, it is held as any container that declares nothing
    out = jsonpatch.apply_patch(p := pod(gpu("server"), on_gpu("helper")), mutate(p, observe, "ml"))
    assert json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"]) == {"server": 12 * GiB}
    assert "VRAM_LIMIT_BYTES" not in env_of(out["spec"]["containers"][1])
    with pytest.raises(Denied):  # the namespace's choice, not the cluster's
        mutate(pod(on_gpu("trainer")), observe, "research")


def test_default_declares_each_such_container_as_a_limit_range_would() -> None:
    settings = undeclared("default", default_vram=8 * GiB)
    p = pod(gpu("server"), on_gpu("trainer"), init=[on_gpu("warmup", part="requests")])
    out = applied(p, settings, "ml")
    spec = out["spec"]
    server, trainer = spec["containers"][:2]
    warmup = next(c for c in spec["initContainers"] if c["name"] == "warmup")
    # written where the scheduler counts it, beside the GPU it asked for
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": "1", RES: "8Gi"}
    assert warmup["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {RES: "8Gi"}}
    assert server["resources"]["limits"] == {RES: "12Gi"}  # its own declaration kept
    assert json.loads(env_of(sidecar_of(out))["VRAM_ENFORCER_LIMITS"]) == {
        "warmup": 8 * GiB,
        "server": 12 * GiB,
        "trainer": 8 * GiB,
    }
    assert env_of(trainer)["VRAM_LIMIT_BYTES"] == str(8 * GiB)
    assert mutate(out, settings, "ml") == []  # a second pass changes nothing
    units = dataclasses.replace(settings, resource_unit=GiB)
    trainer = applied(pod(on_gpu("trainer")), units, "ml")["spec"]["containers"][0]
    assert trainer["resources"]["limits"][RES] == "8"  # a count of the resource's units


def test_default_in_dra_mode_is_a_claim_and_kai_shares_are_left_to_kai() -> None:
    dra = dataclasses.replace(DRA, tenancy=undeclared("default", default_vram=8 * GiB).tenancy)
    p = pod(on_gpu("trainer"))
    out: dict[str, Any] = jsonpatch.apply_patch(p, mutate(p, dra, "ml"))
    assert out["spec"]["resourceClaims"] == [
        {"name": "vram-trainer", "resourceClaimTemplateName": "vram-enforcer-8gi"}
    ]
    trainer = out["spec"]["containers"][0]
    assert trainer["resources"] == {
        "limits": {"nvidia.com/gpu": "1"},
        "claims": [{"name": "vram-trainer"}],
    }
    assert mutate(out, dra, "ml") == []  # the claim declares it on a later pass
    # A pod whose GPU share KAI's annotations declare is held to that share.
    kai_pod = pod(on_gpu("main"), annotations={"gpu-memory": "2048"})
    side = env_of(sidecar_of(jsonpatch.apply_patch(kai_pod, mutate(kai_pod, KAI, "ml"))))
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {"main": 2 * GiB}


# The action a pod gets without asking (issue 43, item 3).


def in_ml(**bounds: Any) -> AdmissionSettings:
    return dataclasses.replace(NATIVE, tenancy=Tenancy(Bounds(), {"ml": Bounds(**bounds)}))


def sidecar_policy(p: dict[str, Any], settings: AdmissionSettings) -> tuple[str, bool]:
    """The action and dry run that the sidecar reads from what the webhook wrote (with the
    sidecar's own settings parser, as the node agent's backstop reads it)."""
    from enforcer.core.settings import resolve
    from enforcer.core.settings.sidecar import POLICY

    env = env_of(sidecar_of(applied(p, settings, "ml")))
    environ = {k: v for k, v in env.items() if isinstance(v, str)}
    declared = (POLICY.action, POLICY.grace_period, POLICY.warn_at, POLICY.over_for, POLICY.dry_run)
    policy = POLICY.config(resolve(declared, {}, environ))
    return policy.action.value, policy.dry_run


def test_a_namespace_in_dry_run_decides_as_terminate_and_signals_nothing() -> None:
    dry = in_ml(default_action="dry-run")
    assert sidecar_policy(pod(gpu("t")), dry) == ("terminate", True)
    env = env_of(sidecar_of(applied(pod(gpu("t")), dry, "ml")))
    assert (env["VRAM_ENFORCER_ACTION"], env["VRAM_ENFORCER_DRY_RUN"]) == ("terminate", "true")
    # a pod may be stricter, within the bounds: it is enforced now
    strict = pod(gpu("t"), annotations={"vram-enforcer.io/action": "kill"})
    assert sidecar_policy(strict, dry) == ("kill", False)
    # ... but not laxer than it may be: warn is not in the bounds
    lax = pod(gpu("t"), annotations={"vram-enforcer.io/action": "warn"})
    with pytest.raises(Denied, match="'warn' is not allowed in namespace 'ml'"):
        mutate(lax, dry, "ml")
    # elsewhere, and with the default terminate, nothing is written: as before
    assert "VRAM_ENFORCER_ACTION" not in env_of(sidecar_of(applied(pod(gpu("t")), NATIVE)))
    assert sidecar_policy(pod(gpu("t")), in_ml(default_action="warn")) == ("warn", False)
    assert sidecar_policy(pod(gpu("t")), in_ml(default_action="kill")) == ("kill", False)


def test_dry_run_may_be_asked_for_only_where_allowed_and_sets_no_toolkit_limit() -> None:
    asks = pod(gpu("t"), annotations={"vram-enforcer.io/action": "DRY-RUN"})
    with pytest.raises(Denied, match="'DRY-RUN' is not allowed in namespace 'ml'"):
        mutate(asks, NATIVE, "ml")
    allowed = in_ml(actions=ALL_ACTIONS)
    assert sidecar_policy(asks, allowed) == ("terminate", True)
    with pytest.raises(Denied, match=r"'explode' is not an action; use one of: .*, dry-run"):
        mutate(pod(gpu("t"), annotations={"vram-enforcer.io/action": "explode"}), NATIVE, "ml")
    # The toolkit's hook refuses allocations past the limit: not for a pod only reported on.
    toolkit = dataclasses.replace(allowed, toolkit_limits=True)
    for action, hard in (("dry-run", False), ("warn", False), ("terminate", True)):
        p = pod(gpu("t"), annotations={"vram-enforcer.io/action": action})
        env = env_of(applied(p, toolkit, "ml")["spec"]["containers"][0])
        assert ("NVIDIA_GPU_MEMORY_LIMIT" in env) is hard, action


def test_a_pod_only_reported_on_borrows_nothing_above_its_request() -> None:
    """What a pod in `warn` or a dry run borrowed could not be taken back, so its neighbours
    would go without their requests. A ceiling beside a report-only action the pod chose is
    denied, naming the field, the value and the fix; beside its namespace's report-only
    default it is dropped and the user told (denying would stop a workload's replacement
    pods in a namespace switched to observe)."""
    chooser = in_ml(actions=ALL_ACTIONS, max_ceiling=40 * GiB)
    for action in ("warn", "dry-run"):
        asks = pod(
            gpu("t", "4Gi"), annotations={CEILING: "16Gi", "vram-enforcer.io/action": action}
        )
        with pytest.raises(Denied) as denied:
            mutate(asks, chooser, "ml")
        assert str(denied.value) == (
            f"metadata.annotations['vram-enforcer.io/vram-ceiling']: a ceiling cannot go with "
            f"metadata.annotations['vram-enforcer.io/action']: {action!r}: a pod that is only "
            "reported on borrows nothing above its request (what it borrowed could not be "
            "taken back while its neighbours go without theirs). Remove the ceiling, or "
            "choose an enforcing action"
        )
    # KAI's limit too: it is a ceiling.
    kai = pod(on_gpu("main"), annotations={"gpu-memory": "2048", "gpu-memory.limit": "8Gi"})
    kai["metadata"]["annotations"]["vram-enforcer.io/action"] = "warn"
    with pytest.raises(Denied, match="the limit in KAI Scheduler's annotations: a ceiling"):
        mutate(kai, dataclasses.replace(KAI, tenancy=chooser.tenancy), "ml")
    # The namespace's default: admitted, held to its request, and said.
    observing = in_ml(default_action="dry-run", max_ceiling=40 * GiB)
    given = pod(gpu("t", "4Gi"), annotations={CEILING: "16Gi"})
    side = env_of(sidecar_of(applied(given, observing, "ml")))
    assert "VRAM_ENFORCER_CEILINGS" not in side
    assert json.loads(side["VRAM_ENFORCER_LIMITS"]) == {"t": 4 * GiB}
    out = review(admission_review(given), observing)  # in namespace ml
    assert out.result == "patched"
    assert out.review["response"]["warnings"] == [
        "metadata.annotations['vram-enforcer.io/vram-ceiling'] is ignored: the default action "
        "in namespace 'ml' is 'dry-run', and a pod that is only reported on borrows nothing "
        "above its request (what it borrowed could not be taken back while its neighbours go "
        "without theirs); the pod is held to its request. Remove the ceiling, or choose an "
        "enforcing action with metadata.annotations['vram-enforcer.io/action']"
    ]
    # Stricter, it borrows as before.
    strict = pod(gpu("t", "4Gi"), annotations={CEILING: "16Gi", "vram-enforcer.io/action": "kill"})
    side = env_of(sidecar_of(applied(strict, observing, "ml")))
    assert json.loads(side["VRAM_ENFORCER_CEILINGS"]) == {"t": 16 * GiB}


def test_the_webhook_and_the_agent_agree_on_which_actions_only_report() -> None:
    """One definition: what the webhook leaves the toolkit's limit out for, and refuses a
    ceiling on (`REPORT_ONLY`), is what the sidecar and the agent give no hard limit and
    lend nothing (`PolicyConfig.reports_only`), as they read what the webhook wrote."""
    for action in ALL_ACTIONS:
        asks = pod(gpu("t"), annotations={"vram-enforcer.io/action": action})
        read, dry_run = sidecar_policy(asks, in_ml(actions=ALL_ACTIONS))
        policy = PolicyConfig(action=Action(read), dry_run=dry_run)
        assert policy.reports_only is (action in REPORT_ONLY), action
