"""The sidecar in a pod on this machine, against the real agent and the real API server.

The pod is simulated by `podsim.SimPod`: a shared PID namespace whose PID 1 stands in for
pause, "containers" in containerd-named cgroups, and a Pod object whose status carries
their container IDs. The node agent runs on the host side with the fake NVML reporting
host PIDs; the sidecar runs inside the pod with the pod's ServiceAccount token, bound to
the Role in deploy/rbac/sidecar.yaml.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from enforcer.core.model import GiB, MiB
from tests.e2e.actors import (
    HOST,
    WORKER,
    Node,
    Sidecar,
    alive,
    namespace_with_sidecar_rbac,
    start_worker,
)
from tests.e2e.cluster import ApiServer
from tests.e2e.podsim import SimPod
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "gpu-team"


@pytest.fixture(scope="module")
def token(apiserver: ApiServer, admin: client.ApiClient) -> str:
    """The namespace's default ServiceAccount, with the shipped sidecar Role bound to its group."""
    return namespace_with_sidecar_rbac(apiserver, admin, NAMESPACE)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, fake_nvml_lib: Path) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("node"), fake_nvml_lib)
    n.start_agent()
    yield n
    if n.agent is not None and n.agent.poll() is None:
        n.stop_agent()


_pod_numbers = itertools.count()


@pytest.fixture
def pod(core: client.CoreV1Api, token: str) -> Iterator[SimPod]:
    """A fresh pod for each test: nothing one test does is seen by the next."""
    p = SimPod(
        core,
        NAMESPACE,
        f"trainer-{next(_pod_numbers)}",
        ["trainer", "helper", "undeclared", "vram-enforcer"],
        unlisted=("ghost",),
    )
    yield p
    p.close()


@pytest.fixture
def sidecar(
    pod: SimPod, node: Node, apiserver: ApiServer, token: str, tmp_path: Path
) -> Iterator[Sidecar]:
    s = Sidecar(pod, node, apiserver, token, tmp_path, {"trainer": 4 * GiB, "helper": 2 * GiB})
    yield s
    assert s.stop() == 0


def events(core: client.CoreV1Api, pod: str) -> list[Any]:
    return list(
        core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={pod}").items
    )


def test_the_container_over_its_limit_is_terminated_and_its_neighbour_untouched(
    sidecar: Sidecar, pod: SimPod, node: Node, tmp_path: Path
) -> None:
    trainer, helper = start_worker(pod, "trainer", tmp_path), start_worker(pod, "helper", tmp_path)
    node.use({trainer: 5 * GiB, helper: 1 * GiB})
    wait_for(lambda: not alive(trainer), what="the trainer to be terminated")
    assert alive(helper)
    sidecar.wait_logged(
        "container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit (125%)", "sent SIGTERM to pid"
    )
    node.use({trainer: None, helper: None})


def test_a_container_without_declared_vram_is_caught(
    sidecar: Sidecar, pod: SimPod, node: Node, tmp_path: Path
) -> None:
    sneaky = start_worker(pod, "undeclared", tmp_path)
    node.use({sneaky: 1 * MiB})
    wait_for(lambda: not alive(sneaky), what="the undeclared container's process to be terminated")
    assert (
        "container 'undeclared' uses 1.00 MiB of VRAM but declares no VRAM limit" in sidecar.text()
    )
    node.use({sneaky: None})


def test_events_are_posted_on_the_pod_and_aggregated(
    sidecar: Sidecar, pod: SimPod, node: Node, core: client.CoreV1Api, tmp_path: Path
) -> None:
    def enforced() -> list[Any]:
        return [
            e
            for e in events(core, pod.name)
            if e.reason == "VRAMEnforced"
            and e.involved_object.field_path == "spec.containers{trainer}"
            and "sent SIGTERM" in e.message
        ]

    first_offender = start_worker(pod, "trainer", tmp_path)
    node.use({first_offender: 5 * GiB})
    (first,) = wait_for(enforced, timeout=20, what="the VRAMEnforced event")
    node.use({first_offender: None})
    assert first.type == "Warning"
    assert first.source.component == "vram-enforcer"
    assert first.involved_object.uid == pod.uid
    assert first.involved_object.kind == "Pod"
    assert "container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit" in first.message
    exceeded = [e for e in events(core, pod.name) if e.reason == "VRAMLimitExceeded"]
    assert [e.involved_object.field_path for e in exceeded] == ["spec.containers{trainer}"]
    again = start_worker(pod, "trainer", tmp_path)
    node.use({again: 6 * GiB})
    wait_for(lambda: not alive(again), what="the second offender to be terminated")
    node.use({again: None})
    (aggregated,) = wait_for(
        lambda: (e := enforced()) and e[0].count >= 2 and e, what="the repeat to be aggregated"
    )
    assert aggregated.metadata.name == first.metadata.name
    assert "6.00 GiB" in aggregated.message


