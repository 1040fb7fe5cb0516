"""The driver's allocation calls decoded from plain bytes laid out at the driver's offsets
(open-gpu-kernel-modules 535.43.02 to 595.45.04: NVOS21 status 28, NVOS64 status 40,
NVOS32 status 20; NV_MEMORY_ALLOCATION_PARAMS.size 64)."""

from __future__ import annotations

import struct

import pytest

from enforcer.core.rm_abi import (
    GATED,
    NV_ERR_NO_MEMORY,
    Call,
    Read,
    ShortRead,
    decode,
    layout_for,
)

GIB = 1 << 30
PARAMS, ALLOC, INNER, XFER = 0x1000, 0x2000, 0x3000, 0x4000  # where the blocks sit


def ioc(nr: int, size: int, kind: int = ord("F"), direction: int = 3) -> int:
    """_IOC(direction, kind, nr, size); 3 is _IOWR."""
    return (direction << 30) | (size << 16) | (kind << 8) | nr


def nvos21(hclass: int, alloc: int = ALLOC) -> bytes:
    block = bytearray(32)
    struct.pack_into("<IQ", block, 12, hclass, alloc)
    struct.pack_into("<I", block, 28, 0xFFFFFFFF)  # status
    return bytes(block)


def nvos64(hclass: int, alloc: int = ALLOC) -> bytes:
    block = bytearray(48)
    struct.pack_into("<IQ", block, 12, hclass, alloc)
    struct.pack_into("<I", block, 32, 128)  # paramsSize
    struct.pack_into("<I", block, 40, 0xFFFFFFFF)  # status
    return bytes(block)


def memory_params(size: int, attr: int = 0, attr2: int = 0) -> bytes:
    block = bytearray(128)
    struct.pack_into("<II", block, 24, attr, attr2)
    struct.pack_into("<Q", block, 64, size)
    return bytes(block)


def nvos32(
    function: int,
    size: int,
    location: int = 0,
    flags: int = 0,
    egm: bool = False,
    attr: int = 0,
    attr2: int = 0,
) -> bytes:
    """NVOS32_PARAMETERS with an allocating function's fields where that function has them;
    `attr` and `attr2` are or'ed into those the other arguments set."""
    attr_at, attr2_at, size_at = {2: (56, 144, 88), 14: (56, 136, 80), 6: (64, 144, 88)}.get(
        function, (56, 144, 88)
    )
    block = bytearray(184)
    struct.pack_into("<I", block, 8, function)
    struct.pack_into("<I", block, 20, 0xFFFFFFFF)  # status
    struct.pack_into("<I", block, 52, flags)
    struct.pack_into("<I", block, attr_at, location << 25 | attr)
    struct.pack_into("<I", block, attr2_at, int(egm) << 24 | attr2)
    struct.pack_into("<Q", block, size_at, size)
    if function == 6:  # the driver allocates height * pitch
        struct.pack_into("<Ii", block, 56, size >> 16, 1 << 16)
    return bytes(block)


def xfer(cmd: int, size: int, ptr: int = INNER) -> bytes:
    return struct.pack("<IIQ", cmd, size, ptr)


def memory(**blocks: bytes) -> dict[int, bytes]:
    at = {"params": PARAMS, "alloc": ALLOC, "inner": INNER, "xfer": XFER}
    return {at[name]: block for name, block in blocks.items()}


def reader(mem: dict[int, bytes]) -> Read:
    def read(address: int, n: int) -> bytes:
        for base, block in mem.items():
            if base <= address < base + len(block):
                return block[address - base : address - base + n]
        return b""

    return read


def test_nvos64_of_local_user_memory_asks_its_size_and_is_refused_at_offset_40() -> None:
    call = decode(
        ioc(0x2B, 48), PARAMS, reader(memory(params=nvos64(0x40), alloc=memory_params(3 * GIB)))
    )
    assert call == Call(
        "RM_ALLOC/NVOS64", detail="class 0x40", ask_bytes=3 * GIB, status_addr=PARAMS + 40
    )
    assert call.what == "RM_ALLOC/NVOS64 class 0x40"


def test_nvos21_is_refused_at_offset_28() -> None:
    call = decode(
        ioc(0x2B, 32), PARAMS, reader(memory(params=nvos21(0x40), alloc=memory_params(GIB)))
    )
    assert (call.escape, call.ask_bytes, call.status_addr) == ("RM_ALLOC/NVOS21", GIB, PARAMS + 28)


@pytest.mark.parametrize("hclass", [0x3E, 0x42, 0x50A0, 0x70, 0x80, 0xC2, 0xF8, 0xFD])
def test_other_classes_allocate_no_video_memory_here(hclass: int) -> None:
    """System memory, EGM, virtual ranges, contexts, fabric handles of existing memory."""
    call = decode(ioc(0x2B, 48), PARAMS, reader(memory(params=nvos64(hclass))))
    assert (call.ask_bytes, call.detail) == (None, f"class 0x{hclass:x}")


