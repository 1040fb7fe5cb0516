"""`vram-enforcer recommend`: each workload's observed peak and a limit for it, from what
Prometheus kept of the node agents' series (`core/recommend.py` works them out)."""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from enforcer.core.recommend import (
    AnswerError,
    Queries,
    manifests,
    observed,
    owners,
    recommend,
    table,
)
from enforcer.core.settings.recommend import RecommendSettings
from enforcer.edge.prometheus import PrometheusApi, QueryFailed

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

EXIT_FAILED = 1  # Prometheus could not be asked, or holds no peak


def run(settings: RecommendSettings) -> int:
    prometheus = PrometheusApi(settings.prometheus, settings.bearer_token_file, settings.ca_file)
    q = settings.queries
    answers = []
    for expr in (q.peaks, q.owners, q.limits):
        answer = prometheus.query(expr)
        if isinstance(answer, QueryFailed):
            return _failed(answer.why)
        answers.append(answer)
    try:
        peaks, owned, declared = observed(answers[0]), owners(answers[1]), observed(answers[2])
    except AnswerError as exc:
        return _failed(f"{settings.prometheus}: {exc}")
    if dropped := peaks.dropped + owned.dropped + declared.dropped:
        print(_dropped(dropped, q), file=sys.stderr)
    if not peaks.found:
        return _failed(_nothing(q))
    namespaces = {p.namespace for p in peaks.found}
    cronjobs = _cronjobs(settings, namespaces) if settings.api else None
    found = recommend(peaks.found, owned.found, settings.method, declared.found, cronjobs)
    if settings.output == "yaml":
        text = manifests(
            found, settings.method, q.window, settings.resource_name, settings.resource_unit
        )
    else:
        text = table(found, settings.method, q.window)
    sys.stdout.write(text)
    return 0


def _failed(why: str) -> int:
    print(f"vram-enforcer recommend: {why}", file=sys.stderr)
    return EXIT_FAILED


def _dropped(n: int, q: Queries) -> str:
    """One line for the series left out: whoever can have its own series scraped writes
    their labels, and none of it reaches what is printed."""
    narrow = (
        ""
        if q.selector
        else '; pass --selector (e.g. job="vram-enforcer-agent") to read the agents\' only'
    )
    return (
        f"vram-enforcer recommend: {n} series left out: a namespace, pod, container or owner "
        f"label that is not in the form of a Kubernetes name (a series scraped from elsewhere "
        f"than the node agents?){narrow}"
    )


def _nothing(q: Queries) -> str:
    where = f" in namespace {q.namespace}" if q.namespace else ""
    return (
        f"Prometheus holds no GPU memory peak{where} over the last {q.window}. Check that it "
        "scrapes the node agents (the chart's monitoring.serviceMonitor.enabled, or a scrape "
        "job on the agents' metrics port, with honor_labels: true), that the window reaches "
        "back to when the pods ran (--window), and that vram_enforcer_container_peak_bytes "
        "(pods in namespaces labelled vram-enforcer.io/inject=enabled) or "
        "vram_enforcer_undeclared_used_bytes has series there"
    )


def _cronjobs(settings: RecommendSettings, namespaces: Collection[str]) -> Mapping[str, set[str]]:
    """Each namespace's CronJobs, by name; none where the API cannot say (said once)."""
    from enforcer.edge.kube import KubeError, call  # noqa: PLC0415 - only with the API

    found: dict[str, set[str]] = {}
    try:
        api = _connect(settings.kubeconfig)
        for namespace in sorted(namespaces):
            path = "/apis/batch/v1/namespaces/{namespace}/cronjobs"
            listed = call(
                api, "GET", path, "cronjobs", deadline=30.0, params={"namespace": namespace}
            )
            found[namespace] = {
                str(item.get("metadata", {}).get("name"))
                for item in listed.get("items") or ()
                if isinstance(item, dict)
            }
    except KubeError as exc:
        print(
            f"vram-enforcer recommend: CronJobs not read ({' '.join(str(exc).split())}); each "
            "run of a CronJob is shown as its Job (--no-api: do not try)",
            file=sys.stderr,
        )
    return found


def _connect(kubeconfig: str | None) -> ApiClient:
    """`kube.connect`, with a file that is not a kubeconfig a KubeError too: the client
    reads it unchecked, and fails with whatever Python or its YAML parser raise on the way
    (a TypeError for a list, a YAMLError, a UnicodeDecodeError)."""
    from enforcer.edge.kube import KubeError, connect  # noqa: PLC0415 - only with the API

    try:
        return connect(kubeconfig)
    except KubeError:
        raise
    except Exception as exc:
        raise KubeError(
            f"the kubeconfig is not one ({type(exc).__name__}: {str(exc)[:100]}): check "
            "--kubeconfig, or KUBECONFIG"
        ) from exc
