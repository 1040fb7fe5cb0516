"""What the agent keeps of its node's pods, and the replies it makes of them (pure).

Any tenant on the node can make its pods large, and the agent holds every pod of its node:
it keeps only what it and the sidecars read (`kept`). Whether that is all they read is
decided by running every reader on the pod as the API server sends it and on what is
kept, as the agent holds it and as the sidecar decodes it from the agent's reply: a reader
of a field that is not kept reads something else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from enforcer.core.declaration import (
    ENFORCED,
    SIDECAR,
    Declares,
    container_env,
    dra_ceilings,
    of_pod,
)
from enforcer.core.dra import DraObjects, DraSettings, allocations, claim_names, container_claims
from enforcer.core.hard_limits import TOOLKIT_LIMIT_ENV, owner
from enforcer.core.last_enforcement import seen
from enforcer.core.lending import tenants
from enforcer.core.model import Action, GiB, MiB
from enforcer.core.owed import Claims, pod_owed
from enforcer.core.owners import Owner, owner_of
from enforcer.core.payloads import Pod
from enforcer.core.pod import containers_by_id, json_map, json_maps, others_finished, spec_field_of
from enforcer.core.pod_directory import DraRead, directory, event_about, kept
from enforcer.core.policy import PolicyConfig
from enforcer.core.protocol import PodReply, decode_reply, encode_pod
from enforcer.core.reasons import Reason
from enforcer.core.settings.sidecar import pod_policy
from enforcer.core.sidecar_presence import guarded, reachable, sidecar_id

RES = "vram-enforcer.io/vram"
BASIS = 80 * GiB  # one GPU's memory, for KAI's portions
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dra"
A, B, C, D, E, F = (d * 64 for d in "abcdef")

Doc = dict[str, Any]


def load(name: str) -> Doc:
    doc: Doc = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


CLAIM = load("claim")
DRA = DraObjects({CLAIM["metadata"]["name"]: CLAIM}, (load("slice"),))


def status(name: str, cid: str, **state: Any) -> Doc:
    return {
        "name": name,
        "containerID": f"containerd://{cid}",
        "ready": True,
        "restartCount": 2,
        "image": "registry/x:1",
        "imageID": "sha256:...",
        "lastState": {},
        "state": state or {"running": {"startedAt": "2026-11-26T10:00:00Z"}},
    }


def variable(name: str, value: object) -> Doc:
    return {"name": name, "value": value if isinstance(value, str) else json.dumps(value)}


def sidecar(*env: Doc) -> Doc:
    """The injected sidecar, with the webhook's variables and the Downward API's."""
    downward = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    return {
        "name": SIDECAR,
        "image": "vram-enforcer:0.2.0",
        "restartPolicy": "Always",
        "env": [downward, *env, variable("HTTP_PROXY", "http://proxy:3128")],
        "resources": {"limits": {"cpu": "100m", "memory": "96Mi"}},
        "volumeMounts": [{"name": "vram-enforcer-socket", "mountPath": "/run/vram-enforcer"}],
        "securityContext": {"capabilities": {"add": ["KILL"]}},
    }


def as_sent(pod: Doc, name: str, namespace: str, labels: Doc) -> Doc:
    """What the API server adds to a pod: metadata, managedFields, spec defaults, status."""
    pod["apiVersion"], pod["kind"] = "v1", "Pod"
    pod["metadata"] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "resourceVersion": "4242",
        "generation": 1,
        "creationTimestamp": "2026-11-26T10:00:00Z",
        "labels": {ENFORCED: "true", **labels},
        "annotations": {
            "vram-enforcer.io/injected": "true",
            "kubectl.kubernetes.io/last-applied-configuration": json.dumps(pod),
        },
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{name}-5f6", "uid": "r"}
            | {"controller": True, "blockOwnerDeletion": True}
        ],
        "managedFields": [
            {
                "manager": "kubectl",
                "operation": "Update",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:containers": {}}},
            }
        ],
    }
    pod["spec"].update(
        {
            "nodeName": "gpu-1",
            "shareProcessNamespace": True,
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "volumes": [{"name": "vram-enforcer-socket", "emptyDir": {}}],
        }
    )
    pod["status"].update(
        {
            "qosClass": "Burstable",
            "podIP": "10.0.0.5",
            "hostIP": "192.168.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
            "startTime": "2026-11-26T10:00:00Z",
        }
    )
    return pod


def declared() -> Doc:
    """Limits in resources (one container may borrow up to a ceiling), the policy in the
    sidecar's environment, a helper that has finished, a debugging ephemeral container."""
    trainer = {
        "name": "trainer",
        "image": "pytorch",
        "command": ["python", "train.py"],
        "args": ["--epochs", "10"],
        "env": [
            variable("VRAM_ENFORCER_ACTION", "warn"),
            # NVIDIA's toolkit hook's, twice (the kubelet keeps the last)
            variable("NVIDIA_GPU_MEMORY_LIMIT", "4096"),
            variable("NVIDIA_GPU_MEMORY_LIMIT", "8192"),
        ],
        "resources": {"limits": {RES: "8Gi", "cpu": "4"}, "requests": {RES: "8Gi"}},
    }
    pod = {
        "spec": {
            "restartPolicy": "OnFailure",
            "priority": 100,
            "initContainers": [
                sidecar(
                    variable("VRAM_ENFORCER_CEILINGS", {"trainer": 16 * GiB}),
                    variable("VRAM_ENFORCER_ACTION", "kill"),
                    variable("VRAM_ENFORCER_GRACE_PERIOD", "5s"),
                    variable("VRAM_ENFORCER_WARN_AT", "80%"),
                )
            ],
            "containers": [trainer, {"name": "helper", "image": "busybox", "resources": {}}],
            "ephemeralContainers": [{"name": "debug", "image": "busybox", "stdin": True}],
        },
        "status": {
            "phase": "Running",
            "initContainerStatuses": [status(SIDECAR, A)],
            "containerStatuses": [
                status("trainer", B),
                status(
                    "helper",
                    C,
                    terminated={"exitCode": 0, "reason": "Completed", "message": "done " * 800},
                ),
            ],
            "ephemeralContainerStatuses": [status("debug", D, waiting={"reason": "Pulling"})],
        },
    }
    return as_sent(pod, "train", "ml", {"app": "train", "pod-template-hash": "5f6"})


