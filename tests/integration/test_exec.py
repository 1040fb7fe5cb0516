"""`vram-enforcer exec` end to end: the real CLI in a subprocess, real signals, real /proc,
and the fake libnvidia-ml.so.1 reporting the pids that the test chooses."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.utils import floatToGoString

from enforcer.core.model import GiB, MiB
from enforcer.edge.cgroupfs import v2_root
from tests.helpers import free_port, reuse_pid, wait_for

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    """One `vram-enforcer exec` run with a worker, and the fake GPU it is watched through."""

    gpu: Any
    tmp: Path
    proc: subprocess.Popen[str] | None = None
    extra: list[subprocess.Popen[str]] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def report(self) -> Path:
        return self.tmp / "worker.json"

    @property
    def stderr(self) -> str:
        """What exec has written to stderr so far."""
        return (self.tmp / "exec.stderr").read_text()

    def start(
        self,
        *flags: str,
        worker: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
        command: tuple[str, ...] = (),
    ) -> None:
        """exec with `flags` over the stand-in worker (with `worker`'s arguments), or over
        `command` when one is given."""
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "enforcer",
            "exec",
            "--interval",
            "20ms",
            "--metrics-port",
            str(self.port),
            *flags,
            "--",
            *(command or (sys.executable, str(WORKER), "--report", str(self.report), *worker)),
        ]
        env = {**os.environ, **self.gpu.env(), "PYTHONUNBUFFERED": "1"}
        with (self.tmp / "exec.stderr").open("w") as stderr:
            self.proc = subprocess.Popen(cmd, env=env, stderr=stderr, text=True, cwd=ROOT)

    def worker(self, role: str = "main") -> dict[str, Any]:
        path = self.report.with_name(f"{self.report.name}.{role}")
        return wait_for(
            lambda: path.exists() and json.loads(path.read_text()), what=f"{role} to start"
        )  # type: ignore[no-any-return]

    def use(self, pid: int, used: int) -> None:
        self.gpu.state.set_process(0, pid, used)
        self.gpu.write()

    def release(self) -> None:
        self.report.with_name(self.report.name + ".release").touch()

    def wait(self, timeout: float = 20) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def saw(self, used: int) -> None:
        """Wait until a tick has counted `used` bytes for the command tree: proof that the
        enforcer looked, before a test asserts that it did nothing."""
        line = (
            f'vram_enforcer_container_used_bytes{{container="{self.name}"}} {floatToGoString(used)}'
        )
        wait_for(lambda: line in self.metrics(), what=f"a tick to count {used} bytes")

    def logged(self, text: str) -> None:
        wait_for(lambda: text in self.stderr, what=f"{text!r} on stderr")

    @property
    def name(self) -> str:
        return Path(sys.executable).name  # exec's default unit name: the command's basename


@pytest.fixture
def run(fake_nvml: Any, tmp_path: Path) -> Iterator[Run]:
    r = Run(fake_nvml, tmp_path)
    yield r
    for p in r.extra:  # the test's own helpers, outside exec's tree
        p.kill()
        p.wait()
    r.release()  # a worker that is still waiting exits, and exec after it, cleaning up
    if r.proc is not None:
        try:
            r.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
    if r.proc is not None and (root := v2_root()) is not None:
        for left in root.rglob(f"vram-enforcer-{r.proc.pid}"):  # exec was killed: tidy up
            for path in (left / "command", left / "enforcer", left):
                wait_for(lambda path=path: not (path / "cgroup.procs").read_text().strip())
                path.rmdir()


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie that its parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it went while we opened it
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_compliant_command_runs_to_its_own_exit_status(run: Run) -> None:
    run.start("--limit", "4Gi", worker=("--exit", "3"))
    w = run.worker()
    run.use(w["pid"], 1 * GiB)
    run.saw(1 * GiB)
    run.release()
    assert run.wait() == 3, run.stderr
    # The fake's default driver (550) has no hard limits: the one line that says so, no more.
    (line,) = run.stderr.splitlines()
    assert line.startswith(
        "vram-enforcer: warning: no hard limit: driver 550.54.15 has no per-cgroup limits: R615+"
    )


def test_the_exit_is_seen_while_nvml_is_busy(run: Run) -> None:
    """The driver's own thread must not swallow SIGCHLD: on a real H100, a command that
    exited while a tick was inside NVML left `exec` waiting forever."""
    run.gpu.state.data["query_delay_ms"] = 40  # with 20 ms ticks: mostly inside NVML
    run.gpu.write()
    for code in (3, 4, 5):
        run.start("--limit", "4Gi", worker=("--exit", str(code)))
        run.worker()
        run.release()
        assert run.wait(timeout=10) == code, run.stderr
        run.report.with_name(run.report.name + ".main").unlink()
        run.report.with_name(run.report.name + ".release").unlink()


def test_an_offender_is_terminated_with_one_explaining_line(run: Run) -> None:
    run.start("--limit", "4Gi")
    w = run.worker()
    run.use(w["pid"], 5 * GiB)
    assert run.wait() == 128 + signal.SIGTERM
    lines = [line for line in run.stderr.splitlines() if "sent SIGTERM" in line]
    assert len(lines) == 1, run.stderr
    assert f"pid {w['pid']} ({sys.executable} {WORKER}" in lines[0]
    assert "uses 5.00 GiB of its 4.00 GiB VRAM limit (125%)" in lines[0]


def test_a_command_line_with_a_newline_and_escapes_stays_on_its_one_line(run: Run) -> None:
    """The command chooses its own argv: it cannot forge a line of exec's, nor reach the
    terminal with a control sequence."""
    role = "main\nvram-enforcer: error: forged\r\x1b[31m"
    worker = str(WORKER.relative_to(ROOT))  # exec runs in ROOT: the role is shown, not cut
    run.start(
        "--limit",
        "4Gi",
        command=(sys.executable, worker, "--role", role, "--report", str(run.report)),
    )
    w = run.worker(role)
    run.use(w["pid"], 5 * GiB)
    assert run.wait() == 128 + signal.SIGTERM
    lines = run.stderr.splitlines()
    (sent,) = [line for line in lines if "sent SIGTERM" in line]
    assert f"pid {w['pid']} ({sys.executable} {worker} --role main\\nvram-enforcer" in sent
    assert sent.endswith("SIGKILL follows in 5s if it has not exited"), run.stderr
    assert not [line for line in lines if line.startswith("vram-enforcer: error: forged")]
    assert "\r" not in run.stderr and "\x1b" not in run.stderr


def test_one_that_ignores_sigterm_is_killed_after_the_grace_period(run: Run) -> None:
    run.start("--limit", "1Gi", "--grace-period", "300ms", worker=("--ignore-term",))
    w = run.worker()
    run.use(w["pid"], 2 * GiB)
    assert run.wait() == 128 + signal.SIGKILL
    assert "did not exit 300ms after SIGTERM; sent SIGKILL" in run.stderr


def test_kill_action(run: Run) -> None:
    run.start("--limit", "1Gi", "--action", "kill", worker=("--ignore-term",))
    w = run.worker()
    run.use(w["pid"], 2 * GiB)
    assert run.wait() == 128 + signal.SIGKILL
    assert "sent SIGKILL" in run.stderr


def test_workers_replaced_as_fast_as_they_are_stopped_lose_the_whole_tree(run: Run) -> None:
    """Four workers at 0.6 of the limit, each ignoring SIGTERM, each replaced by their
    supervisor when killed: one victim at a time would keep the tree over its limit for as
    long as the supervisor runs. One grace period after the first victim, the whole tree
    goes."""
    report = run.tmp / "respawner.json"
    respawner = (
        sys.executable,
        "-m",
        "tests.integration.respawner",
        "--workers",
        "4",
        "--bytes",
        str(600 * MiB),
        "--report",
        str(report),
    )
    run.start("--limit", "1Gi", "--grace-period", "300ms", command=respawner)
    run.saw(4 * 600 * MiB)  # the enforcer saw the whole tree over its limit
    assert run.wait(timeout=30) == 128 + signal.SIGKILL, run.stderr
    assert "still over 300ms after a victim was signalled" in run.stderr
    assert re.search(r"sent SIGKILL to all \d+ processes of the command tree", run.stderr)
    supervisor = json.loads(report.read_text())
    assert not alive(supervisor["pid"])


def test_a_grandchild_is_counted_and_caught(run: Run) -> None:
    run.start("--limit", "4Gi", worker=("--spawn", "child"))
    main, child = run.worker("main"), run.worker("child")
    assert child["ppid"] == main["pid"]
    run.gpu.state.set_process(0, main["pid"], 2 * GiB)
    run.use(child["pid"], 3 * GiB)  # neither alone is over; together they are
    wait_for(lambda: not alive(child["pid"]), what="the child to be terminated")
    assert alive(main["pid"])
    run.release()
    assert run.wait() == 0
    assert f"sent SIGTERM to pid {child['pid']}" in run.stderr


def test_a_reparented_orphan_is_still_counted(run: Run) -> None:
    run.start("--limit", "4Gi", worker=("--spawn", "orphan"))
    run.worker("main")
    orphan = run.worker("orphan")
    assert run.proc is not None
    # Its parent shell has exited: the subreaper (the enforcer) is its parent now.
    wait_for(lambda: _ppid(orphan["pid"]) == run.proc.pid, what="re-parenting")  # type: ignore[union-attr]
    run.use(orphan["pid"], 5 * GiB)
    wait_for(lambda: not alive(orphan["pid"]), what="the orphan to be terminated")
    run.release()
    assert run.wait() == 0
    assert f"sent SIGTERM to pid {orphan['pid']}" in run.stderr


def test_a_double_fork_stays_under_the_limit_after_the_command_exits(run: Run) -> None:
    """The command exits at once, leaving an orphan: exec supervises it until it is gone and
    then exits with the command's own status."""
    run.start("--limit", "4Gi", worker=("--spawn", "orphan", "--leave", "--exit", "3"))
    main, orphan = run.worker("main"), run.worker("orphan")
    assert run.proc is not None
    wait_for(lambda: _ppid(main["pid"]) is None, what="the command to exit and be reaped")
    wait_for(lambda: "still running" in run.stderr, what="the leftovers line")
    assert run.proc.poll() is None, "exec must go on supervising the orphan"
    run.use(orphan["pid"], 5 * GiB)
    assert run.wait() == 3, run.stderr  # the command's status, once the orphan is gone
    assert f"sent SIGTERM to pid {orphan['pid']}" in run.stderr
    assert (
        "the command exited with status 3, but 1 process(es) it started are still running"
        in run.stderr
    )


def test_sigterm_to_exec_reaches_the_leftovers_too(run: Run) -> None:
    run.start("--limit", "4Gi", worker=("--spawn", "orphan", "--leave", "--exit", "3"))
    main, orphan = run.worker("main"), run.worker("orphan")
    assert run.proc is not None
    wait_for(lambda: _ppid(main["pid"]) is None, what="the command to exit and be reaped")
    wait_for(lambda: "still running" in run.stderr, what="the leftovers line")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 3
    assert not alive(orphan["pid"])


def test_sigterm_while_the_command_runs_reaches_an_orphan_as_well(run: Run) -> None:
    run.start("--limit", "4Gi", worker=("--spawn", "orphan"))
    main, orphan = run.worker("main"), run.worker("orphan")
    assert run.proc is not None
    wait_for(lambda: _ppid(orphan["pid"]) == run.proc.pid, what="re-parenting")  # type: ignore[union-attr]
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    assert not alive(main["pid"]) and not alive(orphan["pid"])


def _ppid(pid: int) -> int | None:
    """The parent of `pid`, None once it is gone (reaped between the open and the read, the
    kernel answers ESRCH: ProcessLookupError)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(text.rpartition(")")[2].split()[1])


def test_a_garbage_pid_from_nvml_does_not_stop_enforcement(run: Run) -> None:
    """A pid no process can have (NVML's are unsigned) is not proven; the offender next to it
    is still caught, and nothing escapes a tick as an exception."""
    run.start("--limit", "1Gi")
    w = run.worker()
    run.gpu.state.set_process(0, 2**32 - 1, 10 * GiB)
    run.use(w["pid"], 2 * GiB)
    assert run.wait() == 128 + signal.SIGTERM, run.stderr
    assert f"sent SIGTERM to pid {w['pid']}" in run.stderr
    assert "Traceback" not in run.stderr


def test_warn_only_kills_nothing(run: Run) -> None:
    run.start("--limit", "1Gi", "--action", "warn")
    w = run.worker()
    run.use(w["pid"], 3 * GiB)
    run.logged("the action is warn")
    run.saw(3 * GiB)  # and again after the warning: still alive
    assert alive(w["pid"])
    run.release()
    assert run.wait() == 0
    assert "uses 3.00 GiB of its 1.00 GiB VRAM limit (300%); the action is warn" in run.stderr
    assert run.stderr.count("VRAM limit") == 1  # one warning per crossing


def test_dry_run_kills_nothing_and_says_what_it_would_do(run: Run) -> None:
    """Its own reason (`VRAMWouldEnforce`, in the summary and in a JSON log line's
    `reason`), with the usage, the peak since it went over and the limit."""
    summary = run.tmp / "summary.json"
    run.start("--limit", "1Gi", "--dry-run", "--log-format", "json", "--summary", str(summary))
    w = run.worker()
    run.use(w["pid"], 3 * GiB)
    run.logged("would have sent SIGTERM")
    run.saw(3 * GiB)
    assert alive(w["pid"])
    run.release()
    assert run.wait() == 0
    lines = [json.loads(line) for line in run.stderr.splitlines()]
    (would,) = [line for line in lines if line.get("reason") == "VRAMWouldEnforce"]
    assert would["pid"] == w["pid"]
    assert (
        "uses 3.00 GiB of its 1.00 GiB VRAM limit (300%), 3.00 GiB at most since it went over; "
        f"dry run, so nothing was signalled: would have sent SIGTERM to pid {w['pid']} ("
    ) in would["msg"]
    assert not any(line.get("reason") == "VRAMEnforced" for line in lines)
    doc = json.loads(summary.read_text())
    reasons = [e["reason"] for e in doc["events"]]
    assert reasons == ["VRAMLimitExceeded", "VRAMWouldEnforce"], doc["events"]


def test_near_limit_warning(run: Run) -> None:
    run.start("--limit", "1Gi", "--warn-at", "50%")
    w = run.worker()
    run.use(w["pid"], 600 * 1024**2)
    run.logged("above the 50% warning threshold")
    run.release()
    assert run.wait() == 0
    assert "above the 50% warning threshold" in run.stderr


def test_nvml_errors_mid_run_kill_nothing_and_enforcement_recovers(run: Run) -> None:
    run.start("--limit", "1Gi")
    w = run.worker()
    run.use(w["pid"], 100)
    run.saw(100)
    # The GPU falls off the bus while the worker's usage goes over the limit.
    run.gpu.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    run.use(w["pid"], 5 * GiB)
    run.logged("VRAM usage cannot be observed")
    wait_for(lambda: "vram_enforcer_source_up 0.0" in run.metrics(), what="ticks without data")
    assert alive(w["pid"]), "nothing may be signalled while usage cannot be observed"
    run.gpu.state.clear_errors()
    run.gpu.write()
    assert run.wait() == 128 + signal.SIGTERM
    text = run.stderr
    assert "VRAM usage cannot be observed" in text and "GPU is lost" in text
    assert (
        text.index("cannot be observed") < text.index("observed again") < text.index("sent SIGTERM")
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ns_last_pid)")
def test_a_reused_pid_outside_the_tree_is_never_signalled(run: Run) -> None:
    """A process of the tree exits while NVML goes on listing its pid, which an outsider
    then takes: the outsider is not charged, however much the listing says."""
    run.start("--limit", "1Gi", worker=("--spawn", "orphan"))
    main, child = run.worker("main"), run.worker("orphan")  # exec reaps the orphan
    run.gpu.state.set_process(0, main["pid"], 100)
    run.use(child["pid"], 200)
    run.saw(300)
    os.kill(child["pid"], signal.SIGKILL)  # its listing stays: NVML lags
    wait_for(lambda: _ppid(child["pid"]) is None, what="the child to be reaped")
    outsider = reuse_pid(child["pid"])
    run.extra.append(outsider)
    run.gpu.state.set_process(0, main["pid"], 150)  # in the same write: proof of a tick
    run.use(child["pid"], 10 * GiB)
    run.saw(150)
    assert outsider.poll() is None and alive(main["pid"])
    run.release()
    assert run.wait() == 0
    assert "SIG" not in run.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ns_last_pid)")
def test_a_newcomer_of_the_tree_on_a_stale_listed_pid_is_never_signalled(run: Run) -> None:
    """NVML lags: it still lists the pid of a process of the tree that has exited, now over
    the limit, and another process of the tree has taken that pid. The newcomer started
    after NVML first listed the pid, so it is not the process NVML meant."""
    run.start("--limit", "1Gi", worker=("--spawn", "orphan"))
    main, gone = run.worker("main"), run.worker("orphan")
    run.gpu.state.set_process(0, main["pid"], 100)
    run.use(gone["pid"], 200)
    run.saw(300)
    os.kill(gone["pid"], signal.SIGKILL)
    wait_for(lambda: _ppid(gone["pid"]) is None, what="the process to be reaped")
    late = run.report.with_name(run.report.name + ".late")
    for _ in range(50):  # the worker forks the newcomer onto the freed pid
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(gone["pid"] - 1))
        os.kill(main["pid"], signal.SIGUSR1)
        newcomer = int(wait_for(lambda: late.exists() and late.read_text(), what="the newcomer"))
        late.unlink()
        if newcomer == gone["pid"]:
            break
        os.kill(newcomer, signal.SIGKILL)
    assert newcomer == gone["pid"]
    assert _ppid(newcomer) == main["pid"]  # in the tree
    run.gpu.state.set_process(0, main["pid"], 150)  # in the same write: proof of a tick
    run.use(gone["pid"], 10 * GiB)
    run.saw(150)
    assert alive(newcomer) and alive(main["pid"])
    os.kill(newcomer, signal.SIGKILL)
    run.release()
    assert run.wait() == 0
    assert "SIG" not in run.stderr


def test_metrics_are_served(run: Run) -> None:
    run.start("--limit", "4Gi", "--name", "trainer")
    w = run.worker()
    run.use(w["pid"], 1 * GiB)
    body = wait_for(lambda: (m := run.metrics()) and f'pid="{w["pid"]}"' in m and m, what="metrics")
    assert 'vram_enforcer_container_used_bytes{container="trainer"} 1.073741824e+09' in body
    assert 'vram_enforcer_container_limit_bytes{container="trainer"} 4.294967296e+09' in body
    assert "vram_enforcer_source_up 1.0" in body
    run.release()
    assert run.wait() == 0


def test_sigterm_to_the_enforcer_is_forwarded_to_the_command(run: Run) -> None:
    run.start("--limit", "4Gi")
    w = run.worker()
    assert run.proc is not None
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    assert not alive(w["pid"])


def _real_nvml_installed() -> bool:
    # Look it up without loading it: once loaded, it would shadow the fake NVML in-process.
    return ctypes.util.find_library("nvidia-ml") is not None


@pytest.mark.skipif(_real_nvml_installed(), reason="a real libnvidia-ml.so.1 is installed here")
def test_no_nvml_refuses_to_start_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_STATE")}
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "exec", "--limit", "1Gi", "--", "touch", str(marker)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "libnvidia-ml.so.1 was not found" in out.stderr
    assert "Traceback" not in out.stderr
    assert not marker.exists()


def test_driver_not_loaded_is_explained(fake_nvml: Any, tmp_path: Path) -> None:
    fake_nvml.state.data["init_error"] = "DRIVER_NOT_LOADED"
    fake_nvml.write()
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "exec", "--limit", "1Gi", "--", "true"],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "the NVIDIA kernel driver is not loaded" in out.stderr


def test_summary_of_a_compliant_run(run: Run) -> None:
    summary = run.tmp / "summary.json"
    run.start("--limit", "4Gi", "--summary", str(summary), worker=("--exit", "3"))
    w = run.worker()
    run.gpu.state.set_process(0, w["pid"], 1 * GiB)
    run.gpu.state.set_utilization(0, w["pid"], sm=80, memory=30)
    run.gpu.write()
    run.saw(1 * GiB)
    busy = f'vram_enforcer_container_gpu_sm_utilization_ratio{{container="{run.name}",'
    wait_for(lambda: busy in run.metrics(), what="a utilisation read (twice a second)")
    run.release()
    assert run.wait() == 3, run.stderr
    doc = json.loads(summary.read_text())
    assert doc["version"] == 1 and doc["started"] is True
    assert doc["exit_status"] == 3 and doc["signal"] is None
    assert doc["peak_bytes"] == 1 * GiB and doc["samples"] >= 1
    # The mean over the samples that could tell: the first read after the process appears
    # does not know it yet, and counts neither as busy nor as idle.
    assert doc["sm_percent"] == 80 and doc["memory_percent"] == 30
    assert 1 <= doc["busy_samples"] <= doc["samples"]
    assert doc["limit_bytes"] == 4 * GiB and doc["action"] == "terminate"
    assert doc["events"] == [] and doc["exceeded_after_seconds"] is None
    assert doc["command"][:2] == [sys.executable, str(WORKER)]
    assert 0 < doc["wall_seconds"] == doc["end_monotonic"] - doc["start_monotonic"]
    assert not list(run.tmp.glob(".summary.json.*")), "written in place, atomically"


def test_summary_of_an_offender_says_when_and_what_was_done(run: Run) -> None:
    summary = run.tmp / "summary.json"
    run.start("--limit", "4Gi", "--summary", str(summary))
    w = run.worker()
    run.use(w["pid"], 5 * GiB)
    assert run.wait() == 128 + signal.SIGTERM
    doc = json.loads(summary.read_text())
    assert doc["exit_status"] == 143 and doc["signal"] == "SIGTERM"
    assert doc["peak_bytes"] == 5 * GiB
    reasons = [e["reason"] for e in doc["events"]]
    assert reasons == ["VRAMLimitExceeded", "VRAMEnforced"], doc["events"]
    assert f"sent SIGTERM to pid {w['pid']}" in doc["events"][1]["message"]
    assert 0 <= doc["exceeded_after_seconds"] <= doc["wall_seconds"]


def test_summary_when_the_command_never_ran(fake_nvml: Any, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "exec",
            "--limit",
            "1Gi",
            "--summary",
            str(summary),
            "--",
            "no-such-command-xyz",
        ],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 127
    doc = json.loads(summary.read_text())
    assert doc["started"] is False and doc["exit_status"] == 127
    assert doc["wall_seconds"] is None and doc["peak_bytes"] is None


def test_summary_in_a_missing_directory_refuses_to_start(fake_nvml: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "exec",
            "--limit",
            "1Gi",
            "--summary",
            str(tmp_path / "nowhere" / "s.json"),
            "--",
            "touch",
            str(marker),
        ],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "nowhere does not exist; create it first" in out.stderr
    assert not marker.exists()


def test_command_not_found(fake_nvml: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "exec", "--limit", "1Gi", "--", "no-such-command-xyz"],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 127
    assert "no-such-command-xyz: command not found" in out.stderr


def test_a_busy_metrics_port_is_a_clear_error_and_nothing_runs(
    fake_nvml: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "enforcer",
                "exec",
                "--limit",
                "1Gi",
                "--metrics-port",
                str(port),
                "--metrics-address",
                "127.0.0.1",
                "--",
                "touch",
                str(marker),
            ],
            env={**os.environ, **fake_nvml.env()},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 2
    assert (
        f"--metrics-port {port}: cannot listen on 127.0.0.1: Address already in use" in out.stderr
    )
    assert "Traceback" not in out.stderr
    assert not marker.exists()


def _outsider(run: Run, used: int) -> subprocess.Popen[str]:
    """A process outside exec's tree that NVML lists on the GPU: someone else's work."""
    if not run.extra:
        run.extra.append(subprocess.Popen(["sleep", "600"], text=True))
    run.gpu.state.set_process(0, run.extra[0].pid, used)
    return run.extra[0]


def test_a_borrower_keeps_what_it_borrows_until_the_others_need_the_room(run: Run) -> None:
    """--request 2Gi --limit 8Gi: 6 GiB used is 4 GiB borrowed, left alone while the GPU
    keeps the watermark (4 GiB) free for the process beside it; once that one grows into
    it, the borrower is stopped, one line saying why, and counted. The driver reserves
    nothing on this GPU: every byte of its 80 GiB is there to be lent."""
    run.gpu.state.set_reserved(0, 0)
    summary = run.tmp / "summary.json"
    run.start(
        "--limit",
        "8Gi",
        "--request",
        "2Gi",
        "--reclaim-watermark",
        "4Gi",
        "--grace-period",
        "2s",
        "--summary",
        str(summary),
        worker=("--ignore-term",),
    )
    w = run.worker()
    _outsider(run, 70 * GiB)  # 76 of 80 used: exactly the watermark free
    run.use(w["pid"], 6 * GiB)
    run.saw(6 * GiB)
    over = f'vram_enforcer_container_gpu_over_request_bytes{{container="{run.name}",gpu="'
    wait_for(lambda: over in run.metrics(), what="the borrowed bytes in the metrics")
    assert f"{floatToGoString(4 * GiB)}" in run.metrics().split(over, 1)[1].splitlines()[0]
    assert alive(w["pid"]) and "SIGTERM" not in run.stderr
    _outsider(run, 72 * GiB)  # 2 GiB free: 2 GiB short of the watermark
    run.gpu.write()
    run.logged("sent SIGTERM")
    # One line says why and what was sent: the next report of the reclaim (the SIGKILL)
    # starts with the same why, as the Event it replaces in Kubernetes.
    (sent,) = [line for line in run.stderr.splitlines() if "sent SIGTERM" in line]
    assert (
        "the command tree holds 6.00 GiB on GPU GPU-00000000-fake-4000-8000-000000000000, "
        "4.00 GiB above its 2.00 GiB request (ceiling 8.00 GiB); the GPU has 2.00 GiB free, "
        "2.00 GiB less than it must keep free for its other users, which declared no "
        f"request; taking back what it lent: sent SIGTERM to pid {w['pid']} " in sent
    )
    assert 'vram_enforcer_reclaims_total{needed_by="unrequested"} 1.0' in run.metrics()
    assert run.wait() == 128 + signal.SIGKILL  # it ignored SIGTERM for its grace period
    assert run.extra[0].poll() is None  # the outsider was never ours to signal
    (killed,) = [line for line in run.stderr.splitlines() if "sent SIGKILL" in line]
    assert killed.startswith(sent.split("; taking back")[0])
    written = json.loads(summary.read_text())
    assert written["request_bytes"] == 2 * GiB and written["exceeded_after_seconds"] is None
    assert [e["reason"] for e in written["events"]] == ["VRAMReclaimed"] * 2  # SIGTERM, SIGKILL


def test_within_its_request_nothing_is_taken_however_full_the_gpu(run: Run) -> None:
    run.start("--limit", "8Gi", "--request", "6Gi")
    w = run.worker()
    _outsider(run, 74 * GiB)  # the GPU is full
    run.use(w["pid"], 6 * GiB)
    run.saw(6 * GiB)
    free = 'vram_enforcer_gpu_free_bytes{uuid="GPU-00000000-fake-4000-8000-000000000000"} 0.0'
    wait_for(lambda: free in run.metrics(), what="a tick to see the GPU full")
    run.use(w["pid"], 6 * GiB + 1)  # one byte borrowed, on a full GPU: taken back
    run.logged("sent SIGTERM")
    assert run.wait() == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--limit", "4GB!"],
            "--limit: '4GB!' is not a quantity; use a Kubernetes quantity such as 4Gi",
        ),
        (
            ["--limit", "4Gi", "--warn-at", "150%"],
            "--warn-at: '150%' is out of range; use a percentage above 0% and at most 100%",
        ),
        (
            ["--limit", "4Gi", "--grace-period", "5"],
            "--grace-period: '5' is not a duration; use a duration with a unit",
        ),
        (
            ["--limit", "4Gi", "--action", "explode"],
            "--action: 'explode' is not an action; use one of: terminate, kill, warn",
        ),
        (
            ["--limit", "4Gi", "--request", "6Gi"],
            "--request: '6.00 GiB' is above --limit 4.00 GiB: the request is what the command "
            "is guaranteed and the limit the most it may borrow up to; give a request of at "
            "most the limit",
        ),
        (
            ["--limit", "4Gi", "--reclaim-watermark=-1Gi"],
            "--reclaim-watermark: '-1Gi' is negative; a memory size must be 0 or more",
        ),
        (
            ["--limit", "4Gi", "--request", "lots"],
            "--request: 'lots' is not a quantity; use a Kubernetes quantity such as 4Gi",
        ),
    ],
)
def test_bad_flags_name_the_flag_the_value_and_the_form(flags: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "exec", *flags, "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


NEEDS_UNSHARE = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)


@NEEDS_UNSHARE
def test_in_a_pid_namespace_it_refuses_rather_than_guess(fake_nvml: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "enforcer",
            "exec",
            "--limit",
            "1Gi",
            "--",
            "touch",
            str(marker),
        ],
        env={**os.environ, **fake_nvml.env()},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert (
        "PID namespace" in out.stderr and "--pid=host" in out.stderr and "--host-proc" in out.stderr
    )
    assert not marker.exists()


@NEEDS_UNSHARE
def test_in_a_pid_namespace_with_the_host_proc_it_translates_and_enforces(
    run: Run, tmp_path: Path
) -> None:
    """Like a container with -v /proc:/host/proc:ro: NVML's host pid is mapped to ours."""
    host_proc = tmp_path / "host-proc"
    host_proc.mkdir()
    script = f'mount --bind /proc {host_proc} && mount -t proc proc /proc && exec "$0" "$@"'
    run.start(
        "--limit",
        "1Gi",
        "--host-proc",
        str(host_proc),
        worker=("--host-proc", str(host_proc)),
        prefix=("unshare", "--mount", "--pid", "--fork", "sh", "-c", script),
    )
    w = run.worker()
    assert w["host_pid"] != w["pid"]
    run.use(w["host_pid"], 2 * GiB)
    assert run.wait() == 128 + signal.SIGTERM, run.stderr
    assert f"sent SIGTERM to pid {w['pid']} " in run.stderr


needs_cgroup2 = pytest.mark.skipif(
    v2_root() is None or os.geteuid() != 0, reason="needs root and a cgroup v2 hierarchy"
)


@needs_cgroup2
def test_the_command_starts_in_a_cgroup_already_held_to_the_limit(run: Run) -> None:
    run.gpu.state.support_memory_limits()
    small = run.gpu.state.add_device(total_bytes=2 * GiB)
    run.gpu.write()
    run.start("--limit", "4Gi", "-v", worker=("--spawn", "orphan"))
    w = run.worker()
    assert run.proc is not None
    assert w["cgroup"].endswith(f"/vram-enforcer-{run.proc.pid}/command")
    cgroup = v2_root() / w["cgroup"].lstrip("/")  # type: ignore[operator]
    # The worker read the fake driver's records as its first step: the limits were there.
    held = {
        (r["device"], r["hard"])
        for r in w["limits"]
        if r["cgroup"] == str(cgroup) and r["inode"] == cgroup.stat().st_ino
    }
    gpu0 = run.gpu.state.devices[0]["uuid"]
    assert held == {(gpu0, 4 * GiB), (small["uuid"], 2 * GiB)}  # capped at the GPU's memory
    assert run.worker("orphan")["cgroup"] == w["cgroup"]  # a double fork stays in it too
    metric = (
        f'vram_enforcer_hard_limit_bytes{{container="{run.name}",gpu="{gpu0}"}} 4.294967296e+09'
    )
    wait_for(lambda: metric in run.metrics(), what="the hard-limit metric")
    # Sampling goes on as the backstop: the sum over GPUs is still enforced.
    run.use(w["pid"], 5 * GiB)
    run.logged(f"sent SIGTERM to pid {w['pid']}")
    run.release()
    assert run.wait() == 128 + signal.SIGTERM
    assert "hard limit in place: the command tree may allocate at most 4.00 GiB on" in run.stderr
    assert "no hard limit" not in run.stderr
    assert not cgroup.parent.exists()  # removed, and the limits with it


@needs_cgroup2
def test_a_request_reserves_nothing_the_limit_is_the_hard_one_with_soft_0(run: Run) -> None:
    """A soft limit is the cgroup's `dmem.min` reservation, which the driver adds to every
    ancestor and which outlives the cgroup (NVIDIA's MPS v3 page): exec's request is taken
    back by sampling, never reserved. The hard limit is capped at each GPU's memory."""
    run.gpu.state.support_memory_limits()
    small = run.gpu.state.add_device(total_bytes=2 * GiB)
    run.gpu.write()
    run.start("--limit", "6Gi", "--request", "3Gi")
    w = run.worker()
    gpu0 = run.gpu.state.devices[0]["uuid"]
    cgroup = str(v2_root() / w["cgroup"].lstrip("/"))  # type: ignore[operator]
    held = {(r["device"], r["soft"], r["hard"]) for r in w["limits"] if r["cgroup"] == cgroup}
    assert held == {(gpu0, 0, 6 * GiB), (small["uuid"], 0, 2 * GiB)}


@needs_cgroup2
def test_a_process_that_leaves_the_commands_cgroup_is_moved_back_under_the_hard_limit(
    run: Run,
) -> None:
    """The command runs as the user who owns the parent of its cgroup, so it may write itself
    into that parent, and the driver would no longer hold it to the limit."""
    run.gpu.state.support_memory_limits()
    run.gpu.write()
    run.start("--limit", "4Gi", worker=("--leave-cgroup",))
    w = run.worker()
    assert w["cgroup"].endswith("/command")
    wait_for((run.tmp / "worker.json.escaped").exists, what="the worker to leave its cgroup")
    run.use(w["pid"], 1 * GiB)
    run.saw(1 * GiB)
    run.logged(f"pid {w['pid']} had left the command's cgroup for")
    assert "moved it back under the hard limit" in run.stderr
    assert Path(f"/proc/{w['pid']}/cgroup").read_text().strip().endswith(w["cgroup"])
    run.release()
    assert run.wait() == 0


@needs_cgroup2
@pytest.mark.parametrize("charges", [True, False], ids=["charged", "not-charged"])
def test_the_hard_limit_is_claimed_only_where_the_driver_charges_the_tree_to_it(
    run: Run, charges: bool
) -> None:
    """NVIDIA documents these limits for MPS clients: a driver that takes the limit but
    charges the tree's memory nowhere does not hold it, and the summary says so."""
    run.gpu.state.support_memory_limits(charges=charges)
    run.gpu.write()
    summary = run.tmp / "summary.json"
    run.start("--limit", "4Gi", "-v", "--summary", str(summary))  # -v: the info line too
    w = run.worker()
    run.use(w["pid"], GiB)
    gpu0 = run.gpu.state.devices[0]["uuid"]
    if charges:
        run.logged(
            "the driver counts the command tree against its hard limit: it charges "
            f"1.00 GiB on {gpu0}, where NVML lists 1.00 GiB"
        )
    else:
        run.logged(
            f"no hard limit: the driver holds the limit on {gpu0} but charges nothing "
            "to it, while NVML lists 1.00 GiB for the command tree's processes there"
        )
    run.release()
    assert run.wait() == 0, run.stderr
    # The choice, logged at start as doctor says it; the summary, which tier held the tree.
    assert f"tier driver-limit on {gpu0}, sampling as the backstop: driver 615.43.02" in run.stderr
    doc = json.loads(summary.read_text())
    assert (doc["hard_limit"], doc["tier"]) == (charges, "driver-limit" if charges else "sampling")
    said = "no hard limit" in run.stderr
    assert said is not charges  # said once, and only where it does not bind


@needs_cgroup2
def test_a_cgroup_the_driver_cannot_count_is_said_and_sampling_holds_the_command(
    run: Run,
) -> None:
    """An R615 driver that answers Not Supported for exec's own cgroup (NVIDIA: it has no
    dmem files): that cgroup is named, the driver is not called too old, no limit is set,
    and the summary says sampling held the command."""
    run.gpu.state.support_memory_limits()
    run.gpu.state.inject_error("nvmlDeviceGetMemoryLimits_v1", "NOT_SUPPORTED")
    run.gpu.write()
    summary = run.tmp / "summary.json"
    run.start("--limit", "4Gi", "--summary", str(summary))
    w = run.worker()
    run.release()
    assert run.wait() == 0, run.stderr
    assert w["limits"] == []
    # exec's own cgroup where it is not the root (which the kernel gives no dmem files, so
    # the probe asks what it hands down), else the command's: named either way.
    assert re.search(r"no hard limit: cgroup /\S+ has no dmem files \(Not Supported\)", run.stderr)
    assert "R615" not in run.stderr
    doc = json.loads(summary.read_text())
    assert (doc["hard_limit"], doc["tier"]) == (False, "sampling")


@needs_cgroup2
def test_a_gpu_in_mig_mode_gets_no_hard_limit_and_says_so(run: Run) -> None:
    run.gpu.state.support_memory_limits()
    mig = run.gpu.state.add_device()
    run.gpu.state.enable_mig(1, [{"uuid": "MIG-x", "total_bytes": 10 * GiB}])
    run.gpu.write()
    run.start("--limit", "4Gi")
    w = run.worker()
    run.release()
    assert run.wait() == 0, run.stderr
    assert [r["device"] for r in w["limits"]] == [run.gpu.state.devices[0]["uuid"]]
    (line,) = run.stderr.splitlines()
    assert f"no hard limit: {mig['uuid']} in MIG mode" in line


def test_hard_limits_off_is_silent_and_required_refuses_without_them(run: Run) -> None:
    run.start("--limit", "4Gi", "--hard-limits", "off", worker=("--exit", "3"))
    run.worker()
    run.release()
    assert run.wait() == 3
    assert run.stderr == ""
    run.report.with_name(run.report.name + ".main").unlink()
    run.start("--limit", "4Gi", "--hard-limits", "required")
    assert run.wait() == 2
    assert (
        "--hard-limits required, but there is no hard limit: driver 550.54.15 has no "
        "per-cgroup limits: R615+" in run.stderr
    )
    assert not run.report.with_name(run.report.name + ".main").exists()  # never started


@needs_cgroup2
@pytest.mark.parametrize(
    ("reporting", "said"),
    [
        (("--dry-run",), "would have sent SIGTERM"),
        (("--action", "warn"), "the action is warn, so nothing is signalled"),
    ],
)
def test_reporting_only_sets_no_hard_limit_and_refuses_to_require_one_or_to_borrow(
    run: Run, reporting: tuple[str, ...], said: str
) -> None:
    """Where the driver could hold the command to its limit, a dry run or `warn` does not
    ask it to: the driver would refuse the allocation they only report. Sampling sees it
    over. Nor may it borrow above a request: what it borrowed could not be taken back."""
    run.gpu.state.support_memory_limits()
    run.gpu.write()
    run.start("--limit", "1Gi", *reporting)
    w = run.worker()
    assert "/vram-enforcer-" not in w["cgroup"], w["cgroup"]  # no cgroup of its own
    assert w["limits"] == [], w["limits"]  # the driver's records, as the command starts
    run.use(w["pid"], 3 * GiB)
    run.logged(said)
    run.release()
    assert run.wait() == 0
    run.report.with_name(run.report.name + ".main").unlink()
    flag = " ".join(reporting)
    run.start("--limit", "1Gi", *reporting, "--hard-limits", "required")
    assert run.wait() == 2
    assert (
        f"--hard-limits: 'required' cannot go with {flag}: under a hard limit the driver "
        "refuses allocations past it" in run.stderr
    )
    run.start("--limit", "4Gi", "--request", "1Gi", *reporting)
    assert run.wait() == 2
    assert (
        f"--request: '1.00 GiB' cannot go with {flag}: a command that is only reported on "
        "borrows nothing above its request" in run.stderr
    )


@needs_cgroup2
def test_without_permission_to_set_limits_it_falls_back_and_still_enforces(run: Run) -> None:
    run.gpu.state.support_memory_limits()
    run.gpu.state.inject_error("nvmlDeviceSetMemoryLimits_v1", "NO_PERMISSION")
    run.gpu.write()
    run.start("--limit", "4Gi")
    w = run.worker()
    assert w["cgroup"] == "/" or "vram-enforcer-" not in w["cgroup"]  # not moved: no point
    run.use(w["pid"], 5 * GiB)
    assert run.wait() == 128 + signal.SIGTERM
    assert (
        "no hard limit: NVML refused to set GPU memory limits (Insufficient Permissions): that needs root"
        in run.stderr
    )


@needs_cgroup2
def test_what_a_killed_exec_left_behind_is_removed_once_empty(run: Run) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    own = v2_root() / Path(
        Path("/proc/self/cgroup").read_text().split("0::")[1].strip()
    ).relative_to("/")  # type: ignore[operator]
    stale = own / f"vram-enforcer-{gone.pid}"
    (stale / "command").mkdir(parents=True)
    (stale / "enforcer").mkdir()
    run.gpu.state.support_memory_limits()
    run.gpu.write()
    run.start("--limit", "4Gi")
    run.worker()
    assert not stale.exists()
