"""From each container's observed peak to a limit per workload (pure): `vram-enforcer
recommend`'s arithmetic, its PromQL, the reading of Prometheus' answers, and what it prints.

The method is the Vertical Pod Autoscaler recommender's, for a limit: each pod's peak over
the window is one observation (VPA puts each interval's peak into its histogram), a
percentile of a workload's observations is taken, a margin added, and the result rounded
up to the resource's unit. Unlike VPA's, the default percentile is 100: a limit is where a
container is stopped, not what the scheduler counts, so that by default no pod seen in
the window would have been stopped; a lower one leaves the pods above it out on purpose.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from enforcer.core.messages import shown
from enforcer.core.model import format_bytes
from enforcer.core.owners import Owner, cronjob_of, is_kind, is_label, is_name
from enforcer.core.parsing import format_quantity

PEAK = "vram_enforcer_container_peak_bytes"
UNDECLARED = "vram_enforcer_undeclared_used_bytes"
LIMIT = "vram_enforcer_container_limit_bytes"
OWNER = "vram_enforcer_pod_owner"
_CONTAINER = "namespace, pod, container"
_CELL = 320  # characters of a table's cell: a kind and a name, `Kind/name`, fit
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Method:
    """How a limit is worked out: the `percentile` (0-1] of the pods' peaks, `headroom`
    added (a fraction of it), rounded up to a multiple of `step` bytes."""

    percentile: float
    headroom: float
    step: int


@dataclass(frozen=True, slots=True)
class Queries:
    """The PromQL behind a recommendation, over `window` (a Prometheus duration), in one
    namespace if given, of the series that `selector` matches (label matchers such as
    `job="vram-enforcer-agent"`, checked by `settings.recommend.parse_selector`) if given."""

    window: str
    namespace: str | None = None
    selector: str = ""

    def _selector(self) -> str:
        namespace = [] if self.namespace is None else [f'namespace="{self.namespace}"']
        matchers = ",".join([*namespace, *([self.selector] if self.selector else [])])
        return f"{{{matchers}}}" if matchers else ""

    @property
    def peaks(self) -> str:
        """Each container's highest usage in the window: its enforced instances' peaks,
        else (a pod that declares nothing) its usage over all GPUs as scraped."""
        s, w = self._selector(), self.window
        return (
            f"max by ({_CONTAINER}) (max_over_time({PEAK}{s}[{w}]))\nor\n"
            f"max by ({_CONTAINER}) (max_over_time("
            f"(sum by ({_CONTAINER}) ({UNDECLARED}{s}))[{w}:]))"
        )

    @property
    def limits(self) -> str:
        """What each container declares, as last seen in the window."""
        return f"max by ({_CONTAINER}) (last_over_time({LIMIT}{self._selector()}[{self.window}]))"

    @property
    def owners(self) -> str:
        """Each pod's owner, as last seen in the window."""
        by = "namespace, pod, owner_kind, owner_name"
        return f"max by ({by}) (last_over_time({OWNER}{self._selector()}[{self.window}]))"


class AnswerError(ValueError):
    """Prometheus answered something that is not an instant vector."""


@dataclass(frozen=True, slots=True)
class Read(Generic[T]):
    """What was read from an answer, and how many series were `dropped` for labels that
    are not in the form of the Kubernetes names they stand for. Whoever can have a series
    scraped (a tenant's pod with a scrape annotation) chooses its labels: only names that
    cannot break a line of YAML or drive a terminal are read."""

    found: T
    dropped: int


@dataclass(frozen=True, slots=True, order=True)
class Observed:
    """One pod's container and a value over the window (its peak, or its limit)."""

    namespace: str
    pod: str
    container: str
    value: int


def vector(answer: object) -> list[tuple[dict[str, str], float]]:
    """The series of an instant vector in Prometheus' `/api/v1/query` answer: each one's
    labels and value. Raises AnswerError for anything else."""
    data = answer.get("data") if isinstance(answer, dict) else None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise AnswerError("the answer is not an instant vector (is this Prometheus' query API?)")
    found = []
    for series in result if isinstance(result, list) else ():
        labels = series.get("metric") if isinstance(series, dict) else None
        value = series.get("value") if isinstance(series, dict) else None
        if not (isinstance(labels, dict) and isinstance(value, list) and len(value) == 2):
            raise AnswerError(f"a series is not a metric and a value: {json.dumps(series)[:200]}")
        try:
            number = float(value[1])
        except (TypeError, ValueError):
            raise AnswerError(f"a value is not a number: {value[1]!r}") from None
        found.append(({str(k): str(v) for k, v in labels.items()}, number))
    return found


