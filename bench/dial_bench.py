"""What dialling the node's sidecars costs the agent, and what a hung path costs it (issue 42,
items 1 and 7).

- **The walk**: a dial opens the socket in the sidecar's filesystem one component at a
  time (`tenant_fs.open_in`: openat2, the mount of each component checked against the
  container's mountinfo) and connects through the descriptor; before, it connected to
  `/proc/<pid>/root/run/vram-enforcer/sidecar.sock` as a path. Both are timed on one real
  sidecar (`AgentLink` listening in a pod's namespaces of its own), the listener proof
  included, `repeats` times each, alternating.
- **A hung path**: `sidecars` real sidecars to dial, and `hung` more whose dial waits in the
  kernel (an ordinary `stat` of a path in a FUSE mount that never answers, as a hard NFS
  mount whose server is gone). The sidecar watch checks once a second as the agent runs
  it; each check is timed, and so is the time until every good sidecar is connected. The
  same with `hung` = 0, for the difference: the watch's checks, and the good sidecars,
  should not notice.

Needs root, a writable cgroup v2 hierarchy and /dev/fuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from enforcer.core.payloads import Pod
from enforcer.core.pod_directory import directory
from enforcer.core.protocol import SIDECAR_SOCKET
from enforcer.edge.cgroupfs import v2_root
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.peers import prove_listener
from enforcer.edge.procfs import ProcFs
from enforcer.edge.sidecar_dialer import Dialer, dial, dial_container
from enforcer.edge.usage_server import ServerHooks, ServerMetrics, UsageServer
from enforcer.modes.sidecar_watch import SidecarNews, SidecarProcesses, SidecarWatch
from tests.helpers import remove_cgroup_tree, wait_for
from tests.hung_fuse import hung_fuse_at
from tests.integration.test_agent_pods import Caller
from tests.integration.test_forged_sidecars import in_its_own_namespaces, injected_pod


def available() -> str | None:
    root = v2_root()
    if os.geteuid() != 0 or root is None or not os.access(root, os.W_OK):
        return "needs root and a writable cgroup v2 hierarchy"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    return None


class _Recorder:
    def record(self, *args: object) -> None:
        pass


def _ms(samples: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(samples), "max": max(samples)}


# A sidecar's socket that takes every connection at once (a real sidecar takes one a tick,
# and a dial a millisecond would fill its backlog): its container's first process.
ACCEPTING = (
    "import os, socket\n"
    f"s = socket.socket(socket.AF_UNIX); s.bind({SIDECAR_SOCKET!r}); s.listen(64)\n"
    "while True: s.accept()[0].close()\n"
)


def walk(repeats: int = 200) -> dict[str, Any]:
    """One sidecar's socket, dialled the new way and the old, alternating."""
    root = v2_root()
    assert root is not None
    top = root / f"vram-bench-{secrets.token_hex(4)}"
    cid, uid = secrets.token_hex(32), f"{secrets.token_hex(4)}-0-4-8-0"
    try:
        box = top / f"kubepods/pod{uid}/{cid}"
        box.mkdir(parents=True)
        then = f"exec {sys.executable} -c {shlex.quote(ACCEPTING)}"
        with in_its_own_namespaces("true", box, then) as pid:
            wait_for(lambda: os.path.exists(f"/proc/{pid}/root{SIDECAR_SOCKET}"), what="the socket")
            procfs = ProcFs()
            init = procfs.container_inits([cid])[cid]
            assert not isinstance(init, str)
            walked, by_path = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                found = dial(procfs, cid, init)
                walked.append((time.perf_counter() - start) * 1000)
                assert isinstance(found, socket.socket), found
                found.close()
                start = time.perf_counter()
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(f"/proc/{init.pid}/root{SIDECAR_SOCKET}")
                    prove_listener(sock, procfs, init, cid)
                by_path.append((time.perf_counter() - start) * 1000)
        return {"repeats": repeats, "walk_ms": _ms(walked), "by_path_ms": _ms(by_path)}
    finally:
        remove_cgroup_tree(top)


@contextlib.contextmanager
def _sidecars(top: Path, count: int) -> Iterator[dict[str, str]]:
    """`count` real sidecars, each its pod's, listening: their container IDs by pod UID."""
    started: list[Caller] = []
    found: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(count):
                cid, uid = secrets.token_hex(32), f"{i:08x}-0000-4000-8000-000000000000"
                started.append(Caller(Path(tmp) / "unused", top, uid, cid, listen=True))
                found[uid] = cid
            for caller in started:
                wait_for(caller.listening, what="a sidecar to listen")
            yield found
    finally:
        for caller in started:
            caller.stop()


