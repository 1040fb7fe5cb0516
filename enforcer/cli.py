"""Argument parsing only: flags in, validated settings out, then hand over to a mode."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Sequence

from enforcer import __version__
from enforcer.core.config import (
    DEFAULT_RESOURCE,
    DEFAULT_SOCKET,
    ConfigError,
    agent_settings,
    doctor_settings,
    exec_settings,
    sidecar_settings,
    webhook_settings,
)
from enforcer.edge import logs

EXEC_EPILOG = """\
examples:
  vram-enforcer exec --limit 4Gi -- python train.py
  vram-enforcer exec --limit 12Gi --action kill --interval 50ms -- ./serve.sh
  vram-enforcer exec --limit 8Gi --action warn --metrics-port 9477 -- jupyter lab

how it works:
  Every --interval, the GPU memory of every process that NVML reports is summed over the
  command and all of its descendants (grandchildren and re-parented orphans included).
  Above --warn-at of the limit a warning is printed once. Over the limit for longer than
  --over-for, the process holding the most GPU memory is sent SIGTERM, then SIGKILL after
  --grace-period if it has not exited; the next largest follows if usage stays over. A
  process is only signalled after its pid, start time and membership in the command's
  tree were verified, through a pidfd.

processes that outlive the command:
  A process the command started and left running (a double fork, `cmd &`) is re-parented
  to vram-enforcer and stays under the limit: vram-enforcer keeps running until the last
  of them has exited, then exits with the command's status. It says so on stderr.

signals:
  SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to vram-enforcer are passed on to the command
  and to the processes it left running (a ^C from the terminal has reached the command
  already, and goes only to those outside its process group).

exit status:
  the command's own status, or 128+N if it was killed by signal N;
  2 if the enforcer could not start (bad flags, no NVML, wrong PID namespace);
  126/127 if the command could not be run / was not found.
"""


def _exec_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "exec",
        help="run a command under a GPU memory limit (no Kubernetes needed)",
        description="Run CMD and keep its GPU memory, with all of its descendants, under --limit.",
        epilog=EXEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--limit",
        required=True,
        help="GPU memory limit as a Kubernetes quantity: 4Gi, 512Mi, 8G (10^9) or bytes",
    )
    p.add_argument(
        "--action",
        default="terminate",
        help="what to do over the limit: terminate (SIGTERM, then SIGKILL), kill (SIGKILL), "
        "or warn (print only) [default: terminate]",
    )
    p.add_argument(
        "--grace-period",
        default="5s",
        help="time between SIGTERM and SIGKILL for --action terminate [default: 5s]",
    )
    p.add_argument(
        "--interval", default="100ms", help="how often usage is sampled [default: 100ms]"
    )
    p.add_argument(
        "--warn-at",
        default="90%",
        help="print a warning once usage reaches this share of the limit [default: 90%%]",
    )
    p.add_argument(
        "--over-for",
        default="0s",
        help="how long usage may stay over the limit before the action [default: 0s]",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="decide as usual but only print what would be signalled",
    )
    p.add_argument("--name", help="the unit's name in metrics [default: the command's basename]")
    _metrics_flags(p, "serve Prometheus metrics on this port (0 picks a free one) [default: off]",
                   "127.0.0.1")  # fmt: skip
    p.add_argument(
        "--host-proc",
        metavar="PATH",
        help="the host's /proc, mounted read-only, when running inside a container without "
        "--pid=host: NVML reports host PIDs, and they are translated through it",
    )
    _log_flags(p, default_format="text")
    p.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run"
    )


AGENT_EPILOG = """\
what it does:
  - reads NVML once per --interval for every GPU of the node;
  - serves each pod's sidecar the GPU usage of that pod's own processes on --socket,
    with PIDs translated into the pod's PID namespace (the caller is identified by the
    kernel: SO_PEERPIDFD, or SO_PEERCRED and a challenge on Linux < 6.5);
  - writes the node's VRAM (sum over GPUs or MIG partitions of total minus --reserve) to
    status.capacity and status.allocatable under --resource-name, and the labels
    vram-enforcer.io/gpu.product, gpu.count and gpu.memory (MiB of the smallest device),
    re-checking every --resync and patching only what differs.

