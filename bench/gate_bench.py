"""The allocation gate (issue 45, `--only allocation-gate`): what a gated call costs, and
the overshoot at 10 GiB/s with the gate against sampling alone.

**Cost.** The stand-in of the driver's callers (`tests/integration/rm_standin.py`) issues
the driver's real requests on /dev/null under the real filter, installed by the real
trampoline (`edge/gate_child.py`), and the real `GateListener` answers them in this
process (its device majors: /dev/null's, standing in for NVIDIA's). Each call is timed in
the stand-in around the bare syscall, against the same ioctl with no filter. A thread
plays the sampler (a pass every 100 ms, as `exec --interval 100ms` makes), so the grants
the gate counts expire as they do in `exec`. The kinds:

- `not_memory`: RM_ALLOC of class 0x80, the kind a context's creation makes by the
  hundred: decoded, let go on;
- `allowed`: RM_ALLOC of class 0x40 (video memory, 2 MiB: PyTorch's small granule) within
  the limit;
- `refused`: an ask over the whole limit, refused at once (the driver's status written
  into the caller's block). A refusal over what the tree holds waits for a fresh sampler
  pass first (`core/alloc_gate.py`): that is a pass's latency, not the listener's;
- `filtered, not gated`: RM_CONTROL (0x2A), the busiest escape: the filter alone.

Back to back, the allowed kind keeps about a thousand grants outstanding (those a pass
does not show yet), which a flood makes and a real workload does not; a call a
millisecond is the other end.

The listener's CPU per call is this process's CPU time over the stand-in's calls divided
by their number (nothing else here is busy then: the sampler thread wakes 10 times a
second); its own time per call is what it measures around each call.

**Flood.** One container's stand-in floods the gate (8 threads of class 0x80 back to
back) while another container's makes a call every 5 ms, each served by a listener of its
own in this process, as the agent serves them, and a thread stands in for the agent's
NVML pass (a fixed piece of Python every 100 ms): the other container's round trip, the
pass's time, the flood's pace and this process's CPU, with no flood, with the flood read
as fast as its listener answers, and with the flood held to the agent's budget
(`core/gate_budget.py`), measured once its burst is spent.

**Overshoot.** `vram-enforcer exec --allocation-gate on --limit 4Gi --interval 100ms` over
the fake NVML, around the stand-in allocating 20 MiB calls at 10 GiB/s up to 8 GiB, each
call let go on added to its usage in the fake's state (the stand-in plays the driver):
the usage over the limit, with the gate and with sampling alone, and with a racing thread
that rewrites the size after the check. The gate's `exec` is the real CLI run by
`tests/integration/gate_exec.py`, which only makes /dev/null's major NVIDIA's; an arm
that ran on another tier, or whose gate judged or refused nothing, says so instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import ROOT, GiB, enforcer_argv, percentile
from enforcer.core.gate_budget import Budget
from enforcer.edge import gate_child, gate_listener
from enforcer.edge.gate_listener import GateListener, Ledger, Outcome, Turns
from enforcer.edge.seccomp_filter import program
from enforcer.modes.node_gate import BUDGET
from tests.fakenvml import FakeGpuState

STANDIN = ROOT / "tests" / "integration" / "rm_standin.py"
GATE_EXEC = ROOT / "tests" / "integration" / "gate_exec.py"
NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)
MiB = 1024**2
INTERVAL = 0.1  # s between the stand-in sampler's passes, as exec's default
COST_LIMIT = 1024 * GiB  # the cost arms' limit: 2 MiB grants never reach it
GOAL_P99_US = 50.0
# include/uapi/linux/seccomp.h: SECCOMP_IOW(4, __u64), and its one flag (Linux 6.6+)
SECCOMP_IOCTL_NOTIF_SET_FLAGS = 0x40082104
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP = 1

KINDS = {  # the stand-in's step, and what the listener makes of each call
    "not_memory": ("class=0x80", Outcome.NOT_MEMORY),
    "allowed": (f"class=0x40,size={2 * MiB}", Outcome.ALLOWED),
    "refused": (f"class=0x40,size={2 * COST_LIMIT}", Outcome.REFUSED),
}
UNGATED = "nr=0x2A"  # RM_CONTROL: the filter lets it by


def available() -> str | None:
    """Why the gate cannot run here (None: it can)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        return f"no allocation gate for {platform.machine()}"
    try:
        actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError as exc:
        return f"cannot read the kernel's seccomp actions: {exc}"
    return None if "user_notif" in actions else "the kernel's seccomp lacks user_notif"


