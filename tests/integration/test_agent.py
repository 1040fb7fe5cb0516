"""The node agent's usage socket, against real PID namespaces made with `unshare`.

Each "pod" is a fresh PID namespace whose PID 1 asks the agent for usage. The fake NVML
lists the pods' processes by host pid, as a real driver does; each pod must see exactly its
own processes, named by its own pids, and the host must see all of them by host pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.model import GiB, SourceDown
from enforcer.core.pod_directory import directory
from enforcer.edge.peers import PeerError, attest
from enforcer.edge.pid_view import boot_ticks
from enforcer.edge.procfs import ProcFs
from enforcer.edge.usage_server import PER_NAMESPACE
from tests.fakenvml import FakeGpuState
from tests.fakenvml.plugin import FakeNvml
from tests.helpers import (
    children,
    free_port,
    scratch_cgroup,
    standalone_agent,
    wait_for,
    write_kubeconfig,
)
from tests.integration.conftest import serving

POD = Path(__file__).with_name("pod.py")
ROOT = Path(__file__).resolve().parents[2]
HOST = ProcFs()

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)


# Root without CAP_SYS_PTRACE: the kernel lets such a process read another's `ns/pid` only
# where the other's capabilities are a subset of its own (commoncap's ptrace check).
NO_PTRACE = ["setpriv", "--inh-caps", "-all", "--bounding-set", "-sys_ptrace"]
ASK = (  # a request (argv[2]) to the socket (argv[1]); its reply's line on stdout
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
    "s.sendall(sys.argv[2].encode()); print(s.makefile().readline())"
)


class Agent:
    def __init__(self, gpu: FakeNvml, tmp: Path, *wrapper: str) -> None:
        """`wrapper`: what runs the agent's command (`setpriv`, to take a capability away),
        and `ask`'s requests (the agent reads its callers as it reads any process)."""
        self.wrapper = wrapper
        self.socket = tmp / "run" / "agent.sock"
        self.metrics_port = free_port()
        self.log_path = tmp / "agent.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                *wrapper,
                *standalone_agent(
                    self.socket,
                    "--interval",
                    "50ms",
                    "--metrics-port",
                    str(self.metrics_port),
                    "--log-format",
                    "text",
                ),
            ],
            env={**os.environ, **gpu.env()},
            stderr=self.log,
            text=True,
        )
        wait_for(self._answers, what="the agent socket")

    def _answers(self) -> bool:
        """Listening, and past its first NVML pass."""
        try:
            return "processes" in self.ask()
        except OSError:
            return False

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(self.socket))
        return s

    def ask(self, request: bytes = b'{"v":1,"op":"usage"}\n') -> dict[str, Any]:
        if self.wrapper:
            asking = [*self.wrapper, sys.executable, "-c", ASK, str(self.socket), request.decode()]
            done = subprocess.run(asking, capture_output=True, text=True, check=False)
            if done.returncode:  # not listening yet, say
                raise OSError(done.stderr)
            return json.loads(done.stdout)  # type: ignore[no-any-return]
        with self.connect() as s:
            s.sendall(request)
            return json.loads(s.makefile("rb").readline())  # type: ignore[no-any-return]

    def stderr(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(timeout=10)
        self.log.close()
        return code


class Pod:
    def __init__(self, agent: Agent, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child",
                sys.executable,
                str(POD),
                "--socket",
                str(agent.socket),
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert self.proc.stdout.readline().strip() == "ready"
        (self.init_pid,) = wait_for(lambda: children(self.proc.pid), what="pod init")

    def host_pids(self) -> dict[int, tuple[int, ...]]:
        """Every process of the pod but its init: host pid -> NSpid chain."""
        found = {}
        for pid in HOST.descendants(self.proc.pid):
            nspid = HOST.nspid(pid)
            if pid != self.init_pid and nspid is not None and HOST.stat(pid).state != "Z":  # type: ignore[union-attr]
                found[pid] = nspid
        return found

    def ask(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write('{"v":1,"op":"usage"}\n')
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agent(fake_nvml: FakeNvml, tmp_path: Path) -> Iterator[Agent]:
    a = Agent(fake_nvml, tmp_path)
    yield a
    if a.proc.poll() is None:
        a.stop()


@pytest.fixture
def pods(agent: Agent) -> Iterator[list[Pod]]:
    made: list[Pod] = []
    yield made
    for p in made:
        p.close()


def list_on_gpu(gpu: FakeNvml, pids: dict[int, int]) -> None:
    """List `pids` on the GPU, once the clock has ticked past the youngest one's start.

    The agent never charges a process that started in the clock tick (10 ms) of the pass
    that first listed its pid, or later: it cannot be told from a newcomer on a pid that
    NVML still lists. Listed within that tick of their start (as once happened in CI, to
    the nested namespace's process, started last), the processes would rightly never be
    charged, and the test would wait for them in vain."""
    youngest = max((HOST.start_time(pid) or 0 for pid in pids), default=0)
    wait_for(lambda: boot_ticks() > youngest, what="a clock tick past the processes' start")
    for pid, used in pids.items():
        gpu.state.set_process(0, pid, used)
    gpu.write()


def wait_for_processes(ask: Any, count: int, expected: object = None) -> dict[str, Any]:
    """The first reply that lists `count` processes; on a timeout, the error shows the last
    reply (this wait once timed out in CI, and nothing said what the agent had answered)."""
    last: dict[str, Any] = {}

    def listed() -> dict[str, Any] | None:
        last.clear()
        last.update(ask())
        return dict(last) if len(last.get("processes", ())) == count else None

    try:
        return wait_for(listed, what=f"{count} processes")  # type: ignore[no-any-return]
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; expected {expected}; the agent's last reply: {last}"
        ) from None


def test_each_pod_sees_only_its_own_processes_with_its_own_pids(
    agent: Agent, pods: list[Pod], fake_nvml: FakeNvml
) -> None:
    a, b = Pod(agent), Pod(agent, "--nested")
    pods += [a, b]
    a_pids = wait_for(lambda: len(a.host_pids()) == 2 and a.host_pids(), what="pod a's workers")
    b_pids = wait_for(
        lambda: len(b.host_pids()) == 4 and b.host_pids(), what="pod b's workers"
    )  # 2 + unshare + nested sleep
    everyone = {pid: (i + 1) * GiB for i, pid in enumerate([*a_pids, *b_pids])}
    list_on_gpu(fake_nvml, everyone)

    reply_a = wait_for_processes(a.ask, 2)
    assert {(p["pid"], p["start_time"], p["used_bytes"]) for p in reply_a["processes"]} == {
        (chain[1], HOST.start_time(host), everyone[host]) for host, chain in a_pids.items()
    }
    reply_b = wait_for_processes(b.ask, 4, expected=b_pids)  # host pid -> NSpid chain
    # The nested namespace's process is b's too, named by its pid in b's namespace.
    assert {p["pid"] for p in reply_b["processes"]} == {chain[1] for chain in b_pids.values()}
    assert any(len(chain) == 3 for chain in b_pids.values())

    host = wait_for_processes(agent.ask, 6)
    assert {p["pid"] for p in host["processes"]} == set(everyone)
    assert reply_a["devices"][0]["total_bytes"] == 80 * GiB


def test_a_pod_without_gpu_processes_gets_an_empty_list(
    agent: Agent, pods: list[Pod], fake_nvml: FakeNvml
) -> None:
    a, b = Pod(agent), Pod(agent)
    pods += [a, b]
    a_pids = wait_for(lambda: len(a.host_pids()) == 2 and a.host_pids(), what="pod a's workers")
    list_on_gpu(fake_nvml, dict.fromkeys(a_pids, GiB))
    wait_for_processes(a.ask, 2)
    assert b.ask()["processes"] == []


def test_garbage_huge_lines_and_versions_get_errors_and_the_agent_lives(agent: Agent) -> None:
    with agent.connect() as s:
        f = s.makefile("rwb")
        for request, error in [
            (b"hello\n", "not JSON"),
            (b"[1,2]\n", "a request is a JSON object"),
            (b'{"v":2,"op":"usage"}\n', "unsupported protocol version 2"),
            (b'{"v":1,"op":"rm -rf"}\n', "unknown op 'rm -rf'"),
            (b"\xff\xfe\n", "not JSON"),
        ]:
            f.write(request)
            f.flush()
            assert error in json.loads(f.readline())["error"]
        f.write(b'{"v":1,"op":"usage"}\n')  # the same connection still works
        f.flush()
        assert "processes" in json.loads(f.readline())
    with agent.connect() as s:
        s.sendall(b"x" * 100_000)
        f = s.makefile("rb")
        assert "longer than 4096 bytes" in json.loads(f.readline())["error"]
        assert f.readline() == b""  # and the connection is closed
    assert "processes" in agent.ask()


def test_a_reader_that_never_reads_does_not_stall_others(agent: Agent) -> None:
    stuck = agent.connect()
    stuck.setblocking(False)
    sent = 0
    try:
        while sent < 20_000_000:  # until our socket buffer is full too
            sent += stuck.send(b'{"v":1,"op":"usage"}\n' * 200)
    except BlockingIOError:
        pass
    assert "processes" in agent.ask()
    # Answered while the stuck reader is still connected, so not after the agent gave up on
    # it (it does after 5 s of unread replies): it did not wait for it.
    (open_now,) = re.findall(r"^vram_enforcer_agent_connections (\S+)$", agent.metrics(), re.M)
    assert float(open_now) >= 1
    stuck.close()


def test_a_dead_peer_is_refused_not_confused(tmp_path: Path) -> None:
    """The caller exits before it is identified: no answer about anybody."""
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    conn, _ = server.accept()
    with pytest.raises(PeerError, match=r"exited|cannot read"):
        attest(conn, HOST)
    conn.close()
    server.close()


def test_a_connection_that_closes_at_once_does_not_hurt(agent: Agent) -> None:
    for _ in range(20):
        agent.connect().close()
    assert "processes" in agent.ask()


def test_two_hundred_concurrent_clients(agent: Agent, fake_nvml: FakeNvml) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        list_on_gpu(fake_nvml, {child.pid: GiB})
        wait_for_processes(agent.ask, 1)
        results: list[int] = []
        errors: list[BaseException] = []

        def client() -> None:
            try:
                with agent.connect() as s:
                    f = s.makefile("rwb")
                    for _ in range(10):
                        f.write(b'{"v":1,"op":"usage"}\n')
                        f.flush()
                        results.append(len(json.loads(f.readline())["processes"]))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client) for _ in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == []
        assert results == [1] * 2000
    finally:
        child.kill()
        child.wait()


def test_nvml_down_is_an_error_reply_and_it_recovers(agent: Agent, fake_nvml: FakeNvml) -> None:
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    fake_nvml.write()
    reply = wait_for(lambda: "error" in (r := agent.ask()) and r, what="an error reply")
    assert "GPU usage is unavailable on this node" in reply["error"]
    fake_nvml.state.clear_errors()
    fake_nvml.write()
    wait_for(lambda: "processes" in agent.ask(), what="recovery")


def test_metrics_and_a_clean_shutdown(agent: Agent) -> None:
    def scrape() -> str | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=2
            ) as r:
                body: str = r.read().decode()
        except OSError:
            return None
        return body if "vram_enforcer_source_up 1.0" in body else None

    agent.ask()
    body = wait_for(scrape, what="metrics")
    assert "vram_enforcer_gpu_total_bytes{" in body
    assert 'vram_enforcer_agent_requests_total{result="ok"}' in body
    assert agent.stop() == 0
    assert not agent.socket.exists()
    assert "Traceback" not in agent.stderr()


