"""A creation storm: thousands of pods declaring VRAM, created as fast as the API server
takes them, through the chart's webhook, onto nodes simulated by kwok.

The real control plane of the e2e harness (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager), one real node (kubelet, containerd, runc, kube-proxy) that runs
the chart's webhook Deployment as Helm installs it (two replicas, `failurePolicy: Fail`),
and `nodes` Nodes that kwok (sigs.k8s.io/kwok, built from the Go module proxy by
bench/build-kwok.sh) keeps Ready and whose bound pods it marks Running. Each kwok node
has `gpus` GPUs of 80Gi: advertised as `vram-enforcer.io/vram` in node mode, published as
a ResourceSlice of NVIDIA's DRA driver (tests/e2e/dra.py) in DRA mode.

`workers` threads then create the pods, each declaring 4, 8, 12 or 16Gi, in a namespace
that opted in. Measured:
- the webhook's latency as the API server saw it (its
  `apiserver_admission_webhook_admission_duration_seconds`, whose buckets are coarse) and
  as the webhook saw it (`vram_enforcer_admission_duration_seconds` of every replica);
- the create round trip at the client, admissions per second, failed creates by reason
  (429s are retried and counted apart: the API server asking the client to slow down);
- from the API server's audit log: when each pod was bound (`pods/binding`) and first
  marked Running, so the time from the first create until every pod was placed.

The controller-manager's and the scheduler's client rate limits are lifted as kwokctl
does for its scale runs (`--disable-qps-limits`): with client-go's defaults (20 and 50
requests/s) the time to place 5,000 pods measures those token buckets, not the webhook.
kwok renews each node's lease as a kubelet does (every 10 s, `--node-lease-duration-seconds
40`). The agent does not run (a kwok node cannot run it): the storm is admission and
scheduling.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from bench.common import ROOT, cluster_missing, percentile
from tests.e2e import dra
from tests.e2e.cluster import CACHE, ApiServer
from tests.e2e.helm import CHART, helm
from tests.e2e.images import ENFORCER_IMAGE, enforcer_image
from tests.e2e.node import RealNode

NAMESPACE, TENANTS, RELEASE = "vram-enforcer", "ml", "vram-enforcer"
KWOK = "0.8.0"  # sigs.k8s.io/kwok
KWOK_NODE = "kwok.x-k8s.io/node"
SIZES = ("4Gi", "8Gi", "12Gi", "16Gi")
GPU_MEMORY_GI = 80
UNLIMITED_QPS = ("5000", "10000")  # kwokctl's --disable-qps-limits: qps, burst
POLICY = """
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
    namespaces: [ml]
    verbs: [create, patch, update]
    resources: [{group: "", resources: [pods, pods/binding, pods/status]}]
  - level: None
