"""Slow connections from many pods (issue 42, item 6): the agent's /healthz, and the webhook's
reviews and probes, while attackers drip requests into every place of both ports.

The attack is the issue's reproduction, widened: `ADDRESSES` pods (source addresses
127.0.4.x: loopback holds all of 127/8) each keep `PER_ADDRESS` connections open on each
port (more than either server holds in all, and than the agent's holds from one address), each sending a request's head a byte every
`DRIP` seconds, and open a new one `REOPEN` seconds after one is closed. On the webhook's
port three in four stop inside their TLS handshake, and the fourth drips its head after it.
Meanwhile, from addresses of their own, as the kubelet and the API server do:
- the kubelet asks the agent's /healthz every 100 ms, a new connection each time, and the
  webhook's /healthz every 500 ms over TLS;
- the API server sends a review every 100 ms on one kept-alive connection, and one a second
  on a new connection.
An answer later than `PROBE_TIMEOUT` (the kubelet's default probe timeout) counts as failed.

    .venv/bin/python bench/run.py --only slow-flood
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import selectors
import socket
import ssl
import statistics
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import enforcer_argv, percentile, proc_status_kib
from bench.webhook_bench import sample_review
from tests.e2e.cluster import make_ca, make_serving_cert
from tests.fakenvml import FakeGpuState
from tests.helpers import free_port, wait_for

# 400 on each port: more than either server holds in all (256), and each of 40 addresses
# more than the agent's port holds from one (8).
ADDRESSES = 40
PER_ADDRESS = 10
DRIP = 4.0  # a byte every 4 s, as the eight pods dripped
REOPEN = 0.5
PROBE_TIMEOUT = 1.0


class Attacker(threading.Thread):
    """The pods: keep PER_ADDRESS connections per address on one port, each dripping its
    head; a connection the server closes is opened again after REOPEN."""

    def __init__(self, port: int, tls: ssl.SSLContext | None, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.tls, self.stop = port, tls, stop
        self.opened = 0
        self._selector = selectors.DefaultSelector()
        self._due: deque[tuple[float, str, int]] = deque(
            (0.0, f"127.0.4.{a + 1}", n) for a in range(ADDRESSES) for n in range(PER_ADDRESS)
        )

    def _open(self, address: str, n: int) -> None:
        try:
            sock = socket.create_connection(
                ("127.0.0.1", self.port), timeout=2, source_address=(address, 0)
            )
            if self.tls is None:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Drip: ")
            elif n % 4:
                sock.sendall(b"\x16\x03\x01")  # a handshake begun, never finished
            else:
                sock = self.tls.wrap_socket(sock, server_hostname="127.0.0.1")
                sock.sendall(b"POST /mutate HTTP/1.1\r\nX-Drip: ")
        except OSError:
            self._due.append((time.monotonic() + REOPEN, address, n))
            return
        sock.setblocking(False)
        self.opened += 1
        self._selector.register(sock, selectors.EVENT_READ, (address, n))

    def run(self) -> None:
        next_drip = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            for _ in range(len(self._due)):
                at, address, n = self._due.popleft()
                if at <= now:
                    self._open(address, n)
                else:
                    self._due.append((at, address, n))
            for key, _ in self._selector.select(timeout=0.05):
                self._closed(key.fileobj)  # type: ignore[arg-type]
            if now >= next_drip:
                next_drip = now + DRIP
                for key in list(self._selector.get_map().values()):
                    if self.tls is not None and key.data[1] % 4:
                        continue  # a stalled handshake sends nothing more
                    with contextlib.suppress(OSError, ssl.SSLError):
                        key.fileobj.send(b"x")  # type: ignore[union-attr]
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def _closed(self, sock: socket.socket) -> None:
        """Readable: the server answered (a 408) or closed it; either way it is done."""
        with contextlib.suppress(OSError, ssl.SSLError):
            sock.recv(65536)
        address, n = self._selector.get_key(sock).data
        self._selector.unregister(sock)
        sock.close()
        self._due.append((time.monotonic() + REOPEN, address, n))


def _timed(step: Callable[[], bool], every: float, stop: threading.Event) -> dict[str, Any]:
    """Run `step` every `every` seconds until `stop`: how long each took, and how many
    failed or took longer than PROBE_TIMEOUT."""
    times, failed = [], 0
    while not stop.wait(every):
        t0 = time.perf_counter()
        try:
            ok = step()
        except (OSError, ssl.SSLError, http.client.HTTPException):
            ok = False
        took = time.perf_counter() - t0
        times.append(took * 1000)
        failed += not ok or took > PROBE_TIMEOUT
    ms = sorted(times)
    return {
        "asked": len(ms),
        "failed": failed,
        "p50_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1],
    }


def _healthz(port: int) -> bool:
    with socket.create_connection(
        ("127.0.0.1", port), timeout=PROBE_TIMEOUT * 5, source_address=("127.0.0.3", 0)
    ) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    return answer.split(b"\r\n", 1)[0].endswith(b" 200 OK")  # HTTP/1.0 before issue 42


def _answers(port: int) -> bool:
    try:
        return _healthz(port)
    except OSError:
        return False  # not listening yet


def _closures(port: int, server: str) -> dict[str, float] | None:
    """vram_enforcer_http_connections_closed_total by reason (None: a server without it)."""
    try:
        body = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=10, source_address=("127.0.0.4", 0)
        )
        body.request("GET", "/metrics")
        text = body.getresponse().read().decode()
    except OSError:
        return None
    series = (
        r'vram_enforcer_http_connections_closed_total\{reason="([a-z-]+)",server="(\w+)"\} (\S+)'
    )
    found = [(r, v) for r, name, v in re.findall(series, text) if name == server]
    return {reason: float(value) for reason, value in found} or None


def _sockets(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


def _peak(
    pids: dict[str, int],
    stop: threading.Event,
    out: dict[str, dict[str, float]],
    held: dict[str, list[int]],
) -> None:
    """The largest RSS (MiB) and thread count of each process, and its open sockets every
    tenth of a second, while `stop` is not set."""
    while not stop.wait(0.1):
        for name, pid in pids.items():
            with contextlib.suppress(OSError, KeyError):
                rss = proc_status_kib(pid, "VmRSS") / 1024
                threads = float(proc_status_kib(pid, "Threads"))
                row = out.setdefault(name, {"rss_mib": 0.0, "threads": 0.0})
                row["rss_mib"] = max(row["rss_mib"], rss)
                row["threads"] = max(row["threads"], threads)
                held.setdefault(name, []).append(_sockets(pid))


def run(lib_dir: Path, window: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as name:
        return _run(lib_dir, Path(name), window)


def _run(lib_dir: Path, tmp: Path, window: float) -> dict[str, Any]:  # noqa: PLR0915 - one scenario
    state_file = tmp / "gpu.json"
    FakeGpuState.single_gpu().write(state_file)
    agent_port, hook_port, hook_metrics = free_port(), free_port(), free_port()
    agent = subprocess.Popen(
        [
            *enforcer_argv("agent"),
            *("--no-advertise", "--no-labels", "--no-serve-pods", "--hard-limits", "off"),
            *("--socket", str(tmp / "agent.sock"), "--metrics-port", str(agent_port)),
        ],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)},
        stderr=(tmp / "agent.log").open("w"),
    )
    ca = make_ca(tmp)
    cert, key = make_serving_cert(tmp, ca, "webhook")
    webhook = subprocess.Popen(
        [
            *enforcer_argv("webhook"),
            *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
            *("--port", str(hook_port), "--address", "127.0.0.1"),
            *("--sidecar-image", "img:1", "--sidecar-mode", "native"),
            *("--metrics-port", str(hook_metrics), "--metrics-address", "127.0.0.1"),
        ],
        stderr=(tmp / "webhook.log").open("w"),
        env={**os.environ, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    stop, sampling = threading.Event(), threading.Event()
    peaks: dict[str, dict[str, float]] = {}
    sockets: dict[str, list[int]] = {}
    try:
        wait_for(lambda: _answers(agent_port), timeout=30, what="the agent's /healthz")
        wait_for(lambda: "serving admission" in (tmp / "webhook.log").read_text(), what="webhook")
        context = ssl.create_default_context(cafile=str(ca[0]))
        watcher = threading.Thread(
            target=_peak,
            args=({"agent": agent.pid, "webhook": webhook.pid}, sampling, peaks, sockets),
        )
        watcher.start()
        attackers = [Attacker(agent_port, None, stop), Attacker(hook_port, context, stop)]
        for a in attackers:
            a.start()
        time.sleep(DRIP + 1)  # every place taken, the first drips sent

        def connect(source: str) -> http.client.HTTPSConnection:
            return http.client.HTTPSConnection(
                "127.0.0.1",
                hook_port,
                context=context,
                timeout=PROBE_TIMEOUT * 5,
                source_address=(source, 0),
            )

        body = json.dumps(sample_review()).encode()
        kept = [connect("127.0.0.2")]

        def review(conn: http.client.HTTPSConnection) -> bool:
            conn.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
            return b'"allowed":true' in conn.getresponse().read()

        def kept_alive() -> bool:
            try:
                return review(kept[0])
            except (OSError, http.client.HTTPException):
                kept[0] = connect("127.0.0.2")  # as the API server would: a new one
                raise

        def new_each_time() -> bool:
            conn = connect("127.0.0.2")
            try:
                return review(conn)
            finally:
                conn.close()

        def webhook_healthz() -> bool:
            conn = connect("127.0.0.3")
            try:
                conn.request("GET", "/healthz")
                return conn.getresponse().status == 200
            finally:
                conn.close()

        measured: dict[str, Any] = {}
        done = threading.Event()
        probes = {
            "agent_healthz": (lambda: _healthz(agent_port), 0.1),
            "webhook_review_kept_alive": (kept_alive, 0.1),
            "webhook_review_new_connection": (new_each_time, 1.0),
            "webhook_healthz": (webhook_healthz, 0.5),
        }
        threads = [
            threading.Thread(
                target=lambda n=n, s=s, e=e: measured.__setitem__(n, _timed(s, e, done))
            )
            for n, (s, e) in probes.items()
        ]
        for t in threads:
            t.start()
        time.sleep(window)
        done.set()
        for t in threads:
            t.join()
        # What each server held meanwhile: every socket of the process (its listeners, the
        # agent's usage socket, the probes' own included).
        held = {
            name: statistics.median(counts[-int(window * 10) :]) for name, counts in sockets.items()
        }
        opened = {"agent": attackers[0].opened, "webhook": attackers[1].opened}
        closures = {
            "agent": _closures(agent_port, "metrics"),
            "webhook": _closures(hook_metrics, "webhook"),
        }
    finally:
        stop.set()
        sampling.set()
        for proc in (agent, webhook):
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "window_s": window,
        "attack": {
            "addresses": ADDRESSES,
            "per_address_per_port": PER_ADDRESS,
            "drip_s": DRIP,
            "sockets_held_median": held,
            "opened": opened,
        },
        **measured,
        "closed_by_server": closures,
        "peak": peaks,
        "exited_cleanly": {
            "agent": agent.returncode in (0, -15),
            "webhook": webhook.returncode == 0,
        },
    }


def show(row: dict[str, Any]) -> None:
    held = row["attack"]["sockets_held_median"]
    print(
        f"slow flood, {row['attack']['addresses']} pods x {row['attack']['per_address_per_port']} "
        f"dripping connections a port (the agent held {held['agent']:.0f} sockets, the webhook "
        f"{held['webhook']:.0f}), {row['window_s']:.0f} s:"
    )
    for name in (
        "agent_healthz",
        "webhook_review_kept_alive",
        "webhook_review_new_connection",
        "webhook_healthz",
    ):
        m = row[name]
        print(
            f"  {name}: {m['asked']} asked, {m['failed']} failed or over {PROBE_TIMEOUT:g} s; "
            f"p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms, max {m['max_ms']:.1f} ms"
        )
    print(f"  closed by the servers: {row['closed_by_server']}; peaks: {row['peak']}")