class _Errors:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, amount: float = 1) -> None:
        self.count += int(amount)


def _timed_line(argv: list[str]) -> dict[str, Any]:
    line = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600).stdout
    found: dict[str, Any] = json.loads(line)
    return found


def _figures(ns: list[int]) -> dict[str, float]:
    us = [n / 1000 for n in ns]
    return {"p50_us": statistics.median(us), "p99_us": percentile(us, 0.99), "max_us": us[-1]}


def _sync_wake_up(fd: int) -> str:
    """Ask the kernel to wake the caller on the listener's CPU (6.6+); why not, or ""."""
    try:
        # The flags go by value, not through a pointer (kernel/seccomp.c)
        fcntl.ioctl(fd, SECCOMP_IOCTL_NOTIF_SET_FLAGS, SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)
    except OSError as exc:
        return f"the kernel does not take SYNC_WAKE_UP ({errno.errorcode.get(exc.errno or 0)})"
    return ""


def gated(
    step: str,
    calls: int,
    listener_cpu: int | None = None,
    standin_cpu: int | None = None,
    sync_wake_up: bool = False,
) -> dict[str, Any]:
    """`calls` of the stand-in's `step` through the trampoline and the listener."""
    if standin_cpu is not None:
        step += f",cpu={standin_cpu}"
    mask = os.sched_getaffinity(0)
    if listener_cpu is not None:  # threads started from here on inherit it
        os.sched_setaffinity(0, {listener_cpu})
    # The refusal lines (five a second) are made as in exec, and go nowhere.
    lines = logging.getLogger(gate_listener.__name__)
    quiet = logging.NullHandler()
    lines.addHandler(quiet)
    lines.propagate = False
    try:
        return _gated(step, calls, sync_wake_up)
    finally:
        lines.propagate = True
        lines.removeHandler(quiet)
        os.sched_setaffinity(0, mask)


def _spawn(step: str) -> tuple[gate_child.Spawned, int, int]:
    """The stand-in that will run `step` under the real filter, through the trampoline
    (not started yet): it, its listener fd and the read end of its lines."""
    out_r, out_w = os.pipe()
    os.set_inheritable(out_w, True)
    argv = [sys.executable, str(STANDIN), f"out={out_w}", step]
    spawned = gate_child.spawn(sys.executable, argv, program())
    os.close(out_w)
    if spawned.listener is None:
        spawned.abort()
        os.waitpid(spawned.pid, 0)
        os.close(out_r)
        raise RuntimeError(f"the gate could not be installed: {spawned.why_not}")
    return spawned, spawned.listener, out_r


