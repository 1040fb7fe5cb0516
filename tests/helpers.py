"""Small helpers shared by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from enforcer.core.protocol import SIDECAR_SOCKET_DIR

PROC_FIXTURES = Path(__file__).parent / "fixtures" / "proc"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `predicate` returns something truthy, and return it; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def standalone_agent(socket_path: Path, *flags: str) -> list[str]:
    """`vram-enforcer agent` alone on this machine: no API (nothing advertised, labelled or
    served to pods), no hard limits, its socket at `socket_path`; `flags` added."""
    return [
        sys.executable,
        "-m",
        "enforcer",
        "agent",
        "--no-advertise",
        "--no-labels",
        "--no-serve-pods",
        "--hard-limits",
        "off",
        "--socket",
        str(socket_path),
        *flags,
    ]


def api_agent_flags(node: str, kubeconfig: Path, socket_path: Path) -> list[str]:
    """The flags of `vram-enforcer agent` for node `node` against a stand-in API server
    (`kubeconfig`): pods served (the default), nothing advertised or labelled, no hard
    limits, no kubelet to read, its socket at `socket_path`."""
    return [
        "--node-name",
        node,
        "--kubeconfig",
        str(kubeconfig),
        "--socket",
        str(socket_path),
        "--no-advertise",
        "--no-labels",
        "--hard-limits",
        "off",
        "--pod-resources-socket",
        "",
    ]


def free_port() -> int:
    """A TCP port that nobody uses right now, below the kernel's ephemeral range.

    Not port 0's pick: that comes from the ephemeral range, where every outgoing
    connection takes its local port too, so between this call and the server's own bind
    a client could take it ("address already in use", seen with etcd).
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = secrets.randbelow(low - 10000) + 10000
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # noqa: S104 - a probe, closed at once; servers bind all too
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 10000 and {low}")


def children(parent: int) -> list[int]:
    """The direct children of `parent`, from /proc."""
    from enforcer.edge.procfs import ProcFs

    proc = ProcFs()
    return [
        p
        for p in proc.descendants(parent)
        if (st := proc.stat(p)) is not None and st.ppid == parent
    ]


def copy_proc_fixture(name: str, dest: Path) -> Path:
    """A writable copy of the checked-in `/proc` tree `name` (e.g. "host"), at `dest`."""
    shutil.copytree(PROC_FIXTURES / name, dest, symlinks=True)
    return dest


def set_start_time(proc_root: Path, pid: int, ticks: int) -> None:
    """Rewrite field 22 (start time, clock ticks since boot) of `<proc_root>/<pid>/stat`.

    The fields are counted after the last ')': the command name before it may hold spaces
    and parentheses, so splitting the whole line on spaces would edit another field.
    """
    stat = proc_root / str(pid) / "stat"
    head, paren, tail = stat.read_text().rpartition(")")
    fields = tail.split(" ")  # fields[0] is "" (the space after ')'), fields[1] is field 3
    fields[22 - 2] = str(ticks)
    stat.write_text(head + paren + " ".join(fields))


def older_than_a_tick(pid: int) -> int:
    """Wait until process `pid` started at least one clock tick ago; returns `pid`.

    A real GPU process always is by the time NVML lists it (creating a CUDA context takes
    far longer), and the enforcer refuses a process that started in the tick in which NVML
    first listed its pid: it cannot be proven to be the one NVML meant.
    """
    from enforcer.edge.pid_view import boot_ticks
    from enforcer.edge.procfs import ProcFs

    start = ProcFs().start_time(pid)
    assert start is not None, f"no process {pid}"
    wait_for(lambda: boot_ticks() > start, what=f"pid {pid} to be a tick old")
    return pid


def reuse_pid(pid: int) -> subprocess.Popen[bytes]:
    """A new process (`sleep 60`) that has `pid`, forced through this PID namespace's
    `ns_last_pid` (root only). A fork elsewhere in between takes the pid first: then it
    tries again."""
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        newcomer = subprocess.Popen(["sleep", "60"])
        if newcomer.pid == pid:
            return newcomer
        newcomer.kill()
        newcomer.wait()
    raise AssertionError(f"could not reuse pid {pid}")


def configured(argv: list[str], environ: dict[str, str] | None = None) -> Any:
    """A mode's validated settings from a command line and an environment, as `main` makes
    them (raises ConfigError)."""
    from enforcer.cli import build_parser, configure

    _, _, settings = configure(build_parser().parse_args(argv), environ or {})
    return settings


@contextlib.contextmanager
def scratch_cgroup(prefix: str = "vram-test") -> Iterator[Path]:
    """A fresh cgroup in the cgroup v2 hierarchy (never a v1 controller hierarchy), removed
    with everything below it afterwards, once the processes in it have gone. Skips the
    test where cgroup v2 is not mounted or not writable (not root)."""
    import pytest

    from enforcer.edge.cgroupfs import v2_root

    root = v2_root()
    if root is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    path = root / f"{prefix}-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        yield path
    finally:
        remove_cgroup_tree(path)


def remove_cgroup_tree(path: Path, timeout: float = 10.0) -> None:
    """Remove a cgroup and every cgroup below it, deepest first, each once its processes
    have gone (rmdir is the only removal cgroupfs allows). Nothing there: nothing to do."""
    from enforcer.edge.cgroupfs import remove

    if not path.exists():
        return
    below = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for directory in [*below, path]:
        wait_for(lambda d=directory: remove(d), timeout=timeout, what=f"{directory} removed")


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for `server` with a made-up bearer token, for a component pointed at a
    stand-in API server (or at none)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
    )
    return path


def end_namespace(proc: subprocess.Popen[str], pid: int | None) -> None:
    """The pod's first process (all of its PID namespace goes with it), then unshare."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


# A pod of its own: its own PID namespace, and its own mount namespace, with a tmpfs over
# /run in which the sidecar's emptyDir directory is made (nothing is left on the host); the
# command that follows runs there, as its first process.
POD_NAMESPACES = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--pid",
    "--fork",
    "sh",
    "-c",
    f'mount -t tmpfs tmpfs /run && mkdir -p {SIDECAR_SOCKET_DIR} && exec "$0" "$@"',
]
