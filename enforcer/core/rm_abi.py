"""The NVIDIA driver's allocation calls as bytes (pure): which ioctl requests carry a
video-memory allocation, and how many bytes one asks for, read from its parameters.

The numbers and offsets are the driver's own (open-gpu-kernel-modules, checked at 535.43.02,
580.142 and 595.45.04; `docs/architecture.md`, "The allocation gate"). `nvidia_ioctl`
decodes only a request's NR and SIZE bits (`_IOC_NR`, `_IOC_SIZE`: never its type byte or
direction), so they are all a request is matched on; the inner command of the XFER wrapper
is compared whole, as the driver's switch compares it. The parameters are read through an
injected `read(address, n)`, so the decoding is plain bytes in, a `Call` out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from enforcer.core.model import format_bytes

IOC_NR_SIZE_MASK = 0x3FFF00FF  # _IOC_SIZE | _IOC_NR of a request: what the driver decodes

# The escapes' NR numbers (nv_escape.h, nv-ioctl-numbers.h: 'F', base 200, XFER = base + 11)
NV_ESC_RM_ALLOC = 0x2B
NV_ESC_RM_VID_HEAP_CONTROL = 0x4A
NV_ESC_IOCTL_XFER_CMD = 0xD3

NVOS21_SIZE = 32  # RM_ALLOC's short form
NVOS64_SIZE = 48  # RM_ALLOC's long form (40 bytes before 535: not matched)
NVOS32_SIZE = 184  # VID_HEAP_CONTROL
XFER_SIZE = 16  # nv_ioctl_xfer_t {cmd u32, size u32, ptr u64}


def nr_size(nr: int, size: int) -> int:
    """A request's NR and SIZE bits, as `IOC_NR_SIZE_MASK` leaves them."""
    return (size << 16) | nr


# Every request (NR and SIZE) that can carry a video-memory allocation: the filter's list.
GATED = (
    nr_size(NV_ESC_RM_ALLOC, NVOS21_SIZE),
    nr_size(NV_ESC_RM_ALLOC, NVOS64_SIZE),
    nr_size(NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_SIZE),
    nr_size(NV_ESC_IOCTL_XFER_CMD, XFER_SIZE),
)

NV01_MEMORY_LOCAL_USER = 0x40  # the one RM_ALLOC class that allocates video memory for a user
NV_ERR_NO_MEMORY = 0x51  # the status a full GPU answers (nvstatuscodes.h)

# NVOS32 functions that allocate (nvos.h): name, and where their fields sit in NVOS32_PARAMETERS
_VID_HEAP_FUNCTIONS = {
    2: "ALLOC_SIZE",
    6: "ALLOC_TILED_PITCH_HEIGHT",
    14: "ALLOC_SIZE_RANGE",
}
_ALLOC_FLAGS_VIRTUAL = 0x00080000  # NVOS32_ALLOC_FLAGS_VIRTUAL: address space, no memory
_LOCATION_VIDMEM = 0  # NVOS32_ATTR_LOCATION (attr 26:25); PCI and ANY are system memory
# NVOS32_ATTR_PAGE_SIZE (attr 24:23) 4KB, BIG, HUGE; HUGE's size is NVOS32_ATTR2_PAGE_SIZE_HUGE
# (attr2 21:20: DEFAULT, which the driver takes as 2MB, 2MB, 512MB, 256GB). BIG is the GPU's
# largest big page, 64 or 128 KiB: the larger counted. DEFAULT (0) is the driver's choice.
# 535 has no 256GB (it takes attr2 3 as a default page): counted as 256 GiB all the same.
_PAGE_4KB, _PAGE_BIG = 4 << 10, 128 << 10
_PAGE_HUGE = (2 << 20, 2 << 20, 512 << 20, 256 << 30)


@dataclass(frozen=True, slots=True)
class VidHeapFields:
    """Where one NVOS32 allocating function keeps its fields. `height_pitch`: where a
    function whose size the driver sets to height * pitch keeps those two (it overwrites
    the size field), None where the size field is what it allocates."""

    flags: int
    attr: int
    attr2: int
    size: int
    height_pitch: int | None = None


@dataclass(frozen=True, slots=True)
class Layout:
    """The parameter offsets of one range of driver branches (535 to 59x share one)."""

    status: dict[int, int]  # request SIZE -> offset of `status` (NVOS21, NVOS64, NVOS32)
    hclass: int  # NVOS21/NVOS64
    alloc_params: int  # NVOS21/NVOS64: pAllocParms
    memory_attr: int  # NV_MEMORY_ALLOCATION_PARAMS.attr (attr2 follows it)
    memory_size: int  # NV_MEMORY_ALLOCATION_PARAMS.size
    function: int  # NVOS32
    vid_heap: dict[int, VidHeapFields]  # NVOS32 function -> its fields


LAYOUT = Layout(
    status={NVOS21_SIZE: 28, NVOS64_SIZE: 40, NVOS32_SIZE: 20},
    hclass=12,
    alloc_params=16,
    memory_attr=24,
    memory_size=64,
    function=8,
    vid_heap={
        2: VidHeapFields(flags=52, attr=56, attr2=144, size=88),
        14: VidHeapFields(flags=52, attr=56, attr2=136, size=80),
        6: VidHeapFields(flags=52, attr=64, attr2=144, size=88, height_pitch=56),
    },
)
FIRST_BRANCH, LAST_BRANCH = 535, 599  # the branches whose layouts were compiled and compared
# The branches on which a GPU run showed the gate's refusal reaching CUDA as out-of-memory
# (`tests/gpu/offline.sh gate`); none yet.
PROVEN_BRANCHES: frozenset[int] = frozenset()


def layout_for(branch: int) -> Layout | None:
    """The layout of a driver branch; None where it is not known (an older NVOS64, or a
    branch nobody has compared yet): there the gate is not offered."""
    return LAYOUT if FIRST_BRANCH <= branch <= LAST_BRANCH else None


Read = Callable[[int, int], bytes]  # (address, n) -> n bytes of the caller's memory


class ShortRead(Exception):
    """The caller's memory gave fewer bytes than its parameters hold (unmapped, or gone)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One gated request, decoded. `ask_bytes` is None where it allocates no video memory;
    `status_addr` is where the driver's status is written back (the inner parameters of a
    wrapped call), None where nothing would be refused."""

    escape: str  # "RM_ALLOC/NVOS64", "VID_HEAP/ALLOC_SIZE", "nr 0x2a", ...
    wrapped: bool = False
    detail: str = ""  # "class 0x40", "function 5", "VIRTUAL", ...
    ask_bytes: int | None = None
    status_addr: int | None = None

    @property
    def what(self) -> str:
        """The call as one line names it: `XFER/RM_ALLOC/NVOS64 class 0x40`."""
        name = f"XFER/{self.escape}" if self.wrapped else self.escape
        return f"{name} {self.detail}" if self.detail else name


def decode(cmd: int, argp: int, read: Read, layout: Layout = LAYOUT) -> Call:
    """What a notified request (`cmd` as the caller passed it, `argp` its parameters'
    address) asks of the driver."""
    masked = cmd & IOC_NR_SIZE_MASK
    nr, size = masked & 0xFF, masked >> 16
    if masked == nr_size(NV_ESC_IOCTL_XFER_CMD, XFER_SIZE):
        inner_cmd, inner_size, inner_ptr = struct.unpack("<IIQ", _read(read, argp, XFER_SIZE))
        inner = _escape(inner_cmd, inner_size, inner_ptr, read, layout)
        if inner is None:  # the driver compares the inner command whole: 0x12B is no RM_ALLOC
            return Call(f"cmd 0x{inner_cmd:x}/{inner_size}", wrapped=True)
        return _wrapped(inner)
    return _escape(nr, size, argp, read, layout) or Call(f"nr 0x{nr:x}/{size}")


def _wrapped(call: Call) -> Call:
    return Call(call.escape, True, call.detail, call.ask_bytes, call.status_addr)


def _escape(cmd: int, size: int, argp: int, read: Read, layout: Layout) -> Call | None:
    if cmd == NV_ESC_RM_ALLOC and size in (NVOS21_SIZE, NVOS64_SIZE):
        return _rm_alloc(size, argp, read, layout)
    if cmd == NV_ESC_RM_VID_HEAP_CONTROL and size == NVOS32_SIZE:
        return _vid_heap(argp, read, layout)
    return None


def _rm_alloc(size: int, argp: int, read: Read, layout: Layout) -> Call:
    params = _read(read, argp, size)
    (hclass,) = struct.unpack_from("<I", params, layout.hclass)
    (alloc_params,) = struct.unpack_from("<Q", params, layout.alloc_params)
    escape = f"RM_ALLOC/NVOS{21 if size == NVOS21_SIZE else 64}"
    detail = f"class 0x{hclass:x}"
    if hclass != NV01_MEMORY_LOCAL_USER or alloc_params == 0:
        return Call(escape, detail=detail if alloc_params else f"{detail}, no parameters")
    memory = _read(read, alloc_params, layout.memory_size + 8)
    attr, attr2 = struct.unpack_from("<II", memory, layout.memory_attr)
    (size_field,) = struct.unpack_from("<Q", memory, layout.memory_size)
    ask, detail = _in_pages(size_field, attr, attr2, detail)
    return Call(escape, detail=detail, ask_bytes=ask, status_addr=argp + layout.status[size])


def _vid_heap(argp: int, read: Read, layout: Layout) -> Call:
    params = _read(read, argp, NVOS32_SIZE)
    (function,) = struct.unpack_from("<I", params, layout.function)
    fields = layout.vid_heap.get(function)
    name = _VID_HEAP_FUNCTIONS.get(function)
    if fields is None or name is None:
        return Call("VID_HEAP", detail=f"function {function}")
    escape = f"VID_HEAP/{name}"
    flags, attr, attr2 = (
        struct.unpack_from("<I", params, at)[0] for at in (fields.flags, fields.attr, fields.attr2)
    )
    if flags & _ALLOC_FLAGS_VIRTUAL:
        return Call(escape, detail="VIRTUAL")
    if (attr2 >> 24) & 1:  # NVOS32_ATTR2_USE_EGM: Grace's host memory
        return Call(escape, detail="EGM")
    if (location := (attr >> 25) & 3) != _LOCATION_VIDMEM:  # PCI and ANY: system memory
        return Call(escape, detail=f"location {('VIDMEM', 'PCI', 'AGP', 'ANY')[location]}")
    if fields.height_pitch is None:
        (ask,) = struct.unpack_from("<Q", params, fields.size)
    else:  # `(NvU64)height * pitch`, pitch an NvS32: as the driver computes it
        height, pitch = struct.unpack_from("<Ii", params, fields.height_pitch)
        ask = height * pitch % (1 << 64)
    ask, detail = _in_pages(ask, attr, attr2, "VIDMEM")
    return Call(escape, detail=detail, ask_bytes=ask, status_addr=argp + layout.status[NVOS32_SIZE])


def _page_bytes(attr: int, attr2: int) -> int | None:
    """The page size an allocation's attributes ask for; None where they leave it to the
    driver (DEFAULT), which picks by size and GPU."""
    match (attr >> 23) & 3:
        case 0:
            return None
        case 1:
            return _PAGE_4KB
        case 2:
            return _PAGE_BIG
        case _:
            return _PAGE_HUGE[(attr2 >> 20) & 3]


def _in_pages(size: int, attr: int, attr2: int, detail: str) -> tuple[int, str]:
    """What an allocation of `size` holds: the driver rounds it up to the page size asked,
    so a 1-byte ask in 512 MiB pages holds 512 MiB. Never wraps (the driver's NvU64 sum can):
    a size near 2^64 stays past any limit."""
    page = _page_bytes(attr, attr2)
    if page is None:
        return size, detail
    return -(-size // page) * page, f"{detail}, {format_bytes(page)} pages"


def _read(read: Read, address: int, n: int) -> bytes:
    got = read(address, n)
    if len(got) < n:
        raise ShortRead(f"{len(got)} of {n} bytes at 0x{address:x}")
    return got