health: with --metrics-port, /healthz answers 503 once no NVML pass has completed for 60s
(a liveness probe restarts a hung agent). A thread that stops ends the agent with status 1.

It must run with hostPID: true (NVML reports host PIDs) and as root.
"""


def _agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "agent",
        help="the node agent (DaemonSet): VRAM capacity, GPU labels, per-pod usage socket",
        description="Run the node agent.",
        epilog=AGENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node's name [default: $NODE_NAME]",
    )
    p.add_argument(
        "--socket", default=DEFAULT_SOCKET, help=f"usage socket [default: {DEFAULT_SOCKET}]"
    )
    p.add_argument("--interval", default="100ms", help="NVML sampling interval [default: 100ms]")
    p.add_argument(
        "--reserve",
        default="0",
        help="VRAM per GPU (or MIG partition) kept out of the advertised capacity [default: 0]",
    )
    p.add_argument(
        "--no-advertise", dest="advertise", action="store_false", help="do not write node capacity"
    )
    p.add_argument(
        "--no-labels", dest="labels", action="store_false", help="do not write node labels"
    )
    _resource_flags(p)
    p.add_argument(
        "--resync", default="60s", help="how often the Node is re-checked [default: 60s]"
    )
    p.add_argument(
        "--kubeconfig", help="kubeconfig file [default: in-cluster, then ~/.kube/config]"
    )
    _metrics_flags(p, METRICS_OFF, "0.0.0.0")  # noqa: S104 - scraped from other pods
    p.add_argument("--host-proc", default="/proc", help="the host's /proc [default: /proc]")
    _log_flags(p, default_format="json")


def _resource_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resource-name",
        default=DEFAULT_RESOURCE,
        help=f"the extended resource that counts VRAM [default: {DEFAULT_RESOURCE}]",
    )
    p.add_argument(
        "--resource-unit",
        default="1",
        help="bytes per unit of the resource: with 1Gi, a limit of 3 means 3 GiB [default: 1]",
    )


METRICS_OFF = "serve Prometheus metrics on this port [default: off]"


def _metrics_flags(p: argparse.ArgumentParser, port_help: str, address: str) -> None:
    p.add_argument("--metrics-port", type=int, help=port_help)
    p.add_argument(
        "--metrics-address",
        default=address,
        help=f"address for --metrics-port [default: {address}]",
    )


def _log_flags(p: argparse.ArgumentParser, default_format: str) -> None:
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default_format,
        help=f"[default: {default_format}]",
    )
    p.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )


SIDECAR_EPILOG = """\
environment (set by the admission webhook; the flags above override them):
  POD_NAME, POD_NAMESPACE, POD_UID, NODE_NAME   the pod, from the Downward API
  VRAM_ENFORCER_LIMITS        {"container-name": bytes, ...}
  VRAM_ENFORCER_ACTION        warn | terminate | kill | restart      [terminate]
  VRAM_ENFORCER_GRACE_PERIOD  SIGTERM to SIGKILL                     [5s]
  VRAM_ENFORCER_INTERVAL      how often usage is checked             [100ms]
  VRAM_ENFORCER_WARN_AT       warn once at this share of a limit     [90%]
  VRAM_ENFORCER_AGENT_SOCKET  the node agent                         [/run/vram-enforcer/agent.sock]
  VRAM_ENFORCER_SIDECAR_MODE  native | container                     [native]