def observed(answer: object) -> Read[list[Observed]]:
    """Each container's value in an answer of `Queries.peaks` or `Queries.limits` (a value
    that is not a finite number of bytes is left out; a series whose namespace, pod or
    container is not such a name is dropped)."""
    found, dropped = [], 0
    for labels, number in vector(answer):
        namespace, pod, container = (labels.get(k, "") for k in ("namespace", "pod", "container"))
        if not (is_label(namespace) and is_name(pod) and is_label(container)):
            dropped += 1
        elif math.isfinite(number) and number >= 0:
            found.append(Observed(namespace, pod, container, int(number)))
    return Read(found, dropped)


def owners(answer: object) -> Read[dict[tuple[str, str], Owner]]:
    """(namespace, pod) -> its owner, from an answer of `Queries.owners` (the greatest
    where a pod's owner changed in the window: one per pod; a series whose labels are not
    such names is dropped)."""
    found: dict[tuple[str, str], Owner] = {}
    dropped = 0
    for labels, _ in vector(answer):
        namespace, pod = labels.get("namespace", ""), labels.get("pod", "")
        owner = Owner(labels.get("owner_kind", ""), labels.get("owner_name", ""))
        if is_label(namespace) and is_name(pod) and is_kind(owner.kind) and is_name(owner.name):
            found[namespace, pod] = max(found.get((namespace, pod), owner), owner)
        else:
            dropped += 1
    return Read(found, dropped)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """A workload's container: how many pods were seen, the highest peak, the peak at the
    percentile, the limit recommended, and what it declares now (None: nothing)."""

    namespace: str
    owner: Owner
    container: str
    pods: int
    peak: int
    at_percentile: int
    limit: int
    declared: int | None


def percentile(values: Sequence[int], fraction: float) -> int:
    """The nearest-rank percentile: a value that was observed, the highest at 1.0."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def round_up(n: int, step: int) -> int:
    """`n` rounded up to a multiple of `step`, at least one step (a limit of 0 stops all)."""
    return max(step, -(-n // step) * step)


def recommend(
    peaks: Iterable[Observed],
    owned: Mapping[tuple[str, str], Owner],
    method: Method,
    declared: Iterable[Observed] = (),
    cronjobs: Mapping[str, Collection[str]] | None = None,
) -> list[Recommendation]:
    """A limit for each workload's container, from its pods' peaks: a pod without an owner
    is its own workload; a Job of a CronJob among `cronjobs` (namespace -> names) is that
    CronJob's run."""

    def workload(o: Observed) -> tuple[str, Owner, str]:
        owner = owned.get((o.namespace, o.pod), Owner("Pod", o.pod))
        return o.namespace, cronjob_of(owner, (cronjobs or {}).get(o.namespace, ())), o.container

    groups: dict[tuple[str, Owner, str], list[int]] = {}
    for p in peaks:
        groups.setdefault(workload(p), []).append(p.value)
    limits: dict[tuple[str, Owner, str], int] = {}
    for d in declared:
        limits[workload(d)] = max(limits.get(workload(d), 0), d.value)
    found = []
    for (namespace, owner, container), values in sorted(groups.items()):
        at = percentile(values, method.percentile)
        limit = round_up(math.ceil(at * (1 + method.headroom)), method.step)
        found.append(
            Recommendation(
                namespace,
                owner,
                container,
                len(values),
                max(values),
                at,
                limit,
                limits.get((namespace, owner, container)),
            )
        )
    return found