"""
WEBHOOK_METRICS_PORT = 9479  # the chart's webhook.metricsPort
WEBHOOK_SEEN_BY_APISERVER = "apiserver_admission_webhook_admission_duration_seconds"
WEBHOOK_OWN = "vram_enforcer_admission_duration_seconds"
WEBHOOK_RESULTS = "vram_enforcer_admission_requests_total"


def available() -> str | None:
    if reason := cluster_missing():
        return reason
    if not (CACHE / f"kwok-{KWOK}" / "kwok").exists() and shutil.which("go") is None:
        return "needs kwok: bash bench/build-kwok.sh (Go and the Go module proxy)"
    return None


def run(dra_mode: bool, pods: int, nodes: int, gpus: int, workers: int = 32) -> dict[str, Any]:
    kwok = _kwok()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "audit-policy.yaml").write_text(POLICY)
        audit = tmp / "audit.log"
        server = ApiServer(
            for_pods=True,
            extra_args=[
                f"--audit-policy-file={tmp / 'audit-policy.yaml'}",
                f"--audit-log-path={audit}",
                "--audit-log-maxsize=0",
                "--audit-log-format=json",
            ],
        )
        node: RealNode | None = None
        kwok_process: subprocess.Popen[bytes] | None = None
        try:
            server.start()
            qps, burst = UNLIMITED_QPS
            server.start_controller_manager(
                extra_args=[f"--kube-api-qps={qps}", f"--kube-api-burst={burst}"]
            )
            server.start_scheduler(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"qps": float(qps), "burst": int(burst)},
                }
            )
            (tmp / "image").mkdir()
            (tmp / "node").mkdir()
            node = RealNode(server, tmp / "node", images=[enforcer_image()], kube_proxy=True)
            api = server.client()
            core = client.CoreV1Api(api)
            core.create_namespace(
                {"metadata": {"name": TENANTS, "labels": {"vram-enforcer.io/inject": "enabled"}}}
            )
            if dra_mode:
                dra.device_class(api)
            kubeconfig = server.write_kubeconfig(tmp / "admin.kubeconfig")
            _install(kubeconfig, dra_mode)
            apps = client.AppsV1Api(api)
            _until(
                lambda: (
                    apps.read_namespaced_deployment(
                        f"{RELEASE}-webhook", NAMESPACE
                    ).status.available_replicas
                    == 2
                ),
                180,
                "the webhook's two replicas",
            )
            _until(
                lambda: core.read_namespaced_service_account("default", TENANTS),
                60,
                "the tenants' ServiceAccount",
            )
            names = [f"kwok-{i:04d}" for i in range(nodes)]
            for name in names:
                core.create_node(_node(name, gpus, dra_mode))
                if dra_mode:
                    dra.publish(
                        api, name, [(f"GPU-{name}-{g}", f"{GPU_MEMORY_GI}Gi") for g in range(gpus)]
                    )
            kwok_process = _start_kwok(kwok, kubeconfig, tmp)
            _until(lambda: _ready_nodes(core) >= nodes + 1, 300, f"{nodes} kwok nodes Ready")
            before = _scrape(server, core)
            storm = _storm(server, pods, workers)
            _until(lambda: _count(core, "spec.nodeName=") == 0, 1800, "every pod bound")
            _until(lambda: _count(core, "status.phase!=Running") == 0, 600, "every pod Running")
            after = _scrape(server, core)
            report = _report(
                dra_mode, pods, nodes, gpus, workers, storm, before, after, _placement(audit)
            )
            return {**report, "webhook_restarts": _restarts(core), "webhook_events": _said(core)}
        except TimeoutError:
            if node is not None:
                print(_diagnosis(node), file=sys.stderr)
            raise
        finally:
            if kwok_process is not None:
                kwok_process.terminate()
                kwok_process.wait(timeout=30)
            if node is not None:
                node.close()
            server.close()


def _kwok() -> Path:
    """kwok's directory (the binary and its stages), built on first use."""
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "build-kwok.sh")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "VRAM_ENFORCER_KWOK_VERSION": KWOK},
    )
    return Path(out.stdout.strip())


def _install(kubeconfig: Path, dra_mode: bool) -> None:
    values: dict[str, Any] = {
        "image": {
            "repository": ENFORCER_IMAGE.rsplit(":", 1)[0],
            "tag": "e2e",
            "pullPolicy": "Never",
        },
        "agent": {"enabled": False},
    }
    if dra_mode:
        values["webhook"] = {"draDeviceClass": dra.DEVICE_CLASS}
    helm("install", RELEASE, str(CHART), NAMESPACE, str(kubeconfig), json.dumps(values))