def watched(sidecars: int, hung: int, seconds: float) -> dict[str, Any]:
    """The watch's checks, once a second for `seconds`, with `hung` dials stuck meanwhile."""
    root = v2_root()
    assert root is not None
    top = root / f"vram-bench-{secrets.token_hex(4)}"
    top.mkdir()
    try:
        with (
            _sidecars(top, sidecars) as good,
            contextlib.ExitStack() as mounts,
            tempfile.TemporaryDirectory() as tmp,
        ):
            pods: dict[str, Pod] = {
                uid: injected_pod(f"good-{i}", uid, "team", cid)
                for i, (uid, cid) in enumerate(good.items())
            }
            paths: dict[str, str] = {}  # the hung ones' container ID -> the path that hangs
            for i in range(hung):
                pid = mounts.enter_context(hung_fuse_at("/run/vram-enforcer"))
                cid = secrets.token_hex(32)
                paths[cid] = f"/proc/{pid}/root{SIDECAR_SOCKET}"
                pods[f"hung-{i}"] = injected_pod(f"hung-{i}", f"hung-{i}", "team", cid)

            def dialled(cid: str) -> Any:
                if cid in paths:
                    with contextlib.suppress(OSError):  # ENOTCONN once the server ends
                        os.stat(paths[cid])  # waits in the kernel until the FUSE server ends
                return dial_container(ProcFs(), cid)

            t = AgentTelemetry()
            news = SidecarNews()
            hooks = ServerHooks(hung_up=news.hung_up, sidecars_only=True)
            metrics = ServerMetrics(t.requests, t.connections, t.unexpected)
            server = UsageServer(Path(tmp) / "a.sock", ProcFs(), metrics, 60.0, hooks)
            server.start()
            try:
                server.publish_pods(directory(pods.values(), {}, None, opted_in={"team"}))
                dials = Dialer(dialled, news.woken.set, t.unexpected.labels("sidecar-dial"))
                watch = SidecarWatch(
                    lambda: pods,
                    server,
                    news,
                    _Recorder(),  # type: ignore[arg-type]
                    t,
                    (dials, SidecarProcesses(ProcFs())),
                )
                checks: list[float] = []
                began = time.perf_counter()
                all_connected = None
                while time.perf_counter() - began < seconds:
                    start = time.perf_counter()
                    watch.check()
                    checks.append((time.perf_counter() - start) * 1000)
                    if all_connected is None and set(good.values()) <= server.connected:
                        all_connected = time.perf_counter() - began
                    news.woken.wait(1.0)
                    news.woken.clear()
                return {
                    "sidecars": sidecars,
                    "hung_dials": hung,
                    "checks": len(checks),
                    "first_check_ms": checks[0],  # it starts a dial (a thread) per sidecar
                    "check_ms": _ms(checks[1:]),
                    "all_good_connected_s": all_connected,
                    "still_in_flight": len(dials.in_flight),
                }
            finally:
                server.close()
    finally:
        remove_cgroup_tree(top)


def run(repeats: int = 200, sidecars: int = 20, seconds: float = 15.0) -> dict[str, Any]:
    return {
        "walk": walk(repeats),
        "watch": [watched(sidecars, hung, seconds) for hung in (0, 8)],
    }


def show(found: dict[str, Any]) -> None:
    w = found["walk"]
    print(
        f"a dial of one sidecar, its listener proven: walked (openat2, mounts checked) p50 "
        f"{w['walk_ms']['p50']:.2f} ms (max {w['walk_ms']['max']:.2f}); by path p50 "
        f"{w['by_path_ms']['p50']:.2f} ms (max {w['by_path_ms']['max']:.2f})"
    )
    for row in found["watch"]:
        print(
            f"the sidecar watch, {row['sidecars']} sidecars and {row['hung_dials']} dials hung "
            f"in the kernel: the first check {row['first_check_ms']:.2f} ms, the {row['checks'] - 1} "
            f"after p50 {row['check_ms']['p50']:.2f} ms (max {row['check_ms']['max']:.2f}); "
            "every good sidecar connected after "
            f"{row['all_good_connected_s']:.2f} s; {row['still_in_flight']} dials still hung"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--sidecars", type=int, default=20)
    p.add_argument("--seconds", type=float, default=15.0)
    args = p.parse_args()
    if reason := available():
        sys.exit(f"skipped: {reason}")
    found = run(args.repeats, args.sidecars, args.seconds)
    show(found)
    print(json.dumps(found, indent=2))