def table(found: Sequence[Recommendation], method: Method, window: str) -> str:
    """The recommendations as a table, under a line that says how they were worked out."""
    pct = f"p{method.percentile * 100:g}"
    head = (
        f"# limit = {pct} of each pod's peak over {window}, + {method.headroom * 100:g}% "
        f"headroom, rounded up to {format_quantity(method.step)}\n"
    )
    rows = [
        ("NAMESPACE", "WORKLOAD", "CONTAINER", "PODS", "PEAK", pct.upper(), "LIMIT", "DECLARED"),
        *(
            (
                shown(r.namespace, _CELL),
                shown(f"{r.owner.kind}/{r.owner.name}", _CELL),
                shown(r.container, _CELL),
                str(r.pods),
                format_bytes(r.peak),
                format_bytes(r.at_percentile),
                format_quantity(r.limit),
                "-" if r.declared is None else format_quantity(r.declared),
            )
            for r in found
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return head + "\n".join(line.rstrip() for line in lines) + "\n"


_TEMPLATE = ("spec", "template", "spec")
# The built-in workload kinds: each one's apiVersion, and where it keeps its pod template's
# spec, for a strategic merge patch of its containers' limits. Any other kind (a custom
# resource: RayCluster, PyTorchJob, LeaderWorkerSet) keeps its templates where its own API
# says, and takes no strategic merge patch: it is told in words.
_BUILT_IN = {
    "Pod": ("v1", ("spec",)),
    "Deployment": ("apps/v1", _TEMPLATE),
    "StatefulSet": ("apps/v1", _TEMPLATE),
    "DaemonSet": ("apps/v1", _TEMPLATE),
    "ReplicaSet": ("apps/v1", _TEMPLATE),
    "Job": ("batch/v1", _TEMPLATE),
    "CronJob": ("batch/v1", ("spec", "jobTemplate", "spec", "template", "spec")),
}
# Those whose pod template cannot change once made: the limit goes into the next one.
_IMMUTABLE = {
    "Pod": "# a Pod's containers cannot change: write this into its next manifest",
    "Job": "# a Job's pod template cannot change: write this into its next manifest",
}


def manifests(
    found: Sequence[Recommendation], method: Method, window: str, resource: str, unit: int
) -> str:
    """Each workload's containers' limits as YAML, one document per workload: a built-in
    kind's in the shape of its manifest (a strategic merge patch: `kubectl patch
    --patch-file` takes it as it is), any other kind's as comments that say what to set on
    which container. Each limit is in `unit`s of `resource` (`--resource-unit`), a quantity
    at 1. Every value from Prometheus is a quoted string, comments included."""
    by_workload: dict[tuple[str, Owner], list[Recommendation]] = {}
    for r in found:
        by_workload.setdefault((r.namespace, r.owner), []).append(r)
    docs = []
    for (namespace, owner), recs in sorted(by_workload.items()):
        head = (
            f"# {_string(f'{owner.kind}/{owner.name}')} in namespace {_string(namespace)}: "
            f"p{method.percentile * 100:g} of {window}'s peaks + {method.headroom * 100:g}%"
        )
        limits = [
            (r, format_quantity(r.limit) if unit == 1 else str(r.limit // unit)) for r in recs
        ]
        if owner.kind in _BUILT_IN:
            lines = _patch(namespace, owner, limits, resource)
        else:
            lines = [
                "# not a built-in workload kind, so no patch: its own API says where its pod",
                "# templates are and how it is patched. In its templates' containers, set:",
                *(
                    f"#   {_string(r.container)}: resources.limits.{_string(resource)}: "
                    f"{_string(value)}  # {_seen(r)}"
                    for r, value in limits
                ),
            ]
        docs.append("\n".join([head, *lines]) + "\n")
    return "---\n".join(docs)


def _patch(
    namespace: str, owner: Owner, limits: Sequence[tuple[Recommendation, str]], resource: str
) -> list[str]:
    """A built-in workload's manifest with its containers' limits (and nothing else)."""
    api_version, path = _BUILT_IN[owner.kind]
    lines = [
        *([_IMMUTABLE[owner.kind]] if owner.kind in _IMMUTABLE else []),
        f"apiVersion: {api_version}",
        f"kind: {_string(owner.kind)}",
        "metadata:",
        f"  name: {_string(owner.name)}",
        f"  namespace: {_string(namespace)}",
    ]
    lines += [f"{'  ' * depth}{key}:" for depth, key in enumerate(path)]
    indent = "  " * len(path)
    lines.append(f"{indent}containers:")
    for r, value in limits:
        lines += [
            f"{indent}- name: {_string(r.container)}  # {_seen(r)}",
            f"{indent}  resources:",
            f"{indent}    limits:",
            f"{indent}      {resource}: {_string(value)}",
        ]
    return lines


def _seen(r: Recommendation) -> str:
    return f"peak {format_bytes(r.peak)}, {r.pods} pod{'s' if r.pods != 1 else ''}"


def _string(text: str) -> str:
    """A YAML scalar that reads back as the string `text` (a JSON string is one, all on
    one line: a line break or a control character is escaped)."""
    return json.dumps(text)
