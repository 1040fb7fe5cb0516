"""Property tests of the webhook's decision: any JSON gets a well-formed answer, and a
second pass over the webhook's own output changes nothing."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from enforcer.webhook.admission import AdmissionSettings, BadReview, review

RES = "vram-enforcer.io/vram"
SETTINGS = [
    AdmissionSettings("img:1", "native", RES, 1),
    AdmissionSettings("img:1", "container", RES, 1024**3, framework_env=False, shm_default="1Gi",
                      gpu_exposure="env", runtime_class="nvidia"),
]  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
valid_quantities = st.sampled_from(["1", "3", "12Gi", "512Mi", "0", "8G"])
bad_quantities = st.sampled_from(["1.5", "-1Gi", "1500m", "12GB", "", "x"])
ANNOTATIONS = [
    ("vram-enforcer.io/action", ["kill", "restart", "warn", "terminate"], ["boom"]),
    ("vram-enforcer.io/grace-period", ["5s", "1m30s", "0"], ["5"]),
    ("vram-enforcer.io/warn-at", ["80%", "100%"], ["150%", "0.9"]),
    ("vram-enforcer.io/shm-size", ["auto", "off", "2Gi"], ["lots"]),
    ("vram-enforcer.io/inject", ["true", "enabled"], ["false"]),
    ("example.com/other", ["anything"], ["anything"]),
]
env_names = st.sampled_from(
    ["VRAM_LIMIT_BYTES", "XLA_PYTHON_CLIENT_PREALLOCATE", "PATH", "NVIDIA_VISIBLE_DEVICES"]
)


@st.composite
def containers(draw: st.DrawFn, name: str) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "img"}
    limits = draw(st.dictionaries(st.sampled_from(["memory", "cpu"]), valid_quantities, max_size=2))
    requests: dict[str, str] = {}
    # Mostly well-declared, so that most pods get patched; one in seventeen exercises a denial.
    vram = draw(
        st.sampled_from(
            ["none", "none", "limit", "limit", "limit", "limit", "both", "both"] * 2 + ["broken"]
        )
    )
    if vram in ("limit", "both"):
        limits[RES] = draw(valid_quantities)
    if vram == "both":
        requests[RES] = limits[RES]
    if vram == "broken":
        kind = draw(st.sampled_from(["bad-limit", "request-only", "differ"]))
        limits[RES] = draw(bad_quantities) if kind == "bad-limit" else "2Gi"
        if kind != "bad-limit":
            requests[RES] = "1Gi"
        if kind == "request-only":
            del limits[RES]
    if limits or requests:
        c["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    if draw(st.booleans()):
        c["env"] = [
            {"name": n, "value": "v"} for n in draw(st.lists(env_names, max_size=3, unique=True))
        ]
    if draw(st.booleans()):
        c["volumeMounts"] = [
            {"name": "dshm", "mountPath": draw(st.sampled_from(["/dev/shm", "/data"]))}
        ]
    return c


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(
        st.lists(
            st.sampled_from(["a", "b", "c", "d", "e", "f"]),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    split = draw(st.integers(0, len(names) - 1))
    spec: dict[str, Any] = {"containers": [draw(containers(n)) for n in names[split:]]}
    if split:
        spec["initContainers"] = [draw(containers(n)) for n in names[:split]]
    if draw(st.integers(0, 9)) == 0:
        spec["hostPID"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["automountServiceAccountToken"] = False
    if draw(st.booleans()):
        spec["volumes"] = [
            {"name": draw(st.sampled_from(["dshm", "vram-enforcer-shm"])), "emptyDir": {}}
        ]
    annotations: dict[str, str] = {}
    for key, good, bad in ANNOTATIONS:
        if draw(st.integers(0, 3)) == 0:  # each annotation in one pod of four
            annotations[key] = draw(
                st.sampled_from(bad) if draw(st.integers(0, 7)) == 0 else st.sampled_from(good)
            )
    meta: dict[str, Any] = {"generateName": "p-", "namespace": "ml"}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def wrap(obj: Any) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "object": obj}}  # fmt: skip


def well_formed(answer: dict[str, Any], uid: str) -> list[dict[str, Any]]:
    """Check the AdmissionReview shape; return the decoded patch ([] when none)."""
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    json.dumps(answer)  # serialisable
    if not response["allowed"]:
        assert response["status"]["message"] and response["status"]["code"] in (400, 403)
        assert "patch" not in response
        return []
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    assert ops and all(isinstance(op, dict) and "op" in op for op in ops)
    return ops


@settings(max_examples=300)
@given(doc=json_values, s=st.sampled_from(SETTINGS))
def test_any_json_gets_a_well_formed_answer_or_bad_review(doc: Any, s: AdmissionSettings) -> None:
    try:
        out = review(doc, s)
    except BadReview:
        return
    well_formed(out.review, doc["request"]["uid"])


@settings(max_examples=300)
@given(obj=json_values, s=st.sampled_from(SETTINGS))
def test_any_object_in_a_review_gets_a_well_formed_answer(obj: Any, s: AdmissionSettings) -> None:
    well_formed(review(wrap(obj), s).review, "u-1")


@settings(max_examples=400)
@given(p=pods(), s=st.sampled_from(SETTINGS))
def test_a_second_pass_over_the_webhooks_own_output_yields_no_patch(
    p: dict[str, Any], s: AdmissionSettings
) -> None:
    out = review(wrap(p), s)
    event(out.result)
    ops = well_formed(out.review, "u-1")
    if not ops:
        return
    mutated = jsonpatch.apply_patch(p, ops)
    declared = json.loads(next(e["value"] for c in mutated["spec"].get("initContainers", []) + mutated["spec"]["containers"]
                               if c["name"] == "vram-enforcer" for e in c["env"] if e["name"] == "VRAM_ENFORCER_LIMITS"))  # fmt: skip
    assert declared and all(isinstance(v, int) and v >= 0 for v in declared.values())
    again = review(wrap(mutated), s)
    assert well_formed(again.review, "u-1") == []
    assert again.result == "skipped"