def kai() -> Doc:
    """KAI's share frozen into the sidecar's environment, the sidecar a regular container of
    a Job that is over but for it."""
    portions = {"trainer": {"request": "0.5", "ceiling": "0.8"}}
    pod = {
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "trainer", "image": "pytorch"},
                sidecar(
                    variable("VRAM_ENFORCER_LIMITS", {}),
                    variable("VRAM_ENFORCER_PORTIONS", portions),
                    variable("VRAM_ENFORCER_SIDECAR_MODE", "container"),
                ),
            ],
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                status(SIDECAR, A),
                status("trainer", B, terminated={"exitCode": 1}),
            ],
        },
    }
    return as_sent(pod, "kai", "ml", {"runai/queue": "a"})


def dra() -> Doc:
    """The captured DRA pod, injected and started: its claim is its limit, raised to a ceiling."""
    pod = load("pod")
    ceilings = variable("VRAM_ENFORCER_CEILINGS", {"c": 8 * GiB})
    pod["spec"]["initContainers"] = [
        sidecar(variable("VRAM_ENFORCER_LIMITS_FROM", "dra"), ceilings)
    ]
    pod["status"].update(
        phase="Running",
        containerStatuses=[status("c", E)],
        initContainerStatuses=[status(SIDECAR, F)],
    )
    pod["metadata"]["labels"] = {ENFORCED: "true"}
    return pod


def refused() -> Doc:
    """A request that differs from the limit: the API server refuses it, and the readers
    check it (nothing is declared)."""
    pod = declared()
    pod["spec"]["containers"][0]["resources"]["requests"][RES] = "4Gi"
    return pod


POD_KINDS: dict[str, Callable[[], Doc]] = {
    "declared": declared,
    "kai": kai,
    "dra": dra,
    "refused": refused,
}


