"""The webhook's side of the allocation gate (issue 45, step 2): each declaring container
whose seccomp profile is unset or RuntimeDefault gets `Localhost` vram-enforcer/gpu-v1.json;
never the sidecar, a privileged container, one that adds capabilities or one with a profile
of its own (each said, with why); never a pod only reported on; off by default. The sidecar
of a pod with a gated container is told so, and of no other (its holder, issue 45)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from enforcer.core.admission import mutate
from enforcer.core.admission.gate import why_not_gated
from enforcer.core.tenancy import ALL_ACTIONS, Bounds, Tenancy
from tests.unit.test_admission import NATIVE, applied, env_of, gpu, pod, sidecar_of

GATED = {"type": "Localhost", "localhostProfile": "vram-enforcer/gpu-v1.json"}
ON = dataclasses.replace(NATIVE, allocation_gate=True)
HOLDER = "VRAM_ENFORCER_ALLOCATION_GATE"  # the sidecar's: hold the pod's listener fds


def profile_of(c: dict[str, Any]) -> object:
    return (c.get("securityContext") or {}).get("seccompProfile")


def test_declaring_containers_get_the_gates_profile_and_nothing_else_does() -> None:
    out = applied(
        pod(
            gpu("trainer"),
            gpu("default", securityContext={"seccompProfile": {"type": "RuntimeDefault"}}),
            gpu("cpu-only", None),
            init=[gpu("warm-up")],
        ),
        ON,
    )
    trainer, default, cpu_only = out["spec"]["containers"]
    assert profile_of(trainer) == profile_of(default) == GATED
    assert profile_of(cpu_only) is None  # declares nothing: left as it came
    warm_up = next(c for c in out["spec"]["initContainers"] if c["name"] == "warm-up")
    assert profile_of(warm_up) == GATED
    assert profile_of(sidecar_of(out)) != GATED  # the sidecar is never gated
    assert mutate(out, ON) == []  # a second pass changes nothing


def test_off_by_default() -> None:
    out = applied(pod(gpu("trainer")))
    assert profile_of(out["spec"]["containers"][0]) is None


def test_a_pods_runtime_default_is_replaced_on_its_declaring_containers_only() -> None:
    out = applied(
        pod(
            gpu("trainer"),
            gpu("cpu-only", None),
            securityContext={"seccompProfile": {"type": "RuntimeDefault"}},
        ),
        ON,
    )
    trainer, cpu_only = out["spec"]["containers"]
    assert profile_of(trainer) == GATED
    assert profile_of(cpu_only) is None  # the pod's RuntimeDefault still applies to it
    assert out["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize(
    ("security", "why"),
    [
        ({"capabilities": {"add": ["SYS_ADMIN"]}}, "it adds capabilities (SYS_ADMIN)"),
        (
            {"seccompProfile": {"type": "Localhost", "localhostProfile": "team/mine.json"}},
            "a seccomp profile of its own (team/mine.json)",
        ),
        ({"seccompProfile": {"type": "Unconfined"}}, "its seccomp profile is Unconfined"),
    ],
)
def test_a_container_the_profile_would_change_is_left_alone_and_said(
    security: dict[str, Any], why: str
) -> None:
    said: list[str] = []
    p = pod(gpu("trainer", securityContext=security))
    ops = mutate(p, ON, "", said)
    out = applied(p, ON)
    kept = out["spec"]["containers"][0]["securityContext"]
    assert {k: kept[k] for k in security} == security | (
        {"capabilities": kept["capabilities"]} if "capabilities" in security else {}
    )
    assert profile_of(out["spec"]["containers"][0]) != GATED
    assert ops  # the pod is enforced all the same: sampling holds it
    (line,) = [s for s in said if "allocation gate" in s]
    assert why in line and "'trainer'" in line and "sampling still holds its limit" in line


def test_a_pods_own_localhost_profile_is_left_alone_and_said() -> None:
    said: list[str] = []
    mine = {"type": "Localhost", "localhostProfile": "team/mine.json"}
    out = applied(pod(gpu("trainer"), securityContext={"seccompProfile": mine}), ON)
    mutate(pod(gpu("trainer"), securityContext={"seccompProfile": mine}), ON, "", said)
    assert profile_of(out["spec"]["containers"][0]) is None
    assert any("team/mine.json" in s for s in said)


@pytest.mark.parametrize("action", ["warn", "dry-run"])
def test_a_pod_only_reported_on_is_not_gated(action: str) -> None:
    """The gate refuses allocations: that is enforcing, which such a pod asked not to be."""
    settings = dataclasses.replace(ON, tenancy=Tenancy(Bounds(actions=ALL_ACTIONS)))
    out = applied(pod(gpu("trainer"), annotations={"vram-enforcer.io/action": action}), settings)
    assert profile_of(out["spec"]["containers"][0]) is None


def test_a_privileged_container_is_never_gated() -> None:
    """No seccomp profile applies to it (a declaring pod's privileged container is denied
    anyway: it could reach the sidecar's memory)."""
    assert "privileged" in str(why_not_gated({"securityContext": {"privileged": True}}, {}))
    assert why_not_gated({}, {}) is None
    assert why_not_gated({}, {"type": "Unconfined"}) == "its seccomp profile is Unconfined"


def test_a_container_that_adds_only_default_capabilities_is_gated() -> None:
    """Every capability Pod Security `baseline` lets a pod add is in the runtime's default
    set, for which the file is RuntimeDefault: adding one widens no runtime's RuntimeDefault,
    so the container is gated (any case, `CAP_` or not, as the runtimes read them). One
    outside the set keeps it out, and only that one is named."""
    said: list[str] = []
    added = {"capabilities": {"add": ["NET_BIND_SERVICE", "cap_chown", "CAP_SETUID"]}}
    p = pod(gpu("trainer", securityContext=added))
    mutate(p, ON, "", said)
    assert profile_of(applied(p, ON)["spec"]["containers"][0]) == GATED
    assert not [s for s in said if "allocation gate" in s]
    assert why_not_gated({"securityContext": {"capabilities": {"add": ["NET_RAW"]}}}, {}) is None
    wider = {"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "SYS_NICE"]}}}
    assert why_not_gated(wider, {}) == (
        "it adds capabilities (SYS_NICE), with which RuntimeDefault allows more than the "
        "gate's profile"
    )


def holds(out: dict[str, Any]) -> object:
    """What the webhook told the pod's sidecar of its holder (None: nothing)."""
    return env_of(sidecar_of(out)).get(HOLDER)


@pytest.mark.parametrize(
    ("p", "settings", "want"),
    [
        (pod(gpu("trainer")), ON, "on"),
        (pod(gpu("cpu-only", None), init=[gpu("warm-up")]), ON, "on"),  # an init container
        (pod(gpu("trainer")), NATIVE, None),  # the gate off: no holder
        (
            pod(gpu("trainer", securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})),
            ON,
            None,
        ),
        (pod(gpu("trainer", securityContext={"seccompProfile": {"type": "Unconfined"}})), ON, None),
        (pod(gpu("trainer"), annotations={"vram-enforcer.io/action": "warn"}), ON, None),
        # Its author's choice, the gate off here: gated all the same on a node with the file.
        (pod(gpu("trainer", securityContext={"seccompProfile": GATED})), NATIVE, "on"),
        (
            pod(gpu("trainer"), gpu("cpu-only", None), securityContext={"seccompProfile": GATED}),
            NATIVE,
            "on",
        ),
    ],
)
def test_the_sidecar_holds_the_pods_fds_exactly_where_a_container_runs_under_the_profile(
    p: dict[str, Any], settings: Any, want: str | None
) -> None:
    """`VRAM_ENFORCER_ALLOCATION_GATE=on` on the sidecar of a pod with at least one
    container under the gate's profile; nothing on any other, whose sidecar then runs no
    holder (no thread, no socket)."""
    settings = dataclasses.replace(settings, tenancy=Tenancy(Bounds(actions=ALL_ACTIONS)))
    out = applied(p, settings)
    assert holds(out) == want
    assert mutate(out, settings) == []  # a second pass changes nothing


@pytest.mark.parametrize("forged", ["off", "on", None])
def test_a_pod_never_chooses_its_sidecars_holder(forged: str | None) -> None:
    """The sidecar is the webhook's, replaced whole on every pass: a pod that names it
    with the holder switched off (or on, or absent) gets ours, on where it is gated and
    absent where it is not."""
    for p, want in (
        (pod(gpu("trainer")), "on"),
        (
            pod(
                gpu("cpu", None),
                gpu("t", "1Gi", securityContext={"seccompProfile": {"type": "Unconfined"}}),
            ),
            None,
        ),
    ):
        genuine = applied(p, ON)
        assert holds(genuine) == want
        tampered = copy.deepcopy(genuine)
        side = sidecar_of(tampered)
        side["env"] = [e for e in side["env"] if e["name"] != HOLDER]
        if forged is not None:
            side["env"].append({"name": HOLDER, "value": forged})
        out = applied(tampered, ON)
        assert holds(out) == want
        assert sidecar_of(out) == sidecar_of(genuine)
