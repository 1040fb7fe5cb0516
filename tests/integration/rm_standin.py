"""A test double of the NVIDIA driver's callers (CUDA's user-mode driver): issues the
driver's real allocation requests, with their real parameter blocks, on an ordinary file.

The allocation gate's filter matches a request by its number whatever the fd, so a call
here is notified as a real one would be. A call the gate lets go on reaches the file, which
answers ENOTTY with the status untouched; a refused one returns 0 with the driver's
NV_ERR_NO_MEMORY (0x51) in its status. One JSON line per step on stdout:
{"step", "ret", "errno", "status"}.

Steps (arguments), each `key=value,...`:
  form=nvos64|nvos21|vidheap   the block (default nvos64)
  class=0x40   size=1073741824 fn=2 loc=0 flags=0 egm=0     what it asks
  wrap=1       through NV_ESC_IOCTL_XFER_CMD; inner=0x12B replaces the inner command
  kind=0x47 dir=2 hi32=1       the request's type byte, direction, bit 32 set
  abi=i386     through `int 0x80` (x86_64 only)
  file=PATH    the file the request is issued on (default /dev/null)
  threads=T,repeat=N           the step N times in each of T threads: one line of counts
                               {"step", "counts": {"RET/ERRNO/STATUS": n}}
and the steps `out=FD` (write the lines to FD from now on) and `wait=FD` (read one byte
from FD before going on).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import threading
from collections import Counter

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
MAP_32BIT = 0x40  # x86_64: below 4 GiB, where an i386 call's pointers can reach
PAGE = 4096
STATUS_AT = {"nvos21": 28, "nvos64": 40, "vidheap": 20}
FORM = {"nvos21": (0x2B, 32), "nvos64": (0x2B, 48), "vidheap": (0x4A, 184)}
VIDHEAP = {2: (56, 144, 88), 14: (56, 136, 80), 6: (64, 144, 88)}  # attr, attr2, size


def region() -> int:
    """One page for the step's blocks, below 4 GiB on x86_64."""
    flags = (
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_32BIT if os.uname().machine == "x86_64" else 0)
    )
    address = libc.mmap(None, PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(address)


def put(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def i386_ioctl() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """An `int 0x80` stub: (nr, ebx, ecx, edx) -> eax sign-extended."""
    code = bytes.fromhex("5389f889f34189d189ca4489c9cd804863c05bc3")
    page = libc.mmap(
        None,
        PAGE,
        mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        -1,
        0,
    )
    put(page, code)
    kind = ctypes.CFUNCTYPE(
        ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long
    )
    return kind(page)


def step(spec: str) -> dict[str, object]:
    o = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    form = o.get("form", "nvos64")
    nr, size = FORM[form]
    base = region()
    params, alloc, xfer = base, base + 512, base + 1024
    block = bytearray(size)
    if form == "vidheap":
        fn = int(o.get("fn", "2"), 0)
        attr, attr2, at = VIDHEAP.get(fn, VIDHEAP[2])
        struct.pack_into("<I", block, 8, fn)
        struct.pack_into("<I", block, 52, int(o.get("flags", "0"), 0))
        struct.pack_into("<I", block, attr, int(o.get("loc", "0"), 0) << 25)
        struct.pack_into("<I", block, attr2, int(o.get("egm", "0"), 0) << 24)
        struct.pack_into("<Q", block, at, int(o.get("size", "0"), 0))
    else:
        struct.pack_into("<IQ", block, 12, int(o.get("class", "0x40"), 0), alloc)
        memory = bytearray(128)
        struct.pack_into("<Q", memory, 64, int(o.get("size", "0"), 0))
        put(alloc, bytes(memory))
    struct.pack_into("<I", block, STATUS_AT[form], 0xFFFFFFFF)
    put(params, bytes(block))
    kind, direction = int(o.get("kind", str(ord("F"))), 0), int(o.get("dir", "3"), 0)
    if o.get("wrap") == "1":
        put(xfer, struct.pack("<IIQ", int(o.get("inner", hex(nr)), 0), size, params))
        nr, size, argp = 0xD3, 16, xfer
    else:
        argp = params
    cmd = (direction << 30) | (size << 16) | (kind << 8) | nr | (int(o.get("hi32", "0")) << 32)
    fd = os.open(o.get("file", "/dev/null"), os.O_RDONLY)
    try:
        ctypes.set_errno(0)
        if o.get("abi") == "i386":
            ret = i386_ioctl()(54, fd, cmd & 0xFFFFFFFF, argp)
            err, ret = (-ret, -1) if ret < 0 else (0, ret)
        else:
            ret = libc.syscall(
                ctypes.c_long(16), ctypes.c_long(fd), ctypes.c_ulong(cmd), ctypes.c_void_p(argp)
            )
            err = ctypes.get_errno() if ret < 0 else 0
    finally:
        os.close(fd)
    (status,) = struct.unpack("<I", ctypes.string_at(params + STATUS_AT[form], 4))
    return {"step": spec, "ret": ret, "errno": err, "status": status}


def flood(spec: str, threads: int, repeat: int) -> dict[str, object]:
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> None:
        for _ in range(repeat):
            r = step(spec)
            with lock:
                counts[f"{r['ret']}/{r['errno']}/{r['status']:#x}"] += 1

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"step": spec, "counts": dict(counts)}


def main() -> None:
    out = sys.stdout.fileno()
    for spec in sys.argv[1:]:
        if spec.startswith("out="):
            out = int(spec[4:])
        elif spec.startswith("wait="):
            os.read(int(spec[5:]), 1)
        else:
            o = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
            threads, repeat = int(o.get("threads", "0")), int(o.get("repeat", "1"))
            line = flood(spec, threads, repeat) if threads else step(spec)
            os.write(out, (json.dumps(line) + "\n").encode())


if __name__ == "__main__":
    main()
