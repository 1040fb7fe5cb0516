"""`vram-enforcer exec --allocation-gate on` end to end: the real CLI in a subprocess over the
fake libnvidia-ml.so.1, with the stand-in of the driver's callers (rm_standin.py) as the
command. It issues the driver's real allocation requests on /dev/null, whose device major
stands in for NVIDIA's (gate_exec.py: the only change to the CLI). A call let go on reaches
/dev/null (ENOTTY, status untouched); a refused one returns 0 with NV_ERR_NO_MEMORY (0x51).
The fake NVML plays the driver's bookkeeping: the test sets what the stand-in holds."""

from __future__ import annotations

import errno
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.model import GiB
from tests.helpers import wait_for
from tests.integration.test_exec import Run

HERE = Path(__file__).resolve().parent
GATE_EXEC = str(HERE / "gate_exec.py")
STANDIN = str(HERE / "rm_standin.py")
ROOT = HERE.parents[1]
NO_MEMORY, UNTOUCHED, ENOTTY = 0x51, 0xFFFFFFFF, 25
DEADLINE = 20.0  # s: a bound for a hang, never a measure
NAME = "standin"


def ask(n: int) -> str:
    """A step of the stand-in: RM_ALLOC/NVOS64 of class 0x40 (video memory) for `n` bytes."""
    return f"form=nvos64,class=0x40,size={n}"


@dataclass
class GatedExec(Run):
    """One `exec` run over the stand-in, which waits before each step for `go()`."""

    _buf: bytes = b""
    _go: tuple[int, int] = field(default_factory=os.pipe)  # the stand-in reads, the test writes

    @property
    def summary(self) -> Path:
        return self.tmp / "summary.json"

    @property
    def name(self) -> str:
        return NAME

    def launch(
        self,
        *flags: str,
        steps: tuple[str, ...] = (),
        inner: tuple[str, ...] = (),
        fault: str = "",
        prefix: tuple[str, ...] = (),
        command: tuple[str, ...] = (),
    ) -> None:
        """exec with `flags` over the stand-in's `steps` (each after a `go()`), or over
        `command`; `inner`: the flags of an exec of its own between them (a nested exec);
        `fault`: what becomes of the gate's receiver (gate_exec.py); `prefix`: what runs
        exec."""
        waited = [s for step in steps for s in (f"wait={self._go[0]}", step)]
        command = command or (sys.executable, STANDIN, *waited, f"wait={self._go[0]}")
        if inner:
            command = (sys.executable, GATE_EXEC, "exec", *inner, "--", *command)
        cmd = [
            *prefix,
            sys.executable,
            GATE_EXEC,
            "exec",
            "-v",
            "--name",
            NAME,
            "--metrics-port",
            str(self.port),
            "--summary",
            str(self.summary),
            *flags,
            "--",
            *command,
        ]
        env = {**os.environ, **self.gpu.env(), "PYTHONUNBUFFERED": "1", "GATE_EXEC_FAULT": fault}
        with (self.tmp / "exec.stderr").open("w") as stderr:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT, text=True,
                pass_fds=[self._go[0]],
            )  # fmt: skip
        os.close(self._go[0])

    def pid(self) -> int:
        """The command's pid, as exec says it at start."""
        found = wait_for(
            lambda: re.search(r"enforcing a [\d.]+ GiB limit on pid (\d+)", self.stderr),
            what="exec to start the command",
        )
        return int(found[1])

    def go(self) -> dict[str, Any]:
        """Let the stand-in make its next call; what came of it."""
        self.release()
        return self.line()

    def release(self) -> None:
        """Let the stand-in go on (make its next call, or end)."""
        os.write(self._go[1], b"g")

    def line(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([out], [], [], DEADLINE)
            assert ready, f"the stand-in hung:\n{self.stderr}"
            chunk = os.read(out, 4096)
            assert chunk, f"the stand-in ended early:\n{self.stderr}"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        return json.loads(raw)  # type: ignore[no-any-return]

    def end(self) -> tuple[int, dict[str, Any]]:
        """Let the stand-in end; exec's exit status and summary."""
        self.release()
        return self.wait(timeout=DEADLINE), json.loads(self.summary.read_text())

    def close(self) -> None:
        os.close(self._go[1])
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def gated(fake_nvml: Any, tmp_path: Path) -> Iterator[GatedExec]:
    run = GatedExec(fake_nvml, tmp_path)
    yield run
    run.close()


def refused(line: dict[str, Any]) -> bool:
    return bool(line["ret"] == 0 and line["status"] == NO_MEMORY)


def went_on(line: dict[str, Any]) -> bool:
    """The call reached the "driver" (/dev/null) with its parameters untouched."""
    return bool((line["ret"], line["errno"], line["status"]) == (-1, ENOTTY, UNTOUCHED))


def test_a_call_within_the_limit_goes_on_and_one_past_it_is_refused_and_the_command_lives(
    gated: GatedExec,
) -> None:
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(3 * GiB), ask(2 * GiB)),
    )  # fmt: skip
    pid = gated.pid()
    assert "tier allocation-gate on GPU-" in gated.stderr
    assert went_on(gated.go())
    gated.use(pid, 3 * GiB)  # what the driver would show for it
    gated.saw(3 * GiB)
    assert refused(gated.go())
    counted = f'vram_enforcer_allocation_refusals_total{{container="{NAME}"}} 1.0'
    # The listener counts a call just after answering it.
    wait_for(lambda: counted in gated.metrics(), what="the refusal to be counted")
    metrics = gated.metrics()
    for outcome, n in (("allowed", 1), ("refused", 1), ("unsure", 0), ("error", 0)):
        series = (
            f'vram_enforcer_allocation_gate_calls_total{{container="{NAME}",outcome="{outcome}"}}'
        )
        assert f"{series} {float(n)}" in metrics
    assert "vram_enforcer_allocation_gate_stalled 0.0" in metrics
    status, summary = gated.end()
    assert status == 0, gated.stderr
    (line,) = [x for x in gated.stderr.splitlines() if "refused a GPU allocation" in x]
    assert f"refused a GPU allocation of 2.00 GiB (RM_ALLOC/NVOS64 class 0x40, pid {pid}" in line
    assert "the command tree holds 3.00 GiB" in line and "of its 4.00 GiB limit" in line
    assert summary["tier"] == "allocation-gate" and summary["hard_limit"] is False
    gate = summary["allocation_gate"]
    assert (gate["calls"], gate["refusals"]) == ({"allowed": 1, "refused": 1}, 1)
    (event,) = summary["events"]
    assert (event["reason"], event["message"]) == ("VRAMAllocationRefused", line.split(": ", 2)[2])


