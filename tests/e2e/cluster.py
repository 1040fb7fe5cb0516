"""A real Kubernetes control plane: etcd and kube-apiserver, and on request kube-scheduler
(`start_scheduler`) and kube-controller-manager (`start_controller_manager`).

Two shapes:
- the default, on loopback only, for tests that play the kubelet (they create Nodes, set
  pod status as kubelet would, and mint ServiceAccount tokens through the TokenRequest API
  as kubelet does): the ServiceAccount admission plugin is off, since no kubelet mounts a
  pod's token, and the `kubernetes` Service has no endpoints;
- `for_pods=True`, for a cluster with a real node: the server listens on every address and
  advertises this machine's, so that pods reach it through the `kubernetes` Service (which
  the node's kube-proxy routes), and ServiceAccount admission is on (the controller-manager
  creates each namespace's `default` ServiceAccount and its CA ConfigMap).
The server authenticates static tokens and ServiceAccount tokens and authorizes with RBAC,
so permission tests are real.

    with ApiServer() as server:          # binaries from KUBE_APISERVER_BIN / ETCD_BIN or defaults
        server.start()
        core = kubernetes.client.CoreV1Api(server.api_client())
        ...
        server.restart()                 # same port, certificates and etcd data
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kubernetes import client

from tests.helpers import free_port

VERSION = "1.37.2"
OLDEST = "1.31.4"  # the chart's kubeVersion floor: its install and webhook are tested on it
CACHE = Path(os.environ.get("VRAM_ENFORCER_CACHE", Path.home() / ".cache" / "vram-enforcer"))
ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_TOKEN = "e2e-admin-token"  # noqa: S105 - a throwaway cluster on loopback
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"  # routed by kube-proxy on a real node, else nowhere
KUBERNETES_SERVICE_IP = "10.0.0.1"  # the first address of the range: the `kubernetes` Service

# Variables the children must not inherit: a proxy must never see loopback traffic (webhook
# calls included), and etcd reads any ETCD_* variable as a flag.
_SCRUBBED_ENV = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


class ApiServerError(RuntimeError):
    """etcd or kube-apiserver exited, or did not become ready in time."""


def apiserver_binary() -> Path | None:
    """$KUBE_APISERVER_BIN, else the binary that build-kubernetes.sh caches; None if absent."""
    return _binary("KUBE_APISERVER_BIN", "kube-apiserver")


def scheduler_binary() -> Path | None:
    """$KUBE_SCHEDULER_BIN, else the binary that build-kubernetes.sh caches; None if absent."""
    return _binary("KUBE_SCHEDULER_BIN", "kube-scheduler")


def controller_manager_binary() -> Path | None:
    """$KUBE_CONTROLLER_MANAGER_BIN, else the cached binary; None if absent."""
    return _binary("KUBE_CONTROLLER_MANAGER_BIN", "kube-controller-manager")


def node_ip() -> str:
    """This machine's address toward the outside (not loopback, which the kubelet refuses
    and which pods cannot reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


def etcd_binary() -> Path | None:
    """$ETCD_BIN, else the etcd that build-kubernetes.sh caches; None if absent."""
    return _binary("ETCD_BIN", "etcd")


def oldest_apiserver_binary() -> Path | None:
    """$KUBE_APISERVER_OLDEST_BIN, else the cached kube-apiserver of `OLDEST`; None if absent."""
    return _binary("KUBE_APISERVER_OLDEST_BIN", "kube-apiserver", OLDEST)


def _binary(variable: str, name: str, version: str = VERSION) -> Path | None:
    explicit = os.environ.get(variable)
    path = Path(explicit) if explicit else CACHE / f"kubernetes-{version}" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        raise ApiServerError(f"openssl {' '.join(args)} failed:\n{e.stderr.decode()}") from e


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA in `directory`: (certificate, key)."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    return directory / f"{name}.crt", directory / f"{name}.key"


def make_serving_cert(
    directory: Path, ca: tuple[Path, Path], name: str, sans: str = "IP:127.0.0.1,DNS:localhost"
) -> tuple[Path, Path]:
    """A serving certificate signed by `ca` for `sans`: (certificate, key)."""
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=directory,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        str(ca[0]),
        "-CAkey",
        str(ca[1]),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        ext.name,
        "-out",
        f"{name}.crt",
        cwd=directory,
    )
    return directory / f"{name}.crt", directory / f"{name}.key"


