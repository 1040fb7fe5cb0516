"""The manifests under examples/, as a user would apply them.

- Every Kubernetes object validates against the 1.31 schemas in strict mode (no unknown
  field), and is created on the real API server (1.37) with `utils.create_from_dict`, as
  `kubectl create -f` would (the Python client also wants every quantity to be a string,
  so the manifests quote them). The webhook is not registered here, so pods are stored as
  written; the webhook's own mutation is checked in-process instead, against what
  examples/README.md promises (framework env, /dev/shm size, GPU exposure, annotations).
- The kube-scheduler configuration is not an API object: here its fields and what its
  profiles promise are checked; test_scheduler_e2e.py runs the real kube-scheduler with it,
  and has it place three-pods.yaml and pack or spread by VRAM.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml
from kubernetes import client, utils

from enforcer.core.admission import AdmissionSettings, Denied, mutate
from enforcer.core.tenancy import Bounds, Tenancy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
README = EXAMPLES / "README.md"
RESOURCE = "vram-enforcer.io/vram"
NAMESPACE = "vram-demo"
SCHEDULER_API = "kubescheduler.config.k8s.io/v1"
GiB = 1024**3

Doc = dict[str, Any]


def load(relative: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((EXAMPLES / relative).read_text()) if d is not None]


def all_documents() -> list[tuple[str, Doc]]:
    return [
        (str(path.relative_to(EXAMPLES)), doc)
        for path in sorted(EXAMPLES.rglob("*.y*ml"))
        for doc in load(str(path.relative_to(EXAMPLES)))
    ]


def is_scheduler_config(doc: Doc) -> bool:
    return str(doc.get("apiVersion", "")).startswith("kubescheduler.config.k8s.io/")


API_OBJECTS = [(f, d) for f, d in all_documents() if not is_scheduler_config(d)]
SCHEDULER_CONFIGS = [(f, d) for f, d in all_documents() if is_scheduler_config(d)]


def object_id(item: tuple[str, Doc]) -> str:
    path, doc = item
    return f"{path}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def pod_templates() -> list[tuple[str, Doc]]:
    """(id, pod) for every pod the examples make: Pods, and the templates of Jobs and Deployments."""
    pods = []
    for item in API_OBJECTS:
        _, doc = item
        if doc["kind"] == "Pod":
            pods.append((object_id(item), doc))
        elif doc["kind"] in {"Job", "Deployment"}:
            pods.append(
                (object_id(item), {"apiVersion": "v1", "kind": "Pod", **doc["spec"]["template"]})
            )
    return pods


POD_TEMPLATES = pod_templates()
# The pods that declare VRAM, which the webhook enforces; those of dra/ claim it by hand.
DECLARING = [(i, p) for i, p in POD_TEMPLATES if not i.startswith("dra/")]


def quantity(value: object) -> Decimal:
    return Decimal(utils.parse_quantity(str(value)))


def effective_requests(container: Doc) -> dict[str, Decimal]:
    """What the scheduler counts: requests, defaulted from limits as the API server does."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(value) for name, value in merged.items()}


# --- the files -------------------------------------------------------------------------------


def test_every_example_is_there_and_explained_in_the_readme() -> None:
    expected = {
        "namespace.yaml",
        "pods/three-pods.yaml",
        "jobs/pytorch-overrun.yaml",
        "pods/jax.yaml",
        "pods/mpi-shm.yaml",
        "pods/vram-only.yaml",
    }
    found = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.y*ml")}
    assert expected <= found
    assert any(f.startswith("scheduler/") for f in found)
    readme = README.read_text()
    for f in sorted(found):
        assert f in readme, f"examples/README.md does not mention {f}"
    assert "../docs/security.md" in readme  # the --gpu-exposure env trade-off


@pytest.mark.parametrize("item", API_OBJECTS, ids=object_id)
def test_each_object_validates_against_its_floor_strictly(item: tuple[str, Doc]) -> None:
    """The chart's floor, 1.31; DRA's consumable capacity, which dra/ needs, 1.36."""
    path, doc = item
    kubernetes_validate.validate(doc, "1.36" if path.startswith("dra/") else "1.31", strict=True)