def test_what_reaches_a_closed_server_is_dropped_not_written_to_a_reused_descriptor(
    tmp_path: Path,
) -> None:
    """The sampler, the pod publisher and dials may outlive the server by a moment at the
    agent's shutdown. Before, each wrote its wake-up to the pipe's old descriptor number:
    EBADF tracebacks in the agent's log, or a byte in whatever file had been given that
    number since."""
    with serving(tmp_path / "agent.sock") as server:
        pass
    r, w = os.pipe()  # the lowest free numbers: the wake pipe's, just closed
    try:
        server.publish(SourceDown("late"))
        server.publish_pods(directory((), {}, None, opted_in=frozenset()))
        ours, theirs = socket.socketpair()
        server.adopt("c" * 64, ours)
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing written into it
        assert ours.fileno() == -1  # closed, not kept unread
        theirs.close()
    finally:
        os.close(r)
        os.close(w)


def test_utilisation_reaches_callers_and_tenants_are_counted_per_gpu(
    agent: Agent, fake_nvml: FakeNvml
) -> None:
    """Three GPU processes in two cgroups: each caller gets each process's utilisation with
    its usage, and the agent counts two tenants on the GPU (a third process of the first
    cgroup is the same tenant)."""
    with scratch_cgroup("vram-tenant") as other:
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
        try:
            (other / "cgroup.procs").write_text(str(sleepers[2].pid))
            for i, p in enumerate(sleepers):
                fake_nvml.state.set_process(0, p.pid, GiB)
                fake_nvml.state.set_utilization(0, p.pid, sm=10 * (i + 1), memory=i)
            fake_nvml.write()
            reply = wait_for(
                lambda: (r := agent.ask()) and sum("sm" in p for p in r["processes"]) == 3 and r,
                what="3 processes with their utilisation",
            )
            got = {p["pid"]: (p["sm"], p["mem"]) for p in reply["processes"]}
            assert got == {p.pid: (10 * (i + 1), i) for i, p in enumerate(sleepers)}
            tenants = wait_for(
                lambda: re.search(r"vram_enforcer_gpu_tenants\{[^}]*\} (\S+)", agent.metrics()),
                what="the tenant count",
            )
            assert float(tenants[1]) == 2.0
        finally:
            for p in sleepers:
                p.kill()
                p.wait()


