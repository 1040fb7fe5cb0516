"""The tier probe: what the choice of enforcement tier (`tier_choice.choose`) depends on, read
from this machine. It reads, never sets: NVML's Get on the probed cgroup (no privilege
needed) tells whether the driver can count it.

The probed cgroup is the one below which limited cgroups are made: `exec`'s own (its
command's cgroup goes below it), the kubelet's `kubepods` for the agent. The driver needs a
cgroup's `dmem` files where the kernel's dmem controller is in use, and a cgroup has them
only where every ancestor hands `dmem` down (`cgroup.subtree_control`): the first that
does not is named.

The filesystem reads (the cgroup hierarchy, CDI specs on the host, which a hostile or hung
mount can hold) run on a `tier-probe` thread of their own, within `READ_WITHIN`: a read
that does not come back is said ("did not answer"), and is not started again while its
thread still waits.

What the allocation gate needs (`_GateFacts`) is read from small `/proc` files and
`uname`: the kernel's seccomp user notification, Yama's ptrace scope, NVIDIA's majors.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from enforcer.core.cdi import SPEC_SUFFIXES, memory_limit_hook_gpus
from enforcer.core.hard_limits import mig_gpus, per_gpu
from enforcer.core.model import LimitOutcome
from enforcer.core.tier_choice import Probe
from enforcer.edge import cgroupfs
from enforcer.edge.nvml import Nvml, NvmlError
from enforcer.edge.nvml_source import gpu_device_majors

READ_WITHIN = 2.0  # s: the filesystem part of one probe, at most
# Below the host's root: the CDI registry's defaults. `var/run` is an absolute link to
# `/run` on most distributions, which would resolve in our own root, not the host's.
CDI_DIRS = ("etc/cdi", "var/run/cdi", "run/cdi")
MOST_SPECS = 64  # spec files read per directory
MOST_SPEC_BYTES = 1 << 20  # of each


@dataclass(frozen=True, slots=True)
class _Found:
    """What the filesystem part found."""

    cgroup_v2: str = ""
    dmem: bool = False
    cgroup: str = ""
    no_dmem_at: str = ""
    hook_gpus: tuple[str, ...] = ()


# The kernel that first has SECCOMP_USER_NOTIF_FLAG_CONTINUE: the gate lets calls go on with it
CONTINUE_SINCE = (5, 5)
_CAP_SYS_PTRACE = 19


@dataclass(frozen=True, slots=True)
class _GateFacts:
    """What the allocation gate needs of this machine (`tier_choice.gate_fit`)."""

    seccomp_notify: str
    machine: str
    ptrace_blocked: str
    gpu_majors: tuple[int, ...]

    @classmethod
    def read(cls, proc: Path = Path("/proc")) -> _GateFacts:
        majors = gpu_device_majors()
        return cls(
            _seccomp_notify(proc, os.uname().release),
            os.uname().machine,
            _ptrace_blocked(proc),
            tuple(sorted(majors or ())),
        )

    def onto(self, probe: Probe) -> Probe:
        return replace(
            probe,
            seccomp_notify=self.seccomp_notify,
            machine=self.machine,
            ptrace_blocked=self.ptrace_blocked,
            gpu_majors=self.gpu_majors,
        )


def gate_blocked(proc: Path = Path("/proc")) -> str:
    """Why this kernel keeps the allocation gate from running ("" where it can): no user
    notification with CONTINUE, or the callers' memory unreadable. The same in every PID
    namespace: the node agent asks it of its own `/proc`."""
    return _seccomp_notify(proc, os.uname().release) or _ptrace_blocked(proc)


def _seccomp_notify(proc: Path, release: str) -> str:
    """Why the kernel's seccomp user notification cannot serve the gate, "" where it can."""
    try:
        actions = (proc / "sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError as exc:
        return f"cannot read the kernel's seccomp actions ({exc.strerror or exc})"
    if "user_notif" not in actions:
        return "the kernel's seccomp actions (actions_avail) lack user_notif"
    found = re.match(r"(\d+)\.(\d+)", release)
    if found is None or (int(found[1]), int(found[2])) < CONTINUE_SINCE:
        since = ".".join(map(str, CONTINUE_SINCE))
        return f"kernel {release} has no SECCOMP_USER_NOTIF_FLAG_CONTINUE ({since}+)"
    return ""


def _ptrace_blocked(proc: Path) -> str:
    """Why the gate could not read a caller's parameters (`/proc/<tid>/mem` takes ptrace's
    attach check), "" where it can: Yama's scope 3, or 2 without CAP_SYS_PTRACE."""
    try:
        scope = int((proc / "sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return ""  # no Yama: the ordinary same-user or CAP_SYS_PTRACE check
    if scope >= 3 or (scope == 2 and not _has_cap(proc, _CAP_SYS_PTRACE)):
        return f"cannot read the command's parameters: kernel.yama.ptrace_scope={scope}"
    return ""


def _has_cap(proc: Path, bit: int) -> bool:
    try:
        for line in (proc / "self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


Where = Callable[[], tuple[Path | None, Path | None]]
"""(the cgroup v2 hierarchy, the cgroup below which limited cgroups are made), each None
where there is none; raises CgroupFsError with the reason."""


class TierProbe:
    """Probes for one caller. `where`: which hierarchy and cgroup; `host_root`: where the
    host's / is seen (`/proc/1/root` for the agent, with the host's PID namespace)."""

    def __init__(self, where: Where, host_root: Path, within: float = READ_WITHIN) -> None:
        self._where = where
        self._host_root = host_root
        self._within = within
        self._reader: threading.Thread | None = None
        self._reading = ""  # the path the reader is at, for when it does not come back

    def probe(self, nvml: Nvml) -> Probe:
        """What this machine offers now. `nvml`: a session (started here if it is not)."""
        return _GateFacts.read().onto(self._probe(nvml))

    def _probe(self, nvml: Nvml) -> Probe:
        found, unreadable = self._filesystem()
        try:
            devices = nvml.snapshot().devices
        except NvmlError as exc:
            return Probe("", str(exc), found.cgroup_v2, found.dmem, os.geteuid() == 0, (), ())
        whole = tuple(per_gpu(1, devices))
        calls = nvml.has_limit_calls()
        answers: tuple[tuple[str, LimitOutcome | None], ...] = ()
        if found.cgroup and calls and found.cgroup == found.cgroup_v2:
            # The root cgroup has no dmem files (the kernel gives it none), so the driver's
            # answer there says nothing of the cgroups made below it: `no_dmem_at` does.
            answers = tuple((gpu, None) for gpu in whole)
        elif found.cgroup and calls:
            answers = tuple((gpu, _answer(nvml, gpu, found.cgroup)) for gpu in whole)
        return Probe(
            driver_version=nvml.driver_version,
            nvml_error="",
            cgroup_v2=found.cgroup_v2,
            dmem=found.dmem,
            root=os.geteuid() == 0,
            whole_gpus=whole,
            mig_gpus=mig_gpus(devices),
            answers=answers,
            toolkit_hook=found.hook_gpus,
            limit_calls=calls,
            cgroup=found.cgroup,
            no_dmem_at=found.no_dmem_at,
            unreadable=unreadable,
        )

    def _filesystem(self) -> tuple[_Found, str]:
        """What the filesystem says, read on a thread of its own within `within`; and what
        could not be read ("" when all was)."""
        if self._reader is not None and self._reader.is_alive():
            return _Found(), f"{self._reading} has still not answered an earlier read"
        result: list[_Found | str] = []
        self._reader = threading.Thread(
            target=lambda: result.append(self._read_or_why()), name="tier-probe", daemon=True
        )
        self._reader.start()
        self._reader.join(self._within)
        if not result:
            return _Found(), f"{self._reading} did not answer within {self._within:g} s"
        found = result[0]
        return (_Found(), found) if isinstance(found, str) else (found, "")

    def _read_or_why(self) -> _Found | str:
        """`_read`, or why it failed: an error a host's files raise (a permission, a
        mount gone) is the probe's answer, never a thread's traceback."""
        try:
            return self._read()
        except (OSError, cgroupfs.CgroupFsError) as exc:
            return f"{self._reading}: {exc}"

    def _read(self) -> _Found | str:
        """What the filesystem says, or why the probed cgroup cannot be known."""
        self._reading = "the cgroup v2 hierarchy"
        try:
            hierarchy, cgroup = self._where()
        except cgroupfs.CgroupFsError as exc:
            return str(exc)
        hooks = self._hook_gpus()
        if hierarchy is None:
            return _Found(hook_gpus=hooks)
        self._reading = str(hierarchy)
        dmem = "dmem" in cgroupfs.controllers(hierarchy)
        below = "" if cgroup is None else str(cgroup)
        no_dmem_at = ""
        if cgroup and dmem:
            # Where dmem stops reaching a child of `cgroup` (one made below it, as limited
            # cgroups are): the same walk the hard limiter names a refused cgroup's by.
            self._reading = f"the cgroup.subtree_control files from {hierarchy} to {cgroup}"
            at = cgroupfs.first_without("dmem", cgroup / "child", hierarchy)
            no_dmem_at = "" if at is None else str(at)
        return _Found(str(hierarchy), dmem, below, no_dmem_at, hooks)

    def _hook_gpus(self) -> tuple[str, ...]:
        """The GPUs for which a CDI spec on the host runs NVIDIA's memory-limit hook."""
        found: list[str] = []
        for name in CDI_DIRS:
            directory = self._host_root / name
            self._reading = str(directory)
            try:
                with os.scandir(directory) as entries:
                    specs = sorted(e.path for e in entries if e.name.endswith(SPEC_SUFFIXES))
            except OSError:
                continue
            for path in specs[:MOST_SPECS]:
                self._reading = path
                found.extend(memory_limit_hook_gpus(_spec(path)))
        return tuple(dict.fromkeys(found))


def _spec(path: str) -> str:
    """A spec file's text, "" where it is not a regular file or cannot be read (a FIFO is
    not waited on: it is opened without blocking, and only a regular file is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MOST_SPEC_BYTES).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _answer(nvml: Nvml, gpu: str, cgroup: str) -> LimitOutcome | None:
    """The driver's answer to a Get on `cgroup`: None where it answered (a limit or none)."""
    answer = nvml.memory_limit(gpu, cgroup)
    return answer if isinstance(answer, LimitOutcome) else None


def own_cgroup() -> tuple[Path | None, Path | None]:
    """`doctor`'s and `exec`'s: the hierarchy this process sees, and its own cgroup, below
    which exec makes its command's."""
    hierarchy = cgroupfs.v2_root()
    return hierarchy, (cgroupfs.own_dir() if hierarchy is not None else None)


def pods_cgroup(root: Path) -> Where:
    """The agent's: the host's hierarchy at `root` (a hybrid host's `unified`), and the
    kubelet's kubepods below it (the hierarchy itself until one is found)."""

    def where() -> tuple[Path | None, Path | None]:
        hierarchy = cgroupfs.v2_at(root)
        if not cgroupfs.exists(hierarchy):
            return None, None
        found = cgroupfs.kubepods_dirs(hierarchy)
        return hierarchy, Path(found[0]) if found else hierarchy

    return where


def host_root(proc: Path = Path("/proc")) -> Path:
    """Where the host's / is seen: init's root where this process may look (the host's
    PID namespace, and root or ptrace read access), else this process's own."""
    init_root = proc / "1" / "root"
    return init_root if os.access(init_root / "etc", os.R_OK) else Path("/")