def test_the_strict_validation_does_catch_a_misspelt_field() -> None:
    pod = copy.deepcopy(load("pods/jax.yaml")[0])
    pod["spec"]["containers"][0]["resource"] = pod["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError, match="'resource' was unexpected"):
        kubernetes_validate.validate(pod, "1.31", strict=True)


def test_the_namespace_opts_in_and_every_object_lives_in_it() -> None:
    (namespace,) = [d for _, d in API_OBJECTS if d["kind"] == "Namespace"]
    assert namespace["metadata"] == {
        "name": NAMESPACE,
        "labels": {"vram-enforcer.io/inject": "enabled"},
    }
    for item in API_OBJECTS:
        if item[1]["kind"] != "Namespace":
            assert item[1]["metadata"].get("namespace") == NAMESPACE, object_id(item)


def test_api_versions_are_ga() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for _, d in API_OBJECTS}
    assert kinds <= {
        ("resource.k8s.io/v1", "ResourceClaimTemplate"),
        ("v1", "Namespace"),
        ("v1", "Pod"),
        ("v1", "ConfigMap"),
        ("batch/v1", "Job"),
        ("apps/v1", "Deployment"),
    }


# --- what the webhook makes of them (in-process: the pure admission logic) ------------------


BASE = AdmissionSettings(
    sidecar_image="ghcr.io/vram-enforcer/vram-enforcer:0.2.0",
    sidecar_mode="native",
    resource_name=RESOURCE,
    resource_unit=1,
)


def admitted(pod: Doc, **settings: Any) -> Doc:
    """The pod as the webhook would let it through (native sidecar, as from the chart's 1.31)."""
    ops = mutate(
        pod, dataclasses.replace(BASE, **settings)
    )  # raises Denied if the webhook would refuse the pod
    assert ops, "the webhook would leave this pod alone"
    result: Doc = jsonpatch.apply_patch(pod, ops)
    return result


