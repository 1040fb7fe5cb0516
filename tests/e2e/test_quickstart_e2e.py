"""The README's Kubernetes quick start, run as written on a fresh cluster.

Every command of the README's block under "On Kubernetes" runs through bash, in the
repository, with the real `helm` (tests/e2e/build-helm.sh) and `kubectl` against a cluster
of its own (kube-apiserver, controller-manager, the default kube-scheduler, one real node:
kubelet, containerd, runc, kube-proxy). But one: `docker build && docker push`. There is
no Docker engine or registry here; the image those two commands make is the one
tests/e2e/build-image.sh built from the same Dockerfile with buildah, imported into the
node's containerd under the name the README's `IMAGE` gives.

What stands in, at the outermost boundary only:
- the GPU node: the label GPU feature discovery sets, NVIDIA's container runtime handing
  the agent's container the fake NVML (tests/e2e/agent_pod.py), and NVIDIA's device
  plugin (tests/e2e/deviceplugin.py). The agent itself is the chart's DaemonSet pod, from
  the image, as the README installs it;
- PyTorch: the example's image `pytorch/pytorch:...` is the project's image with a
  stand-in `torch` that counts what the example allocates and writes it where the test,
  playing the driver, reads it and reports it through the fake NVML for that process.

The example's script, its Job, its annotations and the commands that watch it are the
README's and examples/'s own; the test checks what the README promises: the Job fails,
`kubectl describe pod` shows the VRAMEnforced Event, and the README's last line, its check,
passes. The Job fails whether or not it was stopped, so the check must fail where nothing
was: `test_the_check_fails_when_nothing_was_enforced` runs it against such a namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kubernetes import client

from tests.e2e.agent_pod import AgentPod, label_gpu_node
from tests.e2e.cluster import ApiServer
from tests.e2e.deviceplugin import DevicePlugin
from tests.e2e.images import ENFORCER_IMAGE, enforcer_image, image_missing
from tests.e2e.node import BIN, RealNode, missing
from tests.e2e.nvidia_runtime import nvidia_runtime
from tests.fakenvml import FakeGpuState

ROOT = Path(__file__).resolve().parents[2]
SOCKET = Path("/run/vram-enforcer/agent.sock")
TORCH_IMAGE = "docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
# Where the stand-in torch writes the bytes it "holds on the GPU", in its container.
HELD = "/tmp/vram-standin-bytes"
STANDIN_TORCH = f'''"""A stand-in for PyTorch (tests/e2e/test_quickstart_e2e.py): it counts what is
"allocated on the GPU" and writes the count to {HELD}, where the test, which plays the
GPU's driver, reads it and reports it through NVML for this process."""

import os

uint8 = "uint8"
_held = 0


def empty(size, dtype=None, device=None):
    global _held
    _held += int(size)
    with open("{HELD}.tmp", "w") as f:
        f.write(str(_held))
    os.replace("{HELD}.tmp", "{HELD}")
    return bytearray()


class cuda:
    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def memory_reserved():
        return _held