def _gated(step: str, calls: int, sync_wake_up: bool) -> dict[str, Any]:
    spawned, fd, out_r = _spawn(f"{step},time={calls}")
    why_not = _sync_wake_up(fd) if sync_wake_up else ""
    ledger = Ledger(COST_LIMIT)
    ledger.saw(0, time.monotonic())
    outcomes: Counter[str] = Counter()
    own: list[float] = []

    def count(outcome: Outcome, seconds: float) -> None:
        outcomes[outcome] += 1
        own.append(seconds)

    errors = _Errors()
    listener = GateListener(fd, ledger, {NULL_MAJOR}, errors, count=count, pid=spawned.pid)
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(ledger, stop), daemon=True)
    listener.start()
    sampler.start()
    try:
        assert spawned.go() == 0
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        with os.fdopen(out_r) as lines:
            found: dict[str, Any] = json.loads(lines.readline())
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        _, status = os.waitpid(spawned.pid, 0)
    finally:
        stop.set()
        listener.stop()
        sampler.join()
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0 and errors.count == 0
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    mine = sorted(s * 1e6 for s in own)
    return {
        **_figures(found["ns"]),
        "calls": calls,
        "answers": found["counts"],
        "outcomes": dict(outcomes),
        "listener_cpu_us_per_call": cpu * 1e6 / calls if own else 0.0,
        "listener_own_p50_us": statistics.median(mine) if mine else 0.0,
        "listener_own_p99_us": percentile(mine, 0.99) if mine else 0.0,
        "sync_wake_up": sync_wake_up and not why_not,
        "why_not": why_not,
    }


def _sampler(ledger: Ledger, stop: threading.Event) -> None:
    """A pass every INTERVAL that sees nothing held: what /dev/null's "driver" holds."""
    while not stop.wait(INTERVAL):
        ledger.saw(0, time.monotonic())


def bare(step: str, calls: int) -> dict[str, Any]:
    """The same calls with no filter at all."""
    found = _timed_line([sys.executable, str(STANDIN), f"{step},time={calls}"])
    return {**_figures(found["ns"]), "calls": calls, "answers": found["counts"]}


def cost(calls: int) -> dict[str, Any]:
    """Each kind back to back, unpinned; then the allowed kind with the listener and the
    stand-in on one CPU and on two, with SYNC_WAKE_UP, and a call a millisecond (the
    listener idle between calls, as a real workload's come). About 20 s for 20,000 calls
    a kind here."""
    rows: dict[str, Any] = {"unfiltered": bare(KINDS["allowed"][0], calls)}
    rows["filtered, not gated"] = gated(UNGATED, calls)
    for kind, (step, outcome) in KINDS.items():
        row = gated(step, calls)
        assert row["outcomes"] == {outcome: calls}, row["outcomes"]
        rows[kind] = row
    allowed = KINDS["allowed"][0]
    placed = min(calls, 5000)
    rows["allowed, one CPU"] = gated(allowed, placed, listener_cpu=0, standin_cpu=0)
    if (os.cpu_count() or 1) > 1:
        rows["allowed, two CPUs"] = gated(allowed, placed, listener_cpu=0, standin_cpu=1)
    rows["allowed, SYNC_WAKE_UP"] = gated(allowed, placed, sync_wake_up=True)
    rows["allowed, a call a millisecond"] = gated(f"{allowed},gap=0.001", min(calls, 2000))
    return {"goal_p99_us": GOAL_P99_US, "interval_ms": INTERVAL * 1000, "arms": rows}


def show_cost(found: dict[str, Any]) -> None:
    base = found["arms"]["unfiltered"]
    print(
        f"allocation gate, a call with no filter: p50 {base['p50_us']:.1f} us, p99 "
        f"{base['p99_us']:.1f} us ({base['calls']} calls)"
    )
    for name, row in found["arms"].items():
        if name == "unfiltered":
            continue
        if row.get("why_not"):
            print(f"allocation gate, {name}: {row['why_not']}")
            continue
        print(
            f"allocation gate, {name}: round trip p50 {row['p50_us']:.1f} us, p99 "
            f"{row['p99_us']:.1f} us (goal < {found['goal_p99_us']:.0f}), max "
            f"{row['max_us']:.0f} us; listener CPU {row['listener_cpu_us_per_call']:.1f} us a "
            f"call, its own time p50 {row['listener_own_p50_us']:.1f} us, p99 "
            f"{row['listener_own_p99_us']:.1f} us ({row['calls']} calls)"
        )


# --- a flood: what one container's flood costs the agent and another container ------

