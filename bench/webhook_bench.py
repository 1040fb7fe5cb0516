"""Admission webhook benchmarks: the decision in process, and reviews over real HTTPS.

In process: `json.loads` of a realistic AdmissionReview (a Deployment's GPU pod with
volumes, probes and env), `review()`, and `json.dumps` of the answer, timed one by one.
Over HTTPS: `vram-enforcer webhook` pinned to CPU 0, with client processes pinned to the
other CPUs, each on one kept-alive TLS connection (as the API server keeps them) sending
reviews back to back. Throughput is reviews answered per second by that one core.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    enforcer_argv,
    percentile,
    proc_cpu_seconds,
    proc_status_kib,
    release_and_collect,
)
from enforcer.core.admission import AdmissionSettings, review
from tests.e2e.cluster import make_ca, make_serving_cert
from tests.helpers import free_port, wait_for

CLIENT = ROOT / "bench" / "admission_client.py"


def sample_review() -> dict[str, Any]:
    """A Deployment's inference pod as the API server sends it: defaulted, with the usual
    volumes, probes and env."""
    container = {
        "name": "server",
        "image": "vllm/vllm-openai:v0.6.3",
        "imagePullPolicy": "IfNotPresent",
        "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu-memory-utilization", "0.3"],
        "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
        "env": [{"name": f"VAR_{i}", "value": str(i)} for i in range(10)]
        + [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "resources": {
            "limits": {"vram-enforcer.io/vram": "24Gi", "memory": "32Gi", "cpu": "8"},
            "requests": {"vram-enforcer.io/vram": "24Gi", "memory": "32Gi", "cpu": "8"},
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"},
            "periodSeconds": 5,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "models", "mountPath": "/root/.cache/huggingface"},
            {
                "name": "kube-api-access-x7k2p",
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                "readOnly": True,
            },
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "vllm-7d9f8c6b5-",
            "namespace": "inference",
            "labels": {"app": "vllm", "pod-template-hash": "7d9f8c6b5"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "vllm-7d9f8c6b5",
                    "uid": "0b6f2c1e-4b7d-4c9a-9e1f-2d3c4b5a6f70",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "containers": [container],
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "schedulerName": "default-scheduler",
            "priority": 0,
            "terminationGracePeriodSeconds": 30,
            "securityContext": {},
            "enableServiceLinks": True,
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            ],
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                {
                    "name": "kube-api-access-x7k2p",
                    "projected": {
                        "defaultMode": 420,
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                        ],
                    },
                },
            ],
        },
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "inference",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "dryRun": False,
        },
    }


def largest_review() -> dict[str, Any]:
    """sample_review() grown with env to the API server's request limit (3 MiB): the largest
    declaring pod that reaches the webhook through the API server."""
    doc = sample_review()
    env = doc["request"]["object"]["spec"]["containers"][0]["env"]
    env += [{"name": f"PAD_{i:06}", "value": "x" * 8} for i in range(3 * 2**20 // 46)]
    return doc


def in_process(trials: int) -> dict[str, Any]:
    body = json.dumps(sample_review()).encode()
    settings = AdmissionSettings(
        "ghcr.io/vram-enforcer/vram-enforcer:0.2.0", "native", "vram-enforcer.io/vram", 1
    )
    for _ in range(50):  # warm up
        json.dumps(review(json.loads(body), settings).review)
    micros: list[float] = []
    for _ in range(trials):
        t0 = time.perf_counter_ns()
        out = review(json.loads(body), settings)
        json.dumps(out.review)
        micros.append((time.perf_counter_ns() - t0) / 1000)
    assert out.result == "patched"
    micros.sort()
    largest = json.dumps(largest_review()).encode()
    seconds = []
    for _ in range(5):  # the review alone: decoding is the same for any body of that size
        doc = json.loads(largest)
        t0 = time.process_time()
        assert review(doc, settings).result == "patched"
        seconds.append(time.process_time() - t0)
    return {
        "trials": trials,
        "body_bytes": len(body),
        "p50_ms": percentile(micros, 0.5) / 1000,
        "p99_ms": percentile(micros, 0.99) / 1000,
        "target_p99_ms": 5.0,
        "largest_body_bytes": len(largest),
        "largest_cpu_ms": max(seconds) * 1000,
    }


def over_https(seconds: float, clients: int = 4) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[0]
    client_cpus = ",".join(map(str, cpus[1:] or cpus[:1]))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ca = make_ca(tmp)
        cert, key = make_serving_cert(tmp, ca, "webhook")
        body_file = tmp / "review.json"
        body_file.write_text(json.dumps(sample_review()))
        port = free_port()
        log = tmp / "webhook.log"
        server = subprocess.Popen(
            [
                "taskset",
                "-c",
                str(server_cpu),
                *enforcer_argv("webhook"),
                "--tls-cert-file",
                str(cert),
                "--tls-key-file",
                str(key),
                "--port",
                str(port),
                "--address",
                "127.0.0.1",
                "--sidecar-image",
                "img:1",
                "--sidecar-mode",
                "native",
                "--log-format",
                "text",
            ],
            stderr=log.open("w"),
        )
        procs = []
        try:
            wait_for(lambda: "serving admission reviews" in log.read_text(), what="the webhook")
            for _ in range(clients):
                procs.append(
                    subprocess.Popen(
                        [
                            "taskset",
                            "-c",
                            client_cpus,
                            sys.executable,
                            str(CLIENT),
                            str(port),
                            str(ca[0]),
                            str(seconds),
                            str(body_file),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            cpu0, t0 = proc_cpu_seconds(server.pid), time.monotonic()
            micros = release_and_collect(procs)
            elapsed = time.monotonic() - t0
            cpu = proc_cpu_seconds(server.pid) - cpu0
            rss = proc_status_kib(server.pid, "VmRSS") / 1024
        finally:
            for p in procs:
                p.kill()
                p.wait()
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=20)
    micros.sort()
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "reviews": len(micros),
        "reviews_per_second": len(micros) / elapsed,
        "server_cpu_share_of_one_core": cpu / elapsed,
        "p50_ms": percentile(micros, 0.5) / 1000,
        "p99_ms": percentile(micros, 0.99) / 1000,
        "rss_mib": rss,
        "target_reviews_per_second": 300,
    }
