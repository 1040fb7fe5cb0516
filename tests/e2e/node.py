"""A real Kubernetes node on this machine: kubelet 1.37 and containerd 2.x with runc: the one
tests/e2e/build-runc.sh caches (1.3, which runs user-namespaced pods), else Debian's (1.1).

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
containerd does not let us move) are deleted on `close()`. kube-proxy (nftables mode, its
own `kube-proxy` tables, removed on `close()` by `kube-proxy --cleanup`) routes Service
addresses, so that pods reach the API server through the `kubernetes` Service of a
cluster started with `ApiServer(for_pods=True)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kubernetes import client

from tests.e2e.cluster import CACHE, KUBERNETES_SERVICE_IP, VERSION, ApiServer, node_ip
from tests.e2e.images import image_archive
from tests.helpers import free_port, remove_cgroup_tree, wait_for

BIN = CACHE / f"kubernetes-{VERSION}"
CNI_BIN = Path("/usr/lib/cni")
PAUSE_IMAGE = "localhost/pause:e2e"
BRIDGE = "vram-e2e0"
NETNS = Path("/var/run/netns")  # where containerd makes each sandbox's network namespace
CNI_CACHE = Path("/var/lib/cni/results")  # libcni's cache of results, which containerd fixes
RUNC_VERSION = "1.3.7"  # tests/e2e/build-runc.sh's
BUILT_RUNC = CACHE / f"runc-{RUNC_VERSION}" / "runc"


def missing() -> str | None:
    """Why a real node cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for path in (BIN / "kubelet", BIN / "kube-proxy", BIN / "containerd", BIN / "pause"):
        if not path.exists():
            return f"no {path}: run tests/e2e/build-kubernetes.sh"
    if runc() is None or shutil.which("nft") is None or not (CNI_BIN / "bridge").exists():
        return "needs runc, nft and the CNI plugins: apt-get install runc nftables containernetworking-plugins"
    return None


def runc() -> str | None:
    """The runc containers run with: tests/e2e/build-runc.sh's when it is built, else the
    system's (Debian 12's 1.1.5, too old for user namespaces); None if neither."""
    if BUILT_RUNC.is_file() and os.access(BUILT_RUNC, os.X_OK):
        return str(BUILT_RUNC)
    return shutil.which("runc")


def userns_missing() -> str | None:
    """Why this node cannot run a user-namespaced pod (`hostUsers: false`), or None:
    containerd needs a runc with idmapped mounts (>= 1.2)."""
    if runc() != str(BUILT_RUNC):
        return f"no {BUILT_RUNC} (user namespaces need runc >= 1.2): run tests/e2e/build-runc.sh"
    return None


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