def test_a_pod_in_a_dry_run_gets_a_would_be_event_and_nothing_is_signalled(
    pod: SimPod,
    node: Node,
    apiserver: ApiServer,
    token: str,
    core: client.CoreV1Api,
    tmp_path: Path,
) -> None:
    """`VRAM_ENFORCER_DRY_RUN=true`, as the webhook writes it for the action `dry-run`: the
    container over its limit gets a `VRAMWouldEnforce` Event on the pod, with the usage, the
    peak and the limit and the SIGTERM that would have been sent, and keeps running past
    the grace period a SIGKILL would have followed (issue 43, item 3)."""
    dry = Sidecar(
        pod, node, apiserver, token, tmp_path, {"trainer": 4 * GiB},
        env={"VRAM_ENFORCER_DRY_RUN": "true"},
    )  # fmt: skip
    try:
        trainer = start_worker(pod, "trainer", tmp_path)
        node.use({trainer: 5 * GiB})

        def would() -> list[Any]:
            return [e for e in events(core, pod.name) if e.reason == "VRAMWouldEnforce"]

        (event,) = wait_for(would, timeout=20, what="the VRAMWouldEnforce event")
        assert event.type == "Warning"
        assert event.involved_object.field_path == "spec.containers{trainer}"
        assert event.message.startswith(
            "container 'trainer' uses 5.00 GiB of its 4.00 GiB VRAM limit (125%), 5.00 GiB at "
            "most since it went over; dry run, so nothing was signalled: would have sent "
            "SIGTERM to pid "
        ), event.message
        assert event.message.endswith("then SIGKILL after 1s had it not exited")
        dry.wait_logged("would have sent SIGTERM")
        deadline = time.monotonic() + 2  # past the grace period (1s) of a real enforcement
        while time.monotonic() < deadline:
            assert alive(trainer)
            time.sleep(0.1)
        assert not [e for e in events(core, pod.name) if e.reason == "VRAMEnforced"]
        node.use({trainer: None})
    finally:
        assert dry.stop() == 0


def test_a_process_of_the_pod_in_no_listed_container_is_never_signalled(
    sidecar: Sidecar, pod: SimPod, node: Node, tmp_path: Path
) -> None:
    """It shares the pod's PID namespace (the agent reports it to the sidecar), but its
    container's ID is not in the pod's status: the sidecar's own check must refuse it."""
    ghost = start_worker(pod, "ghost", tmp_path)
    node.use({ghost: 50 * GiB})
    sidecar.wait_logged("the pod as a whole uses 50.00 GiB")  # the sidecar saw it, and:
    sidecar.wait_logged("not enforced: the containers of some processes cannot be proven yet")
    assert alive(ghost)
    assert "SIG" not in sidecar.text()
    node.use({ghost: None})


def test_agent_loss_is_reported_and_enforcement_resumes(
    sidecar: Sidecar, pod: SimPod, node: Node, core: client.CoreV1Api, tmp_path: Path
) -> None:
    node.stop_agent()
    wait_for(
        lambda: "VRAM usage cannot be observed" in sidecar.text(), what="the loss to be reported"
    )
    wait_for(
        lambda: any(e.reason == "VRAMUsageUnknown" for e in events(core, pod.name)),
        what="VRAMUsageUnknown",
    )
    node.start_agent()
    wait_for(lambda: "enforcement resumed" in sidecar.text(), what="the sidecar to reconnect")
    offender = start_worker(pod, "trainer", tmp_path)
    node.use({offender: 5 * GiB})
    wait_for(lambda: not alive(offender), what="enforcement after the agent came back")
    node.use({offender: None})


def test_enforcement_goes_on_while_the_api_server_is_down(
    sidecar: Sidecar, pod: SimPod, node: Node, apiserver: ApiServer, tmp_path: Path
) -> None:
    """Once the sidecar has read its pod, the API is no longer needed to enforce."""
    before = start_worker(pod, "trainer", tmp_path)
    node.use({before: 5 * GiB})
    wait_for(lambda: not alive(before), what="enforcement while the API is up")
    node.use({before: None})
    apiserver.stop()
    try:
        offender = start_worker(pod, "trainer", tmp_path)
        node.use({offender: 5 * GiB})
        wait_for(lambda: not alive(offender), what="enforcement without the API")
        node.use({offender: None})
    finally:
        apiserver.start()
    assert "Traceback" not in sidecar.text()


