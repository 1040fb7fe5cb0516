"""nvidia-ml-py behind a small interface: devices, per-process usage, MIG.

pynvml raises a different exception class per NVML return code and reports "not
available" as None in some places and as 0xFFFF... in others. This module turns both into
our own terms: `NvmlUnavailable` (cannot start: nothing will work until a person acts),
`NvmlLost` (the driver or a GPU went away: re-initialise, with backoff) and
`NvmlQueryError` (this pass failed; try the next). Unknown usage stays None, never 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pynvml

from enforcer.core.model import Activity, Device, HeldLimit, LimitOutcome, LimitResult
from enforcer.edge.backoff import Backoff
from enforcer.edge.nvml_utilisation import ProcessUtilisation

# NVML returns all-ones for "not available" in 64-bit fields.
NOT_AVAILABLE_64 = 0xFFFFFFFFFFFFFFFF

_UNAVAILABLE_HELP = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 was not found: the NVIDIA driver is not installed here. In a "
        "container, run it with the NVIDIA container runtime (docker --gpus, or a pod with "
        "runtimeClassName nvidia / NVIDIA_VISIBLE_DEVICES) so that the library is mounted in"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded: is this a GPU machine? `nvidia-smi` should "
        "list the GPUs"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "no permission to talk to the NVIDIA driver: the process needs read-write access to "
        "/dev/nvidiactl and the /dev/nvidia* devices"
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the loaded kernel driver have different versions: the driver "
        "was upgraded without a reboot; reload the nvidia kernel modules or reboot"
    ),
}
# What to do about each, for `doctor`'s fix line (the help above says what is wrong).
_UNAVAILABLE_FIX = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "install the NVIDIA driver, whose user-space part ships libnvidia-ml.so.1 (Debian: "
        "nvidia-driver; Ubuntu: nvidia-driver-<version>; or NVIDIA's installer), then check "
        "that `nvidia-smi` lists the GPUs; in a container, the NVIDIA container runtime mounts "
        "it. Without an NVIDIA GPU, `vram-enforcer demo` shows enforcement on a simulated one, "
        "and `doctor --no-nvml` skips this check"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "load the driver (`modprobe nvidia` as root, or reboot after installing it) and check "
        "that `nvidia-smi` lists the GPUs; `dmesg | grep -i nvrm` says why it did not load"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "run as root, or as a user that may open /dev/nvidiactl and /dev/nvidia* for reading "
        "and writing (`ls -l /dev/nvidia*`); in a container, the NVIDIA container runtime "
        "gives them"
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "reboot, or unload and reload the nvidia kernel modules, so that the loaded driver "
        "matches its library; `nvidia-smi` says `Driver/library version mismatch` until then"
    ),
}
_CHECK_DRIVER = (
    "check the driver with `nvidia-smi`, which fails the same way where the driver is the "
    "cause; `dmesg | grep -i -e nvrm -e xid` shows the kernel's side"
)


class _ProcessInfo(ctypes.Structure):
    """`nvmlProcessInfo_t` as nvml.h lays it out since R470 (24 bytes), for `_v2` and `_v3`.

    We read the process lists into our own array of these instead of pynvml's friendly
    objects: it fixes the layout we depend on (nvidia-ml-py 12.535.77 got it wrong for
    `_v3`) and costs a tenth of the CPU per process, which matters on every tick.
    """

    _fields_: ClassVar[list[tuple[str, type[ctypes._SimpleCData[Any]]]]] = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class _SetMemoryLimits(ctypes.Structure):
    """`nvmlSetMemoryLimits_v1_t` (R615+). Our own, like `_ProcessInfo`: older pynvml
    releases do not have it, and the symbol is looked up the same way."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class _GetMemoryLimits(ctypes.Structure):
    """`nvmlGetMemoryLimits_v1_t` (R615+)."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: with soft 0, no limit

_LIMIT_RESULTS = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: LimitResult.UNSUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: LimitResult.UNSUPPORTED,  # a driver before R615
    pynvml.NVML_ERROR_NO_PERMISSION: LimitResult.FORBIDDEN,
    pynvml.NVML_ERROR_OPERATING_SYSTEM: LimitResult.NO_CGROUP,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: LimitResult.REJECTED,
    # Set only (Get's NOT_FOUND is "no limit"): "Setting on a cgroup with no dmem files
    # returns 'not found'" (NVIDIA's MPS v3 memory-partitioning page)
    pynvml.NVML_ERROR_NOT_FOUND: LimitResult.NO_DMEM,
}

# Each list, newest first; drivers older than R510 lack `_v3`, and `_v2` has the same layout.
_PROCESS_LISTS = (
    ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
    ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
)

# Errors that concern the whole session, not one GPU: nothing can be read until NVML is
# initialised again.
_SESSION_LOST = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

# Errors that say the GPU itself is gone until it is reset or back on the bus.
_GPU_LOST = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})

# Errors after which the NVML session or a device handle is no longer usable.
_LOST = (
    _SESSION_LOST
    | _GPU_LOST
    | {
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_UNKNOWN,
    }
)


class NvmlError(Exception):
    """An NVML failure, with the NVML return code where there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """NVML cannot be initialised; the message says why and what to do."""


