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
  field=N      VID_HEAP's size field written as N (fn=6 still asks `size` as height * pitch)
  attr=N attr2=N  the attributes (NVOS32_ATTR*: page size 24:23, huge page size 21:20),
               in class 0x40's NV_MEMORY_ALLOCATION_PARAMS or or'ed into VID_HEAP's
  wrap=1       through NV_ESC_IOCTL_XFER_CMD; inner=0x12B replaces the inner command
  kind=0x47 dir=2 hi32=1       the request's type byte, direction, bit 32 set
  abi=i386     through `int 0x80` (x86_64 only); abi=i386hi the same with junk in the upper
               halves of the 64-bit registers (the kernel passes the lower ones)
  file=PATH    the file the request is issued on (default /dev/null); fd=N on descriptor
               N as it is (one that is not open: EBADF)
  at=N         the block N bytes into its page (odd; at the end of the mapping: a short read)
  argp=A       the request's pointer replaced by A (unmapped, past user space)
  params=A     NVOS64's pAllocParms replaced by A; far=1 the allocation's parameters mapped
               anywhere (above 4 GiB, where an i386 call's 64-bit field can still point)
  unmap=FD     a second thread unmaps the block once it reads a byte from FD, and says so
               in a line {"unmapped": 1}
  restart=1    SIGUSR1 caught by a handler that does nothing, with SA_RESTART: a signal
               interrupts the call, which the kernel then issues again
  storm=N      (with restart=1) a second thread sends the calling thread N SIGUSR1s while
               its call waits, then says so in a line {"stormed": N}
  flip=SIZE,tries=N   a second thread rewrites the size to SIZE while the call waits for the
               gate, until one call the gate let go on is seen to have reached the file
               with SIZE (at most N calls): one line {"step", "tries", "raced", "refused"}
  threads=T,repeat=N           the step N times in each of T threads: one line of counts
                               {"step", "counts": {"RET/ERRNO/STATUS": n}}
  bg=1         the step in a thread of its own, the next steps going on meanwhile
  nr=0x2A      another escape's NR (not gated: what the filter alone costs)
  time=N[,cpu=C][,gap=S]       the step built once and issued N times on one fd (pinned
                               to CPU C; S seconds apart), each call timed:
                               {"step", "ns": [sorted], "counts"}
  rate=B,upto=B[,driver=1][,race=B][,stop=0][,after=S][,hold=S]
                               the step paced at B bytes a second until it asked for
                               `upto` bytes or a call was refused (see `paced`);
                               driver=1: what went on is added to this process's usage in
                               the fake NVML's state ($FAKE_NVML_STATE), as a driver would
                               hold it: {"step", "calls", "let_go", "refused", "counts"}
and the steps `out=FD` (write the lines to FD from now on), `wait=FD` (read one byte
from FD before going on) and `undumpable` (prctl(PR_SET_DUMPABLE, 0)).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import struct
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

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
NV_ERR_NO_MEMORY = 0x51
PR_SET_DUMPABLE = 4
STATUS_AT = {"nvos21": 28, "nvos64": 40, "vidheap": 20}
FORM = {"nvos21": (0x2B, 32), "nvos64": (0x2B, 48), "vidheap": (0x4A, 184)}
VIDHEAP = {2: (56, 144, 88), 14: (56, 136, 80), 6: (64, 144, 88)}  # attr, attr2, size


libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def region(low: bool = True) -> int:
    """One page for the step's blocks, below 4 GiB on x86_64 unless not `low`, with no
    mapping right after it (a block at its end is read short)."""
    below = MAP_32BIT if low and os.uname().machine == "x86_64" else 0
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | below
    address = libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    libc.munmap(address + PAGE, PAGE)
    return int(address)


def put(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


# (nr, ebx, ecx, edx) -> eax sign-extended; the second loads the whole 64-bit registers
I386_STUBS = {
    "i386": "5389f889f34189d189ca4489c9cd804863c05bc3",
    "i386hi": "5389f84889f34989d14889ca4c89c9cd804863c05bc3",
}
JUNK = 0x5A5A5A5A << 32  # what a 64-bit program may leave in a register's upper half


def machine_code(code: str) -> int:
    """A page of its own holding `code` (hex), executable."""
    page = libc.mmap(
        None,
        PAGE,
        mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        -1,
        0,
    )
    put(page, bytes.fromhex(code))
    return int(page)


def i386_ioctl(abi: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """An `int 0x80` stub."""
    page = machine_code(I386_STUBS[abi])
    kind = ctypes.CFUNCTYPE(
        ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long
    )
    return kind(page)


@dataclass(frozen=True, slots=True)
class Prepared:
    """One step's request and blocks, built once, issuable many times."""

    spec: str
    options: dict[str, str]
    base: int  # the page the blocks are on
    cmd: int
    argp: int
    status_at: int | None  # the status word's address (None: past the mapping, or unmapped)
    size_at: int | None  # the asked size's address (None: no size, e.g. another function)

    def issue(self, fd: int) -> tuple[int, int]:
        """The ioctl, as (ret, errno)."""
        ctypes.set_errno(0)
        abi = self.options.get("abi", "")
        if abi.startswith("i386"):
            junk = JUNK if abi == "i386hi" else 0
            ret = i386_ioctl(abi)(54, fd | junk, (self.cmd & 0xFFFFFFFF) | junk, self.argp | junk)
            return (-1, -ret) if ret < 0 else (ret, 0)
        ret = libc.syscall(
            ctypes.c_long(16),
            ctypes.c_long(fd),
            ctypes.c_ulong(self.cmd),
            ctypes.c_void_p(self.argp),
        )
        return ret, ctypes.get_errno() if ret < 0 else 0

    def issue_once(self) -> tuple[int, int]:
        """The request issued on a file of its own, or on `fd=N` as it is."""
        if "fd" in self.options:
            return self.issue(int(self.options["fd"]))
        fd = self.open()
        try:
            return self.issue(fd)
        finally:
            os.close(fd)

    def status(self) -> int | None:
        if self.status_at is None:
            return None
        (status,) = struct.unpack("<I", ctypes.string_at(self.status_at, 4))
        return int(status)

    def reset(self) -> None:
        if self.status_at is not None:
            put(self.status_at, struct.pack("<I", 0xFFFFFFFF))

    def asked(self) -> int:
        """The size the block asks for now: what the driver reads once the call goes on."""
        if self.size_at is None:
            return 0
        (size,) = struct.unpack("<Q", ctypes.string_at(self.size_at, 8))
        return int(size)

    def open(self) -> int:
        return os.open(self.options.get("file", "/dev/null"), os.O_RDONLY)


def prepare(spec: str) -> Prepared:
    o = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    form = o.get("form", "nvos64")
    nr, size = FORM[form]
    base = region()
    params, alloc, xfer = base + int(o.get("at", "0"), 0), base + 512, base + 1024
    if o.get("far") == "1":
        alloc = region(low=False)
    block = bytearray(size)
    attrs = int(o.get("attr", "0"), 0), int(o.get("attr2", "0"), 0)
    if form == "vidheap":
        fn = int(o.get("fn", "2"), 0)
        attr, attr2, at = VIDHEAP.get(fn, VIDHEAP[2])
        struct.pack_into("<I", block, 8, fn)
        struct.pack_into("<I", block, 52, int(o.get("flags", "0"), 0))
        struct.pack_into("<I", block, attr, int(o.get("loc", "0"), 0) << 25 | attrs[0])
        struct.pack_into("<I", block, attr2, int(o.get("egm", "0"), 0) << 24 | attrs[1])
        ask = int(o.get("size", "0"), 0)
        struct.pack_into("<Q", block, at, int(o.get("field", str(ask)), 0))
        if fn == 6:  # the driver allocates height * pitch, whatever the size field says
            struct.pack_into("<Ii", block, 56, ask >> 16, 1 << 16)
        size_at: int | None = params + at
    else:
        pointer = int(o.get("params", str(alloc)), 0)
        struct.pack_into("<IQ", block, 12, int(o.get("class", "0x40"), 0), pointer)
        memory = bytearray(128)
        struct.pack_into("<II", memory, 24, *attrs)
        struct.pack_into("<Q", memory, 64, int(o.get("size", "0"), 0))
        put(alloc, bytes(memory))
        size_at = alloc + 64
    struct.pack_into("<I", block, STATUS_AT[form], 0xFFFFFFFF)
    put(params, bytes(block)[: base + PAGE - params])  # a block past the page is cut short
    kind, direction = int(o.get("kind", str(ord("F"))), 0), int(o.get("dir", "3"), 0)
    nr = int(o.get("nr", hex(nr)), 0)
    if o.get("wrap") == "1":
        put(xfer, struct.pack("<IIQ", int(o.get("inner", hex(nr)), 0), size, params))
        nr, size, argp = 0xD3, 16, xfer
    else:
        argp = params
    argp = int(o.get("argp", str(argp)), 0)
    cmd = (direction << 30) | (size << 16) | (kind << 8) | nr | (int(o.get("hi32", "0")) << 32)
    status_at = params + STATUS_AT[form]
    readable = status_at + 4 <= base + PAGE and "unmap" not in o
    return Prepared(spec, o, base, cmd, argp, status_at if readable else None, size_at)


def step(spec: str) -> dict[str, object]:
    call = prepare(spec)
    o = call.options
    if "flip" in o:
        return race(spec, call)
    if o.get("restart") == "1":
        restart_on_sigusr1()
    if "storm" in o:
        caller = threading.get_ident()
        threading.Thread(target=storm, args=(caller, int(o["storm"]))).start()
    if "unmap" in o:
        unmapper = threading.Thread(target=unmap_when_told, args=(int(o["unmap"]), call.base))
        unmapper.start()
    ret, err = call.issue_once()
    return {"step": spec, "ret": ret, "errno": err, "status": call.status()}


def storm(caller: int, n: int) -> None:
    """Signals at the caller while its call waits: each one makes the kernel issue the
    call again, as a new notification."""
    for _ in range(n):
        signal.pthread_kill(caller, signal.SIGUSR1)
        time.sleep(0.0001)
    os.write(OUT[0], (json.dumps({"stormed": n}) + "\n").encode())


def unmap_when_told(told: int, base: int) -> None:
    os.read(told, 1)
    libc.munmap(base, PAGE)
    os.write(OUT[0], b'{"unmapped": 1}\n')


SA_RESTART = 0x10000000
RETURN = {"x86_64": "c3", "aarch64": "c0035fd6"}  # a handler that returns at once


def restart_on_sigusr1() -> None:
    """SIGUSR1 handled in C (Python's handlers run between bytecodes, and it sets no
    SA_RESTART), by one `ret` instruction."""
    page = machine_code(RETURN[os.uname().machine])
    action = bytearray(152)  # glibc's struct sigaction: handler, mask[128], flags, restorer
    struct.pack_into("<Q", action, 0, page)
    struct.pack_into("<i", action, 136, SA_RESTART)
    if libc.sigaction(signal.SIGUSR1, (ctypes.c_char * 152).from_buffer(action), None):
        raise OSError(ctypes.get_errno(), "sigaction")


def in_the_call(tid: int) -> bool:
    """Whether the thread is asleep in an ioctl: on /dev/null, only the seccomp wait for the
    gate's answer sleeps, so the call has not reached the file yet."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split(" ", 1)[0] == "16"


def flip(
    caller: int,
    size: ctypes.c_uint64,
    big: int,
    delay: float,
    done: threading.Event,
    before: list[bool],
) -> None:
    """Waits for the call to wait for the gate, then `delay` more, and rewrites the size;
    `before[0]`: the caller was still seen waiting after the rewrite."""
    while not done.is_set():
        if in_the_call(caller):
            until = time.perf_counter() + delay
            while time.perf_counter() < until:
                pass
            size.value = big
            before[0] = in_the_call(caller)
            return


def race(spec: str, call: Prepared) -> dict[str, object]:
    """The CONTINUE race: while the call waits for the gate's answer, another thread
    rewrites its size. The rewrite counts as having reached the file only if the calling
    thread was still seen waiting after it; the first such call let go on ends the step.
    The rewrite's delay follows the gate's read, whatever the machine's load: later after
    a refusal (the gate read the rewrite), sooner after a call that went on untouched."""
    o = call.options
    assert call.size_at is not None, "flip= needs a step that asks a size"
    size, big = ctypes.c_uint64.from_address(call.size_at), int(o["flip"], 0)
    asked = size.value
    caller, tries, raced, refused, delay = threading.get_native_id(), 0, 0, 0, 0.0
    while not raced and tries < int(o.get("tries", "1000")):
        tries += 1
        size.value, done, before = asked, threading.Event(), [False]
        flipper = threading.Thread(target=flip, args=(caller, size, big, delay, done, before))
        flipper.start()
        ret, err = call.issue_once()
        done.set()
        flipper.join()
        status = call.status()
        refused += status == NV_ERR_NO_MEMORY
        raced += ret == -1 and err == 25 and before[0]  # ENOTTY: it reached the file
        step = 10e-6 + delay / 16
        delay = delay + step if status == NV_ERR_NO_MEMORY else max(0.0, delay - step)
        call.reset()
    return {"step": spec, "tries": tries, "raced": raced, "refused": refused}


def outcome(ret: int, err: int, status: int | None) -> str:
    return f"{ret}/{err}/{status:#x}" if status is not None else f"{ret}/{err}/-"


def timed(spec: str, calls: int) -> dict[str, object]:
    """The step issued `calls` times on one fd, each call timed alone (ns, sorted); `gap`
    seconds apart if given (a listener woken from idle each time, as real calls come)."""
    call = prepare(spec)
    if "cpu" in call.options:
        os.sched_setaffinity(0, {int(call.options["cpu"])})
    counts: Counter[str] = Counter()
    took = []
    gap = float(call.options.get("gap", "0"))
    fd = call.open()
    try:
        for _ in range(calls):
            if gap:
                time.sleep(gap)
            call.reset()
            started = time.perf_counter_ns()
            ret, err = call.issue(fd)
            took.append(time.perf_counter_ns() - started)
            counts[outcome(ret, err, call.status())] += 1
    finally:
        os.close(fd)
    return {"step": spec, "ns": sorted(took), "counts": dict(counts)}


class Driver:
    """The fake NVML's state file (FAKE_NVML_STATE) as this process's driver: what each
    call let go on asked for is added to this process's usage on the first GPU."""

    def __init__(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.fakenvml import FakeGpuState  # only this mode needs it

        self._path = Path(os.environ["FAKE_NVML_STATE"])
        self._state = FakeGpuState
        self.held = 0

    def allocated(self, n: int) -> None:
        self.held += n
        state = self._state(json.loads(self._path.read_text()))
        state.set_process(0, os.getpid(), self.held)
        state.write(self._path)  # replaced at once: the reader never sees half a file


def paced(spec: str) -> dict[str, object]:
    """`rate=B/s,upto=B`: the step again and again at `rate` bytes a second until it has
    asked for `upto` bytes or one call was refused (`stop=0`: a refusal stops nothing, as a
    racing workload goes on). With `driver=1`, each call let go on adds
    what its block asked for when it returned to this process's usage in the fake NVML's
    state; with `race=B`, another thread keeps flipping the asked size between the step's
    and B (the race a listener cannot close: the driver reads what is there after the
    check). `after=S`: wait S seconds first; `hold=S`: wait S seconds before the line."""
    call = prepare(spec)
    o = call.options
    rate, upto, ask = int(o["rate"], 0), int(o["upto"], 0), call.asked()
    driver = Driver() if o.get("driver") == "1" else None
    stop = threading.Event()
    if "race" in o and call.size_at is not None:
        sizes = [struct.pack("<Q", ask), struct.pack("<Q", int(o["race"], 0))]
        size_at = call.size_at

        def flip() -> None:
            i = 0
            while not stop.is_set():
                put(size_at, sizes[i & 1])
                i += 1

        threading.Thread(target=flip, daemon=True).start()
    counts: Counter[str] = Counter()
    let_go, calls, refused = 0, 0, 0
    stops = o.get("stop", "1") == "1"
    fd = call.open()
    time.sleep(float(o.get("after", "0")))
    started = time.monotonic()
    try:
        while calls * ask < upto and not (refused and stops):
            if (early := started + calls * ask / rate - time.monotonic()) > 0:
                time.sleep(early)
            call.reset()
            ret, err = call.issue(fd)
            calls += 1
            counts[outcome(ret, err, call.status())] += 1
            if ret == 0 and call.status() == NV_ERR_NO_MEMORY:
                refused += 1
                continue
            n = call.asked()
            let_go += n
            if driver is not None:
                driver.allocated(n)
    finally:
        stop.set()
        os.close(fd)
    time.sleep(float(o.get("hold", "0")))
    return {
        "step": spec,
        "calls": calls,
        "let_go": let_go,
        "refused": refused,
        "counts": dict(counts),
    }


def flood(spec: str, threads: int, repeat: int) -> dict[str, object]:
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> None:
        for _ in range(repeat):
            call = prepare(spec)
            got = outcome(*call.issue_once(), call.status())
            with lock:
                counts[got] += 1

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"step": spec, "counts": dict(counts)}


OUT = [1]  # where the lines go


def main() -> None:
    for spec in sys.argv[1:]:
        if spec.startswith("out="):
            OUT[0] = int(spec[4:])
        elif spec.startswith("wait="):
            os.read(int(spec[5:]), 1)
        elif spec == "undumpable":
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        else:
            o = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
            if o.get("bg") == "1":
                threading.Thread(target=say, args=(spec, o)).start()
            else:
                say(spec, o)


def say(spec: str, o: dict[str, str]) -> None:
    threads, repeat = int(o.get("threads", "0")), int(o.get("repeat", "1"))
    if "time" in o:
        line = timed(spec, int(o["time"]))
    elif "rate" in o:
        line = paced(spec)
    else:
        line = flood(spec, threads, repeat) if threads else step(spec)
    os.write(OUT[0], (json.dumps(line) + "\n").encode())


if __name__ == "__main__":
    main()
