"""`vram-enforcer recommend`'s arithmetic: Prometheus' answers read, each workload's pods'
peaks, a percentile of them, headroom, rounding up; the table and the YAML."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from enforcer.core.model import GiB, MiB
from enforcer.core.owners import Owner
from enforcer.core.parsing import ConfigError
from enforcer.core.recommend import (
    AnswerError,
    Method,
    Observed,
    Queries,
    Read,
    Recommendation,
    manifests,
    observed,
    owners,
    percentile,
    recommend,
    round_up,
    table,
)
from enforcer.core.settings.recommend import parse_selector

P100 = Method(1.0, 0.15, GiB)


def answer(*series: tuple[dict[str, str], object]) -> dict[str, Any]:
    result = [{"metric": labels, "value": [1700000000.0, str(v)]} for labels, v in series]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def peak(pod: str, value: int, container: str = "server", namespace: str = "ml") -> Observed:
    return Observed(namespace, pod, container, value)


def test_the_percentile_is_the_nearest_rank_a_value_that_was_seen() -> None:
    values = [GiB * n for n in (3, 1, 2, 10, 4, 5, 6, 7, 8, 9)]
    assert percentile(values, 1.0) == 10 * GiB
    assert percentile(values, 0.9) == 9 * GiB
    assert (
        percentile(values, 0.95) == 10 * GiB
    )  # rank 9.5, up: 10 pods are too few to leave one out
    assert percentile(values, 0.5) == 5 * GiB
    assert percentile(values, 0.01) == 1 * GiB
    assert percentile([7], 0.5) == 7


def test_a_limit_is_rounded_up_to_whole_steps_and_is_never_0() -> None:
    assert round_up(0, GiB) == GiB
    assert round_up(8 * GiB, GiB) == 8 * GiB
    assert round_up(8 * GiB + 1, GiB) == 9 * GiB
    assert round_up(700 * MiB, 512 * MiB) == 1024 * MiB


def test_each_workloads_pods_make_one_limit_with_its_percentile_and_headroom() -> None:
    """Three pods of one Deployment peaked at 8, 9.5 and 7 GiB: at p100 the highest, plus
    15% (10.925 GiB), rounded up to 11Gi; at p50 the middle one, 9.2 GiB, to 10Gi; a pod
    nothing owns is its own workload."""
    peaks = [
        peak("serve-a", 8 * GiB),
        peak("serve-b", 9 * GiB + 512 * MiB),
        peak("serve-c", 7 * GiB),
        peak("lone", 3 * GiB),
    ]
    owned = {("ml", p): Owner("Deployment", "serve") for p in ("serve-a", "serve-b", "serve-c")}
    declared = [peak("serve-a", 16 * GiB), peak("serve-b", 12 * GiB)]
    serve, lone = sorted(recommend(peaks, owned, P100, declared), key=lambda r: r.owner.kind)
    assert serve == Recommendation(
        "ml",
        Owner("Deployment", "serve"),
        "server",
        3,
        9 * GiB + 512 * MiB,
        9 * GiB + 512 * MiB,
        11 * GiB,
        16 * GiB,
    )
    assert lone == Recommendation(
        "ml", Owner("Pod", "lone"), "server", 1, 3 * GiB, 3 * GiB, 4 * GiB, None
    )
    (median,) = recommend(peaks[:3], owned, Method(0.5, 0.15, GiB))
    assert (median.at_percentile, median.limit, median.peak) == (
        8 * GiB,
        10 * GiB,
        9 * GiB + 512 * MiB,
    )
    (exact,) = recommend(peaks[:1], owned, Method(1.0, 0.0, GiB))
    assert exact.limit == 8 * GiB


def test_containers_namespaces_and_cronjob_runs_are_grouped_as_a_user_names_them() -> None:
    """Each container of a workload has its own limit; the same name in two namespaces is
    two workloads; the runs of a CronJob (Jobs `<cronjob>-<minutes>`) are one."""
    peaks = [
        peak("serve-a", 2 * GiB, "server"),
        peak("serve-a", 1 * GiB, "cache"),
        peak("serve-b", 2 * GiB, "server", namespace="prod"),
        peak("nightly-29412360-abcde", 5 * GiB, "train"),
        peak("nightly-29413800-fghij", 6 * GiB, "train"),
    ]
    owned = {
        ("ml", "serve-a"): Owner("Deployment", "serve"),
        ("prod", "serve-b"): Owner("Deployment", "serve"),
        ("ml", "nightly-29412360-abcde"): Owner("Job", "nightly-29412360"),
        ("ml", "nightly-29413800-fghij"): Owner("Job", "nightly-29413800"),
    }
    found = recommend(peaks, owned, P100, cronjobs={"ml": {"nightly"}})
    assert [(r.namespace, r.owner, r.container, r.pods) for r in found] == [
        ("ml", Owner("CronJob", "nightly"), "train", 2),
        ("ml", Owner("Deployment", "serve"), "cache", 1),
        ("ml", Owner("Deployment", "serve"), "server", 1),
        ("prod", Owner("Deployment", "serve"), "server", 1),
    ]
    without = recommend(peaks, owned, P100)  # the CronJobs not read: each run is its Job
    assert {r.owner for r in without} >= {
        Owner("Job", "nightly-29412360"),
        Owner("Job", "nightly-29413800"),
    }


def test_prometheus_answers_are_read_and_what_is_not_a_peak_is_left_out() -> None:
    got = answer(
        ({"namespace": "ml", "pod": "a", "container": "c", "job": "agent"}, 1073741824),
        ({"namespace": "ml", "pod": "b"}, 5),  # no container
        ({"namespace": "ml", "pod": "c", "container": "c"}, "NaN"),
        ({"namespace": "ml", "pod": "d", "container": "c"}, "-1"),
        ({"namespace": "ml", "pod": "e", "container": "c"}, "+Inf"),
    )
    assert observed(got) == Read([Observed("ml", "a", "c", GiB)], dropped=1)
    who = answer(
        ({"namespace": "ml", "pod": "a", "owner_kind": "Deployment", "owner_name": "serve"}, 1),
        ({"namespace": "ml", "pod": "a", "owner_kind": "ReplicaSet", "owner_name": "serve-1"}, 1),
        ({"namespace": "ml", "pod": "b", "owner_kind": "", "owner_name": "x"}, 1),
    )
    assert owners(who) == Read({("ml", "a"): Owner("ReplicaSet", "serve-1")}, 1)  # one per pod


CLUSTER_ROLE_BINDING = (
    "x\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n"
    "  name: mine\nroleRef: {kind: ClusterRole, name: cluster-admin}"
)


def test_labels_that_are_not_kubernetes_names_are_dropped_and_counted() -> None:
    """Whoever can have a series scraped writes its labels (a tenant's pod with scrape
    annotations): only a namespace, pod, container, kind and name in their Kubernetes form
    is read, so that none can break a line of YAML or drive a terminal."""
    ok = {"namespace": "ml", "pod": "serve-5f6-a", "container": "server"}
    got = answer(
        (ok, GiB),
        (ok | {"container": "c\x1b[31m"}, GiB),
        (ok | {"pod": "a\nb"}, GiB),
        (ok | {"namespace": "Ml"}, GiB),
        (ok | {"namespace": "n" * 64}, GiB),
        (ok | {"container": "c" * 64}, GiB),
        (ok | {"pod": "p" * 254}, GiB),
    )
    assert observed(got) == Read([Observed("ml", "serve-5f6-a", "server", GiB)], 6)
    pod = {"namespace": "ml", "pod": "serve-5f6-a"}
    who = answer(
        (pod | {"owner_kind": "Deployment", "owner_name": CLUSTER_ROLE_BINDING}, 1),
        (pod | {"owner_kind": "Deploy\u202ement", "owner_name": "serve"}, 1),
        (pod | {"owner_kind": "Deployment", "owner_name": "serve"}, 1),
        (pod | {"pod": "serve\x1b]0;x", "owner_kind": "Deployment", "owner_name": "serve"}, 1),
    )
    assert owners(who) == Read({("ml", "serve-5f6-a"): Owner("Deployment", "serve")}, 3)


def test_what_is_printed_quotes_and_escapes_every_value_from_prometheus() -> None:
    """Should a name that is not in its Kubernetes form get this far, it stays one quoted
    value in the YAML (no document of its own, comments included) and one escaped cell in
    the table."""
    hostile = Recommendation(
        "ml\nkind: Secret",
        Owner("Deployment", CLUSTER_ROLE_BINDING),
        "c\x1b[31m",
        1,
        GiB,
        GiB,
        2 * GiB,
        None,
    )
    pasted = manifests([hostile], P100, "7d", "vram-enforcer.io/vram", 1)
    (doc,) = yaml.safe_load_all(pasted)
    assert doc["metadata"] == {"name": CLUSTER_ROLE_BINDING, "namespace": "ml\nkind: Secret"}
    assert doc["spec"]["template"]["spec"]["containers"][0]["name"] == "c\x1b[31m"
    assert "\x1b" not in pasted
    assert all(
        line.startswith(("#", " ", "-", "apiVersion:", "kind:", "metadata:", "spec:"))
        for line in pasted.splitlines()
    )
    shown = table([hostile], P100, "7d")
    assert "\x1b" not in shown
    assert len(shown.splitlines()) == 3
    assert "c\\x1b[31m" in shown


def test_custom_resources_are_told_in_words_not_patched() -> None:
    """A kind that is not a built-in workload keeps its pod templates where its own API
    says (RayCluster's head and worker groups, PyTorchJob's replica specs) and takes no
    strategic merge patch: what to set on which container, as comments."""
    ray = FOUND[3]
    pasted = manifests([ray, FOUND[0]], P100, "7d", "vram-enforcer.io/vram", 1)
    serve, first = pasted.split("---\n")  # by kind
    assert all(line.startswith("#") for line in first.splitlines())
    assert '"RayCluster/ray" in namespace "ml"' in first
    assert (
        '#   "head": resources.limits."vram-enforcer.io/vram": "2Gi"  # peak 1.00 GiB, 1 pod'
        in first
    )
    assert list(yaml.safe_load_all(first)) == []  # nothing to apply
    assert yaml.safe_load(serve)["kind"] == "Deployment"


def test_a_pod_or_a_jobs_limit_is_for_its_next_manifest() -> None:
    pod, job = (
        Recommendation("ml", Owner(kind, "x"), "main", 1, GiB, GiB, 2 * GiB, None)
        for kind in ("Pod", "Job")
    )
    assert "a Pod's containers cannot change" in manifests([pod], P100, "7d", "r.io/v", 1)
    assert "a Job's pod template cannot change" in manifests([job], P100, "7d", "r.io/v", 1)


@pytest.mark.parametrize(
    "got",
    [
        {"status": "success", "data": {"resultType": "matrix", "result": []}},
        {"status": "error", "error": "bad"},
        [],
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}},
        {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "x"]}]},
        },
    ],
)
def test_an_answer_that_is_not_an_instant_vector_is_an_error_that_says_so(got: object) -> None:
    with pytest.raises(AnswerError):
        observed(got)


def test_the_queries_read_peaks_and_undeclared_usage_over_the_window_in_one_namespace() -> None:
    q = Queries("7d", "ml")
    assert 'max_over_time(vram_enforcer_container_peak_bytes{namespace="ml"}[7d])' in q.peaks
    assert (
        '(sum by (namespace, pod, container) (vram_enforcer_undeclared_used_bytes{namespace="ml"}))[7d:]'
        in q.peaks
    )
    assert 'last_over_time(vram_enforcer_pod_owner{namespace="ml"}[7d])' in q.owners
    assert "{" not in Queries("36h").limits
    only = Queries("7d", "ml", 'job="vram-enforcer-agent"')
    assert 'vram_enforcer_pod_owner{namespace="ml",job="vram-enforcer-agent"}[7d]' in only.owners
    every = Queries("7d", selector='job="a",instance=~"10\\..*"')
    for query in (every.peaks, every.limits, every.owners):
        assert query.count('{job="a",instance=~"10\\..*"}') == query.count("vram_enforcer_")


FOUND = [
    Recommendation(
        "ml",
        Owner("Deployment", "serve"),
        "server",
        3,
        9 * GiB + 512 * MiB,
        9 * GiB,
        11 * GiB,
        16 * GiB,
    ),
    Recommendation("ml", Owner("CronJob", "nightly"), "train", 2, 6 * GiB, 6 * GiB, 7 * GiB, None),
    Recommendation("ml", Owner("Pod", "yes"), "main", 1, GiB, GiB, 2 * GiB, None),
    Recommendation("ml", Owner("RayCluster", "ray"), "head", 1, GiB, GiB, 2 * GiB, None),
]


def test_the_table_says_how_each_limit_was_made() -> None:
    text = table(FOUND[:2], P100, "7d")
    assert text.splitlines() == [
        "# limit = p100 of each pod's peak over 7d, + 15% headroom, rounded up to 1Gi",
        "NAMESPACE  WORKLOAD          CONTAINER  PODS  PEAK      P100      LIMIT  DECLARED",
        "ml         Deployment/serve  server     3     9.50 GiB  9.00 GiB  11Gi   16Gi",
        "ml         CronJob/nightly   train      2     6.00 GiB  6.00 GiB  7Gi    -",
    ]


def test_the_yaml_is_each_workloads_manifest_shape_with_its_containers_limits() -> None:
    """Pasted into a manifest, or given to `kubectl patch --patch-file`: each kind's pod
    template where it keeps it, names quoted as strings (a pod named `yes` stays one)."""
    docs = list(yaml.safe_load_all(manifests(FOUND, P100, "7d", "vram-enforcer.io/vram", 1)))
    limits = {"vram-enforcer.io/vram": "11Gi"}
    assert docs[1] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "serve", "namespace": "ml"},
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "server", "resources": {"limits": limits}}]}
            }
        },
    }
    assert (
        docs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["name"]
        == "train"
    )
    assert docs[2]["metadata"]["name"] == "yes"
    assert docs[2]["spec"]["containers"][0]["resources"]["limits"] == {
        "vram-enforcer.io/vram": "2Gi"
    }
    assert docs[3] is None  # a custom resource: comments only (below)
    in_units = yaml.safe_load_all(manifests(FOUND[:1], P100, "7d", "example.com/vram", GiB))
    assert next(in_units)["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"example.com/vram": "11"}
    }


@pytest.mark.parametrize(
    ("given", "taken"),
    [
        ('job="vram-enforcer-agent"', 'job="vram-enforcer-agent"'),
        (' job = "a" , instance=~"10.0.*" ', 'job="a",instance=~"10.0.*"'),
        ('cluster!="", env!~"dev|test"', 'cluster!="",env!~"dev|test"'),
        ("", ""),
    ],
)
def test_a_selector_is_label_matchers_written_back_as_promql_takes_them(
    given: str, taken: str
) -> None:
    assert parse_selector(given, "--selector") == taken


@pytest.mark.parametrize(
    "given",
    [
        'job="a"}) or vector(1) or (x{a="b"',  # a query of one's own
        '{job="a"}',
        'job="a\\"b"',
        'job="a\nb"',
        "job=a",
        'job=="a"',
        '1job="a"',
        'job="a",',
        'job="a" or up',
    ],
)
def test_a_selector_that_is_not_only_label_matchers_is_refused(given: str) -> None:
    with pytest.raises(ConfigError, match=r"--selector.*use e\.g\. job=\"vram-enforcer-agent\""):
        parse_selector(given, "--selector")