def test_a_call_over_the_limit_is_judged_on_an_early_pass_that_sees_a_free(
    gated: GatedExec,
) -> None:
    """A call over the limit on a view that may be stale waits for a pass the main loop
    makes at once (the regular one is 30 s away): it is refused while the command holds
    3.5 GiB, and allowed once the driver shows the memory freed."""
    gated.launch(
        "--limit", "4Gi", "--interval", "30s", "--allocation-gate", "on",
        steps=(ask(3 * GiB), ask(GiB + GiB // 2), ask(GiB + GiB // 2)),
    )  # fmt: skip
    pid = gated.pid()
    assert went_on(gated.go())
    gated.use(pid, 3 * GiB + GiB // 2)
    started = time.monotonic()
    assert refused(gated.go())  # on a pass made for it: the first showed nothing held
    gated.use(pid, GiB)  # the command freed its cache
    assert went_on(gated.go())
    assert time.monotonic() - started < 15  # well before the regular pass, 30 s after start
    status, summary = gated.end()
    assert status == 0, gated.stderr
    assert summary["allocation_gate"]["calls"] == {"allowed": 2, "refused": 1}


def test_with_the_gate_off_the_same_calls_go_on_after_the_enforcer_saw_the_usage(
    gated: GatedExec,
) -> None:
    gated.launch("--limit", "4Gi", "--interval", "20ms", steps=(ask(3 * GiB), ask(2 * GiB)))
    pid = gated.pid()
    assert went_on(gated.go())
    gated.use(pid, 3 * GiB)
    gated.saw(3 * GiB)  # the enforcer looked
    assert went_on(gated.go())
    assert "allocation_gate_calls_total{" not in gated.metrics()
    status, summary = gated.end()
    assert status == 0, gated.stderr
    assert (summary["tier"], summary["allocation_gate"]) == ("sampling", None)


def test_a_nested_exec_under_the_gate_warns_and_samples_only(gated: GatedExec) -> None:
    """The kernel allows one seccomp listener per task (EBUSY): the inner exec runs its
    command without a gate of its own, said; the outer gate still judges the calls."""
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(5 * GiB),),
        inner=("--limit", "8Gi", "--interval", "20ms", "--allocation-gate", "on"),
    )  # fmt: skip
    assert refused(gated.go())  # by the outer gate: 5 GiB is past its 4 GiB
    status, summary = gated.end()
    assert status == 0, gated.stderr
    assert (
        "no hard limit: the allocation gate could not be installed: EBUSY (Device or "
        "resource busy). The limit is enforced by sampling every 20ms"
    ) in gated.stderr
    assert summary["allocation_gate"]["calls"] == {"refused": 1}


def test_a_nested_exec_that_requires_a_hard_limit_does_not_start(gated: GatedExec) -> None:
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(GiB),),
        inner=("--limit", "4Gi", "--allocation-gate", "on", "--hard-limits", "required"),
    )  # fmt: skip
    assert gated.proc is not None
    assert gated.proc.wait(timeout=DEADLINE) == 2  # the inner exec's, passed on by the outer
    assert (
        "--hard-limits required, but there is no hard limit: the allocation gate could not "
        "be installed: EBUSY"
    ) in gated.stderr
    assert "enforcing a 4.00 GiB limit" not in gated.stderr.split("EBUSY", 1)[1]


