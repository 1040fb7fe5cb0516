"""Fuzz and flood: the sidecar, the agent and the webhook under attack at once, with their
memory, their threads and the enforcement latency measured while it lasts.

The attack is what a hostile tenant can do from its pods:

- **the sidecar**: its API server answers garbage (a stand-in that replies 200 with
  non-JSON, JSON that is no object, and 500s). (It has no port for its workload to flood
  since 0.2.0: the agent serves every pod's metrics.);
- **the agent**: pods in PID namespaces of their own each open connection after connection
  to its socket, send malformed and oversize lines, and hang up at once; and hundreds of
  idle connections hold its metrics port, where the kubelet asks `/healthz`;
- **the webhook**: clients post hostile reviews back to back (deep nesting, numbers past
  Python's digit limit, non-ASCII digits, garbage bytes, bodies near the size limit) while
  hundreds of idle connections hold its port.

Meanwhile a process of the pod goes over its limit again and again, and the time from the
fake NVML reporting it to its SIGTERM handler running is the enforcement latency. A
well-formed review from another address is timed too, and `/healthz` from a third.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import http.server
import json
import os
import random
import select
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from kubernetes import client

from bench.common import GiB, enforcer_argv, percentile, proc_status_kib
from bench.sidecar_bench import DRIVER, available
from bench.webhook_bench import sample_review
from tests.e2e.cluster import ApiServer, apiserver_binary, etcd_binary, make_ca, make_serving_cert
from tests.e2e.podsim import SimPod
from tests.fakenvml import FakeGpuState
from tests.helpers import free_port, wait_for

__all__ = ["available", "run"]

IMAGE_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}  # as the image sets
MISSED_AFTER = 5.0  # a victim not stopped this long after it went over counts as missed

HOSTILE_BODIES = [
    b"[" * 200_000,
    b'{"a": ' + b"9" * 5000 + b"}",
    b"\xff\xfe\x00garbage",
    b"{" * 63 + b"}" * 63,
]


def _hostile_reviews() -> list[bytes]:
    base = sample_review()
    out = list(HOSTILE_BODIES)
    for key, value in (
        ("vram-enforcer.io/shm-size", "1e1000000"),
        ("vram-enforcer.io/shm-size", "9" * 5000),
        ("vram-enforcer.io/metrics-port", "\u00b2"),
        ("vram-enforcer.io/grace-period", "9" * 400 + "s"),
        ("vram-enforcer.io/action", "warn"),
    ):
        doc = json.loads(json.dumps(base))
        doc["request"]["object"]["metadata"]["annotations"] = {key: value}
        out.append(json.dumps(doc).encode())
    padded = json.loads(json.dumps(base))
    padded["request"]["object"]["metadata"]["annotations"] = {"pad": "x" * (3 << 20)}
    out.append(json.dumps(padded).encode())
    return out


class _Garbage(http.server.BaseHTTPRequestHandler):
    """An API server that answers nothing well."""

    replies: ClassVar[list[tuple[int, bytes]]] = [
        (200, b"<html>upstream proxy</html>"),
        (200, b"[1, 2, 3]"),
        (500, b"{}"),
        (200, b'{"kind": "Pod", "metadata": '),
    ]

    def _answer(self) -> None:
        status, body = random.choice(self.replies)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Flood:
    """Background attackers, each a thread looping until `stop`."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.held: list[socket.socket] = []
        self.errors = 0

    def loop(self, step: Callable[[], None]) -> None:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    step()
                except (OSError, http.client.HTTPException):
                    self.errors += 1  # refused at once, past a bound: as intended
                    time.sleep(0.01)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def idle(self, host: str, port: int, count: int) -> None:
        for _ in range(count):
            try:
                self.held.append(socket.create_connection((host, port), timeout=5))
            except OSError:
                self.errors += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)
        for s in self.held:
            s.close()


def _peak(pids: dict[str, int], stop: threading.Event, out: dict[str, dict[str, float]]) -> None:
    """The largest RSS (MiB) and thread count of each process while `stop` is not set."""
    while not stop.wait(0.05):
        for name, pid in pids.items():
            try:
                rss = proc_status_kib(pid, "VmRSS") / 1024
                threads = float(proc_status_kib(pid, "Threads"))
            except (OSError, KeyError):
                continue
            row = out.setdefault(name, {"rss_mib": 0.0, "threads": 0.0})
            row["rss_mib"], row["threads"] = max(row["rss_mib"], rss), max(row["threads"], threads)


