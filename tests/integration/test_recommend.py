"""`vram-enforcer recommend` against a real Prometheus (Debian's package) that scrapes the
agent's own collectors over HTTP, beside the series another part of the agent serves for
pods that declare nothing (`vram_enforcer_undeclared_used_bytes`, fed here): the command
as a user runs it, its PromQL run by Prometheus itself, its table and its YAML."""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enforcer.core.attribution import usage_by_container
from enforcer.core.declaration import ENFORCED, SIDECAR
from enforcer.core.model import Device, GiB, MiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.payloads import Pod
from enforcer.core.pod_metrics import ContainerSeries, Named
from enforcer.edge.metrics import PodsCollector, PodsView
from enforcer.modes.pod_metrics import Peaks, with_workloads
from tests.e2e.prometheus import Prometheus
from tests.e2e.prometheus import missing as prometheus_missing
from tests.helpers import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
GPUS = (Device(0, "GPU-0", "H100", 80 * GiB, 0), Device(1, "GPU-1", "H100", 80 * GiB, 0))
A, B, NOTEBOOK, SIDE = "a" * 64, "b" * 64, "c" * 64, "d" * 64


def pod(name: str, owner: str | None, enforced: bool, **containers: str) -> Pod:
    labels = {"pod-template-hash": "5f6"} | ({ENFORCED: "true"} if enforced else {})
    meta: dict[str, Any] = {"namespace": "ml", "name": name, "uid": name, "labels": labels}
    if owner:
        meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": owner, "controller": True}]
    statuses = [{"name": n, "containerID": f"containerd://{c}"} for n, c in containers.items()]
    spec = {"containers": [{"name": n} for n in containers]}
    return cast(Pod, {"metadata": meta, "spec": spec, "status": {"containerStatuses": statuses}})


class Undeclared(Collector):
    """What the agent serves for a container of a pod that declares nothing, per GPU."""

    def __init__(self) -> None:
        self.held = {"GPU-0": 3 * GiB, "GPU-1": 1 * GiB}

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "vram_enforcer_undeclared_used_bytes",
            "held",
            labels=["namespace", "pod", "container", "gpu"],
        )
        for gpu, held in self.held.items():
            family.add_metric(["ml", "notebook", "lab", gpu], held)
        yield family


def recommend(
    url: str, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    argv = [sys.executable, "-m", "enforcer", "recommend", "--prometheus", url, *flags]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)