def _unplaced(metrics: str) -> tuple[float, float] | None:
    """GPU 0's unplaced bytes and processes, as the agent serves them."""
    amount = re.search(r'vram_enforcer_gpu_unplaced_bytes\{gpu="0"[^}]*\} (\S+)', metrics)
    count = re.search(r'vram_enforcer_gpu_unplaced_processes\{gpu="0"[^}]*\} (\S+)', metrics)
    return (float(amount[1]), float(count[1])) if amount and count else None


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_a_process_whose_namespace_cannot_be_read_is_counted_unplaced_never_dropped(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """The agent runs without CAP_SYS_PTRACE, so the kernel refuses it `ns/pid` of a process
    that holds capabilities it lacks (one of this test's, in a PID namespace of its own, as
    a pod's are), as a security module refuses it a process under another profile. That
    process's memory is counted per GPU as unplaced and said once in the log, with its pid
    and why; a process it can read is served as before; once the unplaced process exits,
    nothing is left of it."""
    readable = subprocess.Popen([*NO_PTRACE, "sleep", "600"])
    boxed = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "600"])
    agent = None
    try:
        wait_for(lambda: HOST.cmdline(readable.pid) == "sleep 600", what="the readable's exec")
        (hidden,) = wait_for(lambda: children(boxed.pid), what="the boxed sleep")
        wait_for(lambda: HOST.cmdline(hidden) == "sleep 600", what="the boxed one's exec")
        list_on_gpu(fake_nvml, {readable.pid: GiB, hidden: 3 * GiB})
        agent = Agent(fake_nvml, tmp_path, *NO_PTRACE)
        wait_for(lambda: _unplaced(agent.metrics()) == (3 * GiB, 1), what="3 GiB unplaced")
        for _ in range(3):  # later passes: said once, not on every pass
            reply = agent.ask()
            assert [p["pid"] for p in reply["processes"]] == [readable.pid], reply
        said = [line for line in agent.stderr().splitlines() if "cannot be placed" in line]
        assert len(said) == 1, said
        assert f"pid {hidden} holds 3.00 GiB on " in said[0]
        assert f"/proc/{hidden}/ns/pid: Permission denied" in said[0]
        boxed.kill()  # and its child with it (--kill-child)
        boxed.wait()
        wait_for(lambda: _unplaced(agent.metrics()) == (0, 0), what="the exit to drop it")
        assert agent.stop() == 0
        assert "Traceback" not in agent.stderr()
    finally:
        for child in (readable, boxed):
            child.kill()
            child.wait()
        if agent is not None and agent.proc.poll() is None:
            agent.stop()