def readings(pod: Pod) -> dict[str, object]:
    """What every reader of a pod in the agent and in the sidecar makes of it."""
    spec, status_, meta = (json_map(pod.get(k)) for k in ("spec", "status", "metadata"))
    names = {
        str(c.get("name"))
        for k in ("initContainers", "containers", "ephemeralContainers")
        for c in json_maps(spec.get(k))
    } | {"nobody"}
    found = allocations(pod, DRA.claims, DRA.slices, DraSettings(), {})
    opted_in = {str(meta.get("namespace"))}  # its sidecar's environment is read
    declaration = of_pod(pod, Declares(RES), opted_in=opted_in)
    ceilings = dra_ceilings(declaration)
    claims = Claims(DRA, DraSettings(), {})
    owed = pod_owed(pod, Declares(RES), opted_in=opted_in, basis=BASIS, claims=None)
    from_claims = pod_owed(pod, Declares(RES), opted_in=opted_in, basis=BASIS, claims=claims)
    return {
        # every reply, Event and signal: which container a process is in, and where it is
        "containers": containers_by_id(pod),
        "spec_fields": {n: spec_field_of(pod, n) for n in sorted(names)},
        "events": [event_about(pod, n) for n in [*sorted(names), None]],
        # the sidecar's end in `container` mode
        "finished": {n: others_finished(pod, n) for n in sorted(names)},
        # the limits: the hard limiter, the lender, the backstop (with its policy)
        "declaration": declaration,
        "vram": owed,
        "dra_ceilings": ceilings,
        "policy": pod_policy(pod, SIDECAR, opted_in),
        "claims": (claim_names(pod), container_claims(pod), found),
        "from_claims": from_claims,
        "tenants": tenants([(pod, from_claims)], {}).all,
        # whose a limit the hard limiter did not set is (the toolkit's, or unknown)
        "limit_owner": {
            n: (owner(set(container_env(pod, n))), container_env(pod, n).get(TOOLKIT_LIMIT_ENV))
            for n in sorted(names)
        },
        # the sidecar watch
        "presence": (guarded(pod), sidecar_id(pod), reachable(pod)),
        # a pod's last enforcement: the instance of the container, its restarts
        "condition": [seen(Reason.ENFORCED, pod, n, ()) for n in sorted(names)],
        # read in the modes themselves: what changed (the limiter, the claim cache), whether
        # the pod runs (the limiter), whom an Event or a log line names
        # the pod's owner series
        "owner": owner_of(pod),
        "direct": [meta.get(k) for k in ("uid", "namespace", "name", "resourceVersion")]
        + [status_.get("phase")],
    }


def sent(pod: Pod) -> Pod:
    """The pod as a sidecar decodes it from the agent's reply."""
    reply = decode_reply(encode_pod(PodReply(pod)))
    assert isinstance(reply, PodReply) and reply.pod is not None
    return reply.pod


@pytest.mark.parametrize("kind", POD_KINDS)
def test_every_reader_reads_the_same_of_what_the_agent_keeps(kind: str) -> None:
    pod = cast(Pod, POD_KINDS[kind]())
    whole = readings(pod)
    assert readings(kept(pod)) == whole
    assert readings(sent(kept(pod))) == whole


