"""A pod on this machine: a PID namespace shared by "containers" in containerd-named cgroups.

- PID 1 is `pause.py`, in a fresh PID and mount namespace (`unshare`), with its own /proc.
- Each container's processes are started from outside with `nsenter`, as a runtime does,
  so inside the namespace their parent is 0. They first move into
  `.../kubepods-pod<uid>.slice/cri-containerd-<id>.scope` in the cgroup v2 hierarchy (never
  a v1 controller hierarchy), and then exec the command.
- With `kubelet=True`, the layout is the systemd driver's, named after the Pod's real UID
  (`<root>/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice`),
  and the pod's cgroup is made after the Pod exists, as kubelet does it; `root` is what
  the node agent's --cgroup-root points at.
- The Pod object on the API server gets a status with `containerd://<id>` for each
  container, as kubelet would report it.
Everything is removed again on `close()`.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.helpers import children, remove_cgroup_tree, wait_for

CGROUP2 = (
    Path("/sys/fs/cgroup/unified")
    if Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    else Path("/sys/fs/cgroup")
)
PAUSE = Path(__file__).with_name("pause.py")


class SimPod:
    def __init__(
        self,
        core: client.CoreV1Api,
        namespace: str,
        name: str,
        containers: list[str],
        host_proc: Path | None = None,
        unlisted: tuple[str, ...] = (),
        *,
        limits: dict[str, str] | None = None,
        node_name: str | None = None,
        claims: dict[str, tuple[str, str | None]] | None = None,
        node_selector: dict[str, str] | None = None,
        kubelet: bool = False,
        root: Path | None = None,
        sidecar_env: dict[str, str] | None = None,
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.name = name
        self.ids = {c: secrets.token_hex(32) for c in [*containers, *unlisted]}
        self.unlisted = unlisted  # containers with cgroups whose IDs the pod's status omits
        self._owns_root = root is None  # else another SimPod's (kubelet layout): one node
        self.root = root or CGROUP2 / f"vram-e2e-{secrets.token_hex(4)}.slice"
        self.slice = (
            self.root / "kubepods.slice/kubepods-besteffort.slice" if kubelet else self.root
        )
        if not kubelet:
            self.pod_slice = self.slice / f"kubepods-pod{uuid.uuid4().hex}.slice"
            self.pod_slice.mkdir(parents=True)
        pause = [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            sys.executable,
            str(PAUSE),
        ]
        if host_proc is not None:
            # The host's /proc, visible inside the pod (like a hostPath mount), in a private
            # mount namespace of the pod's own: nothing is mounted on the host.
            host_proc.mkdir(parents=True, exist_ok=True)
            pause = [
                "unshare",
                "--mount",
                "--",
                "sh",
                "-c",
                'mount --bind /proc "$0" && exec "$@"',
                str(host_proc),
                *pause,
            ]
        self.unshare = subprocess.Popen(pause, stdout=subprocess.PIPE, text=True)
        assert self.unshare.stdout is not None
        assert self.unshare.stdout.readline().strip() == "ready"
        (self.pause,) = wait_for(lambda: children(self.unshare.pid), what="pause")
        self.processes: list[subprocess.Popen[Any]] = []
        # DRA: container -> (template, request or None); one pod claim per template
        templates = sorted({t for t, _ in (claims or {}).values()})
        uses = {
            c: [client.CoreV1ResourceClaim(name=t, request=r)]
            for c, (t, r) in (claims or {}).items()
        }
        spec = [
            client.V1Container(
                name=c,
                image="example.com/gpu:1",
                resources=client.V1ResourceRequirements(
                    limits={"vram-enforcer.io/vram": limits[c]} if c in (limits or {}) else None,
                    claims=uses.get(c),
                ),
                env=[client.V1EnvVar(name=k, value=v) for k, v in (sidecar_env or {}).items()]
                if c == "vram-enforcer"
                else None,
            )
            for c in containers
        ]
        body = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(
                containers=spec,
                share_process_namespace=True,
                restart_policy="Never",
                node_name=node_name,
                node_selector=node_selector,
                resource_claims=[
                    client.V1PodResourceClaim(name=t, resource_claim_template_name=t)
                    for t in templates
                ]
                or None,
            ),
        )
        created = core.create_namespaced_pod(namespace, body)
        self.uid = str(created.metadata.uid)
        if kubelet:
            self.pod_slice = (
                self.slice / f"kubepods-besteffort-pod{self.uid.replace('-', '_')}.slice"
            )
            self.pod_slice.mkdir(parents=True)
        self.report_status()

    def report_status(self, states: dict[str, dict[str, Any]] | None = None) -> None:
        """Write status.containerStatuses, as kubelet would."""
        statuses = [
            {
                "name": c,
                "containerID": f"containerd://{cid}",
                "image": "example.com/gpu:1",
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "state": (states or {}).get(c, {"running": {"startedAt": "2026-11-22T00:00:00Z"}}),
            }
            for c, cid in self.ids.items()
            if c not in self.unlisted
        ]
        self.core.patch_namespaced_pod_status(
            self.name,
            self.namespace,
            [{"op": "add", "path": "/status/containerStatuses", "value": statuses}],
        )

    def cgroup(self, container: str) -> Path:
        return self.pod_slice / f"cri-containerd-{self.ids[container]}.scope"

    def start(
        self, container: str, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Run `argv` as (a process of) `container`, inside the pod's namespaces."""
        cg = self.cgroup(container)
        cg.mkdir(exist_ok=True)
        proc = subprocess.Popen(
            [
                "nsenter",
                "-t",
                str(self.pause),
                "-p",
                "-m",
                "--",
                "sh",
                "-c",
                'echo $$ > "$0/cgroup.procs" && exec "$@"',
                str(cg),
                *argv,
            ],
            env={**os.environ, **(env or {})},
            **kwargs,
        )
        self.processes.append(proc)
        return proc

    def restart(self, container: str) -> None:
        """The container's processes end and its cgroup goes; it comes back under a new
        container ID, as a restart does (the new cgroup is made by the next `start`)."""
        for pid in self.host_pids(container):
            os.kill(pid, 9)
        wait_for(lambda: not self.host_pids(container), what=f"{container}'s processes to end")
        self.cgroup(container).rmdir()
        self.ids[container] = secrets.token_hex(32)
        self.report_status()

    def host_pids(self, container: str) -> list[int]:
        """The container's processes, by host pid (cgroup.procs as the host reads it)."""
        try:
            return [int(p) for p in (self.cgroup(container) / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def close(self) -> None:
        self.unshare.kill()  # pause dies, and with it every process of the namespace
        self.unshare.wait()
        for p in self.processes:
            p.wait(timeout=10)
        remove_cgroup_tree(self.pod_slice)
        for directory in (self.slice, *self.slice.parents) if self._owns_root else ():
            directory.rmdir()
            if directory == self.root:
                break
