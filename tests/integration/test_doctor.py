"""`vram-enforcer doctor` as a user runs it: against the fake NVML and a real agent."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from enforcer.core.settings.common import DEFAULT_SOCKET
from enforcer.edge import cgroupfs
from enforcer.modes.doctor import Check, render
from tests.helpers import standalone_agent, wait_for
from tests.kubelet import Kubelet


def doctor(
    env: dict[str, str], *flags: str, cgroup: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return with_api(env, "--no-api", *flags, cgroup=cgroup)


def with_api(
    env: dict[str, str], *flags: str, cgroup: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """doctor as run, the API checks included unless `flags` say --no-api; in `cgroup`
    (a cgroup v2 directory) from its first instruction where one is given."""
    command = [sys.executable, "-m", "enforcer", "doctor", *flags]
    if cgroup is not None:
        command = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *command]
    return subprocess.run(
        command,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def agent(fake_nvml: Any, tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(
        standalone_agent(sock),
        env={**os.environ, **fake_nvml.env()},
        stderr=subprocess.DEVNULL,
    )
    wait_for(sock.exists, what="the agent socket")
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def test_everything_reachable_passes(fake_nvml: Any, agent: Path) -> None:
    out = doctor(fake_nvml.env(), "--agent-socket", str(agent))
    assert out.returncode == 0, out.stdout
    assert (
        "[ok  ] NVML: driver 550.54.15, 1 device(s) [0: NVIDIA H100 80GB HBM3 (80.00 GiB, "
        "512.00 MiB of it reserved by the driver)]" in out.stdout
    )
    assert (
        "[ok  ] agent socket: 1 GPU(s); 0 GPU process(es) visible to this PID namespace"
        in out.stdout
    )
    assert "[ok  ] PID namespace: the host's" in out.stdout
    assert "[skip] Kubernetes API: not asked for" in out.stdout
    assert out.stdout.rstrip().endswith("all checks passed")
    # A driver before R615: sampling alone, which is said, and is no failure.
    assert (
        "[note] enforcement tier: tier sampling on GPU-00000000-fake-4000-8000-000000000000: "
        "driver 550.54.15 has no per-cgroup limits: R615+\n"
        "       fix: allocations past a limit succeed and the offender is stopped within one "
        "interval; for the driver to refuse them: install an NVIDIA driver of R615 or later"
        in out.stdout
    )


def test_the_tier_on_an_r615_driver_is_hard_limits(fake_nvml: Any, cgroup2: Path) -> None:
    """Asked with NVML's Get call on doctor's own cgroup, which the fake answers as an R615
    driver would; nothing is set. Not the root cgroup, which has no dmem files (as in a
    pod)."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.add_device()
    fake_nvml.state.enable_mig(1, [{"uuid": "MIG-x", "total_bytes": 40 * 1024**3}])
    fake_nvml.write()
    out = doctor(fake_nvml.env(), "--json", "--no-agent", cgroup=cgroup2)
    (tier,) = [c for c in json.loads(out.stdout) if c["name"] == "enforcement tier"]
    assert tier["status"] == "ok", tier
    hierarchy = cgroupfs.v2_root()
    assert tier["detail"].startswith(
        "tier driver-limit on GPU-00000000-fake-4000-8000-000000000000, sampling as the "
        f"backstop: driver 615.43.02, cgroup v2 at {hierarchy} ("
    )
    assert (
        "; GPU-00000001-fake-4000-8000-000000000001 in MIG mode: NVML takes no MIG handle; "
        "whether the driver charges an ordinary process" in tier["detail"]
    )
    assert fake_nvml.limit_records() == []


