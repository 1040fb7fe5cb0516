"""`vram-enforcer recommend`'s settings: which Prometheus, over what window, and how a
limit is worked out from the peaks it holds."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from enforcer.core.owners import is_label
from enforcer.core.parsing import ConfigError, as_text, choice, parse_unit
from enforcer.core.recommend import Method, Queries
from enforcer.core.settings import Setting, Values, switch, value, verbosity
from enforcer.core.settings.common import RESOURCE_NAME, kubeconfig, log_format, resource_unit

# Prometheus' durations: units from milliseconds to years, largest first (`1w2d`, `36h`).
_WINDOW = re.compile(
    r"(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?"
    r"(?:[0-9]+s)?(?:[0-9]+ms)?"
)


def parse_url(text: str, field: str) -> str:
    """An http(s) URL of a Prometheus server (or of the path that serves its API)."""
    if not re.fullmatch(r"https?://[^\s/?#]+(?:/[^\s?#]*)?", text):
        raise ConfigError(
            field, text, "is not an http(s) URL; use e.g. http://prometheus.monitoring:9090"
        )
    return text.rstrip("/")


def parse_window(text: str, field: str) -> str:
    """A Prometheus duration (`7d`, `36h`, `1w2d`), as Prometheus reads it."""
    if text.startswith("-"):
        raise ConfigError(field, text, "is negative; use a Prometheus duration such as 7d")
    if not text or text == "0" or not _WINDOW.fullmatch(text):
        raise ConfigError(field, text, "is not a Prometheus duration; use e.g. 7d, 36h or 2w")
    return text


def parse_namespace(text: str, field: str) -> str:
    """A namespace's name (a DNS-1123 label)."""
    if not is_label(text):
        raise ConfigError(field, text, "is not a namespace's name; use e.g. ml-team")
    return text


# One PromQL label matcher: a label name, an operator, a double-quoted value without an
# escape or a quote (what a label value of the scrape's own, a job or a namespace, needs).
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"\\\x00-\x1f\x7f]*)"\s*')


def parse_selector(text: str, field: str) -> str:
    """PromQL label matchers, comma-separated (`job="vram-enforcer-agent"`), written back
    as the queries take them; nothing else (no braces, no escapes), so that they cannot
    change a query beyond choosing its series."""
    if not text.strip():
        return ""
    matchers = [_MATCHER.fullmatch(part) for part in text.split(",")]
    if not all(matchers):
        raise ConfigError(
            field,
            text,
            'is not a list of PromQL label matchers; use e.g. job="vram-enforcer-agent" '
            '(name="value", also !=, =~ and !~, comma-separated, no backslash in a value)',
        )
    return ",".join(f'{m[1]}{m[2]}"{m[3]}"' for m in matchers if m)


