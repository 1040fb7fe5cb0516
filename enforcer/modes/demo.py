"""`vram-enforcer demo`: `exec`'s real enforcement, against a simulated GPU.

What a newcomer without an NVIDIA GPU can run to see the enforcer work. `exec.run` runs
unchanged (the subreaper, a sample every --interval, the process tree, the policy,
signals through verified pidfds, its stderr lines and its exit status) over a real child
process, the grower (`python -m enforcer.workloads.grower`), which claims more simulated
GPU memory a step at a time. Only NVML is simulated (`edge.simulated_gpu`), and every
line says so: the enforcer's log lines get the label here, the grower prints it itself.

Its exit status says whether it showed what its settings are for, not the grower's status
(143 after the SIGTERM it is meant to get, which fails a `&&` chain): 0 when the grower was
stopped over its limit, or left alone where it should be (`--action warn`, a limit it fits
in), with the enforcer seen at work; 1, and a line that says so, when it was not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from enforcer.core import exec_summary, messages
from enforcer.core.exec_summary import ExecSummary
from enforcer.core.model import Action, format_bytes
from enforcer.core.reasons import Reason
from enforcer.core.settings.demo import DemoSettings
from enforcer.core.settings.exec import ExecSettings
from enforcer.edge.pid_view import PidView
from enforcer.edge.procfs import ProcFs
from enforcer.edge.simulated_gpu import LABEL, NO_HARD_LIMITS, SimulatedNvml
from enforcer.modes import exec as exec_mode
from enforcer.workloads import grower

log = logging.getLogger(__name__)

GROWER = "enforcer.workloads.grower"
REAL_THING = "vram-enforcer exec --limit 4Gi -- python train.py"
EXIT_SHOWN = 0
EXIT_NOT_SHOWN = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # ^C: exec's status, passed on as it is


def run(settings: DemoSettings) -> int:
    """Run the grower under `exec` and the simulated GPU; 0 when it showed what it is for."""
    with _labelled():
        try:
            workdir = tempfile.TemporaryDirectory(prefix="vram-enforcer-demo-")
        except OSError as exc:
            log.error(
                "cannot create a directory for the simulated GPU: %s; set TMPDIR to "
                "a writable directory",
                exc,
            )
            return EXIT_USAGE
        with workdir as tmp:
            return _demo(settings, Path(tmp))


def _demo(settings: DemoSettings, tmp: Path) -> int:
    gpu = tmp / "gpu"
    gpu.mkdir()
    summary = tmp / "summary.json"
    limit = format_bytes(settings.limit_bytes)
    log.info(
        "vram-enforcer demo: exec's own enforcement (sampling, the process tree, the "
        "policy, signals through verified pidfds) runs a command that claims more and "
        "more GPU memory, under a %s limit. Only the GPU is simulated: no GPU or NVIDIA "
        "driver is used here",
        limit,
    )
    log.info("%s", messages.sampling_only(NO_HARD_LIMITS, settings.interval))
    status = exec_mode.run(
        ExecSettings(
            command=(sys.executable, "-m", GROWER, str(gpu)),
            limit_bytes=settings.limit_bytes,
            policy=settings.policy,
            interval=settings.interval,
            name="grower",
            hard_limits="off",  # said above: a simulated GPU has none
            summary=str(summary),
        ),
        # Its pids as this /proc names them (the grower writes its own); and no device
        # files for a process to be seen holding: a simulated GPU has none.
        exec_mode.Gpus(SimulatedNvml(gpu), PidView.host(ProcFs()), None),
    )
    ran = _read(summary)
    if ran is None or not ran.started:
        return status or EXIT_NOT_SHOWN  # exec has said why
    shown, line = outcome(ran, settings.limit_bytes < grower.PEAK)
    if shown:
        log.info("%s", line)
        return EXIT_SHOWN
    log.error("%s", line)
    return EXIT_INTERRUPTED if ran.exit_status == EXIT_INTERRUPTED else EXIT_NOT_SHOWN


def outcome(ran: ExecSummary, outgrows: bool) -> tuple[bool, str]:
    """The demo's last line (what the limit did to the grower, and what to run for real),
    and whether it is what the settings are meant to show. `outgrows`: the limit is under
    the grower's peak, so it is to be stopped, or with `--action warn` seen over and left
    alone; else it is to be seen and left alone."""
    limit = format_bytes(ran.limit_bytes)
    peak = format_bytes(ran.peak_bytes) if ran.peak_bytes is not None else "nothing"
    seen = f"exec saw the command tree hold {peak} at most"
    status = f"exit status {ran.exit_status}" + (f" ({ran.signal})" if ran.signal else "")
    real = f"On a machine with an NVIDIA GPU, the same without simulation: {REAL_THING}"
    warn = ran.action == str(Action.WARN)
    if any(e.reason == str(Reason.ENFORCED) for e in ran.events):
        what = f"the grower went over its {limit} limit ({seen}) and was stopped: {status}"
        return True, f"{what}. {real}"
    if outgrows and not warn:
        return False, (
            f"nothing was enforced: the grower should have been stopped over its {limit} "
            f"limit, and ended with {status}, not by the enforcer ({seen}). The demo did "
            "not show what it is for"
        )
    if ran.exit_status != 0:
        return False, f"the grower ended with {status}, and not by the enforcer ({seen})"
    if ran.exceeded_after is not None:
        what = (
            f"the grower went over its {limit} limit ({seen}); the action is "
            f"{ran.action}, so it was left alone: {status}"
        )
        return True, f"{what}. {real}"
    if outgrows or ran.peak_bytes is None:
        return False, (
            f"nothing was seen: the grower ran to its end ({status}) and {seen}, never over "
            f"its {limit} limit. The demo did not show what it is for"
        )
    what = f"the grower stayed within its {limit} limit ({seen}) and was left alone: {status}"
    return True, f"{what}. {real}"


def _read(path: Path) -> ExecSummary | None:
    """What exec's --summary says of the run; None (exec has said why) if it wrote none."""
    try:
        return exec_summary.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _label(record: logging.LogRecord) -> bool:
    """Once per record, whichever handlers it goes to; a JSON line also gets `simulated`."""
    if not getattr(record, "simulated", False):
        record.msg, record.args = f"{LABEL} {record.getMessage()}", ()
        record.simulated = True
    return True


@contextlib.contextmanager
def _labelled() -> Iterator[None]:
    """Every log line, the enforcer's own included, says that the GPU is simulated."""
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(_label)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_label)