def test_a_receiver_that_stopped_is_restarted_by_execs_loop_and_the_waiting_call_judged(
    gated: GatedExec,
) -> None:
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(5 * GiB),), fault="crash",
    )  # fmt: skip
    assert refused(gated.go())  # it waited for the new receiver; it did not fail
    status, summary = gated.end()
    assert status == 0, gated.stderr
    assert "the allocation gate's receiver stopped (a bug); it is restarted" in gated.stderr
    assert summary["allocation_gate"]["calls"] == {"refused": 1}


def test_a_stalled_receiver_is_said_and_served_while_the_loop_goes_on_ticking(
    gated: GatedExec,
) -> None:
    """The call waits unread for 3 s: exec's loop, which goes on ticking, says so after a
    second and shows it (`allocation_gate_stalled`); then the call is served."""
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(GiB), ask(GiB)), fault="stall",
    )  # fmt: skip
    gated.release()
    wait_for(
        lambda: "vram_enforcer_allocation_gate_stalled 1.0" in gated.metrics(),
        what="the stall to be shown",
    )
    assert went_on(gated.line())
    assert went_on(gated.go())  # served at once now
    wait_for(
        lambda: "vram_enforcer_allocation_gate_stalled 0.0" in gated.metrics(),
        what="the stall to end",
    )
    status, summary = gated.end()
    assert status == 0, gated.stderr
    assert "the allocation gate has not answered for 1 s" in gated.stderr
    assert summary["allocation_gate"]["calls"] == {"allowed": 2}


# The command tries to take each of its parent's (exec's) first 64 fds, as a workload that
# would answer its own calls on the gate's listener fd.
TAKE_FDS = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(os.getppid())
took, errors = [], set()
for fd in range(64):
    got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
    if got >= 0:
        took.append(fd)
    else:
        errors.add(ctypes.get_errno())
print(json.dumps({"took": took, "errnos": sorted(errors)}), flush=True)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_a_process_of_execs_own_user_cannot_take_the_gates_fd_from_it(gated: GatedExec) -> None:
    """exec is not dumpable once the command runs: a process of its user without
    CAP_SYS_PTRACE (both run without it here; the fds of a dumpable exec would be its to
    take) gets EPERM for each fd, so it cannot answer its own calls on the listener."""
    no_ptrace = ("setpriv", "--inh-caps", "-all", "--bounding-set", "-sys_ptrace")
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        prefix=no_ptrace, command=(sys.executable, "-c", TAKE_FDS),
    )  # fmt: skip
    assert "the allocation gate is installed on pid" in wait_for(
        lambda: gated.stderr if "installed" in gated.stderr else "", what="the gate"
    )
    assert gated.line() == {"took": [], "errnos": [errno.EPERM]}
    assert gated.wait(timeout=DEADLINE) == 0, gated.stderr


