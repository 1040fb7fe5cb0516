"""A real Kubernetes node on this machine: kubelet 1.37 and containerd 2.x with Debian's runc.

Every cgroup the kubelet and the runtime create stays inside the cgroup the tests run in
(`cgroupRoot` below this process's memory cgroup on a v1 host, or its v2 cgroup): the
machine's own processes live in the rest of the hierarchy. Images cannot be pulled (no
registry): `image_archive` writes one-layer OCI archives, imported with ctr. Settings this
machine needs, each found by a failure:
- containerd's `restrict_oom_score_adj`: root here lacks CAP_SYS_RESOURCE, so runc cannot
  give the sandbox the kubelet's oom_score_adj of -998;
- kubelet: cgroupfs driver, `failCgroupV1: false`, no swap check, no eviction thresholds,
  no kernel-default check, no iptables chains, and a node IP that is not loopback.
Pods get a bridge network from Debian's CNI plugins; the IPAM state is kept in the node's
own directory, and the bridge and libcni's cached results (/var/lib/cni/results, which
containerd does not let us move) are deleted on `close()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from pathlib import Path

from kubernetes import client

from tests.e2e.cluster import CACHE, VERSION, ApiServer
from tests.helpers import free_port, remove_cgroup_tree, wait_for

BIN = CACHE / f"kubernetes-{VERSION}"
CNI_BIN = Path("/usr/lib/cni")
PAUSE_IMAGE = "localhost/pause:e2e"
BRIDGE = "vram-e2e0"


def missing() -> str | None:
    """Why a real node cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for path in (BIN / "kubelet", BIN / "containerd", BIN / "pause"):
        if not path.exists():
            return f"no {path}: run tests/e2e/build-kubernetes.sh"
    if shutil.which("runc") is None or not (CNI_BIN / "bridge").exists():
        return "needs runc and the CNI plugins: apt-get install runc containernetworking-plugins"
    return None


def node_ip() -> str:
    """This machine's address toward the outside (the kubelet refuses a loopback one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


def own_cgroup_root() -> str:
    """The cgroup path the kubelet gets as its root: below this process's memory cgroup
    on a v1 (or hybrid) host, where the machine's own processes fill the rest."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    memory = [line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory"]
    own = memory[0] if memory else next(line[3:] for line in lines if line.startswith("0::"))
    return f"{own.rstrip('/')}/vram-kubelet-{os.getpid()}"


def _hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers and the v2 one)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        if tail.split()[:1] in (["cgroup"], ["cgroup2"]):
            found.append(Path(head.split()[4]))
    return found


def image_archive(path: Path, ref: str, files: dict[str, Path], entrypoint: list[str]) -> Path:
    """A one-layer OCI image archive holding `files` (path in the image -> file here)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        for dest, src in files.items():
            t.add(str(src), arcname=dest.lstrip("/"))
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return f"sha256:{digest}", len(data)

    layer_digest, layer_size = blob(layer.getvalue())
    config = {"architecture": "amd64", "os": "linux", "config": {"Entrypoint": entrypoint},
              "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}  # fmt: skip
    config_digest, config_size = blob(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    }  # fmt: skip
    manifest_digest, manifest_size = blob(json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": manifest_size, "annotations": {"io.containerd.image.name": ref}}]}  # fmt: skip
    with tarfile.open(path, "w") as t:
        entries = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode(),
                   **{f"blobs/sha256/{d}": data for d, data in blobs.items()}}  # fmt: skip
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            t.addfile(info, io.BytesIO(data))
    return path


class RealNode:
    """containerd and kubelet registered as `name` with `apiserver`; `close()` removes
    everything they made: processes, mounts, cgroups, the bridge."""

    def __init__(self, apiserver: ApiServer, directory: Path, name: str = "e2e-real-node") -> None:
        self.name = name
        self.dir = directory
        self.cgroup_root = own_cgroup_root()
        self.socket = directory / "containerd.sock"
        self._procs: list[subprocess.Popen[bytes]] = []
        for hierarchy in _hierarchies():
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(parents=True, exist_ok=True)
        try:
            self._start_containerd()
            self.ctr("images", "import", str(image_archive(directory / "pause.tar", PAUSE_IMAGE,
                                                            {"/pause": BIN / "pause"}, ["/pause"])))  # fmt: skip
            self._start_kubelet(apiserver)
            self.core = client.CoreV1Api(apiserver.client())
            wait_for(self._ready, timeout=60, what=f"node {name} to be Ready")
        except BaseException:
            self.close()
            raise

    def ctr(self, *args: str) -> str:
        out = subprocess.run([str(BIN / "ctr"), "--address", str(self.socket), "-n", "k8s.io", *args],
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout

    def _ready(self) -> bool:
        try:
            node = self.core.read_node(self.name)
        except client.ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
        log = (self.dir / f"{name}.log").open("ab")
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=self.dir))  # fmt: skip

    def _start_containerd(self) -> None:
        d = self.dir
        (d / "cni").mkdir()
        (d / "cni" / "10-e2e.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "vram-e2e", "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "dataDir": str(d / "ipam"),
                          "ranges": [[{"subnet": "10.88.77.0/24"}]]}},
                {"type": "loopback"}]}))  # fmt: skip
        (d / "containerd.toml").write_text(f"""version = 3
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{d}/cni"
""")
        self._spawn("containerd", [str(BIN / "containerd"), "--config", str(d / "containerd.toml")])
        wait_for(self.socket.exists, timeout=30, what="containerd's socket")

    def _start_kubelet(self, apiserver: ApiServer) -> None:
        d = self.dir
        kubeconfig = apiserver.write_kubeconfig(d / "kubelet.kubeconfig")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "cgroupsPerQOS": True,
            "enforceNodeAllocatable": [], "failSwapOn": False, "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "127.0.0.1", "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "evictionHard": {}, "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "protectKernelDefaults": False, "makeIPTablesUtilChains": False,
            "localStorageCapacityIsolation": False, "resolvConf": "/etc/resolv.conf",
        }  # fmt: skip
        (d / "kubelet.json").write_text(json.dumps(config))
        self._spawn("kubelet", [
            str(BIN / "kubelet"), f"--config={d / 'kubelet.json'}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'pki'}", f"--hostname-override={self.name}",
            f"--node-ip={node_ip()}",
        ])  # fmt: skip

    def log(self, name: str = "kubelet") -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        """Stop the kubelet, then every container (their shims), then containerd; remove the
        mounts below the node's directory, its cgroups and the bridge."""
        for proc in reversed(self._procs):  # the kubelet first
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_cgroup_tree()
        shims = subprocess.run(["pgrep", "-f", f"containerd-shim-runc-v2.*{self.socket}"],
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        for pid in shims:
            _kill(int(pid))
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted(
            (m for m in mounts if m.startswith(str(self.dir))), key=len, reverse=True
        ):
            subprocess.run(["umount", "-l", mount], check=False)
        self._remove_cgroups()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        # libcni's cache of results, which containerd keeps in /var/lib/cni whatever we say
        for cached in Path("/var/lib/cni/results").glob("vram-e2e-*"):
            cached.unlink()

    def _kill_cgroup_tree(self) -> None:
        """SIGKILL every process left in the node's cgroups (containers of pods that were
        not deleted); `_remove_cgroups` then waits for each cgroup to empty."""
        for hierarchy in _hierarchies():
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.exists():
                continue
            for procs in top.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    _kill(int(pid))

    def _remove_cgroups(self) -> None:
        for hierarchy in _hierarchies():
            remove_cgroup_tree(hierarchy / self.cgroup_root.lstrip("/"))


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