class _Process:
    """A child process with its log file; terminated by `stop()`, which is idempotent."""

    def __init__(self, argv: list[str], log: Path, cwd: Path) -> None:
        self.log = log
        self._log_file: IO[bytes] = log.open("ab")
        env = {
            k: v
            for k, v in os.environ.items()
            if k.lower() not in _SCRUBBED_ENV and not k.startswith("ETCD_")
        }
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            preexec_fn=_die_with_parent if _in_main_thread() else None,  # noqa: PLW1509
        )

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log_file.close()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    """In the child: get SIGTERM when pytest dies, even by SIGKILL (Linux prctl).

    Only set when spawning from the main thread: the signal fires when the *thread* that
    forked exits, which for the main thread means the process.
    """
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ApiServer:
    """etcd plus kube-apiserver in a temporary directory, on free loopback ports.

    `start()` starts both (etcd once), `stop()` stops only the API server, `restart()` does
    both on the same port with the same certificates and data, `close()` stops everything and
    removes the directory. Use it as a context manager, or call `close()` in a `finally`.
    """

    def __init__(
        self,
        apiserver: Path | None = None,
        etcd: Path | None = None,
        *,
        static_tokens: Mapping[str, tuple[str, Sequence[str]]] | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 90.0,
        for_pods: bool = False,
    ) -> None:
        """`static_tokens` maps extra bearer tokens to (user name, groups); `for_pods`: see
        the module's docstring."""
        found_apiserver, found_etcd = apiserver or apiserver_binary(), etcd or etcd_binary()
        if found_apiserver is None:
            raise ApiServerError(
                "no kube-apiserver: set KUBE_APISERVER_BIN or run tests/e2e/build-kubernetes.sh"
            )
        if found_etcd is None:
            raise ApiServerError("no etcd: set ETCD_BIN or run tests/e2e/build-kubernetes.sh")
        self._apiserver_bin: Path = found_apiserver
        self._etcd_bin: Path = found_etcd
        self._extra_args = list(extra_args)
        self.for_pods = for_pods
        self.ready_timeout = ready_timeout
        self._controller_manager: _Process | None = None
        self._probes = 0
        self._etcd: _Process | None = None
        self._apiserver: _Process | None = None
        self.last_start_seconds: float | None = None
        """How long the last `start()` took until /readyz answered ok."""

        self.dir = Path(tempfile.mkdtemp(prefix="vram-e2e-"))
        # Runs at close(), when the object is collected, or at interpreter exit, whichever
        # comes first; also if the rest of __init__ fails.
        self._processes: list[_Process] = []
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, self._processes)
        self.port = free_port()
        self.etcd_port = free_port()
        self._etcd_peer_port = free_port()
        self.ca_file, ca_key = make_ca(self.dir)
        sans = "IP:127.0.0.1,DNS:localhost"
        if for_pods:
            sans += f",IP:{node_ip()},IP:{KUBERNETES_SERVICE_IP},DNS:kubernetes.default.svc"
        self._tls = make_serving_cert(self.dir, (self.ca_file, ca_key), "apiserver", sans)
        openssl("genrsa", "-out", "sa.key", "2048", cwd=self.dir)
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.dir)
        tokens = {ADMIN_TOKEN: ("admin", ["system:masters"]), **(static_tokens or {})}
        (self.dir / "tokens.csv").write_text(
            "".join(
                f'{token},{user},{user},"{",".join(groups)}"\n'
                for token, (user, groups) in tokens.items()
            )
        )

    # -- addresses and credentials ------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def admin_token(self) -> str:
        """A static token for user `admin` in group system:masters."""
        return ADMIN_TOKEN

    # -- lifecycle ------------------------------------------------------------------------

    def apiserver_args(self) -> list[str]:
        """The kube-apiserver command line."""
        d = self.dir
        if self.for_pods:
            network = ["--bind-address=0.0.0.0", f"--advertise-address={node_ip()}"]
        else:
            network = [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--disable-admission-plugins=ServiceAccount",
                "--endpoint-reconciler-type=none",
            ]
        return [
            str(self._apiserver_bin),
            f"--etcd-servers={self.etcd_url}",
            f"--secure-port={self.port}",
            *network,
            f"--cert-dir={d / 'certs'}",
            f"--tls-cert-file={self._tls[0]}",
            f"--tls-private-key-file={self._tls[1]}",
            f"--client-ca-file={self.ca_file}",
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={ISSUER}",
            f"--api-audiences={ISSUER}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            "--profiling=false",
            # Webhook Services resolve to their Endpoints (no kube-proxy here): the chart
            # test points its webhook Service at a process on this machine.
            "--enable-aggregator-routing=true",
            *self._extra_args,
        ]

    def etcd_args(self) -> list[str]:
        """The etcd command line."""
        peer = f"http://127.0.0.1:{self._etcd_peer_port}"
        return [
            str(self._etcd_bin),
            "--name",
            "e2e",
            "--data-dir",
            str(self.dir / "etcd"),
            "--listen-client-urls",
            self.etcd_url,
            "--advertise-client-urls",
            self.etcd_url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"e2e={peer}",
            "--log-level",
            "warn",
        ]

    @property
    def running(self) -> bool:
        return self._apiserver is not None and self._apiserver.running()

    def start(self) -> None:
        """Start etcd (first time only) and the API server, and wait for /readyz."""
        began = time.monotonic()
        deadline = began + self.ready_timeout
        if self._etcd is None or not self._etcd.running():
            self._etcd = self._spawn("etcd", self.etcd_args())
            self._wait(deadline, "etcd", self._etcd_healthy)
        if not self.running:
            self._apiserver = self._spawn("apiserver", self.apiserver_args())
        self._wait(deadline, "apiserver", self.is_ready)
        self.last_start_seconds = time.monotonic() - began
        if self._controller_manager is not None:
            self._controllers_caught_up()

    def stop(self) -> None:
        """Stop the API server only; etcd keeps the data for a later `start()`."""
        if self._apiserver is not None:
            self._apiserver.stop()
            self._apiserver = None

    def restart(self) -> None:
        """Stop and start the API server: same port, certificates, tokens and etcd data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop etcd and the API server and remove the temporary directory. Idempotent."""
        try:
            self.stop()
            if self._etcd is not None:
                self._etcd.stop()
                self._etcd = None
        finally:
            self._finalizer()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start_scheduler(self, config: Mapping[str, Any], name: str = "scheduler") -> None:
        """The real kube-scheduler with `config` (a KubeSchedulerConfiguration), connected
        to this server as admin (its `clientConnection` kept but for the kubeconfig), without
        leader election; returns once it is ready. It stops with `close()`."""
        binary = scheduler_binary()
        if binary is None:
            raise ApiServerError("no kube-scheduler: run tests/e2e/build-kubernetes.sh")
        kubeconfig = self.write_kubeconfig(self.dir / f"{name}.kubeconfig")
        connection = {**config.get("clientConnection", {}), "kubeconfig": str(kubeconfig)}
        connected = {
            **config,
            "clientConnection": connection,
            "leaderElection": {"leaderElect": False},
        }
        (self.dir / f"{name}.json").write_text(json.dumps(connected))
        self._start_component(name, [str(binary), f"--config={self.dir / f'{name}.json'}"])

    def start_controller_manager(
        self,
        name: str = "controller-manager",
        without: Sequence[str] = (),
        extra_args: Sequence[str] = (),
    ) -> None:
        """The real kube-controller-manager with its default controllers (ServiceAccounts
        and their tokens' CA, garbage collection, Deployments, Jobs, DaemonSets, the node
        lifecycle, ResourceClaims from templates, ...) but those named in `without`, each
        controller under its own ServiceAccount as in a real cluster, without leader
        election, with `extra_args` last; returns once it is running. It stops with `close()`.

        Where tests play the kubelet, leave out `node-lifecycle-controller`: a played
        kubelet sends no heartbeats, so the controller would mark its Nodes unreachable
        after 50 s, taint them, and evict their pods five minutes later."""
        binary = controller_manager_binary()
        if binary is None:
            raise ApiServerError("no kube-controller-manager: run tests/e2e/build-kubernetes.sh")
        kubeconfig = self.write_kubeconfig(self.dir / f"{name}.kubeconfig")
        self._start_component(
            name,
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                "--controllers=" + ",".join(["*", *(f"-{c}" for c in without)]),
                f"--service-account-private-key-file={self.dir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                *extra_args,
            ],
        )
        self._controller_manager = self._processes[-1]
        self._controllers_caught_up()

    def _controllers_caught_up(self) -> None:
        """Return once the controller-manager acts on a new namespace (it gets its `default`
        ServiceAccount and `kube-root-ca.crt`); the namespace is then deleted.

        Healthy is not acting: the controller-manager builds its controllers one by one
        after its /healthz answers. And once the API server has been down (`restart()`),
        client-go's reflectors list again only after their backoff, up to 30 s plus as much
        jitter: the first namespace made after a restart waited up to a minute for its
        ServiceAccount. The tests that make namespaces count on the controllers acting."""
        self._probes += 1
        name = f"e2e-controllers-{self._probes}"
        core = client.CoreV1Api(self.api_client())
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

        def acting() -> bool:
            try:
                core.read_namespaced_service_account("default", name)
                core.read_namespaced_config_map("kube-root-ca.crt", name)
            except client.ApiException:
                return False
            return True

        assert self._controller_manager is not None
        self._wait(time.monotonic() + 150, "controller-manager", acting, self._controller_manager)
        core.delete_namespace(name)

    def _start_component(self, name: str, argv: list[str]) -> None:
        """Start a control-plane component that authenticates its callers through this
        server, on a free loopback port, and wait for its /healthz."""
        kubeconfig = self.dir / f"{name}.kubeconfig"
        port = free_port()
        process = self._spawn(
            name,
            [
                *argv,
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # its own cert

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/healthz", context=insecure, timeout=2
                ) as r:
                    return int(r.status) == 200
            except OSError:
                return False

        self._wait(time.monotonic() + self.ready_timeout, name, healthy, process)

    def _spawn(self, name: str, argv: list[str]) -> _Process:
        process = _Process(argv, self.dir / f"{name}.log", self.dir)
        self._processes.append(process)
        return process

    # -- health ---------------------------------------------------------------------------

    def log_tail(self, name: str = "apiserver", lines: int = 40) -> str:
        """The last `lines` lines of `apiserver.log` or `etcd.log`."""
        path = self.dir / f"{name}.log"
        if not path.exists():
            return f"(no {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        """An admin GET of `path` on this server: (status, body)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(
            f"{self.url}{path}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        try:
            with urllib.request.urlopen(request, context=context, timeout=timeout) as r:
                return int(r.status), r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode(errors="replace")

    def is_ready(self) -> bool:
        """Whether /readyz answers ok (etcd reachable, post-start hooks done)."""
        try:
            return self.get("/readyz") == (200, "ok")
        except OSError:
            return False

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _wait(
        self, deadline: float, name: str, ready: Callable[[], bool], process: _Process | None = None
    ) -> None:
        process = process or (self._etcd if name == "etcd" else self._apiserver)
        while time.monotonic() < deadline:
            if process is None or not process.running():
                code = None if process is None else process.popen.returncode
                raise ApiServerError(
                    f"{name} exited with status {code}; the end of {self.dir / name}.log:\n"
                    f"{self.log_tail(name)}"
                )
            if ready():
                return
            time.sleep(0.1)
        detail = ""
        if name == "apiserver":
            try:
                detail = "\n/readyz?verbose says:\n" + self.get("/readyz?verbose")[1]
            except OSError as e:
                detail = f"\n/readyz is unreachable: {e}"
        raise ApiServerError(
            f"{name} not ready after {self.ready_timeout:.0f}s;{detail}\n"
            f"the end of {self.dir / name}.log:\n{self.log_tail(name)}"
        )

    # -- clients --------------------------------------------------------------------------

    def configuration(self, token: str | None = None) -> client.Configuration:
        """An official client Configuration for this server with bearer `token` (admin)."""
        c = client.Configuration()
        c.host = self.url
        c.proxy = None  # the client reads *_proxy from the environment: never for loopback
        c.ssl_ca_cert = str(self.ca_file)
        c.verify_ssl = True
        c.api_key = {"authorization": token or ADMIN_TOKEN}
        c.api_key_prefix = {"authorization": "Bearer"}
        return c

    def api_client(self, token: str | None = None) -> client.ApiClient:
        """An official `kubernetes.client.ApiClient` with bearer `token` (default: admin)."""
        return client.ApiClient(self.configuration(token))

    def client(self, token: str | None = None) -> client.ApiClient:
        """Same as `api_client`."""
        return self.api_client(token)

    def token_for_service_account(
        self,
        namespace: str,
        name: str,
        audiences: Sequence[str] | None = None,
        expiration_seconds: int = 3600,
    ) -> str:
        """A bound token for ServiceAccount `namespace/name`, minted with the TokenRequest API.

        The default audience is the API server's own (`--api-audiences`); a token for any
        other audience is rejected by this server. `expiration_seconds` must be >= 600.
        """
        core = client.CoreV1Api(self.api_client())
        body = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=list(audiences or [ISSUER]), expiration_seconds=expiration_seconds
            )
        )
        result: Any = core.create_namespaced_service_account_token(name, namespace, body)
        return str(result.status.token)

    def token_for(
        self, namespace: str, service_account: str, audiences: list[str] | None = None
    ) -> str:
        """Same as `token_for_service_account`."""
        return self.token_for_service_account(namespace, service_account, audiences)

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """Write a self-contained kubeconfig (CA embedded) for `token` (admin) to `path`.

        It is JSON, which is YAML: every kubeconfig loader reads it.
        """
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.url, "certificate-authority-data": ca_data},
                }
            ],
            "users": [{"name": "e2e", "user": {"token": token or ADMIN_TOKEN}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)
        return path

    def kubeconfig(self, token: str, path: Path) -> Path:
        """Same as `write_kubeconfig(path, token)`."""
        return self.write_kubeconfig(path, token)


def _cleanup(directory: Path, processes: list[_Process]) -> None:
    """Kill what is left and remove the directory: at close(), garbage collection or exit."""
    for process in processes:
        process.stop(timeout=5.0)
    shutil.rmtree(directory, ignore_errors=True)