class NvmlLost(NvmlError):
    """The driver or a GPU stopped answering; the session is re-initialised with backoff."""


class NvmlQueryError(NvmlError):
    """One query failed for a reason that does not invalidate the session."""


def unavailable_fix(error: NvmlError) -> str:
    """What a person does about NVML failing to start (`init`'s error): install, load or
    reload the driver, or get access to its devices; else how to check the driver."""
    if error.code is None:
        return _CHECK_DRIVER
    return _UNAVAILABLE_FIX.get(error.code, _CHECK_DRIVER)


@dataclass(frozen=True, slots=True)
class NvmlProcess:
    """A process as NVML reports it: host pid, device, bytes (None when not available), and
    how busy it keeps the device (None when NVML cannot tell)."""

    pid: int
    device_uuid: str
    used_bytes: int | None
    activity: Activity | None = None


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    """One pass. A GPU that could not be read is in `failed` (UUID, why), and in `devices`
    with its last known size and no usage; its processes are not in `processes`."""

    devices: tuple[Device, ...]
    processes: tuple[NvmlProcess, ...]
    failed: tuple[tuple[str, str], ...] = ()
    activity_read_at: float | None = None  # when the processes' utilisation was read


@dataclass(frozen=True, slots=True)
class _Handle:
    """A device to query each pass: a whole GPU, or one MIG partition of it."""

    handle: Any
    index: int
    uuid: str
    name: str
    parent_uuid: str | None
    query_processes: bool


def _code(exc: pynvml.NVMLError) -> int:
    return int(exc.value)


def _translate(exc: pynvml.NVMLError, what: str) -> NvmlError:
    code = _code(exc)
    message = f"{what}: {exc}"
    if code in _LOST:
        return NvmlLost(message, code)
    return NvmlQueryError(message, code)


def _limit_outcome(ret: int) -> LimitOutcome:
    if ret == pynvml.NVML_SUCCESS:
        return LimitOutcome(LimitResult.SET)
    return LimitOutcome(_LIMIT_RESULTS.get(ret, LimitResult.FAILED), str(pynvml.NVMLError(ret)))


def _bytes(value: object) -> int | None:
    if value is None:
        return None
    number = int(value)  # type: ignore[call-overload]
    return None if number == NOT_AVAILABLE_64 else number