def test_a_cgroup_without_dmem_files_is_not_a_driver_too_old(fake_nvml: Any, cgroup2: Path) -> None:
    """NVIDIA: Not Supported from Get on an R615 driver means the cgroup has no dmem files.
    doctor names the cgroup and does not ask for a newer driver. Run in a cgroup of its
    own: the root cgroup is judged by what it hands down, not asked."""
    fake_nvml.state.support_memory_limits()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryLimits_v1", "NOT_SUPPORTED")
    fake_nvml.write()
    out = doctor(fake_nvml.env(), "--json", "--no-agent", cgroup=cgroup2)
    (tier,) = [c for c in json.loads(out.stdout) if c["name"] == "enforcement tier"]
    own = cgroup2
    assert tier["status"] == "note", tier
    assert tier["detail"].startswith(
        f"tier sampling on GPU-00000000-fake-4000-8000-000000000000: cgroup {own} has no dmem "
        "files (Not Supported)"
    )
    assert "R615" not in tier["detail"] and "install an NVIDIA driver" not in tier["fix"]


def test_a_lost_gpu_fails_the_nvml_check_and_names_it(fake_nvml: Any) -> None:
    fake_nvml.state.add_device()
    fake_nvml.state.inject_error("nvmlDeviceGetMemoryInfo_v2", "GPU_IS_LOST", device_index=1)
    fake_nvml.write()
    out = doctor(fake_nvml.env(), "--json", "--no-agent")
    assert out.returncode == 1
    (nvml,) = [c for c in json.loads(out.stdout) if c["name"] == "NVML"]
    assert nvml["status"] == "fail"
    assert "2 device(s)" in nvml["detail"]
    assert "GPU GPU-00000001-fake-4000-8000-000000000001 (index 1) cannot be read" in nvml["detail"]
    assert nvml["fix"] == "the other GPUs are enforced; drain the node and reset the GPU"


def test_missing_pieces_fail_with_a_fix_and_exit_1(tmp_path: Path) -> None:
    out = doctor(
        {
            "LD_LIBRARY_PATH": str(tmp_path),
            "VRAM_ENFORCER_AGENT_SOCKET": str(tmp_path / "none.sock"),
        },
        "--json",
    )
    assert out.returncode == 1
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["agent socket"]["status"] == "fail"
    assert checks["agent socket"]["detail"] == f"{tmp_path / 'none.sock'} does not exist"
    assert "is the node agent (DaemonSet) running on this node" in checks["agent socket"]["fix"]
    assert "Traceback" not in out.stderr


def test_a_path_that_is_not_a_socket_is_said_to_be_what_it_is(tmp_path: Path) -> None:
    """A regular file or a directory is a wrong path, not an agent restarting."""
    (tmp_path / "file").write_text("")
    for name, what in (("file", "a regular file"), (".", "a directory")):
        path = tmp_path / name
        out = doctor({}, "--no-nvml", "--agent-socket", str(path))
        assert out.returncode == 1
        assert f"[FAIL] agent socket: {path} is {what}, not a socket\n" in out.stdout
        assert (
            "fix: give the node agent's socket (its --socket; /run/vram-enforcer/agent.sock by "
            "default) with --agent-socket or $VRAM_ENFORCER_AGENT_SOCKET" in out.stdout
        )


def test_a_socket_nobody_listens_on_says_the_agent_is_not_running(tmp_path: Path) -> None:
    path = tmp_path / "a.sock"
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(path))  # and never listens: as an agent that died leaves its socket
    out = doctor({}, "--no-nvml", "--agent-socket", str(path))
    assert out.returncode == 1
    assert (
        f"[FAIL] agent socket: nothing listens on {path} (connection refused): the node agent "
        "is not running, or is restarting" in out.stdout
    )
    assert "get pods -l app.kubernetes.io/component=agent" in out.stdout


