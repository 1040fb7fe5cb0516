"""A real Prometheus (Debian's package) scraping the e2e cluster's components, to run the
Grafana dashboard's queries against what they export."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, wait_for

DASHBOARD = Path(__file__).resolve().parents[2] / "helm/vram-enforcer/dashboards/vram-enforcer.json"


def missing() -> str | None:
    if shutil.which("prometheus") is None:
        return "no prometheus: apt-get install --no-install-recommends prometheus"
    return None


class Prometheus:
    """Scrapes `targets` (job -> host:port) every second; answers PromQL over HTTP. A job's
    `labels` are put on its targets, as the Prometheus Operator puts a ServiceMonitor's
    target's namespace, pod and container; its series' own labels win in the jobs of
    `honor_labels` (the chart's ServiceMonitor sets `honorLabels: true`: the agent's
    series name the pods they are about, not the agent's)."""

    def __init__(
        self,
        tmp: Path,
        targets: Mapping[str, Sequence[str]],
        labels: Mapping[str, Mapping[str, str]] | None = None,
        honor_labels: Collection[str] = (),
    ) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": job,
                    "honor_labels": job in honor_labels,
                    "static_configs": [
                        {"targets": list(hosts), "labels": dict((labels or {}).get(job, {}))}
                    ],
                }
                for job, hosts in targets.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self._log = (tmp / "prometheus.log").open("w")
        self._proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, timeout=30, what="Prometheus to be ready")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """The API's answer: `status` ("success" or "error", with `error`) and `data`."""
        params = {"query": expr, **({"time": str(at)} if at is not None else {})}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error as JSON
            return json.loads(exc.read())  # type: ignore[no-any-return]

    def series(self, expr: str, at: float | None = None) -> list[Any]:
        answer = self.query(expr, at)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return list(answer["data"]["result"])

    def targets_up(self) -> bool:
        return all(float(s["value"][1]) == 1 for s in self.series("up")) and bool(self.series("up"))

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def exported(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` with exactly `labels` in a /metrics page (a counter's
    sample is `..._total`), whatever the order its labels are written in; None: not there."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def dashboard_queries(variables: Mapping[str, str]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard,
    with Grafana's variables filled in (`label_values(EXPR, label)` becomes EXPR)."""
    doc = json.loads(DASHBOARD.read_text())
    found = [
        (f"panel {p['title']!r}", t["expr"]) for p in doc["panels"] for t in p.get("targets", ())
    ]
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            inner = v["query"].removeprefix("label_values(").rpartition(",")[0]
            found.append((f"variable {v['name']!r}", inner))
    return [(where, _filled(expr, variables)) for where, expr in found]


def _filled(expr: str, variables: Mapping[str, str]) -> str:
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    return expr