def _node(name: str, gpus: int, dra_mode: bool) -> dict[str, Any]:
    """A Node that kwok manages (its annotation), that only the storm's pods tolerate (its
    taint: the webhook's own pods stay on the real node), with the capacity that the agent
    would advertise in node mode (Nodes keep their status on create)."""
    capacity = {"cpu": "128", "memory": "1Ti", "pods": "110"}
    if not dra_mode:
        capacity["vram-enforcer.io/vram"] = f"{gpus * GPU_MEMORY_GI}Gi"
    return {
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE: "fake"},
            "labels": {"kubernetes.io/hostname": name, "type": "kwok"},
        },
        "spec": {"taints": [{"key": KWOK_NODE, "value": "fake", "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def _start_kwok(kwok: Path, kubeconfig: Path, tmp: Path) -> subprocess.Popen[bytes]:
    stages = sorted((kwok / "stages").glob("*.yaml"))
    log = (tmp / "kwok.log").open("wb")
    return subprocess.Popen(
        [
            str(kwok / "kwok"),
            f"--kubeconfig={kubeconfig}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE}=fake",
            "--cidr=10.128.0.0/14",
            "--node-ip=10.127.0.1",
            "--node-lease-duration-seconds=40",
            *(f"--config={s}" for s in stages),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _diagnosis(node: RealNode) -> str:
    """What the real node's pods are doing, and the kubelet's last words: why a wait ended."""
    assert node.core is not None
    lines = [
        f"{p.metadata.namespace}/{p.metadata.name}: {p.status.phase} "
        f"{[(c.name, c.state.to_dict()) for c in p.status.container_statuses or ()]}"
        for p in node.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node.name}"
        ).items
    ]
    events = [
        f"{e.involved_object.kind}/{e.involved_object.name}: {e.reason} {e.message}"
        for e in node.core.list_event_for_all_namespaces().items
        if e.type == "Warning"
    ]
    return "\n".join([*lines, *events[-20:], node.log()[-2000:]])


def _restarts(core: client.CoreV1Api) -> dict[str, str]:
    """Each webhook replica's restarts during the run, and why the last one ended."""
    found = {}
    for pod in core.list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/component=webhook"
    ).items:
        for status in pod.status.container_statuses or ():
            ended = status.last_state.terminated if status.last_state else None
            found[pod.metadata.name] = f"{status.restart_count}" + (
                f" (last: {ended.reason}, exit code {ended.exit_code})" if ended else ""
            )
    return found


def _said(core: client.CoreV1Api) -> list[str]:
    """What the control plane and the kubelet said about the webhook's pods (kills,
    evictions, failed probes), once each."""
    said: dict[str, int] = {}
    for e in core.list_namespaced_event(NAMESPACE).items:
        if e.involved_object.kind == "Pod":
            key = f"{e.reason}: {e.message}"
            said[key] = said.get(key, 0) + (e.count or 1)
    return [f"{n}x {key}" for key, n in said.items()]


def _ready_nodes(core: client.CoreV1Api) -> int:
    return sum(
        any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())
        for n in core.list_node().items
    )


def _count(core: client.CoreV1Api, field_selector: str) -> int:
    """Pods of the storm that match `field_selector`, counted from a list of names only."""
    listed = core.list_namespaced_pod(
        TENANTS, field_selector=field_selector, _preload_content=False, _request_timeout=60
    )
    return len(json.loads(listed.data)["items"])


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not _quietly(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(1.0)


def _quietly(predicate: Any) -> bool:
    try:
        return bool(predicate())
    except client.ApiException:
        return False


def _pod(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"storm-{i:05d}"},
        "spec": {
            "tolerations": [{"key": KWOK_NODE, "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "trainer",
                    "image": "registry.example/trainer:1",
                    "resources": {"limits": {"vram-enforcer.io/vram": SIZES[i % len(SIZES)]}},
                }
            ],
        },
    }


def _storm(server: ApiServer, pods: int, workers: int) -> dict[str, Any]:
    """Create the pods from `workers` threads, each with its own connection; 429s are
    retried after the delay the API server asks."""
    lock = threading.Lock()
    round_trips: list[float] = []
    failures: Counter[str] = Counter()
    throttled = 0
    local = threading.local()

    def create(i: int) -> None:
        nonlocal throttled
        if not hasattr(local, "core"):
            local.core = client.CoreV1Api(server.client())
        while True:
            started = time.monotonic()
            try:
                local.core.create_namespaced_pod(
                    TENANTS, _pod(i), _preload_content=False, _request_timeout=60
                )
            except client.ApiException as e:
                if e.status == 429:
                    with lock:
                        throttled += 1
                    time.sleep(float((e.headers or {}).get("Retry-After", "1")))
                    continue
                with lock:
                    failures[f"{e.status} {_reason(e.body)}"] += 1
                return
            except (OSError, urllib3.exceptions.HTTPError) as e:  # a transport failure
                with lock:
                    failures[type(e).__name__] += 1
                return
            with lock:
                round_trips.append(time.monotonic() - started)
            return

    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, range(pods)))
    elapsed = time.monotonic() - start
    round_trips.sort()
    return {
        "created": len(round_trips),
        "seconds": elapsed,
        "throttled_retries": throttled,
        "failures": dict(failures),
        "round_trip_p50_ms": 1000 * percentile(round_trips, 0.5),
        "round_trip_p99_ms": 1000 * percentile(round_trips, 0.99),
    }