def test_local_user_memory_without_parameters_asks_nothing() -> None:
    call = decode(ioc(0x2B, 48), PARAMS, reader(memory(params=nvos64(0x40, alloc=0))))
    assert call.ask_bytes is None


def test_the_driver_ignores_the_type_byte_the_direction_and_the_upper_bits_so_does_decode() -> None:
    mem = reader(memory(params=nvos64(0x40), alloc=memory_params(GIB)))
    for cmd in (
        ioc(0x2B, 48, kind=ord("G")),
        ioc(0x2B, 48, direction=2),
        (1 << 32) | ioc(0x2B, 48),
    ):
        assert decode(cmd, PARAMS, mem).ask_bytes == GIB


@pytest.mark.parametrize(
    ("function", "name"),
    [(2, "ALLOC_SIZE"), (14, "ALLOC_SIZE_RANGE"), (6, "ALLOC_TILED_PITCH_HEIGHT")],
)
def test_vid_heap_video_memory_is_asked_at_each_functions_offsets_and_refused_at_20(
    function: int, name: str
) -> None:
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=nvos32(function, 2 * GIB))))
    assert call == Call(
        f"VID_HEAP/{name}", detail="VIDMEM", ask_bytes=2 * GIB, status_addr=PARAMS + 20
    )


def test_a_tiled_pitch_height_call_asks_height_times_pitch_whatever_its_size_field_says() -> None:
    """The driver sets the size to height * pitch before it allocates
    (`_nvos32FunctionAllocTiledPitchHeight`): read from the size field, a caller that wrote
    0 there got any amount past the gate, with no race at all."""
    block = bytearray(nvos32(6, 0))
    struct.pack_into("<Ii", block, 56, 1 << 16, 1 << 16)  # height, pitch: 4 GiB
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=bytes(block))))
    assert call.ask_bytes == 4 * GIB
    struct.pack_into("<i", block, 60, -1)  # pitch is signed: the driver's NvU64 product wraps
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=bytes(block))))
    assert call.ask_bytes == ((1 << 16) * ((1 << 64) - 1)) % (1 << 64)


MIB = 1 << 20
# NVOS32_ATTR_PAGE_SIZE (attr 24:23) and NVOS32_ATTR2_PAGE_SIZE_HUGE (attr2 21:20), nvos.h
PAGE_4KB, PAGE_BIG, PAGE_HUGE = 1 << 23, 2 << 23, 3 << 23
HUGE_2MB, HUGE_512MB, HUGE_256GB = 1 << 20, 2 << 20, 3 << 20
PAGES = [
    (PAGE_4KB, 0, 4096, "4.00 KiB"),
    (PAGE_BIG, 0, 128 << 10, "128.00 KiB"),  # 64 or 128 KiB by GPU: the larger
    (PAGE_HUGE, 0, 2 * MIB, "2.00 MiB"),  # the driver takes HUGE's DEFAULT as 2MB
    (PAGE_HUGE, HUGE_2MB, 2 * MIB, "2.00 MiB"),
    (PAGE_HUGE, HUGE_512MB, 512 * MIB, "512.00 MiB"),
    (PAGE_HUGE, HUGE_256GB, 256 * GIB, "256.00 GiB"),
]
PAGE_IDS = ["4KB", "BIG", "HUGE-DEFAULT", "HUGE-2MB", "HUGE-512MB", "HUGE-256GB"]


@pytest.mark.parametrize(("attr", "attr2", "page", "name"), PAGES, ids=PAGE_IDS)
def test_local_user_memory_asks_its_size_rounded_up_to_the_page_size_it_asks_for(
    attr: int, attr2: int, page: int, name: str
) -> None:
    """The driver rounds the size up to the page size (memmgrAllocDetermineAlignment): read
    as the size alone, a 1-byte ask in 512 MiB pages got 512 MiB past the gate."""
    for size, pages in ((1, 1), (page, 1), (page + 1, 2), (3 * GIB + 1, -(-(3 * GIB + 1) // page))):
        mem = memory(params=nvos64(0x40), alloc=memory_params(size, attr, attr2))
        call = decode(ioc(0x2B, 48), PARAMS, reader(mem))
        assert (call.ask_bytes, call.detail) == (pages * page, f"class 0x40, {name} pages")


@pytest.mark.parametrize(("attr", "attr2", "page", "name"), PAGES, ids=PAGE_IDS)
@pytest.mark.parametrize("function", [2, 14, 6])
def test_vid_heap_video_memory_asks_its_size_rounded_up_to_the_page_size_it_asks_for(
    function: int, attr: int, attr2: int, page: int, name: str
) -> None:
    block = nvos32(function, 1 << 16, attr=attr, attr2=attr2)  # 64 KiB (fn 6: 1 x 64 KiB)
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=block)))
    assert (call.ask_bytes, call.detail) == (max(page, 1 << 16), f"VIDMEM, {name} pages")