@contextmanager
def serving(*collectors: Collector) -> Iterator[str]:
    """`collectors` served in Prometheus' text format over HTTP: the address."""
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    port = free_port()
    server, thread = start_http_server(port, "127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


@pytest.fixture
def agent() -> Iterator[tuple[str, Undeclared]]:
    """The agent's pod series over HTTP: two pods of the Deployment `serve` whose trainer
    peaked at 8 GiB and at 9.5 GiB (over two GPUs, in a pass no scrape saw), their declared
    16 GiB, and a notebook that declares nothing (its owner, and its usage fed as the
    agent's undeclared series)."""
    pods = {
        "serve-5f6-a": pod("serve-5f6-a", "serve-5f6", True, trainer=A, **{SIDECAR: SIDE}),
        "serve-5f6-b": pod("serve-5f6-b", "serve-5f6", True, trainer=B, **{SIDECAR: SIDE}),
        "notebook": pod("notebook", None, False, lab=NOTEBOOK),
    }
    peaks = Peaks(lambda: pods)
    keys = {cid: ProcessKey(100 + i, 1) for i, cid in enumerate((A, B, NOTEBOOK))}
    passes = [
        ((A, "GPU-0", 8 * GiB), (B, "GPU-0", 6 * GiB), (B, "GPU-1", 3 * GiB + 512 * MiB)),
        ((A, "GPU-0", 1 * GiB), (B, "GPU-0", 1 * GiB), (NOTEBOOK, "GPU-0", 1 * GiB)),
    ]
    for held in passes:
        usage = tuple(ProcessUsage(keys[cid], gpu, used) for cid, gpu, used in held)
        peaks.see(usage_by_container(Sample(0.0, GPUS, usage), {k: c for c, k in keys.items()}))

    def declared() -> PodsView:
        return PodsView(
            tuple(
                ContainerSeries(Named("ml", name, "trainer"), GiB, 16 * GiB, None, (), ())
                for name in ("serve-5f6-a", "serve-5f6-b")
            )
        )

    view = lambda: with_workloads(declared, lambda: pods, peaks, lambda: frozenset({"ml"}))  # noqa: E731
    undeclared = Undeclared()
    with serving(PodsCollector(view), undeclared) as address:
        yield address, undeclared


# What a tenant may write into a label of its own series: a whole document more.
CLUSTER_ROLE_BINDING = (
    "x\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n"
    "  name: mine\nroleRef: {kind: ClusterRole, name: cluster-admin}\nsubjects:\n"
    "- {kind: ServiceAccount, name: default, namespace: ml}"
)


class Tenant(Collector):
    """A tenant's pod whose own series a scrape by annotation takes: the agent's metrics'
    names, with a document in an owner's name, a terminal's escape in a container's, and a
    workload of its own making in the form of a real one."""

    def collect(self) -> Iterator[Metric]:
        owner = GaugeMetricFamily(
            "vram_enforcer_pod_owner",
            "forged",
            labels=["namespace", "pod", "owner_kind", "owner_name"],
        )
        owner.add_metric(["ml", "notebook", "Deployment", CLUSTER_ROLE_BINDING], 1)
        yield owner
        peak = GaugeMetricFamily(
            "vram_enforcer_container_peak_bytes", "forged", labels=["namespace", "pod", "container"]
        )
        peak.add_metric(["ml", "serve-5f6-a", "c\x1b[31m"], 20 * GiB)
        peak.add_metric(["ml", "made-up", "main"], 30 * GiB)
        yield peak


@contextmanager
def scraping(tmp: Path, targets: dict[str, list[str]]) -> Iterator[Prometheus]:
    """A Prometheus that scrapes `targets` (job -> addresses), the agent's labels honoured."""
    if reason := prometheus_missing():
        pytest.skip(reason)
    found = Prometheus(tmp, targets, honor_labels={"agent"})
    try:
        wait_for(found.targets_up, timeout=30, what=f"{', '.join(targets)} up in Prometheus")
        yield found
    finally:
        found.close()


@pytest.fixture
def prometheus(tmp_path: Path, agent: tuple[str, Undeclared]) -> Iterator[Prometheus]:
    with scraping(tmp_path, {"agent": [agent[0]]}) as found:
        yield found


@pytest.fixture
def with_tenant(tmp_path: Path, agent: tuple[str, Undeclared]) -> Iterator[Prometheus]:
    """A Prometheus that scrapes the agent, and a tenant's pod (`job="tenant"`)."""
    with (
        serving(Tenant()) as tenant,
        scraping(tmp_path, {"agent": [agent[0]], "tenant": [tenant]}) as found,
    ):
        yield found


def test_recommends_each_workloads_limit_from_the_peaks_prometheus_kept(
    prometheus: Prometheus, agent: tuple[str, Undeclared]
) -> None:
    """serve's pods peaked at 8 and 9.5 GiB: 9.5 GiB plus 15%, 10.925 GiB, rounded up to
    11Gi. The notebook, which declares nothing, held 3 + 1 GiB on two GPUs, then less:
    its highest sum, plus 15%, 4.6 GiB, is 5Gi."""
    _, undeclared = agent
    url = f"http://127.0.0.1:{prometheus.port}"
    top = "max_over_time((sum(vram_enforcer_undeclared_used_bytes))[1h:])"
    wait_for(lambda: prometheus.series(f"{top} >= {4 * GiB}"), timeout=30, what="a scrape of 4 GiB")
    undeclared.held = {"GPU-0": 1 * GiB}
    now = f"sum(vram_enforcer_undeclared_used_bytes) == {GiB}"
    wait_for(lambda: prometheus.series(now), timeout=30, what="a scrape of 1 GiB")

    shown = recommend(url, "--window", "1h", "--no-api")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "# limit = p100 of each pod's peak over 1h, + 15% headroom, rounded up to 1Gi",
        "NAMESPACE  WORKLOAD          CONTAINER  PODS  PEAK      P100      LIMIT  DECLARED",
        "ml         Deployment/serve  trainer    2     9.50 GiB  9.50 GiB  11Gi   16Gi",
        "ml         Pod/notebook      lab        1     4.00 GiB  4.00 GiB  5Gi    -",
    ]

    pasted = recommend(url, "--window", "1h", "--no-api", "--output", "yaml", "--percentile", "50")
    assert pasted.returncode == 0, pasted.stderr
    serve = next(d for d in yaml.safe_load_all(pasted.stdout) if d["kind"] == "Deployment")
    assert serve["metadata"] == {"name": "serve", "namespace": "ml"}
    (trainer,) = serve["spec"]["template"]["spec"]["containers"]
    assert trainer == {
        "name": "trainer",
        "resources": {"limits": {"vram-enforcer.io/vram": "10Gi"}},
    }