FLOOD_STEP = "class=0x80,threads=8,repeat=1000000000"  # 8 threads back to back, until killed
VICTIM_CALLS = 300  # the other container's calls, ...
VICTIM_GAP = 0.005  # ... this many s apart
PASS_WORK = 20_000  # a stand-in NVML pass: this much Python (about 1-2 ms idle)


@contextlib.contextmanager
def _served(
    step: str, turn: Callable[[], float] = lambda: 0.0
) -> Iterator[tuple[GateListener, Callable[[], dict[str, Any]]]]:
    """The stand-in running `step` under the real filter, its calls answered by a listener
    in this process (a gated container, as the agent serves one); its listener, and a
    reader of its next line. Killed at the end, if it still runs."""
    spawned, fd, out_r = _spawn(step)
    ledger = Ledger(COST_LIMIT)
    ledger.saw(0, time.monotonic())
    errors = _Errors()
    listener = GateListener(fd, ledger, {NULL_MAJOR}, errors, turn=turn)
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(ledger, stop), daemon=True)
    listener.start()
    sampler.start()
    lines = os.fdopen(out_r)
    try:
        assert spawned.go() == 0
        yield listener, lambda: dict(json.loads(lines.readline()))
    finally:
        stop.set()
        os.kill(spawned.pid, signal.SIGKILL)  # a zombie's too: not reaped yet
        os.waitpid(spawned.pid, 0)
        listener.stop()
        sampler.join()
        os.close(fd)
        lines.close()
    assert errors.count == 0


def _passes(stop: threading.Event, took: list[float]) -> None:
    """The agent's NVML pass, stood in for by a fixed piece of Python every INTERVAL: how
    long it takes is what a flood's share of the GIL adds to it."""
    while not stop.wait(INTERVAL):
        started = time.perf_counter()
        sum(i * i for i in range(PASS_WORK))
        took.append(time.perf_counter() - started)


def flood_arm(flooding: bool, budget: Budget | None) -> dict[str, Any]:
    """Another container's gated calls (`VICTIM_CALLS`, `VICTIM_GAP` apart) and the passes
    meanwhile, while one container floods (or none), read within `budget` (None: as fast as
    the listener answers); past the flood's burst."""
    took: list[float] = []
    throttled = threading.Event()  # the flood's burst spent: its budget's rate from now
    turns = Turns(budget) if budget is not None else None

    def turn() -> float:
        wait = turns.take() if turns is not None else 0.0
        if wait > 0:
            throttled.set()
        return wait

    with contextlib.ExitStack() as stack:
        flooder = None
        if flooding:
            flooder, _ = stack.enter_context(_served(FLOOD_STEP, turn))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                throttled.is_set() if turns is not None else flooder.answered > 1000
            ):
                time.sleep(0.01)
        stop = threading.Event()
        passes = threading.Thread(target=_passes, args=(stop, took), daemon=True)
        passes.start()
        stack.callback(passes.join)
        stack.callback(stop.set)
        read0, t0 = (flooder.answered if flooder else 0), time.monotonic()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        _, line = stack.enter_context(_served(f"class=0x80,time={VICTIM_CALLS},gap={VICTIM_GAP}"))
        victim = line()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        read1, t1 = (flooder.answered if flooder else 0), time.monotonic()
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    passes_ms = sorted(t * 1000 for t in took)
    return {
        **_figures(victim["ns"]),
        "flood_calls_per_s": (read1 - read0) / (t1 - t0),
        "agent_cpu_share": cpu / (t1 - t0),
        "pass_p50_ms": statistics.median(passes_ms) if passes_ms else 0.0,
        "pass_p99_ms": percentile(passes_ms, 0.99) if passes_ms else 0.0,
        "passes": len(passes_ms),
    }


FLOOD_ARMS = {
    "no flood": (False, None),
    "a flood, no budget": (True, None),
    "a flood, the budget": (True, BUDGET),
}