def on_a_workstation(tmp_path: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """The environment and flags of doctor run as `vram-enforcer doctor` on a workstation:
    not in a pod, no kubelet, no kubeconfig (a HOME without ~/.kube)."""
    env = {"KUBERNETES_SERVICE_HOST": "", "KUBECONFIG": "", "HOME": str(tmp_path)}
    return env, ("--pod-resources-socket", str(tmp_path / "none.sock"))


def test_on_a_workstation_what_does_not_apply_is_skipped_with_why(
    fake_nvml: Any, tmp_path: Path
) -> None:
    """Plain `vram-enforcer doctor`, the API checks included: no agent, kubelet or API
    server is there to ask and exec needs none, so each is a skip that says why, and
    doctor passes where NVML works."""
    if os.path.exists(DEFAULT_SOCKET):
        pytest.skip(f"an agent's socket is at {DEFAULT_SOCKET} here")
    env, flags = on_a_workstation(tmp_path)
    out = with_api({**fake_nvml.env(), **env}, *flags)
    assert out.returncode == 0, out.stdout
    assert "[ok  ] NVML: driver 550.54.15" in out.stdout  # what applies was checked
    skipped = [line for line in out.stdout.splitlines() if line.startswith("[skip]")]
    assert skipped == [
        f"[skip] agent socket: does not apply: {DEFAULT_SOCKET} does not exist, and this is "
        "taken for a workstation (not in a pod, no kubelet), where exec needs no agent (it "
        "reads NVML itself). On a GPU node of a cluster the agent must be there: kubectl -n "
        "<ns> get pods -l app.kubernetes.io/component=agent -o wide",
        "[skip] Kubernetes API: does not apply: not in a pod, and no kubeconfig "
        "(--kubeconfig, $KUBECONFIG, ~/.kube/config), so there is no API server to ask; "
        "exec needs none. To check a cluster's RBAC from here, give --kubeconfig",
        f"[skip] kubelet pod resources: does not apply: no socket at {tmp_path / 'none.sock'}, "
        "and this is taken for a workstation (not in a pod, no kubelet), where exec needs no "
        "kubelet",
    ]
    assert out.stdout.rstrip().endswith("all checks passed")


def test_on_a_workstation_without_the_driver_nvml_alone_fails_with_a_fix(tmp_path: Path) -> None:
    """No libnvidia-ml.so.1: the one failure that applies, and its fix says what to install,
    how to check the driver, and what to run without an NVIDIA GPU."""
    env, flags = on_a_workstation(tmp_path)
    empty = tmp_path / "lib"
    empty.mkdir()
    out = with_api({**env, "LD_LIBRARY_PATH": str(empty)}, "--json", *flags)
    assert out.returncode == 1, out.stdout
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert [n for n, c in checks.items() if c["status"] == "fail"] == ["NVML"], checks
    fix = checks["NVML"]["fix"]
    assert fix.startswith("install the NVIDIA driver, whose user-space part ships")
    assert "check that `nvidia-smi` lists the GPUs" in fix
    assert "`vram-enforcer demo`" in fix and "`doctor --no-nvml` skips this check" in fix
    assert checks["enforcement tier"]["status"] == "skip"
    assert "Traceback" not in out.stderr


def test_on_a_workstation_with_a_kubeconfig_the_api_is_asked(tmp_path: Path) -> None:
    """A kubeconfig is there to reach a cluster from outside it: its API check applies."""
    env, flags = on_a_workstation(tmp_path)
    missing = tmp_path / "kubeconfig"  # named, and not there: the check runs and fails
    out = with_api({**env, "KUBECONFIG": str(missing)}, "--no-nvml", "--json", *flags)
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["Kubernetes API"]["status"] == "fail", checks
    assert out.returncode == 1


@pytest.mark.parametrize("where", ["pod", "node", "named"])
def test_where_an_agent_belongs_its_missing_socket_fails(where: str, tmp_path: Path) -> None:
    """Even with --no-api: in a pod, beside a kubelet, or with a socket named."""
    if os.path.exists(DEFAULT_SOCKET):
        pytest.skip(f"an agent's socket is at {DEFAULT_SOCKET} here")
    kubelet = tmp_path / "kubelet.sock"
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1" if where == "pod" else ""}
    flags = ["--pod-resources-socket", str(kubelet), "--json", "--no-nvml"]
    if where == "node":
        kubelet.write_text("")
    if where == "named":
        flags += ["--agent-socket", str(tmp_path / "agent.sock")]
    out = doctor(env, *flags)
    assert out.returncode == 1
    (check,) = [c for c in json.loads(out.stdout) if c["name"] == "agent socket"]
    assert check["status"] == "fail" and check["detail"].endswith("does not exist"), check


@contextlib.contextmanager
def sidecar_socket(path: Path, listening: bool = True, agent: str = "connected") -> Iterator[None]:
    """A sidecar's --listen socket, as the kernel shows it: listened on or only left bound
    (a sidecar that died), with the node agent's connection accepted, waiting to be
    accepted (`pending`: a sidecar that is stopped), or `none`."""
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(socket.socket(socket.AF_UNIX))
        sidecar.bind(str(path))
        if listening:
            sidecar.listen(4)
        if agent != "none":
            caller = stack.enter_context(socket.socket(socket.AF_UNIX))
            caller.connect(str(path))
            if agent == "connected":
                stack.enter_context(sidecar.accept()[0])
        yield


def in_a_sidecar(tmp_path: Path) -> dict[str, str]:
    """The environment the webhook gives a sidecar of 0.2.0 (with its socket under
    tmp_path), in a pod whose ServiceAccount token is not mounted."""
    return {
        "VRAM_ENFORCER_LISTEN": str(tmp_path / "sidecar.sock"),
        "VRAM_ENFORCER_AGENT_SOCKET": str(tmp_path / "none.sock"),
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBECONFIG": str(tmp_path / "no-kubeconfig"),
    }


def test_in_a_sidecar_of_0_2_0_the_api_is_not_asked_and_the_agents_connection_is(
    tmp_path: Path,
) -> None:
    """`kubectl exec POD -c vram-enforcer -- vram-enforcer doctor --no-nvml` in a sidecar of
    this release, the API checks not turned off: the sidecar holds no token and needs no
    RBAC, which is no fault; what it needs is the node agent connected to its socket."""
    path = tmp_path / "sidecar.sock"
    no_kubelet = ("--pod-resources-socket", str(tmp_path / "kubelet.sock"))
    with sidecar_socket(path):
        out = with_api(in_a_sidecar(tmp_path), "--no-nvml", *no_kubelet)
    assert out.returncode == 0, out.stdout
    assert (
        f"[ok  ] sidecar socket: the sidecar listens on {path}, and the node agent is connected "
        "to it: it brings the usage and this pod, and posts the sidecar's Events\n" in out.stdout
    )
    assert (
        "[skip] Kubernetes API: not needed here: a sidecar of --api-access agent (the default) "
        "makes no API request: the node agent reads its pod and posts its Events, so this "
        "sidecar holds no API token; run doctor in the agent's pod for the API and the agent's "
        "RBAC\n" in out.stdout
    )
    assert "RBAC" not in out.stdout.replace("the agent's RBAC", "")
    assert "agent socket" not in out.stdout
    assert out.stdout.rstrip().endswith("all checks passed")


@pytest.mark.parametrize(
    ("state", "detail", "fix"),
    [
        (
            "missing",
            "{path} does not exist: the sidecar is not listening (it has not started, or "
            "could not)",
            "its log says why: kubectl logs <pod> -c vram-enforcer",
        ),
        (
            "left",
            "nothing listens on {path}: the sidecar is not running, or is restarting",
            "its log says why: kubectl logs <pod> -c vram-enforcer (--previous after a restart)",
        ),
        (
            "alone",
            "the sidecar listens on {path}, but the node agent is not connected to it: "
            "the sidecar has no usage to enforce on",
            "is a node agent of 0.2.0 running on this "
            "node (kubectl -n <ns> get pods -l app.kubernetes.io/component=agent -o wide), and may "
            "it read the sidecar's root with ptrace (AppArmor)? Its log says why it cannot connect",
        ),
        (
            "stopped",
            "the sidecar listens on {path}, but the node agent is not connected to it: "
            "the sidecar has no usage to enforce on",
            "is a node agent of 0.2.0",
        ),
        (
            "file",
            "{path} is a regular file, not a socket",
            "VRAM_ENFORCER_LISTEN must be the "
            "sidecar's --listen (the webhook sets /run/vram-enforcer/sidecar.sock)",
        ),
    ],
)
def test_in_a_sidecar_whose_agent_is_not_connected_the_socket_check_fails(
    state: str, detail: str, fix: str, tmp_path: Path
) -> None:
    """No socket, a socket that nobody listens on, a sidecar that the agent has not
    connected to, or one that does not accept the agent's connection (stopped): each is a
    failure, with a fix, and the agent's own socket (which the sidecar does not use) is
    not asked for."""
    path = tmp_path / "sidecar.sock"
    with contextlib.ExitStack() as stack:
        if state == "file":
            path.write_text("")
        elif state != "missing":
            agent = "pending" if state == "stopped" else "none"
            stack.enter_context(sidecar_socket(path, listening=state != "left", agent=agent))
        out = doctor(in_a_sidecar(tmp_path), "--no-nvml", "--json")
    assert out.returncode == 1, out.stdout
    (check,) = [c for c in json.loads(out.stdout) if c["name"] == "sidecar socket"]
    assert check["status"] == "fail" and check["detail"] == detail.format(path=path), check
    assert check["fix"].startswith(fix), check
    assert not [c for c in json.loads(out.stdout) if c["name"] == "agent socket"]


def test_in_a_sidecar_an_unreadable_socket_table_is_a_note(tmp_path: Path) -> None:
    from enforcer.modes.doctor import check_sidecar_socket

    path = tmp_path / "sidecar.sock"
    with sidecar_socket(path):
        check = check_sidecar_socket(str(path), table=str(tmp_path / "no-table"))
    assert check.status == "note" and check.detail.startswith(
        f"{path} is a socket; whether the node agent is connected to it cannot be read ("
    ), check
    assert "vram_enforcer_source_up" in check.fix


class FakeApiServer(http.server.BaseHTTPRequestHandler):
    """The API server as doctor asks it: its version, the ResourceSlices (none), and each
    SelfSubjectAccessReview, answered from `allowed` and recorded in `asked`."""

    allowed: ClassVar[set[tuple[str, str, str, str]]] = set()
    asked: ClassVar[list[tuple[str, str, str, str]]] = []

    def do_GET(self) -> None:
        if self.path.startswith("/version"):
            self._reply({"major": "1", "minor": "37", "gitVersion": "v1.37.0"})
        else:
            self._reply({"kind": "ResourceSliceList", "items": []})

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        a = review["spec"]["resourceAttributes"]
        asked = (a["verb"], a["resource"], a.get("subresource") or "", a.get("namespace") or "")
        self.asked.append(asked)
        self._reply({**review, "status": {"allowed": asked in self.allowed}})

    def _reply(self, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


AGENT_NEEDS = [
    ("get", "nodes", "", ""),
    ("patch", "nodes", "", ""),
    ("patch", "nodes", "status", ""),
    ("list", "pods", "", ""),
    ("watch", "pods", "", ""),
    ("delete", "pods", "", ""),
    ("patch", "pods", "status", ""),
    ("create", "pods", "eviction", ""),
    ("list", "namespaces", "", ""),
    ("watch", "namespaces", "", ""),
    ("create", "events", "", ""),
    ("patch", "events", "", ""),
    ("list", "events", "", ""),
]


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig of the fake API server, which allows what the agent needs."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    FakeApiServer.allowed, FakeApiServer.asked = set(AGENT_NEEDS), []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    yield kubeconfig
    server.shutdown()
    server.server_close()


def test_for_a_sidecar_of_0_2_0_no_rbac_is_checked_and_the_agents_is(api_server: Path) -> None:
    """Run for a namespace's sidecars (here by whoever may do all the agent needs): those
    that 0.2.0 injects need no RBAC, so no Role is asked for in it, and the agent's
    RBAC covers what it does for them (reading the node's pods, posting their Events)."""
    out = with_api(
        {},
        "--no-nvml",
        "--no-agent",
        "--json",
        "--kubeconfig",
        str(api_server),
        "--namespace",
        "ml",
    )
    assert out.returncode == 0, out.stdout
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["Kubernetes API"]["detail"] == "reachable, v1.37.0"
    assert checks["RBAC for the sidecar"] == {
        "name": "RBAC for the sidecar",
        "status": "skip",
        "fix": "",
        "detail": "none needed: a sidecar of --api-access agent (the default) makes no API "
        "request: the node agent reads its pod and posts its Events (the agent's RBAC is "
        "checked below); --api-access direct checks the Role that sidecars of 0.1.0 need",
    }
    assert checks["RBAC for the agent"]["status"] == "ok"
    assert FakeApiServer.asked == AGENT_NEEDS  # nothing in namespace ml


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_for_a_sidecar_of_api_access_direct_the_role_is_checked(how: str, api_server: Path) -> None:
    """`--api-access direct` (or VRAM_ENFORCER_API_ACCESS, as in such a sidecar): the Role
    of deploy/rbac/sidecar.yaml, which sidecars of 0.1.0 need too, in the namespace."""
    flags = ["--api-access", "direct"] if how == "flag" else []
    env = {"VRAM_ENFORCER_API_ACCESS": "direct"} if how == "environment" else {}
    out = with_api(
        env,
        "--no-nvml",
        "--no-agent",
        "--json",
        "--kubeconfig",
        str(api_server),
        "--namespace",
        "ml",
        *flags,
    )
    assert out.returncode == 1, out.stdout
    sidecar = {c["name"]: c for c in json.loads(out.stdout)}["RBAC for the sidecar"]
    assert sidecar["status"] == "fail"
    assert sidecar["detail"] == (
        "this identity may not get pods, create events, patch events in namespace ml"
    )
    assert sidecar["fix"] == (
        "add the namespace to the chart's sidecar.namespaces (or apply deploy/rbac/sidecar.yaml "
        "there), or run the sidecar with --api-access agent, which needs none"
    )
    assert FakeApiServer.asked[:3] == [
        ("get", "pods", "", "ml"),
        ("create", "events", "", "ml"),
        ("patch", "events", "", "ml"),
    ]


def test_an_api_access_that_is_not_a_choice_is_refused_with_the_choices() -> None:
    out = doctor({"VRAM_ENFORCER_API_ACCESS": "etcd"}, "--no-nvml", "--no-agent")
    assert out.returncode == 2
    assert "VRAM_ENFORCER_API_ACCESS: 'etcd' is not a choice; use one of: agent, direct" in (
        out.stderr
    )


def test_the_kubelets_pod_resources_answer_or_say_why_not(tmp_path: Path) -> None:
    """Which GPU a device plugin gave each container: the kubelet answers (the stand-in of
    its gRPC socket), is absent (no socket: a note, not a fault, e.g. in a pod), or a file
    there is not the kubelet (a fault, with a fix)."""
    socket = tmp_path / "kubelet.sock"
    kubelet = Kubelet(socket)
    try:
        out = doctor({}, "--no-nvml", "--no-agent", "--pod-resources-socket", str(socket), "--json")
    finally:
        kubelet.stop()
    (check,) = [c for c in json.loads(out.stdout) if c["name"] == "kubelet pod resources"]
    assert check["status"] == "ok", check
    assert check["detail"].startswith("answers: of this node's containers, 1 with nvidia.com/gpu;")
    in_a_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # on a workstation: a skip (above)
    missing = doctor(
        in_a_pod, "--no-nvml", "--no-agent", "--pod-resources-socket", str(tmp_path / "none.sock")
    )
    assert missing.returncode == 0, missing.stdout
    assert f"[note] kubelet pod resources: no socket at {tmp_path / 'none.sock'}" in missing.stdout
    not_it = tmp_path / "file"
    not_it.write_text("")
    broken = doctor({}, "--no-nvml", "--pod-resources-socket", str(not_it), "--json")
    (check,) = [c for c in json.loads(broken.stdout) if c["name"] == "kubelet pod resources"]
    assert check["status"] == "fail" and "is the kubelet running" in check["fix"]
    assert "Traceback" not in broken.stderr


def test_render() -> None:
    text = render(
        [
            Check("A", "ok", "fine"),
            Check("B", "fail", "broken", "do this"),
            Check("C", "skip", "not asked"),
        ]
    )
    assert text.splitlines() == [
        "[ok  ] A: fine",
        "[FAIL] B: broken",
        "       fix: do this",
        "[skip] C: not asked",
        "1 check(s) failed",
    ]
