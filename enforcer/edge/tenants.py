"""Which tenant each GPU process of the node runs for, read from the host's `/proc`.

The agent counts a GPU's tenants from this on every pass, so each process's cgroup is read
once, when NVML first lists it, and forgotten when NVML stops listing it.
"""

from __future__ import annotations

from enforcer.core.attribution import tenants_per_gpu
from enforcer.core.cgroups import CONTAINER, tenant
from enforcer.core.model import ProcessKey, Sample
from enforcer.edge.procfs import ProcFs


class TenantCache:
    def __init__(self, procfs: ProcFs) -> None:
        self._procfs = procfs
        self._known: dict[ProcessKey, str] = {}

    def count(self, sample: Sample) -> dict[str, int]:
        """Tenants per GPU uuid of the sample (its keys are host pids)."""
        listed = {p.key for p in sample.processes}
        self._known = {k: v for k, v in self._known.items() if k in listed}
        for key in listed - self._known.keys():
            entries = self._procfs.cgroup(key.pid)
            found = tenant(entries) if entries else None
            # Read after the cgroup: a pid reused in between is not taken for the listed one.
            if found is not None and self._procfs.start_time(key.pid) == key.start_time:
                self._known[key] = found
        return tenants_per_gpu(sample, self._known)

    def containers(self) -> dict[ProcessKey, str]:
        """The container ID of each process of the last sample that runs in one."""
        return {
            k: t.removeprefix(CONTAINER) for k, t in self._known.items() if t.startswith(CONTAINER)
        }