def test_without_the_api_from_the_start_a_pod_with_one_container_is_enforced(
    node: Node, apiserver: ApiServer, token: str, core: client.CoreV1Api, tmp_path: Path
) -> None:
    """The sidecar never reads its pod: its one container is proven by its only ID."""
    solo = SimPod(core, NAMESPACE, "solo-0", ["trainer", "vram-enforcer"])
    apiserver.stop()
    try:
        side = Sidecar(
            solo,
            node,
            apiserver,
            token,
            tmp_path,
            {"trainer": 1 * GiB},
            env={"VRAM_ENFORCER_CONTAINERS": "trainer"},
        )
        offender = start_worker(solo, "trainer", tmp_path)
        node.use({offender: 2 * GiB})
        wait_for(lambda: not alive(offender), what="the offender to be terminated without the API")
        side.wait_logged(
            "enforcing container 'trainer', the pod's only one, by its ID",
            "container 'trainer' uses 2.00 GiB of its 1.00 GiB VRAM limit",
        )
        node.use({offender: None})
        assert side.stop() == 0
    finally:
        apiserver.start()
        solo.close()


def test_without_the_api_two_containers_are_reported_then_enforced_once_it_answers(
    node: Node, apiserver: ApiServer, token: str, core: client.CoreV1Api, tmp_path: Path
) -> None:
    duo = SimPod(core, NAMESPACE, "duo-0", ["trainer", "helper", "vram-enforcer"])
    apiserver.stop()
    try:
        side = Sidecar(
            duo,
            node,
            apiserver,
            token,
            tmp_path,
            {"trainer": 1 * GiB, "helper": 1 * GiB},
            env={"VRAM_ENFORCER_CONTAINERS": "trainer,helper"},
        )
        offender = start_worker(duo, "trainer", tmp_path)
        node.use({offender: 3 * GiB})
        side.wait_logged("the pod as a whole uses 3.00 GiB")  # it saw the usage, and then:
        side.wait_logged("only the pod's total is checked, and nothing is signalled")
        assert alive(offender)
    finally:
        apiserver.start()
    try:
        wait_for(lambda: not alive(offender), timeout=60, what="enforcement once the pod is read")
        side.wait_logged("container 'trainer' uses 3.00 GiB of its 1.00 GiB VRAM limit")
        node.use({offender: None})
        assert side.stop() == 0
    finally:
        duo.close()


def test_restart_signals_the_containers_init_process_not_an_exec_shell(
    node: Node, apiserver: ApiServer, token: str, core: client.CoreV1Api, tmp_path: Path
) -> None:
    """A `kubectl exec` into the container also has parent 0 in the shared namespace; here
    it even has a lower pid than the init. The init is the oldest."""
    restarter = SimPod(core, NAMESPACE, "restarter-0", ["trainer", "vram-enforcer"])
    try:
        side = Sidecar(
            restarter, node, apiserver, token, tmp_path, {"trainer": 1 * GiB}, "--action", "restart"
        )
        placeholder = start_in(restarter, "trainer", ["sleep", "600"])  # keeps a low pid free
        report = tmp_path / "restart.json"
        before = set(restarter.host_pids("trainer"))
        restarter.start(
            "trainer", [sys.executable, str(WORKER), "--report", str(report), "--spawn", "child"]
        )
        wait_for(lambda: report.with_name(report.name + ".child").exists(), what="the child")
        pids = set(restarter.host_pids("trainer")) - before
        init = next(p for p in pids if HOST.stat(p).ppid not in pids)  # type: ignore[union-attr]
        (gpu_user,) = pids - {init}
        low = pod_pid(placeholder)
        os.kill(placeholder, signal.SIGKILL)
        wait_for(lambda: placeholder not in restarter.host_pids("trainer"), what="the pid freed")
        shell = exec_into(restarter, "trainer", low)
        assert pod_pid(shell) < pod_pid(init)
        node.use({gpu_user: 2 * GiB})
        wait_for(lambda: not alive(init), what="the init process to be terminated")
        side.wait_logged("restarting it: sent SIGTERM to its init process")
        assert alive(shell)
        node.use({gpu_user: None})
        assert side.stop() == 0
    finally:
        restarter.close()


def pod_pid(host_pid: int) -> int:
    nspid = HOST.nspid(host_pid)
    assert nspid is not None
    return nspid[-1]


def start_in(pod: SimPod, container: str, argv: list[str]) -> int:
    """Run `argv` in the container; returns its host pid."""
    known = set(pod.host_pids(container))
    pod.start(container, argv)
    (pid,) = wait_for(lambda: set(pod.host_pids(container)) - known, what=f"{argv[0]} to start")
    return pid  # type: ignore[no-any-return]