def parse_headroom(text: str, field: str) -> float:
    """A percentage of 0% or more (at most 1000%), as a fraction."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)%", text.strip())
    if m is None or float(m[1]) > 1000:
        raise ConfigError(field, text, "is not a headroom; use a percentage such as 15% or 0%")
    return float(m[1]) / 100


def parse_percentile(text: str, field: str) -> float:
    """A percentile above 0 and at most 100 (`95`, `p95`, `99.9`), as a fraction."""
    m = re.fullmatch(r"p?([0-9]+(?:\.[0-9]+)?)", text.strip())
    if m is None or not 0 < float(m[1]) <= 100:
        raise ConfigError(field, text, "is not a percentile; use a number above 0 up to 100")
    return float(m[1]) / 100


PROMETHEUS = value(
    "prometheus",
    parse_url,
    "the Prometheus server that scrapes the agents",
    flag="--prometheus",
    env="VRAM_ENFORCER_PROMETHEUS",
    metavar="URL",
    required="pass --prometheus URL, e.g. http://localhost:9090 after "
    "`kubectl -n monitoring port-forward svc/prometheus-operated 9090`",
    doc="the Prometheus server that scrapes the node agents (its base URL: its HTTP API is "
    "`URL/api/v1/query`)",
)
WINDOW = value(
    "window",
    parse_window,
    "how far back the peaks are read",
    flag="--window",
    default="7d",
    metavar="DURATION",
    doc="how far back the peaks are read, as a Prometheus duration (`7d`, `36h`, `2w`): a "
    "week holds a weekly cycle; it cannot reach past Prometheus' retention",
)
NAMESPACE = value(
    "namespace",
    parse_namespace,
    "only this namespace's workloads",
    flag="--namespace",
    metavar="NAMESPACE",
    shown_default="every namespace",
)
SELECTOR = value(
    "selector",
    parse_selector,
    "PromQL label matchers that the series read must match",
    flag="--selector",
    default="",
    metavar="MATCHERS",
    shown_default="every series",
    doc="PromQL label matchers, comma-separated, that every series read must match: "
    "`job=\"vram-enforcer-agent\"` takes the node agents' series only (the chart's "
    "ServiceMonitor scrapes them under the name of the agents' Service, `vram-enforcer-agent` "
    "for a release named `vram-enforcer`). None, the default, reads every series of the "
    "agents' metric names, whatever the scrape job is called; but where Prometheus also "
    "scrapes pods' own ports (by annotation), a tenant can serve series of those names and "
    "put pods and workloads of its own making into the recommendation: set it there, on a "
    "label the scrape sets (`job`), not one a target may set. Labels that are not Kubernetes "
    "names are dropped either way, and counted on stderr",
)
PERCENTILE = value(
    "percentile",
    parse_percentile,
    "the percentile of a workload's pods' peaks that the limit covers",
    flag="--percentile",
    default="100",
    metavar="N",
    doc="the percentile (nearest rank) of a workload's pods' peaks that its limit is made "
    "from: `100`, the highest, leaves no pod of the window over the limit; `95` leaves out "
    "the highest 5% of pods, which would have been stopped",
)
HEADROOM = value(
    "headroom",
    parse_headroom,
    "added above the percentile's peak",
    flag="--headroom",
    default="15%",
    metavar="PERCENT",
    doc="added above the percentile's peak before it is rounded up (the Vertical Pod "
    "Autoscaler's margin is 15%): room for what the window did not see",
)
ROUND = value(
    "round",
    parse_unit,
    "a limit is rounded up to a multiple of this",
    flag="--round",
    default="1Gi",
    metavar="QUANTITY",
    doc="a limit is rounded up to a multiple of this (and of `--resource-unit`)",
)
RESOURCE_UNIT = resource_unit(
    "bytes per unit of `--resource-name` in the YAML: with `1Gi`, a limit of 12 GiB is written `12`"
)
OUTPUT = value(
    "output",
    choice("table", "yaml"),
    "a table, or YAML to paste into each workload's manifest",
    flag="--output",
    default="table",
    metavar="table|yaml",
    doc="`table`: one row per workload's container; `yaml`: each workload's containers' "
    "limits in the shape of its manifest (`kubectl patch --patch-file` takes each document)",
)
BEARER_TOKEN_FILE = value(
    "bearer_token_file",
    as_text,
    "a file whose content is sent as a bearer token",
    flag="--bearer-token-file",
    metavar="FILE",
    shown_default="none",
)
CA_FILE = value(
    "ca_file",
    as_text,
    "the CA certificates that an https Prometheus is checked against",
    flag="--ca-file",
    metavar="FILE",
    shown_default="the system's",
)
API = switch(
    "api",
    "--no-api",
    "do not read CronJobs from the API: their runs are shown as their Jobs",
    doc="do not read the namespaces' CronJobs from the Kubernetes API (`--kubeconfig`): a "
    "pod knows its Job only, and a CronJob's runs are then shown each as its Job",
)
KUBECONFIG = kubeconfig(
    "in-cluster config, then `~/.kube/config`",
    "how to read the CronJobs (a run's Job is named after its CronJob), with list on cronjobs",
)
LOG_FORMAT = log_format("text")
VERBOSE = verbosity("warnings only")

DECLARED: tuple[Setting[Any], ...] = (
    PROMETHEUS,
    WINDOW,
    NAMESPACE,
    SELECTOR,
    PERCENTILE,
    HEADROOM,
    ROUND,
    RESOURCE_NAME,
    RESOURCE_UNIT,
    OUTPUT,
    BEARER_TOKEN_FILE,
    CA_FILE,
    API,
    KUBECONFIG,
    LOG_FORMAT,
    VERBOSE,
)


@dataclass(frozen=True, slots=True)
class RecommendSettings:
    """What `vram-enforcer recommend` asks, and how it works out and prints a limit."""

    prometheus: str
    queries: Queries
    method: Method
    resource_name: str
    resource_unit: int
    output: str
    bearer_token_file: str | None
    ca_file: str | None
    api: bool
    kubeconfig: str | None


def recommend_settings(values: Values) -> RecommendSettings:
    unit = values[RESOURCE_UNIT]
    return RecommendSettings(
        prometheus=values[PROMETHEUS],
        queries=Queries(values[WINDOW], values[NAMESPACE], values[SELECTOR]),
        method=Method(values[PERCENTILE], values[HEADROOM], math.lcm(values[ROUND], unit)),
        resource_name=values[RESOURCE_NAME],
        resource_unit=unit,
        output=values[OUTPUT],
        bearer_token_file=values[BEARER_TOKEN_FILE],
        ca_file=values[CA_FILE],
        api=values[API],
        kubeconfig=values[KUBECONFIG],
    )
