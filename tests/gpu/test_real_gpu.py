"""Real NVML and real CUDA processes (PyTorch): the enforcer catches an allocation at the
limit and leaves a compliant process alone. Skipped without a GPU."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from enforcer.core.model import GiB, ProcessUsage, Sample
from enforcer.core.tier_choice import R615, TierName, choose, driver_branch
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import NvmlSource, gpu_device_majors
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs
from enforcer.edge.tier_probe import TierProbe, host_root, own_cgroup
from tests.helpers import children, standalone_agent, wait_for

ALLOC = Path(__file__).with_name("alloc.py")
POD_ALLOC = Path(__file__).with_name("pod_alloc.py")
BUSY = Path(__file__).with_name("busy.py")


def enforce(limit: str, step_mib: int, steps: int, hold: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "enforcer",
            "exec",
            "--limit",
            limit,
            "--interval",
            "50ms",
            "--grace-period",
            "2s",
            "--",
            sys.executable,
            str(ALLOC),
            str(step_mib),
            str(steps),
            str(hold),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_the_tier_probe_on_this_driver() -> None:
    """The tier's probe against the real driver: it reads, sets nothing, and its choice
    follows the driver's branch; whether the NVML library has the per-cgroup calls is
    learnt here, not assumed (printed with -s: what offline.sh prints too)."""
    nvml = Nvml()
    try:
        probe = TierProbe(own_cgroup, host_root()).probe(nvml)
    finally:
        nvml.shutdown()
    choice = choose(probe)
    print(f"driver {probe.driver_version}, per-cgroup calls: {probe.limit_calls}")
    print(choice.said())
    assert probe.nvml_error == "" and probe.driver_version
    branch = driver_branch(probe.driver_version)
    assert branch is not None
    if branch < R615:
        assert choice.tier is TierName.SAMPLING
        assert f"driver {probe.driver_version} has no per-cgroup limits: R615+" in choice.why
    else:
        assert probe.limit_calls  # an R615 driver's NVML has them


def test_real_nvml_lists_devices_and_memory() -> None:
    nvml = Nvml()
    nvml.init()
    try:
        snap = nvml.snapshot()
    finally:
        nvml.shutdown()
    assert snap.devices
    for d in snap.devices:
        assert d.total_bytes and d.total_bytes > GiB
        assert d.used_bytes is not None
    print("driver", nvml.driver_version, [(d.index, d.name, d.total_bytes) for d in snap.devices])


def test_a_real_cuda_process_is_seen_with_its_start_time() -> None:
    child = subprocess.Popen(
        [sys.executable, str(ALLOC), "512", "1", "30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("allocated")
        nvml = Nvml()
        nvml.init()
        source = NvmlSource(nvml, PidView.host(ProcFs()), gpu_device_majors())
        try:  # listed when the source first looked: charged once seen holding a GPU device

            def proven() -> list[ProcessUsage]:
                sample = source.sample()
                assert isinstance(sample, Sample), sample
                return [p for p in sample.processes if p.key.pid == child.pid and p.used_bytes]

            mine = wait_for(proven, what=f"pid {child.pid} listed by NVML, with its usage")
        finally:
            source.close()
        assert mine[0].key.start_time == ProcFs().start_time(child.pid)
        assert mine[0].used_bytes is not None and mine[0].used_bytes >= 512 * 1024**2
        print("NVML sees", mine)
    finally:
        child.kill()
        child.wait()


def test_an_allocation_past_the_limit_is_terminated() -> None:
    out = enforce("2Gi", 256, 24, 30)  # would reach 6 GiB (plus the CUDA context)
    print(out.stdout, out.stderr)
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert "of its 2.00 GiB VRAM limit" in out.stderr and "sent SIGTERM" in out.stderr
    last = [line for line in out.stdout.splitlines() if line.startswith("allocated")][-1]
    assert int(last.split()[1]) <= 2048 + 256, "caught within one step of the limit"


def test_a_compliant_cuda_process_survives() -> None:
    out = enforce("4Gi", 256, 4, 1)  # 1 GiB plus the CUDA context
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout
    assert "SIG" not in out.stderr


def test_the_agent_names_a_pods_cuda_process_by_the_pods_own_pid(tmp_path: Path) -> None:
    """NVML reports host pids; a caller in a PID namespace must get its own pids back."""
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(
        standalone_agent(sock, "--interval", "50ms", "--log-format", "text"),
        stderr=(tmp_path / "agent.log").open("w"),
    )
    pod = None
    try:
        wait_for(sock.exists, what="the agent socket")
        pod = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child",
                sys.executable,
                str(POD_ALLOC),
                str(sock),
                "768",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert pod.stdout is not None
        seen = json.loads(pod.stdout.readline())
        print("the pod saw", seen)
        (listed,) = seen["reply"]["processes"]
        assert listed["pid"] == seen["pid"] == 1  # the namespace's pid, never the host's
        assert listed["used_bytes"] >= 768 * 1024**2
        (host_pid,) = children(pod.pid)
        assert listed["start_time"] == ProcFs().start_time(host_pid)
        assert seen["reply"]["devices"] and seen["reply"]["devices"][0]["total_bytes"] > GiB
    finally:
        if pod is not None:
            pod.kill()
            pod.wait()
        agent.terminate()
        assert agent.wait(timeout=15) == 0, (tmp_path / "agent.log").read_text()


def test_the_real_driver_is_asked_for_a_hard_limit_and_its_answer_is_reported() -> None:
    """Issue 12 on hardware: below R615 `exec` says in one line that only sampling holds the
    limit, and `--hard-limits required` refuses to start; from R615 the driver itself makes
    the allocation past the limit fail, before sampling would stop the process."""
    nvml = Nvml()
    nvml.init()
    try:
        driver = nvml.driver_version
    finally:
        nvml.shutdown()
    major = int(str(driver).split(".")[0])
    out = enforce("2Gi", 256, 24, 5)
    print(driver, out.stdout, out.stderr)
    if major < 615:
        assert f"no hard limit: the NVIDIA driver {driver}" in out.stderr
        assert out.returncode == 128 + signal.SIGTERM  # sampling still holds the limit
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "enforcer",
                "exec",
                "--limit",
                "2Gi",
                "--hard-limits",
                "required",
                "--",
                sys.executable,
                str(ALLOC),
                "256",
                "1",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(refused.stderr)
        assert refused.returncode == 2 and "--hard-limits required" in refused.stderr
        assert "allocated" not in refused.stdout  # the command never ran
    else:
        assert "no hard limit" not in out.stderr
        assert "out of memory" in out.stderr.lower()  # CUDA's own error, from the driver
        assert "sent SIGTERM" not in out.stderr


def test_a_busy_cuda_process_has_sm_utilisation_and_an_idle_one_none() -> None:
    """Per-process utilisation from the real driver: a matmul loop shows SM activity, and a
    process that only holds memory shows (close to) none. Prints which NVML call served."""
    busy = subprocess.Popen([sys.executable, str(BUSY), "20"], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen(
        [sys.executable, str(ALLOC), "256", "1", "30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert busy.stdout is not None and idle.stdout is not None
        assert busy.stdout.readline().startswith("busy")
        assert idle.stdout.readline().startswith("allocated")
        nvml = Nvml(utilisation_every=0.5)
        nvml.init()
        try:

            def activity() -> dict[int, object]:
                snap = nvml.snapshot()
                return {p.pid: p.activity for p in snap.processes if p.pid in (busy.pid, idle.pid)}

            seen = wait_for(
                lambda: (
                    (a := activity())
                    and len(a) == 2
                    and all(v is not None for v in a.values())
                    and a[busy.pid].sm_percent > 0
                    and a
                ),  # type: ignore[attr-defined]
                timeout=15,
                what="utilisation of both processes",
            )
        finally:
            nvml.shutdown()
        print("utilisation", {pid: seen[pid] for pid in seen}, "driver", nvml.driver_version)
        assert seen[busy.pid].sm_percent >= 20  # type: ignore[attr-defined]
        assert seen[idle.pid].sm_percent <= 5  # type: ignore[attr-defined]
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