@pytest.mark.parametrize("gpus", [1, 2])
def test_usage_that_cannot_be_read_never_makes_room(gated: GatedExec, gpus: int) -> None:
    """NVML fails on the GPU where a pass showed 3 GiB held (allocated where the gate does
    not count): the gate judges on that pass, never on the passes that follow, which read
    nothing (one GPU) or only the other GPU (two). The retry after the out-of-memory is
    refused too: it waited for a good pass, none came, and it went on (`unsure`)."""
    if gpus == 2:
        gated.gpu.state.add_device()
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(2 * GiB), ask(2 * GiB)),
    )  # fmt: skip
    pid = gated.pid()
    gated.use(pid, 3 * GiB)
    gated.saw(3 * GiB)
    gated.gpu.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=0)
    gated.use(pid, 0)
    if gpus == 1:
        wait_for(lambda: "vram_enforcer_source_up 0.0" in gated.metrics(), what="no data")
    else:
        gated.saw(0)  # a pass without GPU 0 shows the tree holding nothing
    assert refused(gated.go())
    assert refused(gated.go())  # the retry
    gated.logged("the command tree holds 3.00 GiB (3.00 GiB sampled")  # said after the answer


def test_a_trampoline_killed_before_it_runs_the_command_is_said_in_one_line_exit_126(
    gated: GatedExec,
) -> None:
    """Killed once it has handed over the listener fd (gate_exec.py's `trampoline-killed`):
    exec says what failed, as a command it cannot run (126), and never starts its loop."""
    gated.launch(
        "--limit", "4Gi", "--interval", "20ms", "--allocation-gate", "on",
        steps=(ask(GiB),), fault="trampoline-killed",
    )  # fmt: skip
    assert gated.wait(timeout=DEADLINE) == 126, gated.stderr
    assert (
        "not started, the allocation gate's trampoline failed: it ended before it ran the "
        "command (killed by SIGKILL)"
    ) in gated.stderr
    assert "Traceback" not in gated.stderr
    assert "enforcing a" not in gated.stderr


# exec's gated spawn, run in a process of its own: each line printed is a JSON object.
SPAWN_GATED = """
import ctypes, json, os, resource, sys
from enforcer.edge import gate_child
from enforcer.modes import exec_spawn
libc = ctypes.CDLL(None, use_errno=True)
def fds():
    return sorted(os.listdir("/proc/self/fd"))
def dumpable():
    return libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
SHOW = "import ctypes, json; print(json.dumps({'command': ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)}))"
command = (sys.executable, "-c", SHOW)
if sys.argv[1] == "no-fd":  # one fd free: socketpair needs two
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held, before = [], fds()
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        os.close(held.pop())
    try:
        exec_spawn.spawn_gated(command, False, 1.0)
        said = None
    except exec_spawn.SpawnError as exc:
        said = [exc.status, str(exc)]
    for fd in held:
        os.close(fd)
    try:
        child = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        child = None
    print(json.dumps({"said": said, "fds_kept": fds() == before, "child": child}))
else:  # who can read the trampoline while it holds the listener fd
    start = gate_child.spawn
    def spawn(path, argv, program):
        seen = {"exec": dumpable()}
        spawned = start(path, argv, program)
        try:
            open(f"/proc/{spawned.pid}/mem", "rb").close()
            seen["trampoline"] = 0
        except OSError as exc:
            seen["trampoline"] = exc.errno
        print(json.dumps(seen), flush=True)
        return spawned
    gate_child.spawn = spawn
    pid, _ = exec_spawn.spawn_gated(command, False, 1.0)
    os.waitpid(pid, 0)
"""


def spawn_gated(case: str) -> list[dict[str, Any]]:
    no_ptrace = ("setpriv", "--inh-caps", "-all", "--bounding-set", "-sys_ptrace")
    out = subprocess.run(
        [*no_ptrace, sys.executable, "-c", SPAWN_GATED, case],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=DEADLINE, check=True,
    )  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_no_fd_free_for_the_trampolines_socket_is_said_exit_126_and_nothing_leaks() -> None:
    """RLIMIT_NOFILE reached (EMFILE): one line naming socketpair and why; no fd kept, no
    child left."""
    assert spawn_gated("no-fd") == [
        {
            "said": [
                126,
                f"{sys.executable}: not started, the allocation gate's trampoline failed: "
                "socketpair: Too many open files",
            ],
            "fds_kept": True,
            "child": None,
        }
    ]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_exec_and_the_trampoline_are_not_dumpable_while_they_hold_the_fd_and_the_command_is() -> (
    None
):
    """exec is not dumpable before the listener fd exists, and the trampoline while it holds
    it: a process of their user without CAP_SYS_PTRACE cannot read it (EACCES). The
    command's exec makes it dumpable again, as any program its user may read."""
    assert spawn_gated("dumpable") == [
        {"exec": 0, "trampoline": errno.EACCES},
        {"command": 1},
    ]