def _reason(body: str | None) -> str:
    try:
        return str(json.loads(body or "")["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return (body or "")[:200]


def _scrape(server: ApiServer, core: client.CoreV1Api) -> dict[str, list[Any]]:
    """The API server's metrics and every webhook replica's (through the API server's pod
    proxy), as samples by name (a histogram's `_bucket`, a counter's `_total`)."""
    texts = [_get(server, "/metrics")]
    for pod in core.list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/component=webhook"
    ).items:
        texts.append(
            _get(
                server,
                f"/api/v1/namespaces/{NAMESPACE}/pods/{pod.metadata.name}:{WEBHOOK_METRICS_PORT}/proxy/metrics",
            )
        )
    series: dict[str, list[Any]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append(sample)
    return series


def _get(server: ApiServer, path: str) -> str:
    status, body = server.get(path, timeout=30)
    if status != 200:
        raise RuntimeError(f"GET {path}: {status} {body[:300]}")
    return body


def _buckets(
    series: Mapping[str, list[Any]], name: str, match: Mapping[str, str]
) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name` (summed over series whose labels include
    `match`), by upper bound."""
    found: dict[float, float] = {}
    for sample in series.get(name + "_bucket", ()):
        if any(sample.labels.get(k) != v for k, v in match.items()):
            continue
        le = float(sample.labels["le"])
        found[le] = found.get(le, 0.0) + sample.value
    return found


def _quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """What Prometheus's histogram_quantile answers for the observations between two scrapes
    (linear inside a bucket); None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return None


def _counter(series: Mapping[str, list[Any]], name: str, label: str) -> Counter[str]:
    found: Counter[str] = Counter()
    for sample in series.get(name, ()):
        found[sample.labels.get(label, "")] += sample.value
    return found


def _placement(audit: Path) -> dict[str, Any]:
    """From the audit log: the first create received, each pod's bind and its first status
    write by kwok (Running), and the server-side create latency."""
    first_create: float | None = None
    bound: dict[str, float] = {}
    running: dict[str, float] = {}
    creates: list[float] = []
    codes: Counter[int] = Counter()
    for event in _events(audit):
        ref = event.get("objectRef") or {}
        received, done = _at(event["requestReceivedTimestamp"]), _at(event["stageTimestamp"])
        code = int((event.get("responseStatus") or {}).get("code", 0))
        name, sub = ref.get("name", ""), ref.get("subresource", "")
        if event["verb"] == "create" and not sub:
            codes[code] += 1
            first_create = received if first_create is None else min(first_create, received)
            if code == 201:
                creates.append(done - received)
        elif sub == "binding" and code == 201:
            bound.setdefault(name, done)
        elif sub == "status" and code == 200 and name in bound:
            running.setdefault(name, done)
    creates.sort()
    assert first_create is not None, "the audit log has no create of a pod"
    return {
        "create_codes": {str(c): n for c, n in sorted(codes.items())},
        "server_create_p50_ms": 1000 * percentile(creates, 0.5),
        "server_create_p99_ms": 1000 * percentile(creates, 0.99),
        "bound": len(bound),
        "all_bound_after_s": max(bound.values()) - first_create,
        "all_running_after_s": max(running.values(), default=first_create) - first_create,
        "bind_rate_per_s": len(bound) / max(max(bound.values()) - min(bound.values()), 1e-9),
    }


def _events(audit: Path) -> Iterator[dict[str, Any]]:
    with audit.open() as lines:
        for line in lines:
            event = json.loads(line)
            if event.get("stage") == "ResponseComplete":
                yield event


def _at(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _report(
    dra_mode: bool,
    pods: int,
    nodes: int,
    gpus: int,
    workers: int,
    storm: dict[str, Any],
    before: dict[str, list[Any]],
    after: dict[str, list[Any]],
    placement: dict[str, Any],
) -> dict[str, Any]:
    webhook_name = {"operation": "CREATE", "type": "admit"}
    seen = (
        _buckets(before, WEBHOOK_SEEN_BY_APISERVER, webhook_name),
        _buckets(after, WEBHOOK_SEEN_BY_APISERVER, webhook_name),
    )
    own = _buckets(before, WEBHOOK_OWN, {}), _buckets(after, WEBHOOK_OWN, {})
    results = _counter(after, WEBHOOK_RESULTS, "result") - _counter(
        before, WEBHOOK_RESULTS, "result"
    )

    def ms(value: float | None) -> float | None:
        return None if value is None else 1000 * value

    return {
        "mode": "dra" if dra_mode else "node",
        "pods": pods,
        "nodes": nodes,
        "gpus_per_node": gpus,
        "workers": workers,
        "admissions_per_second": storm["created"] / storm["seconds"],
        "storm": storm,
        "webhook_seen_by_apiserver_p50_ms": ms(_quantile(*seen, 0.5)),
        "webhook_seen_by_apiserver_p99_ms": ms(_quantile(*seen, 0.99)),
        "webhook_own_p50_ms": ms(_quantile(*own, 0.5)),
        "webhook_own_p99_ms": ms(_quantile(*own, 0.99)),
        "webhook_results": dict(results),
        # The API server calls the webhook again when a later plugin changed the pod.
        "reviews_per_pod": sum(results.values()) / max(storm["created"], 1),
        "placement": placement,
    }