def run(lib_dir: Path, trials: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = ApiServer(apiserver_binary(), etcd_binary())  # type: ignore[arg-type]
        server.start()
        try:
            return _run(server, lib_dir, tmp, trials)
        finally:
            server.close()


def _run(server: ApiServer, lib_dir: Path, tmp: Path, trials: int) -> dict[str, Any]:  # noqa: PLR0915 - one scenario
    core = client.CoreV1Api(server.client())
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="flood")))
    state_file, state = tmp / "gpu.json", FakeGpuState.single_gpu()
    state.write(state_file)
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)}
    agent_metrics = free_port()
    agent = subprocess.Popen(
        [
            *enforcer_argv("agent"),
            "--no-advertise",
            "--no-labels",
            "--no-serve-pods",
            "--hard-limits",
            "off",
            "--socket",
            str(tmp / "agent.sock"),
            "--metrics-port",
            str(agent_metrics),
        ],
        env=env,
        stderr=(tmp / "agent.log").open("w"),
    )
    wait_for((tmp / "agent.sock").exists, what="the agent")
    garbage = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    kubeconfig = tmp / "garbage-kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "g",
                "clusters": [
                    {
                        "name": "g",
                        "cluster": {"server": f"http://127.0.0.1:{garbage.server_address[1]}"},
                    }
                ],
                "users": [{"name": "g", "user": {"token": "x"}}],
                "contexts": [{"name": "g", "context": {"cluster": "g", "user": "g"}}],
            }
        )
    )
    ca = make_ca(tmp)
    cert, key = make_serving_cert(tmp, ca, "webhook")
    hook_port = free_port()
    webhook = subprocess.Popen(
        [
            *enforcer_argv("webhook"),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--port",
            str(hook_port),
            "--address",
            "127.0.0.1",
            "--sidecar-image",
            "img:1",
            "--sidecar-mode",
            "native",
            "--log-format",
            "text",
        ],
        stderr=(tmp / "webhook.log").open("w"),
        env={**os.environ, **IMAGE_ENV},
    )
    wait_for(lambda: "serving admission" in (tmp / "webhook.log").read_text(), what="webhook")
    pod = SimPod(core, "flood", "flood-0", ["trainer", "vram-enforcer"])
    flood, peaks, pods = _Flood(), {}, []  # type: ignore[var-annotated]
    sampling = threading.Event()
    try:
        driver = pod.start(
            "trainer",
            [sys.executable, "-c", DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert driver.stdout is not None and driver.stdin is not None
        assert driver.stdout.readline().strip() == "ready"
        (driver_pid,) = pod.host_pids("trainer")
        pod.start(
            "vram-enforcer",
            [
                *enforcer_argv("sidecar"),
                "--kubeconfig",
                str(kubeconfig),
                "--interval",
                "100ms",
                "--api-access",
                "direct",
                "--log-format",
                "text",
            ],
            env={
                "POD_NAME": pod.name,
                "POD_NAMESPACE": pod.namespace,
                "POD_UID": pod.uid,
                "VRAM_ENFORCER_LIMITS": json.dumps({"trainer": GiB}),
                "VRAM_ENFORCER_CONTAINERS": "trainer",
                "VRAM_ENFORCER_AGENT_SOCKET": str(tmp / "agent.sock"),
            },
            stderr=(tmp / "sidecar.log").open("w"),
        )
        (sidecar_pid,) = wait_for(lambda: pod.host_pids("vram-enforcer"), what="the sidecar")
        wait_for(
            lambda: "enforcing" in (tmp / "sidecar.log").read_text(),
            timeout=20,
            what="the sidecar to start",
        )
        time.sleep(1.0)
        before = {
            name: proc_status_kib(pid, "VmRSS") / 1024
            for name, pid in (
                ("sidecar", sidecar_pid),
                ("agent", agent.pid),
                ("webhook", webhook.pid),
            )
        }
        watcher = threading.Thread(
            target=_peak,
            args=(
                {"sidecar": sidecar_pid, "agent": agent.pid, "webhook": webhook.pid},
                sampling,
                peaks,
            ),
        )
        watcher.start()
        # -- the attack --------------------------------------------------------------------
        flood.idle("127.0.0.1", agent_metrics, 500)  # any pod
        flood.idle("127.0.0.1", hook_port, 300)  # any pod
        for _ in range(10):  # pods of their own, hammering the socket
            p = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "--kill-child",
                    sys.executable,
                    "-c",
                    SOCKET_HAMMER,
                    str(tmp / "agent.sock"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            pods.append(p)
        reviews = _hostile_reviews()
        statuses: dict[int, int] = {}
        context = ssl.create_default_context(cafile=str(ca[0]))

        def hostile_review(source: str) -> None:
            """From an address of its own: the idle flood holds 127.0.0.1's share."""

            def connect() -> http.client.HTTPSConnection:
                return http.client.HTTPSConnection(
                    "127.0.0.1", hook_port, context=context, timeout=30, source_address=(source, 0)
                )

            conn = connect()
            for body in random.sample(reviews, len(reviews)):
                conn.request(
                    "POST", "/mutate", body=body, headers={"Content-Type": "application/json"}
                )
                status = conn.getresponse()
                status.read()
                statuses[status.status] = statuses.get(status.status, 0) + 1
                if status.getheader("Connection") == "close":
                    conn.close()
                    conn = connect()
            conn.close()

        for i in range(4):
            flood.loop(functools.partial(hostile_review, f"127.0.1.{i + 1}"))
        time.sleep(2.0)
        # -- measured while it lasts -------------------------------------------------------
        latencies, reviews_ms, healthz_ms, missed = [], [], [], 0
        good = json.dumps(sample_review()).encode()
        review_conn = http.client.HTTPSConnection(
            "127.0.0.1", hook_port, context=context, timeout=30, source_address=("127.0.0.2", 0)
        )
        for _ in range(trials):
            driver.stdin.write("go\n")
            driver.stdin.flush()
            assert driver.stdout.readline().strip() == "forked"
            (victim,) = set(pod.host_pids("trainer")) - {driver_pid}
            time.sleep(random.uniform(0, 0.1))
            state.set_process(0, victim, 2 * GiB)
            state.write(state_file)
            crossed = time.monotonic_ns()
            t0 = time.perf_counter()
            review_conn.request(
                "POST", "/mutate", body=good, headers={"Content-Type": "application/json"}
            )
            assert b'"allowed":true' in review_conn.getresponse().read()
            reviews_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            with socket.create_connection(
                ("127.0.0.1", agent_metrics), timeout=5, source_address=("127.0.0.3", 0)
            ) as probe:
                probe.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                assert b"200 OK" in probe.recv(4096)
            healthz_ms.append((time.perf_counter() - t0) * 1000)
            if not select.select([driver.stdout], [], [], MISSED_AFTER)[0]:
                missed += 1  # not enforced in time: let the trial end, and say so
                os.kill(victim, signal.SIGTERM)
                driver.stdout.readline()
            else:
                word, hit = driver.stdout.readline().split()
                assert word == "hit"
                latencies.append((int(hit) - crossed) / 1e6)
            state.remove_process(victim)
            state.write(state_file)
            print(f"flood: trial {len(latencies) + missed}/{trials}", file=sys.stderr, flush=True)
    finally:
        sampling.set()
        flood.close()
        for p in pods:  # the whole session: unshare and the pod's processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        pod.close()
        for proc in (agent, webhook):
            proc.terminate()
            proc.wait(timeout=15)
        garbage.shutdown()
    alive = {"agent": agent.returncode in (0, -15), "webhook": webhook.returncode == 0}
    ms = sorted(latencies)
    return {
        "trials": len(ms) + missed,
        "missed": missed,
        "detection_p50_ms": statistics.median(ms),
        "detection_p99_ms": percentile(ms, 0.99),
        "detection_max_ms": ms[-1],
        "target_p99_ms": 100 + 100 + 10,
        "review_p50_ms": statistics.median(reviews_ms),
        "review_p99_ms": percentile(sorted(reviews_ms), 0.99),
        "healthz_p99_ms": percentile(sorted(healthz_ms), 0.99),
        "hostile_reviews": sum(statuses.values()),
        "hostile_review_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "rss_before_mib": before,
        "peak": peaks,
        "exited_cleanly": alive,
        "flood_errors": flood.errors,
    }


# A pod of its own: opens connection after connection to the agent's socket (the agent
# keeps at most 8), sends a malformed line and an oversize one, and hangs up; forever.
SOCKET_HAMMER = r"""
import socket, sys, time
held = []
while True:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        s.sendall(b'{"v":1,"op":"subscribe"}\n' if len(held) < 20 else b"not json\n" + b"x" * 8192 + b"\n")
        held.append(s)
        if len(held) > 40:
            held.pop(0).close()
    except OSError:
        time.sleep(0.01)
"""