class RealNode:
    """containerd and kubelet registered as `name` with `apiserver`; `close()` removes
    everything they made: processes, mounts, cgroups, the bridge."""

    def __init__(
        self,
        apiserver: ApiServer,
        directory: Path,
        name: str = "e2e-real-node",
        images: Sequence[Path] = (),
        kube_proxy: bool = False,
        runtime: Path | None = None,
        cdi: Path | None = None,
    ) -> None:
        """`images`: OCI archives to import beside the pause image; `kube_proxy`: route
        Services (needs `ApiServer(for_pods=True)`); `runtime`: the OCI runtime containerd
        runs every container with, in place of runc (a wrapper around it, such as
        `nvidia_runtime`); `cdi`: the directory of CDI specs containerd resolves a device
        plugin's CDI devices from (none: the host's /etc/cdi and /var/run/cdi are not read)."""
        self.name = name
        self._runtime = runtime
        self._cdi = cdi or directory / "cdi-specs"
        self.dir = directory
        # containerd's state (the containers' bundles and root filesystems) where the root of
        # a user-namespaced pod, a high host uid, can reach it: the pytest directories are
        # 0700 ("remount-private dst=.../rootfs: permission denied" from runc otherwise), as
        # containerd's own /run/containerd is 0711.
        self.state = Path(tempfile.mkdtemp(prefix="vram-e2e-containerd-", dir="/run"))
        self.state.chmod(0o711)
        self.cgroup_root = own_cgroup_root()
        self.socket = directory / "containerd.sock"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._kube_proxy: list[str] = []
        self._netns_before = set(NETNS.glob("cni-*"))
        self.core: client.CoreV1Api | None = None
        for hierarchy in _hierarchies():
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(parents=True, exist_ok=True)
        try:
            self._start_containerd()
            self.ctr(
                "images",
                "import",
                str(
                    image_archive(
                        directory / "pause.tar", PAUSE_IMAGE, {"/pause": BIN / "pause"}, ["/pause"]
                    )
                ),
            )
            for archive in images:
                self.ctr("images", "import", str(archive))
            self._start_kubelet(apiserver)
            self.core = client.CoreV1Api(apiserver.client())
            wait_for(self._ready, timeout=60, what=f"node {name} to be Ready")
            if kube_proxy:
                self._start_kube_proxy(apiserver)
        except BaseException:
            self.close()
            raise

    def ctr(self, *args: str) -> str:
        out = subprocess.run(
            [str(BIN / "ctr"), "--address", str(self.socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            check=True,
        )
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
        self._procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        )

    def _start_containerd(self) -> None:
        d = self.dir
        (d / "cni").mkdir()
        (d / "cni" / "10-e2e.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "vram-e2e",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "isDefaultGateway": True,
                            "ipMasq": False,
                            "ipam": {
                                "type": "host-local",
                                "dataDir": str(d / "ipam"),
                                "ranges": [[{"subnet": "10.88.77.0/24"}]],
                            },
                        },
                        {"type": "loopback"},
                    ],
                }
            )
        )
        binary = f'\n      BinaryName = "{self._runtime or runc()}"'
        (d / "containerd.toml").write_text(f"""version = 3
root = "{d}/containerd/root"
state = "{self.state}"
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
  cdi_spec_dirs = ["{self._cdi}"]
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      SystemdCgroup = false{binary}
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
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
            "localStorageCapacityIsolation": False,
            "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(d / "pods"),
        }
        (d / "kubelet.json").write_text(json.dumps(config))
        self._spawn(
            "kubelet",
            [
                str(BIN / "kubelet"),
                f"--config={d / 'kubelet.json'}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={d / 'kubelet'}",
                f"--cert-dir={d / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={node_ip()}",
            ],
        )

    def _start_kube_proxy(self, apiserver: ApiServer) -> None:
        """kube-proxy in nftables mode; conntrack sysctls are left as they are (0)."""
        kubeconfig = apiserver.write_kubeconfig(self.dir / "kube-proxy.kubeconfig")
        self._kube_proxy = [f"--kubeconfig={kubeconfig}", "--proxy-mode=nftables"]
        self._spawn(
            "kube-proxy",
            [
                str(BIN / "kube-proxy"),
                *self._kube_proxy,
                f"--hostname-override={self.name}",
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
            ],
        )

        def routed() -> bool:
            rules = subprocess.run(
                ["nft", "list", "table", "ip", "kube-proxy"], capture_output=True, text=True
            ).stdout
            return KUBERNETES_SERVICE_IP in rules

        wait_for(routed, timeout=30, what="kube-proxy's rule for the kubernetes Service")

    def pids(self, container_id: str) -> list[int]:
        """The host pids in a container's cgroup (runc's, below the kubelet's root)."""
        for hierarchy in _hierarchies():
            for found in (hierarchy / self.cgroup_root.lstrip("/")).rglob(container_id):
                procs = found / "cgroup.procs"
                if procs.exists():
                    return [int(pid) for pid in procs.read_text().split()]
        return []

    def log(self, name: str = "kubelet") -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def _our_netns(self) -> set[Path]:
        return set(NETNS.glob("cni-*")) - self._netns_before

    def _drain(self) -> None:
        """Delete every pod on this node and give the kubelet time to tear their sandboxes
        down (CNI DEL, which removes the veth, then the network namespace)."""
        if self.core is None:
            return
        try:
            pods = self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.name}"
            )
            for pod in pods.items:
                with contextlib.suppress(client.ApiException):
                    self.core.delete_namespaced_pod(
                        pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
                    )
        except OSError:
            return  # the API server is gone: the forced cleanup in close() does it all
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not self._our_netns(), timeout=30, what="the sandboxes' teardown")

    def close(self) -> None:
        """Delete the node's pods; stop the kubelet, then every container (their shims), then
        containerd; remove the mounts below the node's directory, its cgroups, what is left of
        the pods' networks and the bridge."""
        self._drain()
        for proc in reversed(self._procs):  # the kubelet first
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_cgroup_tree()
        shims = subprocess.run(
            ["pgrep", "-f", f"containerd-shim-runc-v2.*{self.socket}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        for pid in shims:
            _kill(int(pid))
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted(
            (m for m in mounts if m.startswith((str(self.dir), str(self.state)))),
            key=len,
            reverse=True,
        ):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.state, ignore_errors=True)
        self._remove_cgroups()
        if self._kube_proxy:
            subprocess.run(
                [str(BIN / "kube-proxy"), *self._kube_proxy, "--cleanup"],
                capture_output=True,
                check=False,
            )
        leftover = self._our_netns()
        for netns in leftover:  # with it go the pod's end of each veth, and the host's
            subprocess.run(["ip", "netns", "delete", netns.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
        for cached in CNI_CACHE.glob("*"):
            text = cached.read_text(errors="replace")
            if cached.name.startswith("vram-e2e-") or any(str(n) in text for n in leftover):
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


def container_log(node: RealNode, pod: client.V1Pod, container: str) -> str:
    """What a container wrote, from the kubelet's log files (CRI lines: time, stream,
    F(ull) or P(artial), then the text)."""
    found = node.dir / "pods" / f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid}"
    lines = [
        line.split(" ", 3)
        for run in sorted((found / container).glob("*.log"))
        for line in run.read_text().splitlines()
    ]
    return "".join(p[3] + ("\n" if p[2] == "F" else "") for p in lines if len(p) == 4)