def test_the_default_page_size_is_the_drivers_choice_and_the_size_is_counted_as_asked() -> None:
    """The driver picks a default page by size and GPU (2 MiB from 2 MiB up): rounding to the
    largest it may pick would refuse small allocations it places in 64 KiB pages."""
    mem = memory(params=nvos64(0x40), alloc=memory_params(1, attr2=HUGE_512MB))
    assert decode(ioc(0x2B, 48), PARAMS, reader(mem)).ask_bytes == 1
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=nvos32(2, 1, attr2=HUGE_256GB))))
    assert (call.ask_bytes, call.detail) == (1, "VIDMEM")


def test_a_size_near_2_64_rounded_up_stays_past_any_limit_never_wraps_to_small() -> None:
    """The driver's NvU64 (size + page - 1) wraps to a few bytes; the ask must not."""
    top = (1 << 64) - 1
    for attr, attr2, _, _ in PAGES:
        mem = memory(params=nvos64(0x40), alloc=memory_params(top, attr, attr2))
        assert decode(ioc(0x2B, 48), PARAMS, reader(mem)).ask_bytes == 1 << 64
        block = nvos32(2, top, attr=attr, attr2=attr2)
        assert decode(ioc(0x4A, 184), PARAMS, reader(memory(params=block))).ask_bytes == 1 << 64
    tiled = bytearray(nvos32(6, 0, attr=PAGE_HUGE, attr2=HUGE_512MB))
    struct.pack_into("<Ii", tiled, 56, 1 << 16, -1)  # height x pitch: 2^64 - 2^16
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=bytes(tiled))))
    assert call.ask_bytes == 1 << 64


@pytest.mark.parametrize(
    ("block", "detail"),
    [
        (nvos32(2, GIB, location=1), "location PCI"),
        (nvos32(2, GIB, location=3), "location ANY"),  # the driver allocates ANY as system memory
        (nvos32(2, GIB, flags=0x80000), "VIRTUAL"),
        (nvos32(2, GIB, egm=True), "EGM"),
        (nvos32(5, GIB), "function 5"),  # INFO
    ],
)
def test_vid_heap_calls_that_take_no_video_memory_ask_nothing(block: bytes, detail: str) -> None:
    call = decode(ioc(0x4A, 184), PARAMS, reader(memory(params=block)))
    assert (call.ask_bytes, call.detail) == (None, detail)


def test_a_wrapped_call_is_refused_at_its_inner_parameters() -> None:
    mem = memory(xfer=xfer(0x2B, 48), inner=nvos64(0x40), alloc=memory_params(GIB))
    call = decode(ioc(0xD3, 16), XFER, reader(mem))
    assert (call.wrapped, call.ask_bytes, call.status_addr) == (True, GIB, INNER + 40)
    assert call.what == "XFER/RM_ALLOC/NVOS64 class 0x40"
    mem = memory(xfer=xfer(0x2B, 32), inner=nvos21(0x40), alloc=memory_params(GIB))
    assert decode(ioc(0xD3, 16), XFER, reader(mem)).status_addr == INNER + 28
    mem = memory(xfer=xfer(0x4A, 184), inner=nvos32(2, GIB))
    assert decode(ioc(0xD3, 16), XFER, reader(mem)).status_addr == INNER + 20


@pytest.mark.parametrize(
    ("cmd", "size"), [(0x12B, 48), (0xC030462B, 48), (0x2B, 40), (0x2B, 64), (0xD3, 16), (0x2A, 32)]
)
def test_the_wrapped_command_is_compared_whole_as_the_driver_compares_it(
    cmd: int, size: int
) -> None:
    """The driver's switch takes the inner command as it is: 0x12B is no RM_ALLOC there, nor a
    full request number, nor a nested XFER."""
    mem = memory(xfer=xfer(cmd, size), inner=nvos64(0x40), alloc=memory_params(GIB))
    call = decode(ioc(0xD3, 16), XFER, reader(mem))
    assert (call.wrapped, call.ask_bytes) == (True, None)


def test_a_short_read_is_an_error_not_a_guess() -> None:
    with pytest.raises(ShortRead):
        decode(ioc(0x2B, 48), PARAMS, reader({PARAMS: nvos64(0x40)[:20]}))
    with pytest.raises(ShortRead):  # the allocation's parameters are unmapped
        decode(ioc(0x2B, 48), PARAMS, reader(memory(params=nvos64(0x40))))


def test_the_gated_requests_and_the_status_are_the_drivers() -> None:
    assert [hex(ioc(r & 0xFF, r >> 16)) for r in GATED] == [
        "0xc020462b",
        "0xc030462b",
        "0xc0b8464a",
        "0xc01046d3",
    ]
    assert NV_ERR_NO_MEMORY == 0x51


def test_layouts_are_known_for_535_to_59x_only() -> None:
    assert layout_for(530) is None  # NVOS64 was 40 bytes
    assert layout_for(535) is not None and layout_for(595) is not None
    assert layout_for(600) is None