def test_a_tenants_own_series_reach_neither_the_yaml_nor_the_terminal(
    with_tenant: Prometheus,
) -> None:
    """A tenant whose pod is scraped by its annotations serves series of the agent's
    names: labels that are not Kubernetes names are dropped, and said in one line; the
    YAML an operator pastes holds the workloads' documents and nothing more, the table no
    escape. What has the form of a real workload is read unless --selector takes only the
    agents' series."""
    prometheus = with_tenant
    url = f"http://127.0.0.1:{prometheus.port}"
    tenant = 'vram_enforcer_pod_owner{job="tenant"}'
    wait_for(lambda: prometheus.series(tenant), timeout=30, what="a scrape of the tenant")
    peaks = "vram_enforcer_container_peak_bytes"
    wait_for(lambda: len(prometheus.series(peaks)) == 4, timeout=30, what="every peak scraped")
    # A subquery's steps fall on whole evaluation intervals (1 s here): a sample scraped
    # since the last one is not in it yet.
    top = "max_over_time((sum(vram_enforcer_undeclared_used_bytes))[1h:])"
    wait_for(lambda: prometheus.series(top), timeout=30, what="the notebook's usage in a subquery")

    pasted = recommend(url, "--window", "1h", "--no-api", "--output", "yaml")
    assert pasted.returncode == 0, pasted.stderr
    assert pasted.stderr.splitlines() == [
        "vram-enforcer recommend: 2 series left out: a namespace, pod, container or owner "
        "label that is not in the form of a Kubernetes name (a series scraped from elsewhere "
        'than the node agents?); pass --selector (e.g. job="vram-enforcer-agent") to read '
        "the agents' only"
    ]
    docs = list(yaml.safe_load_all(pasted.stdout))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Deployment", "serve"),
        ("Pod", "made-up"),  # a name in the form of one: --selector keeps it out
        ("Pod", "notebook"),
    ]
    assert "ClusterRoleBinding" not in pasted.stdout
    shown = recommend(url, "--window", "1h", "--no-api")
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout
    assert len(shown.stdout.splitlines()) == 5

    agents = recommend(url, "--window", "1h", "--no-api", "--selector", 'job="agent"')
    assert agents.returncode == 0, agents.stderr
    assert not agents.stderr
    assert [line.split()[1] for line in agents.stdout.splitlines()[2:]] == [
        "Deployment/serve",
        "Pod/notebook",
    ]


def documented_queries() -> list[str]:
    """The PromQL of operations.md's "Choosing a limit", one query per paragraph."""
    text = (ROOT / "docs" / "operations.md").read_text().split("## Choosing a limit", 1)[1]
    block = text.split("```promql\n", 1)[1].split("```", 1)[0]
    paragraphs = block.split("\n\n")
    lines = ([ln for ln in p.splitlines() if not ln.startswith("#")] for p in paragraphs)
    return ["\n".join(ln) for ln in lines if ln]


def test_the_promql_of_the_docs_answers_per_workload(prometheus: Prometheus) -> None:
    """What operations.md gives an operator to run by hand or on a dashboard parses, and
    answers: the peaks (the notebook's from its undeclared usage too), per workload."""
    peaks, per_workload, declared = documented_queries()

    def named() -> set[tuple[str, str]]:
        return {(s["metric"]["pod"], s["metric"]["container"]) for s in prometheus.series(peaks)}

    every = {("serve-5f6-a", "trainer"), ("serve-5f6-b", "trainer"), ("notebook", "lab")}
    wait_for(lambda: named() == every, timeout=30, what=f"{every} from {peaks}")
    (serve, notebook) = sorted(
        prometheus.series(per_workload), key=lambda s: s["metric"]["owner_kind"]
    )
    assert serve["metric"] == {
        "namespace": "ml",
        "owner_kind": "Deployment",
        "owner_name": "serve",
        "container": "trainer",
    }
    assert float(serve["value"][1]) == 9 * GiB + 512 * MiB
    assert notebook["metric"]["owner_kind"] == "Pod"  # its peak is its undeclared usage's
    assert {float(s["value"][1]) for s in prometheus.series(declared)} == {16 * GiB}


def test_says_what_to_check_when_prometheus_has_nothing_or_cannot_be_reached(
    prometheus: Prometheus,
) -> None:
    empty = recommend(f"http://127.0.0.1:{prometheus.port}", "--namespace", "nobody", "--no-api")
    assert empty.returncode == 1
    assert "holds no GPU memory peak in namespace nobody over the last 7d" in empty.stderr
    assert "scrapes the node agents" in empty.stderr
    assert not empty.stdout

    closed = free_port()
    away = recommend(f"http://127.0.0.1:{closed}", "--no-api")
    assert away.returncode == 1
    assert away.stderr.startswith(
        f"vram-enforcer recommend: cannot reach Prometheus at http://127.0.0.1:{closed}"
    )
    assert "check --prometheus" in away.stderr
    assert "Traceback" not in away.stderr

    wrong = recommend(f"http://127.0.0.1:{prometheus.port}/graph", "--no-api")
    assert wrong.returncode == 1
    assert "/graph/api/v1/query: HTTP 404: check --prometheus" in wrong.stderr