def env_of(container: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def sidecar_env(pod: Doc) -> dict[str, str]:
    (sidecar,) = [
        c
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
        if c["name"] == "vram-enforcer"
    ]
    return env_of(sidecar)


# What an operator who lets tenants borrow sets (webhook.tenants.maxCeiling: 80Gi).
BORROWING = Tenancy(Bounds(max_ceiling=80 * GiB))
CEILING = "vram-enforcer.io/vram-ceiling"


@pytest.mark.parametrize(("name", "pod"), DECLARING, ids=[i for i, _ in DECLARING])
def test_the_webhook_admits_and_enforces_every_declaring_example_pod(name: str, pod: Doc) -> None:
    out = admitted(pod, tenancy=BORROWING)
    assert out["spec"]["shareProcessNamespace"] is True
    ceiling = pod["metadata"].get("annotations", {}).get(CEILING)
    for c in pod["spec"]["containers"]:
        vram = (c.get("resources", {}).get("limits") or {}).get(RESOURCE)
        assert vram is not None, f"{name}: container {c['name']!r} declares no VRAM"
        (after,) = [x for x in out["spec"]["containers"] if x["name"] == c["name"]]
        most = ceiling if ceiling is not None else vram
        assert env_of(after)["VRAM_LIMIT_BYTES"] == str(int(quantity(most)))
        assert env_of(after)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert env_of(after)["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_the_borrowing_example_is_refused_until_allowed_then_told_both_amounts() -> None:
    """As examples/README.md shows it: the denial (word for word), then the environment."""
    (pod,) = load("pods/bursting.yaml")
    with pytest.raises(Denied) as denied:  # the webhook names the review's namespace
        mutate(pod, dataclasses.replace(BASE, tenancy=Tenancy()), NAMESPACE)
    assert f"denied the request: {denied.value}" in README.read_text()
    out = admitted(pod, tenancy=BORROWING)
    (server,) = out["spec"]["containers"][:1]
    assert env_of(server)["VRAM_REQUEST_BYTES"] == str(4 * GiB)
    assert env_of(server)["VRAM_LIMIT_BYTES"] == str(16 * GiB)
    assert json.loads(sidecar_env(out)["VRAM_ENFORCER_CEILINGS"]) == {"server": 16 * GiB}


def test_jax_gets_no_preallocation() -> None:
    (pod,) = load("pods/jax.yaml")
    assert "env" not in pod["spec"]["containers"][0]  # what follows is the webhook's doing
    env = env_of(admitted(pod)["spec"]["containers"][0])
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["VRAM_LIMIT_BYTES"] == str(8 * GiB)
    # --no-framework-env: JAX would preallocate 75% of the GPU, which the README warns of
    bare = env_of(admitted(pod, framework_env=False)["spec"]["containers"][0])
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in bare


def test_the_dataloader_gets_a_dev_shm_as_large_as_its_memory_limit() -> None:
    (pod,) = load("pods/mpi-shm.yaml")
    assert pod["metadata"]["annotations"]["vram-enforcer.io/shm-size"] == "auto"
    out = admitted(pod)
    (trainer,) = [c for c in out["spec"]["containers"] if c["name"] == "trainer"]
    (mount,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in out["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert quantity(volume["emptyDir"]["sizeLimit"]) == 16 * GiB
    assert quantity(trainer["resources"]["limits"]["memory"]) == 16 * GiB
    # and not with shm-size: off, where the runtime's 64 MB would break the DataLoader
    off = copy.deepcopy(pod)
    off["metadata"]["annotations"]["vram-enforcer.io/shm-size"] = "off"
    (trainer,) = [c for c in admitted(off)["spec"]["containers"] if c["name"] == "trainer"]
    assert all(m["mountPath"] != "/dev/shm" for m in trainer.get("volumeMounts", []))


def test_the_vram_only_pod_gets_the_gpu_only_with_gpu_exposure_env() -> None:
    (pod,) = load("pods/vram-only.yaml")
    assert "nvidia.com/gpu" not in json.dumps(pod)
    exposed = env_of(admitted(pod, gpu_exposure="env")["spec"]["containers"][0])
    assert exposed["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert exposed["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(admitted(pod)["spec"]["containers"][0])


def test_the_overrun_job_is_enforced_as_annotated() -> None:
    config_map, job = load("jobs/pytorch-overrun.yaml")
    assert (job["spec"]["backoffLimit"], job["spec"]["template"]["spec"]["restartPolicy"]) == (
        0,
        "Never",
    )
    (pod,) = [p for i, p in POD_TEMPLATES if i.endswith("Job/pytorch-overrun")]
    env = sidecar_env(admitted(pod))
    assert json.loads(env["VRAM_ENFORCER_LIMITS"]) == {"trainer": 4 * GiB}
    assert (env["VRAM_ENFORCER_ACTION"], env["VRAM_ENFORCER_GRACE_PERIOD"]) == ("terminate", "10s")
    assert env["VRAM_ENFORCER_WARN_AT"] == "80%"
    # the script that overruns is the one the Job runs
    container = pod["spec"]["containers"][0]
    (mount,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    script = container["command"][-1]
    assert script == f"{mount['mountPath']}/overrun.py"
    assert "overrun.py" in config_map["data"]
    compile(config_map["data"]["overrun.py"], "overrun.py", "exec")


def test_every_inline_python_script_compiles() -> None:
    for name, pod in POD_TEMPLATES:
        for c in pod["spec"]["containers"]:
            command = c.get("command", [])
            if command[:2] == ["python", "-c"]:
                compile(command[2], f"{name}:{c['name']}", "exec")


# --- the scheduler profiles -------------------------------------------------------------------

CONFIG_FIELDS = {
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "healthzBindAddress",
    "metricsBindAddress",
    "enableProfiling",
    "enableContentionProfiling",
    "percentageOfNodesToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
}
PROFILE_FIELDS = {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"}
EXTENSION_POINTS = {
    "preEnqueue",
    "queueSort",
    "preFilter",
    "filter",
    "postFilter",
    "preScore",
    "score",
    "reserve",
    "permit",
    "preBind",
    "bind",
    "postBind",
    "multiPoint",
}


def test_there_is_a_scheduler_configuration() -> None:
    assert SCHEDULER_CONFIGS, "no KubeSchedulerConfiguration under examples/scheduler/"
    for path, _ in SCHEDULER_CONFIGS:
        assert path.startswith("scheduler/")


@pytest.mark.parametrize("item", SCHEDULER_CONFIGS, ids=object_id)
def test_the_scheduler_profiles_weigh_vram(item: tuple[str, Doc]) -> None:
    _, config = item
    assert config["apiVersion"] == SCHEDULER_API
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert set(config) <= CONFIG_FIELDS
    profiles = {p["schedulerName"]: p for p in config["profiles"]}
    assert len(profiles) == len(config["profiles"]), "schedulerNames must be unique"
    assert {"vram-binpack", "vram-spread"} <= set(profiles)
    for name, profile in profiles.items():
        assert set(profile) <= PROFILE_FIELDS, name
        plugins = profile.get("plugins") or {}
        assert set(plugins) <= EXTENSION_POINTS, name
        assert "queueSort" not in plugins, f"{name}: every profile must share the queue sort"
    for name, strategy in (("vram-binpack", "MostAllocated"), ("vram-spread", "LeastAllocated")):
        profile = profiles[name]
        (fit,) = [c for c in profile["pluginConfig"] if c["name"] == "NodeResourcesFit"]
        assert set(fit["args"]) <= {"ignoredResources", "ignoredResourceGroups", "scoringStrategy"}
        scoring = fit["args"]["scoringStrategy"]
        assert set(scoring) <= {"type", "resources", "requestedToCapacityRatio"}
        assert scoring["type"] == strategy
        weights = {r["name"]: r["weight"] for r in scoring["resources"]}
        assert all(isinstance(w, int) and 1 <= w <= 100 for w in weights.values())
        assert weights[RESOURCE] > max(weights.get("cpu", 0), weights.get("memory", 0))
        # a resource weight scales within the plugin's score; the plugin weight across plugins
        scored = {p["name"]: p.get("weight", 1) for p in profile["plugins"]["score"]["enabled"]}
        assert scored["NodeResourcesFit"] > 1


def test_workloads_name_profiles_that_exist() -> None:
    profiles = {p["schedulerName"] for _, c in SCHEDULER_CONFIGS for p in c["profiles"]}
    used = {
        pod["spec"]["schedulerName"] for _, pod in POD_TEMPLATES if "schedulerName" in pod["spec"]
    }
    assert used == {"vram-binpack", "vram-spread"}
    assert used <= profiles


# --- on the API server ------------------------------------------------------------------------


def selects(webhook: client.V1MutatingWebhook, labels: dict[str, str]) -> bool:
    selector = webhook.namespace_selector
    if selector is None or (not selector.match_labels and not selector.match_expressions):
        return True
    if selector.match_expressions:
        return True  # not worth evaluating: assume the worst
    return all(labels.get(k) == v for k, v in selector.match_labels.items())


@pytest.fixture(scope="module")
def created(admin: client.ApiClient) -> dict[str, Doc]:
    """Every API object, created in dependency order; returns them as stored, by id."""
    (namespace,) = [d for _, d in API_OBJECTS if d["kind"] == "Namespace"]
    hooks = client.AdmissionregistrationV1Api(admin).list_mutating_webhook_configuration().items
    leaked = [
        h.metadata.name
        for h in hooks
        if any(selects(w, namespace["metadata"]["labels"]) for w in h.webhooks or [])
    ]
    assert not leaked, (
        f"webhook configurations left by another module would mutate {NAMESPACE}: {leaked}"
    )
    ordered = sorted(API_OBJECTS, key=lambda item: item[1]["kind"] != "Namespace")
    stored = {}
    for item in ordered:
        (obj,) = utils.create_from_dict(admin, copy.deepcopy(item[1]), namespace=NAMESPACE)
        stored[object_id(item)] = admin.sanitize_for_serialization(obj)
    return stored


def test_every_object_is_accepted_by_the_api_server(created: dict[str, Doc]) -> None:
    assert set(created) == {object_id(item) for item in API_OBJECTS}
    for item in API_OBJECTS:
        doc, obj = item[1], created[object_id(item)]
        assert obj["metadata"]["uid"]
        assert obj["kind"] == doc["kind"]
        assert obj["metadata"]["name"] == doc["metadata"]["name"]


def test_pods_are_stored_as_written(created: dict[str, Doc], core: client.CoreV1Api) -> None:
    for item in API_OBJECTS:
        doc = item[1]
        if doc["kind"] != "Pod":
            continue
        pod = core.read_namespaced_pod(doc["metadata"]["name"], NAMESPACE)
        assert [c.name for c in pod.spec.containers] == [
            c["name"] for c in doc["spec"]["containers"]
        ]
        assert not pod.spec.share_process_namespace  # no webhook in this test
        for stored, written in zip(pod.spec.containers, doc["spec"]["containers"], strict=True):
            limits = {k: quantity(v) for k, v in stored.resources.limits.items()}
            assert limits == {k: quantity(v) for k, v in written["resources"]["limits"].items()}
            # the API server defaulted the requests from the limits, as the scheduler sees them
            requests = {k: quantity(v) for k, v in stored.resources.requests.items()}
            assert requests == effective_requests(written)


def test_the_job_and_its_script_are_stored(
    created: dict[str, Doc], admin: client.ApiClient
) -> None:
    job = client.BatchV1Api(admin).read_namespaced_job("pytorch-overrun", NAMESPACE)
    assert job.spec.backoff_limit == 0
    assert job.spec.template.spec.restart_policy == "Never"
    config_map = client.CoreV1Api(admin).read_namespaced_config_map("pytorch-overrun", NAMESPACE)
    assert "torch.empty(512 * 2**20" in config_map.data["overrun.py"]
