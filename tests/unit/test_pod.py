from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.pod import (
    ContainerRef,
    container_limits,
    containers_by_id,
    others_finished,
    sole_container,
    spec_field_of,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64


def pod(policy: str = "Never", states: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    states = states or {}
    return {
        "spec": {
            "restartPolicy": policy,
            "containers": [{"name": "trainer"}, {"name": "vram-enforcer"}],
            "initContainers": [{"name": "fetch"}],
        },
        "status": {
            "initContainerStatuses": [
                {
                    "name": "fetch",
                    "containerID": f"containerd://{C}",
                    "state": {"terminated": {"exitCode": 0}},
                }
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "containerID": f"containerd://{A}",
                    "state": states.get("trainer", {"running": {}}),
                },
                {
                    "name": "vram-enforcer",
                    "containerID": f"containerd://{B}",
                    "state": {"running": {}},
                },
                {
                    "name": "waiting",
                    "state": states.get("waiting", {"waiting": {"reason": "ContainerCreating"}}),
                },
            ],
        },
    }


def test_containers_by_id_covers_init_containers_and_skips_uncreated_ones() -> None:
    refs = containers_by_id(pod())
    assert refs == {
        C: ContainerRef("fetch", "initContainers"),
        A: ContainerRef("trainer", "containers"),
        B: ContainerRef("vram-enforcer", "containers"),
    }
    assert refs[C].field_path == "spec.initContainers{fetch}"
    assert containers_by_id({}) == {}


def test_a_container_without_a_declaration_is_held_to_zero_unless_allowed() -> None:
    refs = [ContainerRef("trainer", "containers"), ContainerRef("fetch", "initContainers")]
    assert container_limits({"trainer": 8}, refs, undeclared_allowed=False) == {
        "trainer": 8,
        "fetch": 0,
    }
    assert container_limits({"trainer": 8}, refs, undeclared_allowed=True) == {"trainer": 8}


def test_only_a_sole_container_with_a_sole_id_is_proven_without_the_status() -> None:
    assert sole_container(["trainer"], {A}) == {A: ContainerRef("trainer", "containers")}
    assert sole_container(["trainer"], {A, C}) == {}  # a restart or an ephemeral container
    assert sole_container(["trainer", "helper"], {A}) == {}
    assert sole_container(["trainer"], set()) == {}


def test_spec_field_of() -> None:
    assert spec_field_of(pod(), "fetch") == "initContainers"
    assert spec_field_of(pod(), "trainer") == "containers"
    assert spec_field_of({}, "x") == "containers"


def test_others_finished_follows_the_restart_policy() -> None:
    done_ok = {
        "trainer": {"terminated": {"exitCode": 0}},
        "waiting": {"terminated": {"exitCode": 0}},
    }
    failed = {
        "trainer": {"terminated": {"exitCode": 1}},
        "waiting": {"terminated": {"exitCode": 0}},
    }
    assert not others_finished(pod("Never"), "vram-enforcer")  # trainer still running
    assert others_finished(pod("Never", done_ok), "vram-enforcer")
    assert others_finished(pod("Never", failed), "vram-enforcer")
    assert others_finished(pod("OnFailure", done_ok), "vram-enforcer")
    assert not others_finished(pod("OnFailure", failed), "vram-enforcer")  # it will be restarted
    assert not others_finished(pod("Always", done_ok), "vram-enforcer")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "status",
                    "spec",
                    "containerStatuses",
                    "initContainers",
                    "name",
                    "containerID",
                    "state",
                    "terminated",
                    "exitCode",
                    "restartPolicy",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=25,
)


@given(pod=st.dictionaries(st.sampled_from(["spec", "status", "metadata"]), json_values))
def test_a_pod_of_any_shape_is_read_without_an_exception(pod: dict[str, Any]) -> None:
    """The pod comes from the API server; a shape we did not expect means "not known"."""
    assert isinstance(containers_by_id(pod), dict)
    assert others_finished(pod, "vram-enforcer") in (True, False)
    assert spec_field_of(pod, "trainer") in ("containers", "initContainers", "ephemeralContainers")
