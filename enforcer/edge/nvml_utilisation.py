"""Per-process GPU utilisation from NVML: how busy each process keeps each GPU.

The driver samples every process's SM and memory-controller activity once per sample
period (a fraction of a second) and keeps a buffer of these samples. A query returns the
samples newer than a timestamp the caller gives, one per process that was busy, and
NVML_ERROR_NOT_FOUND when no process was. So each read asks for what is newer than the
newest sample of the read before, keeps each process's latest sample, and counts a process
that was listed at the read but has no sample as idle. One listed only since is not known
yet.

`nvmlDeviceGetProcessesUtilizationInfo` (R550+) is asked first, then the older
`nvmlDeviceGetProcessUtilization`; a GPU that supports neither (MIG, some vGPU) has
unknown utilisation, never 0. Reads happen at most once per `every` seconds, because the
figures change no faster than the driver samples and the agent's pass runs ten times a
second: between reads the last one stands, and a pass that reads none pays nothing.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pynvml

from enforcer.core.model import IDLE, Activity

NEWER = "nvmlDeviceGetProcessesUtilizationInfo"
OLDER = "nvmlDeviceGetProcessUtilization"
FUNCTIONS = (NEWER, OLDER)
# The call cannot serve this GPU: try the next one (and remember, per GPU).
_NEXT_CALL = frozenset(
    {
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    }
)
_GROW_ATTEMPTS = 4  # processes may start between the calls of a size handshake


class _Sample(ctypes.Structure):
    """`nvmlProcessUtilizationSample_t`, for `nvmlDeviceGetProcessUtilization`."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class _Info(ctypes.Structure):
    """`nvmlProcessUtilizationInfo_v1_t`, one entry of `_Infos.procUtilArray`."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("timeStamp", ctypes.c_ulonglong),
        ("pid", ctypes.c_uint),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
        ("jpgUtil", ctypes.c_uint),
        ("ofaUtil", ctypes.c_uint),
    ]


class _Infos(ctypes.Structure):
    """`nvmlProcessesUtilizationInfo_v1_t`."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("version", ctypes.c_uint),
        ("processSamplesCount", ctypes.c_uint),
        ("lastSeenTimeStamp", ctypes.c_ulonglong),
        ("procUtilArray", ctypes.POINTER(_Info)),
    ]


_INFOS_V1 = ctypes.sizeof(_Infos) | 1 << 24  # NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1)

# (timestamp in microseconds, pid, SM %, memory %)
_Row = tuple[int, int, int, int]


class ProcessUtilisation:
    """Each GPU's busy processes, by host pid, as of the latest read; None: not known."""

    def __init__(self, every: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        self._read_at: float | None = None
        self._current: dict[str, dict[int, Activity] | None] = {}
        self._listed: dict[str, frozenset[int]] = {}  # the pids each GPU listed at the read
        self._last_seen: dict[str, int] = {}
        self._call: dict[str, int] = {}  # GPU uuid -> index in FUNCTIONS; past the end: none
        self._infos = (_Info * 64)()
        self._samples = (_Sample * 64)()

    def reset(self) -> None:
        """Forget everything: NVML was re-initialised, and its handles and buffers with it."""
        self._read_at = None
        self._current, self._listed, self._last_seen, self._call = {}, {}, {}, {}

    @property
    def read_at(self) -> float | None:
        """When the last read was made (the clock's time); None before the first."""
        return self._read_at

    def of(self, gpu_uuid: str, pid: int) -> Activity | None:
        """How busy the process kept the GPU at the last read; None when not known."""
        busy = self._current.get(gpu_uuid)
        if busy is None:
            return None
        if pid in busy:
            return busy[pid]
        return IDLE if pid in self._listed.get(gpu_uuid, ()) else None

    def due(self) -> bool:
        """Whether the last read is `every` seconds old (never, when reads are off)."""
        if self._every is None:
            return False
        return self._read_at is None or self._clock() - self._read_at >= self._every

    def read(self, gpus: Sequence[tuple[str, Any, frozenset[int]]]) -> None:
        """Read each (uuid, handle, pids NVML lists there now) again."""
        self._read_at = self._clock()
        self._current = {uuid: self._read(uuid, handle) for uuid, handle, _ in gpus}
        self._listed = {uuid: pids for uuid, _, pids in gpus}

    def _read(self, uuid: str, handle: Any) -> dict[int, Activity] | None:
        while (which := self._call.get(uuid, 0)) < len(FUNCTIONS):
            ret, rows = self._query(FUNCTIONS[which], handle, self._last_seen.get(uuid, 0))
            if ret == pynvml.NVML_SUCCESS:
                latest: dict[int, _Row] = {}
                for row in rows:
                    if row[1] not in latest or row[0] >= latest[row[1]][0]:
                        latest[row[1]] = row
                if rows:
                    self._last_seen[uuid] = max(row[0] for row in rows)
                return {pid: Activity(sm, mem) for pid, (_, _, sm, mem) in latest.items()}
            if ret == pynvml.NVML_ERROR_NOT_FOUND:
                return {}  # no sample since the last read: every process was idle
            if ret not in _NEXT_CALL:
                return None  # this read failed; the next one may not
            self._call[uuid] = which + 1
        return None

    def _query(self, function: str, handle: Any, last_seen: int) -> tuple[int, list[_Row]]:
        try:
            fn = pynvml._nvmlGetFunctionPointer(function)
        except pynvml.NVMLError as exc:  # the symbol is missing: an older driver
            return int(exc.value), []
        if function == NEWER:
            return self._infos_call(fn, handle, last_seen)
        return self._samples_call(fn, handle, last_seen)

    def _infos_call(self, fn: Any, handle: Any, last_seen: int) -> tuple[int, list[_Row]]:
        for _ in range(_GROW_ATTEMPTS):
            array = ctypes.cast(self._infos, ctypes.POINTER(_Info))
            infos = _Infos(_INFOS_V1, len(self._infos), last_seen, array)
            ret = int(fn(handle, ctypes.byref(infos)))
            count = int(infos.processSamplesCount)
            if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                break
            self._infos = (_Info * (count * 2 + 16))()
        return ret, _rows(self._infos, count) if ret == pynvml.NVML_SUCCESS else []

    def _samples_call(self, fn: Any, handle: Any, last_seen: int) -> tuple[int, list[_Row]]:
        for _ in range(_GROW_ATTEMPTS):
            count = ctypes.c_uint(len(self._samples))
            ret = int(fn(handle, self._samples, ctypes.byref(count), ctypes.c_ulonglong(last_seen)))
            if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                break
            self._samples = (_Sample * (count.value * 2 + 16))()
        return ret, _rows(self._samples, count.value) if ret == pynvml.NVML_SUCCESS else []


def _rows(buffer: Any, count: int) -> list[_Row]:
    """The first `count` entries of either struct array (their fields share names)."""
    return [
        (buffer[i].timeStamp, buffer[i].pid, buffer[i].smUtil, buffer[i].memUtil)
        for i in range(min(count, len(buffer)))
    ]