'''


def quick_start() -> list[str]:
    """The commands of the README's block under "## On Kubernetes", a line each
    (continuations joined)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## On Kubernetes\n\n```sh\n(.*?)^```", readme, re.S | re.M)
    assert block, "the README has no sh block under '## On Kubernetes'"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


def the_image_name(commands: list[str]) -> str:
    (assignment,) = [c for c in commands if c.startswith("IMAGE=")]
    out = subprocess.run(
        ["bash", "-c", f'{assignment}\nprintf %s "$IMAGE"'],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def standin_torch_image(base: Path, work: Path) -> Path:
    """`TORCH_IMAGE`: the project's image, root, with the stand-in torch on PYTHONPATH."""
    (work / "torch").mkdir(parents=True)
    (work / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    bah = ["buildah", "--storage-driver", "vfs"]
    name = "localhost/vram-enforcer-e2e:pytorch-standin"
    container = subprocess.run(
        [*bah, "from", "--quiet", f"docker-archive:{base}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        subprocess.run(
            [*bah, "copy", container, str(work / "torch"), "/opt/standin/torch"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                *bah,
                "config",
                "--user",
                "0:0",
                "--env",
                "PYTHONPATH=/opt/standin",
                "--entrypoint",
                "[]",
                "--cmd",
                "python",
                container,
            ],
            check=True,
        )
        subprocess.run(
            [*bah, "commit", "--quiet", container, name], check=True, capture_output=True
        )
    finally:
        subprocess.run([*bah, "rm", container], capture_output=True)
    archive = work / "pytorch.tar"
    subprocess.run(
        [*bah, "push", "--quiet", name, f"docker-archive:{archive}:{TORCH_IMAGE}"], check=True
    )
    subprocess.run([*bah, "rmi", name], capture_output=True)
    return archive


@dataclass
class Fresh:
    server: ApiServer
    node: RealNode
    env: dict[str, str]
    gpus: FakeGpuState
    state_file: Path


@pytest.fixture(scope="module")
def fresh(
    apiserver: ApiServer, fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fresh]:
    """A cluster of its own, with nothing of the project in it: the image only, in the
    node's containerd under the README's name. `apiserver` (the shared one) only for its
    skip-or-fail check."""
    helm = subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "build-helm.sh")], capture_output=True, text=True
    )
    reason = (
        missing()
        or image_missing()
        or (None if helm.returncode == 0 else f"no helm: {helm.stderr[-500:]}")
    )
    if reason:
        if os.environ.get("VRAM_ENFORCER_E2E") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    image = the_image_name(quick_start())
    assert not SOCKET.exists(), f"{SOCKET} is in use: is another vram-enforcer agent running?"
    made_socket_dir = not SOCKET.parent.exists()
    tmp = tmp_path_factory.mktemp("quickstart")
    server = ApiServer(for_pods=True)
    node = None
    try:
        server.start()
        server.start_controller_manager()
        server.start_scheduler(
            {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration"}
        )
        built = enforcer_image()
        torch = standin_torch_image(built, tmp / "standin")
        (tmp / "gpu").mkdir()
        state_file, gpus = tmp / "gpu" / "gpu.json", FakeGpuState.single_gpu()
        gpus.write(state_file)
        node = RealNode(
            server,
            tmp_path_factory.mktemp("node"),
            images=[built, torch],
            kube_proxy=True,
            runtime=nvidia_runtime(tmp, fake_nvml_lib, state_file),
        )
        label_gpu_node(node)
        node.ctr("images", "tag", ENFORCER_IMAGE, image)
        tools = tmp / "bin"
        tools.mkdir()
        for tool in (BIN / "kubectl", Path(helm.stdout.strip())):
            (tools / tool.name).symlink_to(tool)
        env = {
            **os.environ,
            "PATH": f"{tools}:{os.environ['PATH']}",
            "KUBECONFIG": str(server.write_kubeconfig(tmp / "admin.kubeconfig")),
            "HELM_CACHE_HOME": str(tmp / "helm"),
            "HELM_CONFIG_HOME": str(tmp / "helm"),
            "HELM_DATA_HOME": str(tmp / "helm"),
        }
        yield Fresh(server, node, env, gpus, state_file)
    finally:
        if node is not None:
            node.close()
        server.close()
        if made_socket_dir:  # the chart's hostPath; after the node, whose agent may recreate it
            shutil.rmtree(SOCKET.parent, ignore_errors=True)


def bash(
    command: str, env: dict[str, str], timeout: float = 360
) -> subprocess.CompletedProcess[str]:
    """One command of the README, as bash runs it in the repository, after the README's
    own `IMAGE=` line."""
    (assignment,) = [c for c in quick_start() if c.startswith("IMAGE=")]
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{assignment}\n{command}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run(fresh: Fresh, command: str) -> str:
    """`bash`, which must succeed; its output."""
    done = bash(command, fresh.env)
    assert done.returncode == 0, (
        f"{command}\nexited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


class Driver:
    """Plays the GPU's driver for the example: every process of this node that runs the
    example's script reports, through the fake NVML, what its stand-in torch holds."""

    def __init__(self, state: FakeGpuState, state_file: Path) -> None:
        self.state, self.state_file = state, state_file
        self.seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit():
                    self._report(int(proc.name))
            for pid in [p for p in self.seen if not Path(f"/proc/{p}").exists()]:
                self.state.remove_process(pid)
                self.state.write(self.state_file)

    def _report(self, pid: int) -> None:
        try:
            if b"/scripts/overrun.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return
            held = int(Path(f"/proc/{pid}/root{HELD}").read_text())
        except (OSError, ValueError):
            return
        if self.seen.get(pid) != held:
            self.seen[pid] = held
            self.state.set_process(0, pid, held)
            self.state.write(self.state_file)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_the_readme_quick_start_runs_as_written(fresh: Fresh) -> None:
    commands = quick_start()
    steps = [c.split()[0] if not c.startswith("IMAGE=") else "IMAGE=" for c in commands]
    assert steps[:3] == ["IMAGE=", "docker", "helm"], commands
    assert commands[1] == 'docker build -t "$IMAGE" . && docker push "$IMAGE"', (
        "the test stands in for this line with the image build-image.sh made: "
        "if the README changes it, change the stand-in"
    )
    uuid = fresh.gpus.devices[0]["uuid"]
    plugin = DevicePlugin([f"{uuid}::{n}" for n in range(4)])
    driver = Driver(fresh.gpus, fresh.state_file)
    agent = None
    try:
        run(fresh, commands[2])  # helm install --wait: the agent's pod is ready too
        agent = AgentPod(fresh.node, "vram-enforcer", fresh.state_file)
        outputs = [run(fresh, command) for command in commands[3:]]  # the check's, last
        assert driver.seen, "the example's process never showed on the played GPU"
        assert "condition met" in outputs[-1], outputs[-1]
        (described,) = [o for c, o in zip(commands[3:], outputs, strict=True) if "describe" in c]
        assert "VRAMEnforced" in described, described
        assert re.search(
            r"container 'trainer' uses \d+\.\d\d GiB of its 4\.00 GiB VRAM limit", described
        ), described
    finally:
        driver.stop()
        plugin.close()
        if agent is not None:
            assert "Traceback" not in agent.log(), agent.log()


def test_the_check_fails_when_nothing_was_enforced(apiserver: ApiServer, tmp_path: Path) -> None:
    """The README's Kubernetes commands where the example's Job failed and nothing was
    enforced: every one passes but the last, the check, which passes once the pod has its
    VRAMEnforced Event. The wait for the Job cannot be the check: the Job fails either way
    (its script exits 1 once it has allocated 16 GiB unchecked).

    Nothing enforced, as the namespace shows it: the Job failed, its pod said what comes
    before a stop or instead of one (VRAMNearLimit; VRAMLimitExceeded, all that `action: warn`
    says; VRAMWouldEnforce, a dry run's), and another namespace's pod was stopped. On an API
    server of its own, where nothing posts Events but this test and the test plays the Job
    controller (`apiserver` only for its skip-or-fail check), with the real kubectl."""
    commands = quick_start()
    (apply,) = [n for n, c in enumerate(commands) if c.startswith("kubectl apply -f examples/")]
    with ApiServer() as server:
        server.start()
        env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "KUBECONFIG": str(server.write_kubeconfig(tmp_path / "admin.kubeconfig")),
        }
        api = server.client()
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="elsewhere")))
        for command in commands[3 : apply + 1]:  # create and label the namespace, apply
            done = bash(command, env)
            assert done.returncode == 0, f"{command}\n{done.stderr}"
        fail_the_job(client.BatchV1Api(api))

        def say(reason: str, namespace: str = "vram-demo") -> None:
            pod = "pytorch-overrun-x7k2p"
            core.create_namespaced_event(
                namespace,
                client.CoreV1Event(
                    metadata=client.V1ObjectMeta(generate_name=f"{pod}."),
                    involved_object=client.V1ObjectReference(
                        kind="Pod", namespace=namespace, name=pod
                    ),
                    reason=reason,
                    message=f"{reason}, as the test says it",
                    type="Warning",
                ),
            )

        for reason in ("VRAMNearLimit", "VRAMLimitExceeded", "VRAMWouldEnforce"):
            say(reason)
        say("VRAMEnforced", "elsewhere")

        for command in commands[apply + 1 : -1]:  # the wait for the Job, describe
            done = bash(command, env)
            assert done.returncode == 0, f"{command}\n{done.stderr}"
        unenforced = bash(commands[-1], env)
        assert unenforced.returncode != 0, unenforced.stdout
        assert "timed out waiting for the condition" in unenforced.stderr, unenforced.stderr

        say("VRAMEnforced")
        enforced = bash(commands[-1], env)
        assert enforced.returncode == 0, enforced.stderr
        assert "condition met" in enforced.stdout, enforced.stdout


def fail_the_job(batch: client.BatchV1Api) -> None:
    """The example's Job failed, as the Job controller fails it (BackoffLimitExceeded)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    failed = {
        "status": "True",
        "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit",
        "lastTransitionTime": now,
    }
    batch.patch_namespaced_job_status(
        "pytorch-overrun",
        "vram-demo",
        {
            "status": {
                "startTime": now,
                "failed": 1,
                "conditions": [{"type": "FailureTarget", **failed}, {"type": "Failed", **failed}],
            }
        },
    )