def test_a_stale_socket_is_replaced_but_a_live_one_is_not(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    stale = tmp_path / "run" / "agent.sock"
    stale.parent.mkdir()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a crashed agent leaves behind
    first = Agent(fake_nvml, tmp_path)
    try:
        assert "processes" in first.ask()
        second = subprocess.run(
            standalone_agent(first.socket),
            env={**os.environ, **fake_nvml.env()},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        assert "another agent is already listening" in second.stderr
        assert "processes" in first.ask()
    finally:
        first.stop()


def test_the_agent_refuses_to_run_outside_the_host_pid_namespace(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    out = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            *standalone_agent(tmp_path / "a.sock", "--log-format", "text"),
        ],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "hostPID: true" in out.stderr


def test_a_subscriber_gets_each_new_sample_pushed(agent: Agent, fake_nvml: FakeNvml) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        with agent.connect() as s:
            f = s.makefile("rwb")
            f.write(b'{"v":1,"op":"subscribe"}\n')
            f.flush()
            first = json.loads(f.readline())  # the current sample, at once
            stamps = [first["sampled_at"]]
            list_on_gpu(fake_nvml, {child.pid: GiB})
            seen = []
            for _ in range(30):  # then one line per NVML pass, without asking
                reply = json.loads(f.readline())
                stamps.append(reply["sampled_at"])
                seen.append(len(reply["processes"]))
            assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
            assert seen[-1] == 1
    finally:
        child.kill()
        child.wait()


def test_one_pid_namespace_cannot_take_the_sockets_connections_from_the_others(
    agent: Agent, pods: list[Pod]
) -> None:
    """A pod that opens connection after connection holds at most PER_NAMESPACE of them
    (its first, and PER_NAMESPACE - 1 more); a pod in another PID namespace is answered all
    the same."""
    greedy, other = Pod(agent), Pod(agent)
    pods += [greedy, other]
    assert "processes" in greedy.ask()  # its first connection
    assert greedy.proc.stdin is not None and greedy.proc.stdout is not None
    greedy.proc.stdin.write(f"hold {PER_NAMESPACE}\n")
    greedy.proc.stdin.flush()
    answers = json.loads(greedy.proc.stdout.readline())
    assert ["processes" in a for a in answers] == [True] * (PER_NAMESPACE - 1) + [False]
    assert "too many connections from this PID namespace" in answers[-1]["error"]
    assert "processes" in other.ask()
    assert "processes" in agent.ask()  # the host's own namespace is not a pod's: not capped


EMFILE_SERVER = textwrap.dedent(
    """
    import os, resource, signal, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from enforcer.edge.metrics import AgentTelemetry
    from enforcer.edge.procfs import ProcFs
    from enforcer.edge.usage_server import ServerMetrics, UsageServer
    t = AgentTelemetry()
    server = UsageServer(Path(sys.argv[1]), ProcFs(), ServerMetrics(t.requests, t.connections,
                         t.unexpected), stale_after=60.0)
    server.start()
    in_use = len(list(Path("/proc/self/fd").iterdir()))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    filler = []
    try:
        while True:  # every descriptor taken: accept() can only fail, with EMFILE
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    signal.signal(signal.SIGUSR1, lambda *_: [os.close(fd) for fd in filler])
    print("ready", flush=True)
    time.sleep(60)
    """
)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def test_out_of_file_descriptors_the_socket_pauses_instead_of_spinning(tmp_path: Path) -> None:
    """accept() failing with EMFILE leaves the listener readable: polled on at once, the loop
    would spin a core and flood the log. It pauses, and accepts again once fds are free."""
    sock, log = tmp_path / "agent.sock", tmp_path / "server.log"
    server = subprocess.Popen(
        [sys.executable, "-c", EMFILE_SERVER, str(sock), str(ROOT)],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline() == "ready\n"
    flood = []
    try:
        for _ in range(4):  # they wait in the kernel's backlog: accept() cannot take them
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            flood.append(s)
        time.sleep(0.5)
        before = _cpu_ticks(server.pid)
        time.sleep(2.0)
        spent = (_cpu_ticks(server.pid) - before) / os.sysconf("SC_CLK_TCK")
        assert spent < 0.5, f"{spent:.2f}s of CPU in 2s: the accept loop spins"
        for s in flood:
            s.close()
        flood.clear()
        server.send_signal(signal.SIGUSR1)  # descriptors free again

        def answered() -> bool:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(str(sock))
                s.sendall(b'{"v":1,"op":"usage"}\n')
                return b"v" in s.makefile("rb").readline()

        wait_for(answered, timeout=15, what="the socket to accept again")
    finally:
        for s in flood:
            s.close()
        server.kill()
        server.wait()
    said = log.read_text().count("cannot accept connections")
    assert 1 <= said <= 3, said  # once per pause, not once per wake-up


HAMMER = textwrap.dedent(
    """
    import socket, sys
    while True:  # connect, and connect again, as fast as the agent refuses
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(sys.argv[1])
        except OSError:
            pass
        s.close()
    """
)


def test_pods_that_connect_as_fast_as_they_are_refused_do_not_stall_the_others(
    agent: Agent, pods: list[Pod]
) -> None:
    """Once, the loop accepted for as long as connections kept coming: with callers that
    reconnect in a tight loop, it never got back to pushing samples or answering."""
    honest = Pod(agent)
    pods.append(honest)
    hammer = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        sys.executable,
        "-c",
        HAMMER,
        str(agent.socket),
    ]
    hammers = [subprocess.Popen(hammer) for _ in range(4)]
    try:
        time.sleep(1.0)
        answered = []
        answering = threading.Thread(target=lambda: answered.extend(honest.ask() for _ in range(5)))
        answering.start()
        answering.join(20)
        assert not answering.is_alive(), "the agent stopped answering under the hammering"
        assert all("processes" in reply for reply in answered)
    finally:
        for h in hammers:
            h.kill()
            h.wait()


def test_sigterm_ends_an_agent_whose_api_is_unreachable_promptly(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """The DaemonSet's grace period is 30 s. The threads get 5 s to end, together: the pod
    list and the advertiser, in their API calls' retry pauses, once took 5 s each, one
    after the other, and the pod publisher, waiting for a change that never came, 5 s
    more (15 s). The bound lies between one such wait and two, whatever the load."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:1")
    state = FakeGpuState.single_gpu()
    state.write(tmp_path / "gpu.json")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "enforcer",
            "agent",
            "--node-name",
            "n",
            "--kubeconfig",
            str(kubeconfig),
            "--socket",
            str(tmp_path / "a.sock"),
            "--log-format",
            "text",
        ],
        env={
            **os.environ,
            "LD_LIBRARY_PATH": str(fake_nvml_lib),
            "FAKE_NVML_STATE": str(tmp_path / "gpu.json"),
        },
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for((tmp_path / "a.sock").exists, what="the agent's socket")
        time.sleep(2.0)  # its threads in their waits: the pod list failing, the publisher idle
        started = time.monotonic()
        agent.terminate()
        assert agent.wait(timeout=30) == 0
        assert time.monotonic() - started < 9.5
    finally:
        agent.kill()
        agent.wait()