class Answer(socketserver.BaseRequestHandler):
    """Reads one HTTP request, whole, and answers the server's `reply`, whatever it was."""

    server: Answering

    def handle(self) -> None:
        data = b""
        while b"\r\n\r\n" not in data and (chunk := self.request.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(v)
                for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            ),
            0,
        )
        while len(body) < length and (chunk := self.request.recv(65536)):
            body += chunk
        self.server.asked.append(body)
        self.request.sendall(self.server.reply)


class Answering(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self, reply: bytes) -> None:
        super().__init__(("127.0.0.1", 0), Answer)
        self.reply = reply
        self.asked: list[bytes] = []


@contextmanager
def answering(reply: bytes) -> Iterator[Answering]:
    """A server on a real socket that answers each request `reply`, then closes."""
    server = Answering(reply)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def http(body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


EMPTY = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}})


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (b"SSH-2.0-OpenSSH_9.2p1\r\n", "did not answer in HTTP (BadStatusLine"),
        (http(b'{"status": "succ', length=4096), "did not answer in HTTP (IncompleteRead"),
        (http(b"[" * 100_000), "did not answer JSON (nested too deeply): is it Prometheus?"),
        (http(b"<html>Grafana</html>"), "did not answer JSON (Expecting value"),
    ],
    ids=["not-http", "cut-short", "nested", "not-json"],
)
def test_an_answer_that_is_not_prometheus_is_one_line_that_says_what_to_check(
    reply: bytes, said: str
) -> None:
    with answering(reply) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        got = recommend(url, "--no-api")
    assert got.returncode == 1
    assert "Traceback" not in got.stderr
    (line,) = got.stderr.splitlines()
    assert line.startswith(f"vram-enforcer recommend: {url}/api/v1/query {said}"), line
    assert "check --prometheus" in line or "is it Prometheus?" in line


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\xff\xfetoken", "is not text (not UTF-8): check that it holds the token"),
        (b"first\nsecond\n", "does not hold one bearer token"),
        (b"a token\n", "does not hold one bearer token"),
        (b"\n", "does not hold one bearer token"),
    ],
    ids=["not-utf8", "two-lines", "space", "empty"],
)
def test_a_token_file_that_holds_no_token_is_said_so_before_anything_is_sent(
    tmp_path: Path, content: bytes, said: str
) -> None:
    token = tmp_path / "token"
    token.write_bytes(content)
    with answering(http(EMPTY.encode())) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        got = recommend(url, "--no-api", "--bearer-token-file", str(token))
        asked = server.asked
    assert got.returncode == 1
    assert (
        got.stderr
        == f"vram-enforcer recommend: --bearer-token-file {token} {said}"
        + (got.stderr.split(said, 1)[1])
    )
    assert len(got.stderr.splitlines()) == 1
    assert not asked  # the token file is read first: nothing went out
    missing = recommend(url, "--no-api", "--bearer-token-file", str(tmp_path / "none"))
    assert missing.stderr == (
        f"vram-enforcer recommend: cannot read --bearer-token-file {tmp_path / 'none'}: "
        "No such file or directory\n"
    )


@pytest.mark.parametrize("content", ["[1, 2]", "a: [", "\udcff"])
def test_a_kubeconfig_that_is_not_one_is_one_line_and_the_runs_are_shown_as_jobs(
    prometheus: Prometheus, tmp_path: Path, content: str
) -> None:
    """The kubernetes client reads a YAML file that is not a kubeconfig without checking
    it, and raises what Python raises: said in one line, as a kubeconfig that is missing."""
    wait_for(lambda: prometheus.series("vram_enforcer_container_peak_bytes"), timeout=30)
    config = tmp_path / "kubeconfig"
    config.write_bytes(content.encode(errors="surrogateescape"))
    got = recommend(f"http://127.0.0.1:{prometheus.port}", env={"KUBECONFIG": str(config)})
    assert got.returncode == 0, got.stderr
    (line,) = got.stderr.splitlines()
    assert line.startswith("vram-enforcer recommend: CronJobs not read (")
    assert "check --kubeconfig, or KUBECONFIG" in line or "pass --kubeconfig" in line
    assert "Deployment/serve" in got.stdout


def test_a_ca_file_that_holds_no_certificate_is_one_line(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not a certificate\n")
    got = recommend("https://127.0.0.1:1", "--no-api", "--ca-file", str(ca))
    assert got.returncode == 1
    assert got.stderr.startswith(f"vram-enforcer recommend: cannot read --ca-file {ca} (")
    assert got.stderr.endswith("): check that it holds PEM certificates\n")
    assert len(got.stderr.splitlines()) == 1
