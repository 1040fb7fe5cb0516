"""A GPU that is not there, for `vram-enforcer demo` alone: NVML's edge, simulated.

`SimulatedNvml` is an `Nvml` whose snapshot lists one simulated GPU, and as its processes
whatever each live process has written to `DIR/<pid>` (a number of bytes; the demo's
grower writes it). Everything after the snapshot is the production code: `NvmlSource`
pins each listed pid by a pidfd, `exec` attributes, decides and signals as it does on a
real GPU. The pids are named as this process's `/proc` names them (the grower writes its
own), so the view to pair it with is that `/proc`'s (`PidView.host(ProcFs())`).

Only `enforcer.modes.demo` may import this module (an import-linter contract): no flag or
variable of `exec`, the agent or the sidecar can put a simulated GPU in front of them.
"""

from __future__ import annotations

from pathlib import Path

from enforcer.core.model import Device, HeldLimit, LimitOutcome, LimitResult
from enforcer.edge.nvml import Nvml, NvmlProcess, NvmlQueryError, NvmlSnapshot
from enforcer.edge.procfs import ProcFs

LABEL = "[simulated GPU]"  # what every line of the demo starts with, after its log level
UUID = "GPU-simulated-0"  # not the form of a real GPU's UUID: it cannot be taken for one
NAME = "simulated GPU"
TOTAL_BYTES = 16 * 1024**3
NO_HARD_LIMITS = "a simulated GPU has no driver to hold a cgroup to a limit"


class SimulatedNvml(Nvml):
    """NVML's interface over `directory` instead of a driver. A subclass, so that `exec`
    takes it where it takes an `Nvml`; every method that would reach the driver is
    replaced, and `init()` is never needed (the session has no handles to open)."""

    def __init__(self, directory: Path, procfs: ProcFs | None = None) -> None:
        super().__init__()
        self.driver_version = "simulated"
        self._directory = directory
        self._procfs = procfs or ProcFs()

    def snapshot(self) -> NvmlSnapshot:
        """The simulated GPU and what each live process says it holds. A process that has
        exited is dropped and its file removed, as a driver frees an exited process's
        memory."""
        try:
            paths = [p for p in self._directory.iterdir() if p.name.isdigit()]
        except OSError as exc:
            raise NvmlQueryError(f"reading the simulated GPU in {self._directory}: {exc}") from exc
        processes = []
        for path in paths:
            st = self._procfs.stat(int(path.name))
            if st is None or st.exited:
                path.unlink(missing_ok=True)
                continue
            try:
                used = int(path.read_text())
            except (OSError, ValueError):
                continue  # removed meanwhile, or not a number: not listed this pass
            processes.append(NvmlProcess(int(path.name), UUID, used))
        used_bytes = sum(p.used_bytes or 0 for p in processes)
        device = Device(0, UUID, NAME, TOTAL_BYTES, used_bytes)
        return NvmlSnapshot((device,), tuple(processes))

    def set_memory_limit(
        self, gpu_uuid: str, cgroup: str, hard_bytes: int, soft_bytes: int = 0
    ) -> LimitOutcome:
        return LimitOutcome(LimitResult.UNSUPPORTED, NO_HARD_LIMITS)

    def clear_memory_limit(self, gpu_uuid: str, cgroup: str) -> LimitOutcome:
        return LimitOutcome(LimitResult.UNSUPPORTED, NO_HARD_LIMITS)

    def memory_limit(self, gpu_uuid: str, cgroup: str) -> HeldLimit | LimitOutcome | None:
        return LimitOutcome(LimitResult.UNSUPPORTED, NO_HARD_LIMITS)