class Nvml:
    """An NVML session that enumerates devices once and re-initialises itself after loss.

    `utilisation_every`: read per-process utilisation at most this often (seconds); None
    reads none.
    """

    def __init__(
        self,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        utilisation_every: float | None = None,
    ):
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._utilisation = ProcessUtilisation(utilisation_every, clock)
        self._handles: list[_Handle] | None = None
        self.driver_version = ""
        self._lists = [names[0] for names in _PROCESS_LISTS]
        self._memory_v2 = True  # until the driver says it has no nvmlDeviceGetMemoryInfo_v2
        self._buffer = (_ProcessInfo * 64)()
        self._sizes: dict[str, int | None] = {}  # each GPU's total memory when last read

    def init(self) -> None:
        """Start the session; raises NvmlUnavailable with a reason a person can act on."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = _code(exc)
            help_text = _UNAVAILABLE_HELP.get(code, f"NVML initialisation failed: {exc}")
            raise NvmlUnavailable(help_text, code) from exc
        try:
            self.driver_version = str(pynvml.nvmlSystemGetDriverVersion())
            self._handles = self._enumerate()
        except pynvml.NVMLError as exc:
            self._shutdown_quietly()
            raise _translate(exc, "enumerating GPUs") from exc

    def shutdown(self) -> None:
        if self._handles is not None:
            self._shutdown_quietly()

    def _shutdown_quietly(self) -> None:
        self._handles = None
        self._utilisation.reset()
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def snapshot(self) -> NvmlSnapshot:
        """One pass over every device: memory totals and per-process usage."""
        handles = self._handles if self._handles is not None else self._reinit()
        try:
            snap = self._read(handles)
        except pynvml.NVMLError as exc:
            error = _translate(exc, "reading GPU usage")
            if isinstance(error, NvmlLost):
                self._shutdown_quietly()
                self._backoff.failed(self._clock())
            raise error from exc
        self._backoff.succeeded()
        return snap

    def set_memory_limit(
        self, gpu_uuid: str, cgroup: str, hard_bytes: int, soft_bytes: int = 0
    ) -> LimitOutcome:
        """Hold every process in the cgroup v2 directory `cgroup` (a path as this process
        sees it) to `hard_bytes` on the GPU: the driver refuses allocations past it.
        `soft_bytes` is what nvml.h calls "guaranteed before allocations may fail due to
        memory pressure": a request."""
        return self._memory_limits(gpu_uuid, cgroup, soft_bytes, hard_bytes)

    def clear_memory_limit(self, gpu_uuid: str, cgroup: str) -> LimitOutcome:
        return self._memory_limits(gpu_uuid, cgroup, 0, MEMORY_LIMIT_MAX)

    def memory_limit(self, gpu_uuid: str, cgroup: str) -> HeldLimit | LimitOutcome | None:
        """The limits the driver holds for `cgroup` on the GPU and what it charges to them,
        None when there are none, or why it cannot say. None is NVML's NOT_FOUND, and also
        the pair soft 0, hard MAX, which a clear leaves: "No limit is set when softLimit is 0
        and hardLimit is MAX" (nvml.h). Needs no privilege: `doctor` asks it to learn the
        tier."""
        limits = _GetMemoryLimits(cgroup.encode(), 0, 0, 0)
        ret = self._limits_call("nvmlDeviceGetMemoryLimits_v1", gpu_uuid, limits)
        if ret == pynvml.NVML_SUCCESS:
            soft, hard = int(limits.softLimit), int(limits.hardLimit)
            if soft == 0 and hard == MEMORY_LIMIT_MAX:
                return None
            return HeldLimit(hard, soft, int(limits.currentUsed))
        if ret == pynvml.NVML_ERROR_NOT_FOUND:
            return None
        return ret if isinstance(ret, LimitOutcome) else _limit_outcome(ret)

    def has_limit_calls(self) -> bool:
        """Whether this NVML has the per-cgroup limit calls at all: a driver before R615
        answers FUNCTION_NOT_FOUND to each (`doctor` tells "driver too old" by it)."""
        try:
            pynvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryLimits_v1")
        except pynvml.NVMLError:
            return False
        return True

    def _memory_limits(self, gpu_uuid: str, cgroup: str, soft: int, hard: int) -> LimitOutcome:
        limits = _SetMemoryLimits(cgroup.encode(), soft, hard)
        ret = self._limits_call("nvmlDeviceSetMemoryLimits_v1", gpu_uuid, limits)
        return ret if isinstance(ret, LimitOutcome) else _limit_outcome(ret)

    def _limits_call(
        self, function: str, gpu_uuid: str, limits: ctypes.Structure
    ) -> int | LimitOutcome:
        """NVML's return code for one per-cgroup limit call on a whole GPU, or why the call
        could not be made."""
        try:
            handles = self._handles if self._handles is not None else self._reinit()
        except NvmlError as exc:
            return LimitOutcome(LimitResult.FAILED, str(exc))
        handle = next((h for h in handles if h.uuid == gpu_uuid and h.parent_uuid is None), None)
        if handle is None:
            return LimitOutcome(LimitResult.FAILED, f"no GPU {gpu_uuid} in this NVML session")
        try:
            fn = pynvml._nvmlGetFunctionPointer(function)
        except pynvml.NVMLError as exc:  # the symbol is missing: a driver before R615
            return _code(exc)
        return int(fn(handle.handle, ctypes.byref(limits)))

    def _reinit(self) -> list[_Handle]:
        now = self._clock()
        if not self._backoff.ready(now):
            wait = self._backoff.next_attempt - now
            raise NvmlLost(f"NVML is re-initialising; next attempt in {wait:.2f}s")
        try:
            self.init()
        except NvmlError as exc:
            self._backoff.failed(now)
            raise NvmlLost(f"re-initialising NVML failed: {exc}", exc.code) from exc
        assert self._handles is not None  # noqa: S101 - init() sets them or raises
        return self._handles

    def _enumerate(self) -> list[_Handle]:
        handles: list[_Handle] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(pynvml.nvmlDeviceGetUUID(handle))
            migs = self._mig_devices(handle, index, uuid)
            name = str(pynvml.nvmlDeviceGetName(handle))
            handles.append(_Handle(handle, index, uuid, name, None, not migs))
            handles.extend(migs)
        return handles

    def _mig_devices(self, parent: Any, index: int, parent_uuid: str) -> list[_Handle]:
        """MIG partitions of a GPU in MIG mode; processes are only attributable per partition."""
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(parent)
        except pynvml.NVMLError_NotSupported:
            return []
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        found = []
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
            except pynvml.NVMLError_NotFound:
                continue
            uuid = str(pynvml.nvmlDeviceGetUUID(mig))
            name = str(pynvml.nvmlDeviceGetName(mig))
            found.append(_Handle(mig, index, uuid, name, parent_uuid, True))
        return found

    def _read(self, handles: list[_Handle]) -> NvmlSnapshot:
        """Every device; one that fails (a GPU off the bus: GPU_IS_LOST, an Xid) is reported
        in `failed` and the others are read on. Only an error of the whole session, or every
        device failing, fails the pass."""
        devices = []
        usage: dict[tuple[int, str], int | None] = {}
        failed: list[tuple[str, str]] = []
        error: pynvml.NVMLError | None = None
        for h in handles:
            try:
                device, found = self._read_device(h)
            except pynvml.NVMLError as exc:
                if _code(exc) in _SESSION_LOST:
                    raise
                error = exc
                failed.append((h.uuid, str(exc)))
                total = self._sizes.get(h.uuid)
                devices.append(Device(h.index, h.uuid, h.name, total, None, h.parent_uuid))
                continue
            devices.append(device)
            for pid, used in found:
                key = (pid, h.uuid)
                usage[key] = _merge(usage[key], used) if key in usage else used
        if error is not None and len(failed) == len(handles):
            raise error  # nothing was read: the pass fails, and a lost session re-initialises
        lost = {uuid for uuid, _ in failed}
        if self._utilisation.due():
            listed: dict[str, set[int]] = {}
            for pid, uuid in usage:
                listed.setdefault(uuid, set()).add(pid)
            # Whole GPUs only: NVML has no per-process utilisation under MIG.
            self._utilisation.read(
                [
                    (h.uuid, h.handle, frozenset(listed.get(h.uuid, ())))
                    for h in handles
                    if h.query_processes and h.parent_uuid is None and h.uuid not in lost
                ]
            )
        of = self._utilisation.of
        processes = tuple(
            NvmlProcess(pid, uuid, used, of(uuid, pid)) for (pid, uuid), used in usage.items()
        )
        return NvmlSnapshot(tuple(devices), processes, tuple(failed), self._utilisation.read_at)

    def _read_device(self, h: _Handle) -> tuple[Device, list[tuple[int, int | None]]]:
        total, used, reserved = self._memory(h.handle)
        self._sizes[h.uuid] = total
        device = Device(h.index, h.uuid, h.name, total, used, h.parent_uuid, reserved)
        return device, self._processes(h.handle) if h.query_processes else []

    def _memory(self, handle: Any) -> tuple[int | None, int | None, int | None]:
        """Total, used and reserved bytes. Memory info v2 (R510+) keeps the driver's reserved
        memory out of `used`; v1 counts it in "used" and does not say how much it is. A driver
        without v2 switches it off for the session; any other v2 failure that does not say
        the session or the GPU is lost (NOT_SUPPORTED or UNKNOWN under WSL, where v1 answers)
        falls back to v1 for this read only, and v1's own failure is the device's."""
        if self._memory_v2:
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
                self._memory_v2 = False
            except pynvml.NVMLError as exc:
                if _code(exc) in _SESSION_LOST or _code(exc) in _GPU_LOST:
                    raise
            else:
                return _bytes(mem.total), _bytes(mem.used), _bytes(mem.reserved)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return _bytes(mem.total), _bytes(mem.used), None

    def _processes(self, handle: Any) -> list[tuple[int, int | None]]:
        """(host pid, bytes or None) from both process lists of one device."""
        found: list[tuple[int, int | None]] = []
        for i, name in enumerate(self._lists):
            try:
                found.extend(self._process_list(name, handle))
            except pynvml.NVMLError_FunctionNotFound:
                older = _PROCESS_LISTS[i][1]
                if name == older:
                    raise
                self._lists[i] = older
                found.extend(self._process_list(older, handle))
        return found

    def _process_list(self, name: str, handle: Any) -> list[tuple[int, int | None]]:
        """NVML's size handshake, into a buffer kept between calls (grown when too small)."""
        fn = pynvml._nvmlGetFunctionPointer(name)
        while True:
            count = ctypes.c_uint(len(self._buffer))
            ret = fn(handle, ctypes.byref(count), self._buffer)
            if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                break
            # Processes may start between two calls: leave room for them.
            self._buffer = (_ProcessInfo * (count.value * 2 + 16))()
        if ret != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(ret)
        buf = self._buffer
        return [(buf[i].pid, _bytes(buf[i].usedGpuMemory)) for i in range(count.value)]


def _merge(a: int | None, b: int | None) -> int | None:
    """One process in both the compute and the graphics list of a device holds one context:
    the same memory, reported twice. Count it once, preferring a known figure."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)