A process counts for a container when the container ID in its cgroup is one that kubelet
reports in this pod's status. restart sends the container's init process SIGTERM (then
SIGKILL), so that kubelet restarts the container. Processes whose container cannot be
proven are checked against the pod's total and reported, never signalled.
"""


def _sidecar_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sidecar",
        help="the in-pod enforcer (injected by the webhook)",
        description="Enforce each container's declared VRAM limit, from inside the pod.",
        epilog=SIDECAR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--limits", help="overrides VRAM_ENFORCER_LIMITS")
    p.add_argument("--action", help="overrides VRAM_ENFORCER_ACTION")
    p.add_argument("--grace-period", help="overrides VRAM_ENFORCER_GRACE_PERIOD")
    p.add_argument("--interval", help="overrides VRAM_ENFORCER_INTERVAL")
    p.add_argument("--warn-at", help="overrides VRAM_ENFORCER_WARN_AT")
    p.add_argument("--over-for", help="how long usage may stay over a limit [default: 0s]")
    p.add_argument(
        "--dry-run", action="store_true", help="report what would be signalled, signal nothing"
    )
    p.add_argument(
        "--undeclared",
        default="deny",
        help="deny: a container that declares no VRAM has a limit of 0; allow: it is not checked "
        "[default: deny]",
    )
    p.add_argument(
        "--source", default="agent", help="agent (the node agent's socket) or nvml [default: agent]"
    )
    p.add_argument("--agent-socket", help="overrides VRAM_ENFORCER_AGENT_SOCKET")
    p.add_argument("--host-proc", help="with --source nvml: the host's /proc, mounted read-only")
    p.add_argument(
        "--stale-after", default="2s", help="usage older than this counts as unknown [default: 2s]"
    )
    p.add_argument("--sidecar-mode", help="overrides VRAM_ENFORCER_SIDECAR_MODE")
    p.add_argument("--kubeconfig", help="[default: in-cluster]")
    _metrics_flags(p, "overrides VRAM_ENFORCER_METRICS_PORT [default: 9477]", "0.0.0.0")  # noqa: S104
    _log_flags(p, default_format="json")


WEBHOOK_EPILOG = """\
The API server calls POST /mutate for each pod CREATE in namespaces labelled
vram-enforcer.io/inject=enabled (see the chart's MutatingWebhookConfiguration). A pod
that declares --resource-name in a container's limits gets the sidecar, a shared process
namespace, the agent socket, VRAM_LIMIT_BYTES and a /dev/shm. Pod annotations:
  vram-enforcer.io/inject: "false"            leave this pod alone
  vram-enforcer.io/action: kill               warn | terminate | kill | restart
  vram-enforcer.io/grace-period: 30s          SIGTERM to SIGKILL
  vram-enforcer.io/warn-at: 80%               warn once at this share of a limit
  vram-enforcer.io/shm-size: auto             auto | off | a quantity such as 8Gi
  vram-enforcer.io/metrics-port: "9500"       the sidecar's /metrics port [default: 9477,
                                              or the next one no container declares]

The certificate and key are re-read when they change on disk (cert-manager rotation).
/healthz and /readyz answer plain GETs. SIGTERM drains requests in flight, then exits.
"""


def _webhook_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "webhook",
        help="the mutating admission webhook that injects the sidecar",
        description="Serve AdmissionReviews over HTTPS and inject the enforcer into pods "
        "that declare VRAM.",
        epilog=WEBHOOK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tls-cert-file", required=True, help="PEM serving certificate (reloaded on change)"
    )
    p.add_argument("--tls-key-file", required=True, help="PEM private key (reloaded on change)")
    p.add_argument("--port", type=int, default=8443, help="HTTPS port [default: 8443]")
    p.add_argument("--address", default="0.0.0.0", help="[default: 0.0.0.0]")  # noqa: S104
    p.add_argument("--sidecar-image", required=True, help="the enforcer image to inject")
    p.add_argument(
        "--sidecar-mode",
        default="auto",
        help="native (init container with restartPolicy Always, Kubernetes >= 1.29), container "
        "(a regular container), or auto (by the API server's version) [default: auto]",
    )
    _resource_flags(p)
    p.add_argument(
        "--no-framework-env",
        dest="framework_env",
        action="store_false",
        help="do not set XLA_PYTHON_CLIENT_PREALLOCATE=false and TF_FORCE_GPU_ALLOW_GROWTH=true",
    )
    p.add_argument(
        "--shm-default",
        default="auto",
        help="the /dev/shm of pods without the shm-size annotation: auto (memory-backed, "
        "sized to the largest container memory limit), off, or a quantity [default: auto]",
    )
    p.add_argument(
        "--gpu-exposure",
        default="none",
        help="none, or env: set NVIDIA_VISIBLE_DEVICES=all on declaring containers, for pods "
        "that request VRAM but not nvidia.com/gpu (see docs/security.md) [default: none]",
    )
    p.add_argument("--runtime-class", help="with --gpu-exposure env: set this runtimeClassName")
    p.add_argument("--sidecar-cpu", default="10m", help="the sidecar's CPU request [default: 10m]")
    p.add_argument(
        "--sidecar-memory",
        default="96Mi",
        help="the sidecar's memory request and limit [default: 96Mi]",
    )
    p.add_argument("--agent-socket", default=DEFAULT_SOCKET, help=f"[default: {DEFAULT_SOCKET}]")
    p.add_argument("--kubeconfig", help="for --sidecar-mode auto [default: in-cluster]")
    _metrics_flags(p, METRICS_OFF, "0.0.0.0")  # noqa: S104 - scraped from other pods
    _log_flags(p, default_format="json")


def _doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check NVML, the PID namespace, the agent socket and the API (RBAC)",
        description="Try each thing vram-enforcer depends on, here, and say what to fix. "
        "Exits 1 if a check failed.",
        epilog="examples:\n"
        "  vram-enforcer doctor --no-api                      # a workstation, before exec\n"
        "  kubectl exec POD -c vram-enforcer -- vram-enforcer doctor --no-nvml\n"
        "  kubectl -n vram-enforcer exec AGENT_POD -- vram-enforcer doctor",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--no-nvml", dest="nvml", action="store_false", help="skip the NVML check")
    p.add_argument("--no-agent", dest="agent", action="store_false", help="skip the socket check")
    p.add_argument("--no-api", dest="api", action="store_false", help="skip the API checks")
    p.add_argument(
        "--agent-socket", help=f"[default: $VRAM_ENFORCER_AGENT_SOCKET or {DEFAULT_SOCKET}]"
    )
    p.add_argument("--kubeconfig", help="[default: in-cluster, then ~/.kube/config]")
    p.add_argument(
        "--namespace", help="for the sidecar's RBAC [default: $POD_NAMESPACE or default]"
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    _log_flags(p, default_format="text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vram-enforcer",
        description="Enforce GPU memory (VRAM) limits on processes and Kubernetes containers.",
    )
    parser.add_argument("--version", action="version", version=f"vram-enforcer {__version__}")
    sub = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    _exec_parser(sub)
    _agent_parser(sub)
    _sidecar_parser(sub)
    _webhook_parser(sub)
    _doctor_parser(sub)
    return parser


# mode -> (settings builder, default log level, the module whose run() takes the settings).
# Each builder's keyword arguments are the mode's argparse destinations.
_MODES: dict[str, tuple[Callable[..., object], int, str]] = {
    "exec": (exec_settings, logging.WARNING, "enforcer.modes.exec"),
    "agent": (agent_settings, logging.INFO, "enforcer.modes.agent"),
    "sidecar": (sidecar_settings, logging.INFO, "enforcer.modes.sidecar"),
    "webhook": (webhook_settings, logging.INFO, "enforcer.modes.webhook"),
    "doctor": (doctor_settings, logging.WARNING, "enforcer.modes.doctor"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    build, level, module = _MODES[args.mode]
    try:
        params = inspect.signature(build).parameters
        values = {name: getattr(args, name) for name in params if name != "environ"}
        if "environ" in params:
            values["environ"] = os.environ
        settings = build(**values)
    except ConfigError as exc:
        print(f"vram-enforcer {args.mode}: error: {exc}", file=sys.stderr)
        return 2
    logs.setup(args.log_format, args.verbose, default_level=level)
    try:
        # Imported late: `--help` and bad flags stay fast, and a mode loads only its own needs.
        return int(importlib.import_module(module).run(settings))
    except KeyboardInterrupt:
        return 130
