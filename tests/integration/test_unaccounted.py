"""GPU memory no declaration accounts for, as the real agent shows and says it (issue 43,
item 2): the agent process itself, over the fake NVML, the host's real /proc and a real
cgroup named as containerd names a container's, with a stand-in API server that lists the
node's pods and namespaces and takes its Events.

A pod in a namespace that did not opt in runs a GPU workload and declares nothing; a host
process holds memory too. The agent names the pod's container per GPU, says so once on it
however many passes go by, and counts the host process apart, per GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.model import GiB
from tests.fakenvml.plugin import FakeNvml
from tests.helpers import api_agent_flags, free_port, wait_for, write_kubeconfig
from tests.integration.test_agent import list_on_gpu
from tests.integration.test_backstop import in_box, moved_in
from tests.pods_api import PodsApi, serving

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup of its own)")

# Container IDs of this run's own: another run may have its own on the host.
CID, OWN_CID = secrets.token_hex(32), secrets.token_hex(32)
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
OWN = "vram-enforcer"  # the agent's namespace


def plain(name: str, namespace: str, cid: str) -> dict[str, Any]:
    """A running pod of one container, `trainer`, that declares no VRAM."""
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"nodeName": "gpu-node", "containers": [{"name": "trainer"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": "trainer", "containerID": f"containerd://{cid}"}],
        },
    }


def agent(api: PodsApi, tmp: Path, fake_nvml: FakeNvml, port: int) -> subprocess.Popen[str]:
    """`vram-enforcer agent` for node gpu-node, with the stand-in API, in namespace OWN."""
    kubeconfig = write_kubeconfig(tmp / "kubeconfig", api.url)
    argv = [
        sys.executable,
        "-m",
        "enforcer",
        "agent",
        *api_agent_flags("gpu-node", kubeconfig, tmp / "run" / "agent.sock"),
        "--namespace",
        OWN,
        "--interval",
        "50ms",
        "--metrics-port",
        str(port),
        "--log-format",
        "text",
    ]
    log = (tmp / "agent.log").open("w")
    return subprocess.Popen(argv, env={**os.environ, **fake_nvml.env()}, stderr=log, text=True)


@contextlib.contextmanager
def running(api: PodsApi, tmp: Path, fake_nvml: FakeNvml, port: int) -> Iterator[None]:
    """The agent, run over the block: then it must stop cleanly, with no traceback."""
    proc = agent(api, tmp, fake_nvml, port)
    try:
        yield
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in (tmp / "agent.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def metrics(port: int) -> str:
    """The agent's /metrics ("" while it does not listen yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def sample(text: str, name: str, labels: str) -> float | None:
    """A sample of `name` whose labels contain `labels` (as the text writes them)."""
    found = re.search(rf"^{name}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    return float(found[1]) if found else None


def passes(port: int) -> float:
    """NVML passes the agent has made."""
    found = re.search(r"^vram_enforcer_tick_duration_seconds_count (\S+)$", metrics(port), re.M)
    return float(found[1]) if found else 0.0


def undeclared_events(api: PodsApi) -> list[dict[str, Any]]:
    return [
        body
        for path, body in list(api.posts)
        if path.endswith("/events") and body["reason"] == "VRAMUndeclared"
    ]


def undeclared_shown(port: int, tmp: Path, labels: str, held: int) -> None:
    """Wait until the agent shows `held` bytes undeclared for `labels` (its log if not)."""
    try:
        wait_for(
            lambda: sample(metrics(port), "vram_enforcer_undeclared_used_bytes", labels) == held,
            what=f"undeclared memory of {labels}",
        )
    except AssertionError:
        raise AssertionError((tmp / "agent.log").read_text()[-3000:]) from None


def told_once(api: PodsApi, port: int) -> dict[str, Any]:
    """The one VRAMUndeclared Event, still one 20 passes later."""
    (told,) = wait_for(lambda: undeclared_events(api), what="the VRAMUndeclared Event")
    later = passes(port) + 20
    wait_for(lambda: passes(port) >= later, what="20 passes more")
    assert len(undeclared_events(api)) == 1, undeclared_events(api)
    return dict(told)


def said(tmp: Path, text: str) -> list[str]:
    """The lines of the agent's log that say `text`."""
    return [line for line in (tmp / "agent.log").read_text().splitlines() if text in line]


def test_a_pod_that_declares_nothing_is_shown_and_told_once_and_a_host_process_apart(
    cgroup2: Path, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """A pod of a namespace that did not opt in holds 12 GiB undeclared: shown, and told once
    on its container. A pod of the agent's own namespace holds 1 GiB undeclared: shown, and
    said in the log alone (none of the agent's Events are about that namespace). A host
    process holds 2 GiB: counted as in no pod, and said once in the log with its pid."""
    box, own_box = cgroup2 / f"cri-containerd-{CID}.scope", cgroup2 / f"docker-{OWN_CID}.scope"
    box.mkdir()
    own_box.mkdir()
    workload, own, host = in_box(box, SLEEP), in_box(own_box, SLEEP), subprocess.Popen(SLEEP)
    pods = [plain("plain", "research", CID), plain("mine", OWN, OWN_CID)]
    namespaces = [{"metadata": {"name": "ml", "labels": {"vram-enforcer.io/inject": "enabled"}}}]
    port = free_port()
    try:
        moved_in(box, workload)
        moved_in(own_box, own)
        list_on_gpu(fake_nvml, {workload.pid: 12 * GiB, own.pid: GiB, host.pid: 2 * GiB})
        uuid = fake_nvml.state.devices[0]["uuid"]
        with serving([json.dumps(p).encode() for p in pods]) as api:
            api.namespaces = [json.dumps(n).encode() for n in namespaces]
            with running(api, tmp_path, fake_nvml, port):
                held = f'container="trainer",gpu="{uuid}",namespace="research",pod="plain"'
                undeclared_shown(port, tmp_path, held, 12 * GiB)
                shown = metrics(port)
                mine = f'container="trainer",gpu="{uuid}",namespace="{OWN}",pod="mine"'
                assert sample(shown, "vram_enforcer_undeclared_used_bytes", mine) == GiB, shown
                outside = sample(shown, "vram_enforcer_gpu_outside_pods_bytes", f'uuid="{uuid}"')
                assert outside == 2 * GiB, shown
                told = told_once(api, port)
                (host_said,) = said(tmp_path, "and is in no pod of this node")  # with its pid, once
                assert f"pid {host.pid} holds 2.00 GiB on {uuid} and is in no pod" in host_said
                assert len(said(tmp_path, f"pod {OWN}/mine: ")) == 1  # there alone: no Event
                assert (told["type"], told["involvedObject"]["uid"]) == ("Warning", "uid-plain")
                assert told["involvedObject"]["fieldPath"] == "spec.containers{trainer}"
                assert told["message"].startswith(
                    f"container 'trainer' holds 12.00 GiB of {uuid} and declares no VRAM: its "
                    "namespace 'research' has not opted in"
                ), told["message"]
                # The pod leaves: its series with it; the host process is still counted apart.
                api.send("DELETED", pods[0])
                wait_for(lambda: 'pod="plain"' not in metrics(port), what="the pod's series gone")
                assert sample(metrics(port), "vram_enforcer_gpu_outside_pods_bytes", uuid)
    finally:
        for each in (workload, own, host):
            each.kill()
            each.wait()


def test_what_a_process_in_an_injected_pods_sidecar_container_holds_is_shown_and_told(
    cgroup2: Path, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """An injected pod of an opted-in namespace: a process in its sidecar's container (the
    sidecar uses no GPU memory) holds 3 GiB. It is in no enforced series, so it is shown
    as undeclared under the sidecar's name and told once on that container; it is never
    signalled (the sidecar's container never is)."""
    box = cgroup2 / f"cri-containerd-{CID}.scope"
    box.mkdir()
    exec_d = in_box(box, SLEEP)
    pod = {
        "metadata": {
            "name": "enforced",
            "namespace": "ml",
            "uid": "uid-enforced",
            "labels": {"vram-enforcer.io/enforced": "true"},
        },
        "spec": {
            "nodeName": "gpu-node",
            "containers": [
                {"name": "trainer", "resources": {"limits": {"vram-enforcer.io/vram": "8Gi"}}},
                {"name": "vram-enforcer"},
            ],
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "vram-enforcer", "containerID": f"containerd://{CID}"},
            ],
        },
    }
    labels = {"vram-enforcer.io/inject": "enabled"}
    namespaces = [{"metadata": {"name": "ml", "uid": "uid-ml", "labels": labels}}]
    port = free_port()
    try:
        moved_in(box, exec_d)
        list_on_gpu(fake_nvml, {exec_d.pid: 3 * GiB})
        uuid = fake_nvml.state.devices[0]["uuid"]
        with serving([json.dumps(pod).encode()]) as api:
            api.namespaces = [json.dumps(n).encode() for n in namespaces]
            with running(api, tmp_path, fake_nvml, port):
                held = f'container="vram-enforcer",gpu="{uuid}",namespace="ml",pod="enforced"'
                undeclared_shown(port, tmp_path, held, 3 * GiB)
                assert sample(metrics(port), "vram_enforcer_gpu_outside_pods_bytes", uuid) == 0
                told = told_once(api, port)
                assert told["involvedObject"]["fieldPath"] == "spec.containers{vram-enforcer}"
                assert told["message"].startswith(
                    f"the vram-enforcer sidecar's container holds 3.00 GiB of {uuid}; the sidecar "
                    "uses no GPU memory"
                ), told["message"]
                assert exec_d.poll() is None  # never signalled
    finally:
        exec_d.kill()
        exec_d.wait()