def exec_into(pod: SimPod, container: str, pid: int) -> int:
    """Like `kubectl exec`: a process of the container with parent 0, given `pid` (a free pid
    in the pod's namespace) through the namespace's ns_last_pid."""
    for _ in range(20):
        subprocess.run(
            [
                "nsenter",
                "-t",
                str(pod.pause),
                "-p",
                "-m",
                "--",
                "sh",
                "-c",
                f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid",
            ],
            check=True,
        )
        shell = start_in(pod, container, ["sleep", "600"])
        if pod_pid(shell) == pid:
            return shell
        os.kill(shell, signal.SIGKILL)  # a thread of the pod took it first: again
    raise AssertionError(f"pid {pid} could not be had")


def test_direct_nvml_through_the_host_proc(
    node: Node, apiserver: ApiServer, token: str, admin: client.ApiClient, tmp_path: Path
) -> None:
    """--source nvml: no agent; NVML's host pids translated through a read-only host /proc."""
    host_proc = tmp_path / "host-proc"
    direct = SimPod(
        client.CoreV1Api(admin),
        NAMESPACE,
        "direct-0",
        ["trainer", "vram-enforcer"],
        host_proc=host_proc,
    )
    try:
        side = Sidecar(
            direct,
            node,
            apiserver,
            token,
            tmp_path,
            {"trainer": 1 * GiB},
            "--source",
            "nvml",
            "--host-proc",
            str(host_proc),
            env=node.nvml_env(),
        )
        offender = start_worker(direct, "trainer", tmp_path)
        node.use({offender: 2 * GiB})
        wait_for(lambda: not alive(offender), what="the offender to be terminated")
        side.wait_logged("container 'trainer' uses 2.00 GiB of its 1.00 GiB VRAM limit")
        node.use({offender: None})
        assert side.stop() == 0
    finally:
        direct.close()


def test_container_mode_exits_once_the_other_containers_are_done(
    node: Node, apiserver: ApiServer, token: str, admin: client.ApiClient, tmp_path: Path
) -> None:
    """The legacy sidecar (a regular container) must exit by itself, or the Job never completes."""
    job = SimPod(client.CoreV1Api(admin), NAMESPACE, "job-0", ["trainer", "vram-enforcer"])
    try:
        side = Sidecar(
            job,
            node,
            apiserver,
            token,
            tmp_path,
            {"trainer": 1 * GiB},
            env={"VRAM_ENFORCER_SIDECAR_MODE": "container"},
        )
        offender = start_worker(job, "trainer", tmp_path)  # the pod was read, and enforced
        node.use({offender: 2 * GiB})
        wait_for(lambda: not alive(offender), what="the offender to be terminated")
        node.use({offender: None})
        assert side.proc.poll() is None  # the trainer container is still running
        job.report_status({"trainer": {"terminated": {"exitCode": 0, "reason": "Completed"}}})
        assert side.proc.wait(timeout=15) == 0
        assert "every other container has finished" in side.text()
    finally:
        job.close()


def listening(pid: int) -> list[str]:
    """The TCP sockets of process `pid` that listen, and its UDP sockets that take
    datagrams from anyone (bound, unconnected), as "tcp6 [::]:9477": those of its network
    namespace's tables (/proc/<pid>/net) whose inodes are among its open files."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if (target := os.readlink(fd)).startswith("socket:["):
                mine.add(target.removeprefix("socket:[").removesuffix("]"))
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for local, remote, state, inode in ((r[1], r[2], r[3], r[9]) for r in map(str.split, rows)):
            unconnected = set(remote.split(":")[0]) == {"0"} and remote.endswith(":0000")
            if inode in mine and (state == "0A" if table.startswith("tcp") else unconnected):
                found.append(f"{table} {local}")
    return found


def test_the_sidecar_listens_on_no_port(
    sidecar: Sidecar, pod: SimPod, node: Node, tmp_path: Path
) -> None:
    """It serves no metrics (its agent serves the pod's): not a TCP or UDP port of the pod's
    network namespace is taken, so none can clash with one of the workload's, nor be
    scraped, while it enforces."""
    with socket.socket() as tcp, socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("::1", 0))
        ours = listening(os.getpid())  # what a listener looks like, seen
        for kind, bound in (("tcp", tcp), ("udp6", udp)):
            assert any(
                f.startswith(f"{kind} ") and f.endswith(f":{bound.getsockname()[1]:04X}")
                for f in ours
            ), ours
    offender = start_worker(pod, "trainer", tmp_path)
    node.use({offender: 5 * GiB})
    wait_for(lambda: not alive(offender), what="the offender to be terminated")
    node.use({offender: None})
    sidecar.wait_logged("sent SIGTERM to pid")
    assert listening(sidecar.pid()) == []


def test_bad_environment_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "enforcer", "sidecar"],
        env={
            **os.environ,
            "POD_NAME": "p",
            "POD_NAMESPACE": "n",
            "POD_UID": "u",
            "VRAM_ENFORCER_LIMITS": "trainer=4Gi",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "VRAM_ENFORCER_LIMITS: 'trainer=4Gi' is not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr
