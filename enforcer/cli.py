"""The command line: one subcommand per mode, its flags made from the mode's declared
settings (`enforcer.core.settings`), validated settings handed over to the mode."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from enforcer import __version__
from enforcer.core.model import format_bytes
from enforcer.core.parsing import ConfigError
from enforcer.core.settings import Setting, Values, environment_text, help_text, resolve
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

hard limits (--hard-limits auto):
  Where the NVIDIA driver can (R615 and newer, cgroup v2, run as root), the command starts
  in a cgroup of its own that the driver holds to the limit on every GPU (capped at each
  GPU's memory): an allocation past it fails with out-of-memory in the program, before any
  neighbour is affected. Sampling goes on as above, for the sum over GPUs. Elsewhere one
  line says why there is no hard limit, and sampling alone enforces.

allocation gate (--allocation-gate on; experimental, unverified on any GPU):
  Where the driver's limits cannot hold (NVIDIA 535 to 599, kernel 5.5+, no MIG), the
  command starts under a seccomp filter that hands the driver's allocation calls to
  vram-enforcer before they run. A call that would take the command tree past --limit
  gets the driver's own out-of-memory status: the program sees CUDA's out-of-memory error
  and lives, and one line says the sizes. It is cooperative, not a boundary (a thread that
  rewrites a call after the check gets past; managed memory is not seen), so sampling stays
  on as the backstop. Under another seccomp listener it warns and samples only.

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
  2 if the enforcer could not start (bad flags, no NVML, wrong PID namespace, or no
    hard limit with --hard-limits required);
  126/127 if the command could not be run / was not found.
"""


DEMO_EPILOG = """\
what it shows:
  A real command (python -m enforcer.workloads.grower) claims 256 MiB more GPU memory
  every 0.25 s, up to 1536 MiB, under `vram-enforcer exec`'s own enforcement: a sample
  every --interval, the command's process tree, the policy, a signal through a verified
  pidfd, the line that says why, and the command's exit status. Only the GPU is
  simulated: the command allocates nothing, and writes what it holds where the simulated
  NVML reads it. No GPU, NVIDIA driver or root is needed, and every line says
  [simulated GPU]. Nothing can make exec, the agent or the sidecar use a simulated GPU:
  this subcommand alone runs one.

examples:
  vram-enforcer demo                  # stopped at 1.25 GiB, over its 1Gi limit (SIGTERM)
  vram-enforcer demo --action kill    # SIGKILL instead of SIGTERM
  vram-enforcer demo --limit 2Gi      # it fits: seen, and left alone

on a machine with an NVIDIA GPU, the real thing (see vram-enforcer exec --help):
  vram-enforcer exec --limit 4Gi -- python train.py

exit status:
  0 when the demo showed what its settings are for: the command stopped over its limit
  (the command's own status, 143 after SIGTERM or 137 after SIGKILL, is on the last line),
  or seen and left alone where it fits or with --action warn; 1, with a line that says so,
  when it did not (nothing was enforced); 130 on ^C; 2 if the demo could not start.
"""


AGENT_EPILOG = """\
what it does:
  - reads NVML once per --interval for every GPU of the node;
  - connects to the sidecar of each pod the webhook injected (its socket, in the pod's
    own filesystem) and sends it the GPU usage of that pod's own processes, with PIDs
    translated into the pod's PID namespace, and its pod; sidecars of 0.1.0, doctor and
    other callers connect to --socket instead (the caller is identified by the kernel:
    SO_PEERPIDFD, or SO_PEERCRED and a challenge on Linux < 6.5);
  - writes the node's VRAM (sum over GPUs or MIG partitions of total minus --reserve) to
    status.capacity and status.allocatable under --resource-name, and the labels
    vram-enforcer.io/gpu.product, gpu.count and gpu.memory (MiB of the smallest device),
    re-checking every --resync and patching only what differs.

health: with --metrics-port, /healthz answers 503 once no NVML pass (or no check of the
sidecars) has completed for 60s (a liveness probe restarts a hung agent). A thread that
stops ends the agent with status 1.

It must run with hostPID: true (NVML reports host PIDs) and as root.
"""


SIDECAR_NOTES = """\
A process counts for a container when the container ID in its cgroup is one that kubelet
reports in this pod's status. restart sends the container's init process SIGTERM (then
SIGKILL), so that kubelet restarts the container. Processes whose container cannot be
proven are checked against the pod's total and reported, never signalled.
"""


WEBHOOK_EPILOG = """\
The API server calls POST /mutate for each pod CREATE in namespaces labelled
vram-enforcer.io/inject=enabled (see the chart's MutatingWebhookConfiguration). A pod
that declares --resource-name in a container's limits gets the sidecar, a shared process
namespace, the agent socket, VRAM_LIMIT_BYTES and a /dev/shm. A container that asks for
a GPU (--gpu-resources) and declares no VRAM is denied, declared with --default-vram, or
admitted as it is, as --undeclared-gpu (or its namespace's undeclaredGpu) says. Pod
annotations:
  vram-enforcer.io/inject: "false"            leave this pod alone (it runs unenforced): only
                                              with --allow-opt-out, else it is denied
  vram-enforcer.io/action: kill               terminate | kill | restart, or warn | dry-run
                                              (report only): only those in --tenant-actions
                                              (not warn, by default), else it is denied;
                                              without it: --default-action (or the
                                              namespace's defaultAction)
  vram-enforcer.io/grace-period: 30s          SIGTERM to SIGKILL, at most --max-grace-period
  vram-enforcer.io/vram-ceiling: 16Gi         borrow above the request while the GPU has
                                              room, up to --max-vram-ceiling (0: none)
  vram-enforcer.io/warn-at: 80%               warn once at this share of a limit
  vram-enforcer.io/shm-size: auto             auto | off | a quantity such as 8Gi
  vram-enforcer.io/metrics-port               ignored since 0.2.0, with a warning: the sidecar
                                              serves no metrics (the node agent serves the pod's)
The flags named bound what a pod may ask; --namespace-bounds sets them per namespace.

The certificate and key are re-read when they change on disk (cert-manager rotation).
/healthz and /readyz answer plain GETs. SIGTERM drains requests in flight, then exits.
"""


INTERFERENCE_EPILOG = """\
examples:
  vram-enforcer interference --builtin matmul,copy,cnn,infer --gpu 0 --output results/
  vram-enforcer interference --repeat 5 \\
      --workload 'trainer:20Gi:python train.py --epochs 1' \\
      --workload 'server:8Gi:python serve.py --requests 2000'
  vram-enforcer interference --builtin matmul,copy --builtin-device cpu --builtin-scale 0.2

what it does:
  Each workload runs alone (--warmup runs first, discarded, then --repeat measured runs),
  and next to each workload, itself included (a second copy), --repeat times: the two
  are started together on the same GPU. The repetitions are interleaved: everything
  once, then everything again. Every run goes through `vram-enforcer exec --limit LIMIT`
  (the LIMIT of --workload NAME:LIMIT:COMMAND), which times the command from start to
  exit, samples its peak GPU memory and stops it if it goes over its limit: a pair that
  does not fit is a cell of the report, not a crash.

timing:
  A workload may time its work itself, after its start-up, and write the section to the
  file that $VRAM_ENFORCER_TIMING_FILE names, as {{"start_monotonic": S, "end_monotonic":
  E}} on CLOCK_MONOTONIC (Python: time.monotonic()); the built-ins do. If every good run
  of a workload wrote one, its figures are those sections, which its start-up does not
  dilute; otherwise exec's times of the whole command. See docs/interference.md.

the report (stdout; with --output also report.json, report.md, heatmap.png, runs/):
  One row per workload: its median time alone, then its slowdown next to each neighbour
  (median time next to it / median time alone) and its own peak GPU memory. OVER: exec
  stopped it over its limit; OOM: it crashed out of memory; FAIL: it failed otherwise;
  TIMEOUT: stopped after --timeout; n/m: in n of m runs. * marks a cell whose
  repetitions spread more than --max-spread ((max - min) / median); ~ a pair where the
  neighbour finished long before, so that the rest of the run was a run alone.

built-in workloads (--builtin; PyTorch in this Python, python -m enforcer.workloads):
{builtins}

signals:
  SIGINT (^C), SIGTERM and SIGHUP stop the runs in flight (through exec, which passes the
  signal on) and the report of what was measured so far is printed and written, marked
  PARTIAL.

exit status:
  0 the report was made, and at least one measured run went well, whatever the others
    did; 1 it could not be written;
  2 bad input (a workload, a flag, no PyTorch for --builtin), or exec cannot start here
    (no NVML: it needs the NVIDIA driver, with --builtin-device cpu too); nothing ran;
  3 not one measured run went well: the report, made all the same, has no figure, and
    one line says why;
  128+N when signal N stopped the measurement.
"""


DOCTOR_EPILOG = """\
examples:
  vram-enforcer doctor                               # a workstation, before exec
  kubectl exec POD -c vram-enforcer -- vram-enforcer doctor --no-nvml
  kubectl -n vram-enforcer exec AGENT_POD -- vram-enforcer doctor
"""


RECOMMEND_EPILOG = """\
examples:
  vram-enforcer recommend --prometheus http://localhost:9090
  vram-enforcer recommend --prometheus http://localhost:9090 --namespace ml --window 14d
  vram-enforcer recommend --prometheus http://localhost:9090 --namespace ml --output yaml

what it does:
  Asks Prometheus for each container's highest GPU memory over --window (the agents'
  vram_enforcer_container_peak_bytes, and vram_enforcer_undeclared_used_bytes for pods
  that declare nothing), groups the pods by workload (vram_enforcer_pod_owner: a
  Deployment, StatefulSet, DaemonSet, Job, CronJob, or the pod itself), and for each
  workload's container prints the highest peak, the peak at --percentile of its pods,
  and a limit: that peak plus --headroom, rounded up to --round. The PromQL is in
  docs/operations.md, "Choosing a limit".

exit status:
  0 the recommendations were printed; 1 Prometheus could not be asked, or holds no
  peak (one line says what to check); 2 bad flags.
"""


def _interference_epilog() -> str:
    from enforcer.core.interference.workloads import BUILTINS  # noqa: PLC0415 - for this --help only

    lines = (
        f"  {b.name:<8}{format_bytes(b.limit_bytes):>9}  {b.profile}" for b in BUILTINS.values()
    )
    return INTERFERENCE_EPILOG.format(builtins="\n".join(lines))


@dataclass(frozen=True, slots=True)
class Mode:
    """A subcommand: where its settings are declared, how they become the mode's settings,
    and where it runs. Both modules are imported for the mode that runs and no other: the
    sidecar, in every pod, does not load the webhook's settings (with the admission code)
    or interference's."""

    settings: str  # the module that declares them: DECLARED, LOG_FORMAT, VERBOSE
    build: Callable[[Any, Values, argparse.Namespace], object]  # (that module, values, args)
    level: int  # the log level without -v
    module: str  # imported only to run: --help and bad flags stay fast
    help: str
    description: str
    epilog: Callable[[], str]

    def config(self) -> Any:
        return importlib.import_module(self.settings)

    @property
    def declared(self) -> tuple[Setting[Any], ...]:
        declared: tuple[Setting[Any], ...] = self.config().DECLARED
        return declared


MODES = {
    "exec": Mode(
        "enforcer.core.settings.exec",
        lambda cfg, values, args: cfg.exec_settings(values, args.command),
        logging.WARNING,
        "enforcer.modes.exec",
        "run a command under a GPU memory limit (no Kubernetes needed)",
        "Run CMD and keep its GPU memory, with all of its descendants, under --limit.",
        lambda: EXEC_EPILOG,
    ),
    "demo": Mode(
        "enforcer.core.settings.demo",
        lambda cfg, values, _: cfg.demo_settings(values),
        logging.INFO,
        "enforcer.modes.demo",
        "see exec stop a command over its limit, on a simulated GPU (no GPU needed)",
        "Run exec's real enforcement over a command that outgrows its GPU memory limit, "
        "against a simulated GPU: no NVIDIA GPU or driver is used, and every line says so.",
        lambda: DEMO_EPILOG,
    ),
    "agent": Mode(
        "enforcer.core.settings.agent",
        lambda cfg, values, _: cfg.agent_settings(values),
        logging.INFO,
        "enforcer.modes.agent",
        "the node agent (DaemonSet): VRAM capacity, GPU labels, per-pod usage socket",
        "Run the node agent.",
        lambda: AGENT_EPILOG,
    ),
    "sidecar": Mode(
        "enforcer.core.settings.sidecar",
        lambda cfg, values, _: cfg.sidecar_settings(values),
        logging.INFO,
        "enforcer.modes.sidecar",
        "the in-pod enforcer (injected by the webhook)",
        "Enforce each container's declared VRAM limit, from inside the pod.",
        lambda: SIDECAR_NOTES,
    ),
    "webhook": Mode(
        "enforcer.core.settings.webhook",
        lambda cfg, values, _: cfg.webhook_settings(values),
        logging.INFO,
        "enforcer.modes.webhook",
        "the mutating admission webhook that injects the sidecar",
        "Serve AdmissionReviews over HTTPS and inject the enforcer into pods that declare VRAM.",
        lambda: WEBHOOK_EPILOG,
    ),
    "interference": Mode(
        "enforcer.core.settings.interference",
        lambda cfg, values, args: cfg.interference_settings(values, args.workloads, sys.executable),
        logging.INFO,
        "enforcer.modes.interference",
        "measure how much workloads slow each other down when they share a GPU",
        "Run each workload alone, then each pair together on one GPU, each under exec with "
        "its GPU memory limit, and report each workload's slowdown, its peak GPU memory and "
        "what crashed.",
        _interference_epilog,
    ),
    "recommend": Mode(
        "enforcer.core.settings.recommend",
        lambda cfg, values, _: cfg.recommend_settings(values),
        logging.WARNING,
        "enforcer.modes.recommend",
        "recommend each workload's VRAM limit from the peaks Prometheus kept",
        "Read each container's observed GPU memory peak from Prometheus and print, per "
        "workload, the peak and a recommended limit, as a table or as YAML for its manifest.",
        lambda: RECOMMEND_EPILOG,
    ),
    "doctor": Mode(
        "enforcer.core.settings.doctor",
        lambda cfg, values, _: cfg.doctor_settings(values),
        logging.WARNING,
        "enforcer.modes.doctor",
        "check NVML, the PID namespace, the agent socket and the API (RBAC)",
        "Try each thing vram-enforcer depends on, here, and say what to fix. Exits 1 if a "
        "check failed.",
        lambda: DOCTOR_EPILOG,
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse, where a word that starts with a dash and a digit (`-4Gi`, `-5s`) is a value,
    as in Python 3.14's argparse: before 3.14 only a bare number was, so `--limit -4Gi` got
    "expected one argument" and never reached the check that says what is wrong with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")


def _environment(declared: Sequence[Setting[Any]]) -> str:
    """The environment variables a mode reads, for its --help, laid out by argparse as its
    flags are: a long name on a line of its own, descriptions wrapped to the terminal."""
    formatter = argparse.HelpFormatter("vram-enforcer", max_help_position=30)
    formatter.start_section("environment (a flag, where there is one, wins)")
    for s in declared:
        if s.env:
            formatter.add_argument(argparse.Action([s.env], s.key, 0, help=environment_text(s)))
    formatter.end_section()
    shown = formatter.format_help()  # empty without variables
    return shown + "\n" if shown else ""


def _add(parser: argparse.ArgumentParser, s: Setting[Any]) -> None:
    if not s.flag:
        return
    if s.kind == "switch":
        parser.add_argument(
            s.flag, dest=s.key, action="store_true", default=None, help=help_text(s)
        )
    elif s.kind == "count":
        parser.add_argument(
            s.flag, "--verbose", dest=s.key, action="count", default=0, help=help_text(s)
        )
    else:
        parser.add_argument(s.flag, dest=s.key, metavar=s.metavar, default=None, help=help_text(s))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line. With `only`, the flags of that mode alone are declared, so that no
    other mode's settings are imported; without it, every mode's (`--help`, tests)."""
    parser = _Parser(
        prog="vram-enforcer",
        description="Enforce GPU memory (VRAM) limits on processes and Kubernetes containers.",
    )
    parser.add_argument("--version", action="version", version=f"vram-enforcer {__version__}")
    sub = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    for name, mode in MODES.items():
        if only is not None and name != only:
            sub.add_parser(name, help=mode.help)
            continue
        p = sub.add_parser(
            name,
            help=mode.help,
            description=mode.description,
            epilog=_environment(mode.declared) + mode.epilog(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for setting in mode.declared:
            _add(p, setting)
        if name == "exec":
            p.add_argument(
                "command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run"
            )
        elif name == "interference":
            p.add_argument(
                "--workload",
                dest="workloads",
                action="append",
                default=[],
                metavar="NAME:LIMIT:COMMAND",
                help="a workload: its name, its GPU memory limit (a quantity) and "
                "its command, split as a shell would; once per workload",
            )
    return parser


def configure(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[Mode, Values, object]:
    """The mode that the command line asks for, its values (flags, then `environ`, then
    defaults) and its validated settings. Raises ConfigError for a bad value."""
    mode = MODES[args.mode]
    cfg = mode.config()
    given = {s.key: getattr(args, s.key) for s in cfg.DECLARED if s.flag}
    values = resolve(cfg.DECLARED, given, environ)
    return mode, values, mode.build(cfg, values, args)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = words[0] if words and words[0] in MODES else None
    args = build_parser(chosen).parse_args(words)
    try:
        mode, values, settings = configure(args, os.environ)
    except ConfigError as exc:
        print(f"vram-enforcer {args.mode}: error: {exc}", file=sys.stderr)
        return 2
    cfg = mode.config()
    logs.setup(values[cfg.LOG_FORMAT], values[cfg.VERBOSE], default_level=mode.level)
    try:
        return int(importlib.import_module(mode.module).run(settings))
    except KeyboardInterrupt:
        return 130