def flood(rounds: int) -> dict[str, Any]:
    """What one container's flood (8 threads of non-memory calls back to back) costs the
    agent and another container: the other's call round trip, a stand-in pass, the flood's
    pace and the process's CPU, with no flood, a flood read as fast as answered, and a
    flood held to the node agent's budget (`core/gate_budget.py`). The arms run in turn,
    `rounds` times (a loaded machine moves each figure from run to run); each figure is
    the median over the rounds."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FLOOD_ARMS}
    for _ in range(rounds):
        for name, (flooding, budget) in FLOOD_ARMS.items():
            runs[name].append(flood_arm(flooding, budget))
    arms = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for name, rows in runs.items()
    }
    return {"rate": BUDGET.rate, "burst": BUDGET.burst, "rounds": rounds, "arms": arms}


def show_flood(found: dict[str, Any]) -> None:
    for name, row in found["arms"].items():
        print(
            f"allocation gate, {name}: another container's call p50 {row['p50_us']:.0f} us, "
            f"p99 {row['p99_us']:.0f} us; a pass p50 {row['pass_p50_ms']:.2f} ms, p99 "
            f"{row['pass_p99_ms']:.2f} ms; the flood read at {row['flood_calls_per_s']:.0f} "
            f"calls/s; the process's CPU {row['agent_cpu_share']:.0%} of a core (the median "
            f"of {found['rounds']} runs)"
        )


# --- overshoot: needs `vram-enforcer exec --allocation-gate` ---------------------------

LIMIT = 4 * GiB
RATE = 10 * GiB  # bytes a second
STEP_BYTES = 20 * MiB  # PyTorch's large granule
UP_TO = 8 * GiB
RACE_TO = GiB  # what the racing thread writes into the size after the check


def overshoot(lib_dir: Path, tmp: Path, trials: int) -> dict[str, Any]:
    """Bytes over the limit per arm, its p50, p99 and largest over the trials: sampling
    alone, the gate, and the gate with a racing thread (sampling is then what stops it);
    with in how many trials the command lived to its end and saw a refused call (one
    killed says nothing), and the summaries' refusals. An arm whose trials did not measure
    what it names says why instead of a figure."""
    arms = {
        "sampling alone": (None, ""),
        "allocation-gate": ("on", ""),
        "allocation-gate, racing": ("on", f",race={RACE_TO},stop=0"),
    }
    rows: dict[str, Any] = {}
    for name, (gate, race) in arms.items():
        found = [
            overshoot_trial(lib_dir, tmp / f"{name}-{i}".replace(" ", "_"), gate, race)
            for i in range(trials)
        ]
        if reason := mismeasured(gate, race, found):
            rows[name] = f"{reason}: see {tmp}/*/exec.log"
            continue
        over = sorted(t["over_bytes"] / GiB for t in found)
        rows[name] = {
            "trials": trials,
            "p50_gib": statistics.median(over),
            "p99_gib": percentile(over, 0.99),
            "max_gib": over[-1],
            "refused": sum(t["refused"] > 0 for t in found),  # seen by the stand-in
            "lived": sum(t["lived"] for t in found),
            "signalled": sum(t["signal"] is not None for t in found),
            "summary_refusals": sum(t["summary_refusals"] for t in found),
        }
    return {
        "limit_gib": LIMIT / GiB,
        "rate_gib_per_s": RATE / GiB,
        "step_mib": STEP_BYTES / MiB,
        "interval_ms": INTERVAL * 1000,
        "arms": rows,
    }


def mismeasured(gate: str | None, race: str, found: list[dict[str, Any]]) -> str:
    """Why an arm's trials did not measure what it names ("": they did): exec chose another
    tier than the arm's, the gate judged no allocation (its listener did not take the
    stand-in's file for the driver's), or it refused nothing in a trial of a workload that
    does not race it, all of whose asks past the limit it should refuse."""
    chose = {t["tier"] for t in found}
    if chose != {"allocation-gate" if gate else "sampling"}:
        return f"exec chose the tier {sorted(map(str, chose))}"
    if gate and not all(t["judged"] for t in found):
        return "the gate judged no allocation in some trials"
    if gate and not race and not all(t["refused"] and t["summary_refusals"] for t in found):
        return "the gate refused nothing in some trials"
    return ""


def overshoot_trial(lib_dir: Path, tmp: Path, gate: str | None, race: str) -> dict[str, Any]:
    """One run of exec around the paced stand-in; what it held at most over the limit (it
    only ever grows, so its last usage in the fake's state). With the gate, exec runs as
    gate_exec.py runs it: /dev/null's device major stands in for NVIDIA's, as the stand-in
    issues its calls there."""
    tmp.mkdir(parents=True)
    state_file, summary = tmp / "gpu.json", tmp / "summary.json"
    FakeGpuState.single_gpu().write(state_file)
    after = random.uniform(0, INTERVAL)  # a random phase against exec's tick
    step = (
        f"class=0x40,size={STEP_BYTES},rate={RATE},upto={UP_TO},driver=1,after={after:.4f},"
        f"hold=0.3{race}"
    )
    if gate:
        launcher = [enforcer_argv()[0], str(GATE_EXEC), "exec", "--allocation-gate", gate]
    else:
        launcher = enforcer_argv("exec")
    argv = [
        *launcher,
        "--limit",
        f"{LIMIT}",
        "--interval",
        f"{int(INTERVAL * 1000)}ms",
        "--grace-period",
        "2s",
        "--summary",
        str(summary),
        "--",
        sys.executable,
        str(STANDIN),
        step,
    ]
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_STATE": str(state_file)}
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    (tmp / "exec.log").write_text(done.stderr)
    state = json.loads(state_file.read_text())
    held = max((p["used_bytes"] or 0 for p in state["devices"][0]["compute_processes"]), default=0)
    ran = json.loads(summary.read_text())
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    gated = ran["allocation_gate"] or {"calls": {}, "refusals": 0}
    return {
        "over_bytes": max(0, held - LIMIT),
        "tier": ran["tier"],
        "signal": ran["signal"],
        "refused": lines[-1]["refused"] if lines else 0,
        "lived": bool(lines) and ran["signal"] is None and ran["exit_status"] == 0,
        "judged": sum(gated["calls"].get(o, 0) for o in (Outcome.ALLOWED, Outcome.REFUSED)),
        "summary_refusals": gated["refusals"],
    }


def show_overshoot(found: dict[str, Any]) -> None:
    for name, row in found["arms"].items():
        what = f"overshoot, {name} at {found['rate_gib_per_s']:.0f} GiB/s in {found['step_mib']:.0f} MiB calls, --limit {found['limit_gib']:.0f}Gi --interval {found['interval_ms']:.0f}ms"
        if isinstance(row, str):
            print(f"{what}: not run ({row})")
            continue
        print(
            f"{what}: p50 {row['p50_gib']:.3f} GiB, p99 {row['p99_gib']:.3f} GiB, max "
            f"{row['max_gib']:.3f} GiB over {row['trials']} trials (the command lived in "
            f"{row['lived']} and saw a call refused in {row['refused']}, ended by a signal in "
            f"{row['signalled']}; the summaries' refusals: {row['summary_refusals']})"
        )


def run(lib_dir: Path, tmp: Path, calls: int, trials: int) -> dict[str, Any]:
    reason = available()
    if reason:
        return {"skipped": reason}
    return {
        "cost": cost(calls),
        "flood": flood(max(1, trials // 4)),
        "overshoot": overshoot(lib_dir, tmp, trials),
    }


def show(found: dict[str, Any]) -> None:
    if "skipped" in found:
        print(f"allocation gate: skipped ({found['skipped']})")
        return
    show_cost(found["cost"])
    show_flood(found["flood"])
    show_overshoot(found["overshoot"])