def test_the_pods_reach_every_reader() -> None:
    """The comparison above means something only where the readers find something."""
    got = {kind: readings(cast(Pod, make())) for kind, make in POD_KINDS.items()}
    assert [r.name for r in cast(dict[str, Any], got["declared"]["containers"]).values()] == [
        SIDECAR,
        "trainer",
        "helper",
        "debug",
    ]
    assert got["declared"]["spec_fields"] == {
        SIDECAR: "initContainers",
        "debug": "ephemeralContainers",
        "helper": "containers",
        "nobody": "containers",
        "trainer": "containers",
    }
    assert got["declared"]["presence"] == (True, A, A)
    assert cast(PolicyConfig, got["declared"]["policy"]).action is Action.KILL
    units = [t.unit for t in cast(tuple[Any, ...], got["declared"]["tenants"])]
    assert units == ["ml/train/trainer"]
    (trainer,) = cast(Any, got["declared"]["vram"]).owed.units
    assert (str(trainer.unit), trainer.request) == ("trainer", 8 * GiB)
    assert got["kai"]["finished"] == {SIDECAR: True, "nobody": False, "trainer": False}
    (kai,) = cast(Any, got["kai"]["vram"]).owed.units
    assert kai.ceiling == int(0.8 * BASIS // MiB) * MiB
    assert cast(Any, got["dra"]["claims"])[2].units and got["dra"]["dra_ceilings"] == {"c": 8 * GiB}
    assert cast(Any, got["dra"]["from_claims"]).owed.claimed
    assert "differs from limits" in str(got["refused"]["declaration"])
    assert got["declared"]["owner"] == Owner("Deployment", "train")
    assert got["kai"]["owner"] == Owner("ReplicaSet", "kai-5f6")


def hostile(pod: Doc, size: int = MiB) -> Doc:
    """The pod with `size` bytes more in each of the places a tenant may fill: annotations,
    labels, the workload's environment and command, the sidecar's other variables, and the
    managedFields that name them."""
    many = [f"tenant.example/k{i:06}" for i in range(size // 128)]
    meta, spec = pod["metadata"], pod["spec"]
    meta["annotations"].update(dict.fromkeys(many, "x" * 100))
    meta["labels"].update({f"k{i:06}": "v" * 50 for i in range(size // 64)})
    meta["managedFields"].append({"fieldsV1": {"f:metadata": {f"f:{k}": {} for k in many}}})
    owners = [
        {"kind": "K" * 100, "name": "n" * 300, "controller": i % 2 == 0} for i in range(size // 512)
    ]
    meta["ownerReferences"] += [*owners, {"kind": "Job", "name": "x" * size, "controller": True}]
    work = spec["containers"][0]
    work.setdefault("env", []).extend(variable(f"E{i:06}", "x" * 100) for i in range(size // 128))
    work["command"] = ["sh", "-c", "x" * size]
    mine = next(c for c in spec["initContainers"] if c["name"] == SIDECAR)
    mine["env"] += [variable(f"T{i:06}", "x" * 100) for i in range(size // 128)]
    return pod


def test_a_tenants_pod_of_megabytes_is_kept_in_a_few_kilobytes() -> None:
    pod = cast(Pod, hostile(declared()))
    assert len(json.dumps(pod)) > 5 * MiB
    trimmed = kept(pod)
    assert len(encode_pod(PodReply(trimmed))) < 4096
    assert readings(trimmed) == readings(pod)


OPTED_IN = frozenset({"ml", "dra"})  # the namespaces of declared() and dra()


def test_a_reply_is_encoded_again_only_when_its_pod_changed() -> None:
    """A change of one pod encodes that pod's reply, not the node's: the others are the
    same bytes as before (what the socket compares before it pushes). A and F: the
    sidecars of declared() and dra()."""
    one, two = kept(cast(Pod, declared())), kept(cast(Pod, dra()))
    read = {two["metadata"]["uid"]: DraRead(DRA)}
    first = directory([one, two], read, None, opted_in=OPTED_IN)
    again = directory([one, two], read, None, first, opted_in=OPTED_IN)
    assert again.replies == first.replies
    assert again.replies[A] is first.replies[A] and again.replies[F] is first.replies[F]
    changed = kept(cast(Pod, declared()))
    changed["status"]["phase"] = "Succeeded"
    after = directory([changed, two], read, None, again, opted_in=OPTED_IN)
    assert after.replies[F] is first.replies[F]
    alone = directory([changed], {}, None, opted_in=OPTED_IN)
    assert after.replies[A] == alone.replies[A] != first.replies[A]
    # The claims read again, or the watch's health: the replies that carry them change.
    failed = {two["metadata"]["uid"]: DraRead(DRA, "forbidden")}
    reread = directory([changed, two], failed, None, after, opted_in=OPTED_IN)
    assert reread.replies[A] is after.replies[A] and b"forbidden" in reread.replies[F]
    outage = directory([changed, two], failed, "the API is away", reread, opted_in=OPTED_IN)
    assert all(b"the API is away" in reply for reply in outage.replies.values())


def test_only_the_sidecar_of_an_injected_pod_is_served() -> None:
    """Issue 42, items 10 and 11: the pod's other containers (B, C, D) are told why not; so
    is every container of a pod that carries the label and a container under the sidecar's
    name in a namespace that did not opt in; a container ID that two pods list is neither's.
    """
    one = kept(cast(Pod, declared()))
    forged = kept(cast(Pod, as_sent(declared(), "forged", "elsewhere", {})))
    for field in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for i, cs in enumerate(forged["status"][field]):  # its own containers: E, 0..., 1...
            cs["containerID"] = f"containerd://{E if cs['name'] == SIDECAR else str(i) * 64}"
    found = directory([one, forged], {}, None, opted_in=OPTED_IN)
    assert found.replies.keys() == found.pods.keys() == {A}
    assert found.refusal(A) is None
    assert "'trainer' of pod ml/train is not its vram-enforcer sidecar" in str(found.refusal(B))
    assert found.refusal(D) == found.refusals[D]  # the ephemeral container, named in the status
    assert "pod elsewhere/forged was not injected" in str(found.refusal(E))
    assert "no pod on this node lists container" in str(found.refusal("9" * 64))
    assert "in no container" in str(found.refusal(None))
    # The forged pod lists the real sidecar's ID too (it cannot: only the kubelet writes a
    # status; the rule holds all the same): neither pod's.
    forged["status"]["initContainerStatuses"][0]["containerID"] = f"containerd://{A}"
    clash = directory([one, forged], {}, None, opted_in=OPTED_IN)
    assert A not in clash.replies and "listed by two pods" in str(clash.refusal(A))
