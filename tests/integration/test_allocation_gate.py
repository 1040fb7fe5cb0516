"""The allocation gate end to end on this kernel: the real seccomp filter installed by the
trampoline, the real listener, and a stand-in of the driver's callers (rm_standin.py) that
issues the driver's real requests on /dev/null, whose device major stands in for NVIDIA's.

A call let go on reaches /dev/null (ENOTTY, status untouched); a refused one returns 0 with
NV_ERR_NO_MEMORY (0x51) in its status, and the process goes on. The sampler is stood in for
by the test: `usage` is what it would read, reported when the gate asks for a pass."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.alloc_gate import Verdict, View
from enforcer.edge import gate_child
from enforcer.edge.gate_listener import (
    STALL_AFTER,
    GateListener,
    Ledger,
    Notification,
    Outcome,
)
from enforcer.edge.seccomp_filter import program
from tests.hung_fuse import hung_fuse

GIB = 1 << 30
STANDIN = str(Path(__file__).with_name("rm_standin.py"))
NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)
NO_MEMORY, UNTOUCHED = 0x51, 0xFFFFFFFF
DEADLINE = 60.0  # s: a bound for a hang, never a measure


class Errors:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, amount: float = 1) -> None:
        self.count += int(amount)


class Gated:
    """The stand-in run under the gate, its lines read as they come."""

    def __init__(
        self,
        steps: list[str],
        limit: int,
        usage: int,
        ledger: Ledger | None,
        kind: type[GateListener] = GateListener,
    ) -> None:
        self.usage = usage
        self.sampling = True
        self.asked = threading.Event()
        self.passes = 0  # the early passes the gate asked for
        self.outcomes: list[Outcome] = []
        self.errors = Errors()
        self.ledger = ledger or Ledger(limit)
        self.ledger.saw(usage, time.monotonic())
        self._out, out = os.pipe()
        self.go_r, self.go_w = os.pipe()  # `wait=GO`, `unmap=GO`: for `go_on()`
        os.set_inheritable(out, True)
        os.set_inheritable(self.go_r, True)
        steps = [s.replace("=GO", f"={self.go_r}") for s in steps]
        argv = [sys.executable, STANDIN, f"out={out}", *steps]
        self.spawned = gate_child.spawn(sys.executable, argv, program())
        os.close(out)
        assert self.spawned.listener is not None, self.spawned.why_not
        self.fd = self.spawned.listener
        self.listener = kind(
            self.fd,
            self.ledger,
            {NULL_MAJOR},
            self.errors,
            count=lambda outcome, seconds: self.outcomes.append(outcome),
            want_pass=self.sample,
            recheck_wait=DEADLINE,
            pid=self.spawned.pid,
        )
        self.listener.start()
        assert self.spawned.go() == 0
        self._buf = b""

    def sample(self) -> None:
        """The sampler's pass, asked for early by the gate; with `sampling` off, none comes."""
        self.asked.set()
        self.passes += 1
        if self.sampling:
            self.ledger.saw(self.usage, time.monotonic())

    def line(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._out], [], [], DEADLINE)
            assert ready, "the stand-in hung"
            chunk = os.read(self._out, 4096)
            assert chunk, "the stand-in ended early"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        return json.loads(raw)  # type: ignore[no-any-return]

    def go_on(self) -> None:
        os.write(self.go_w, b"g")

    def exit_code(self) -> int:
        for _ in range(int(DEADLINE * 100)):
            pid, status = os.waitpid(self.spawned.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        raise AssertionError("the stand-in did not end")

    def answered(self) -> list[Outcome]:
        """What became of each call, once the stand-in has ended and the listener stopped
        (it counts a call just after answering it)."""
        assert self.exit_code() == 0
        self.listener.stop()
        return self.outcomes

    def close(self) -> None:
        self.listener.stop()
        for fd in (self.fd, self._out, self.go_r, self.go_w):
            with contextlib.suppress(OSError):
                os.close(fd)


Start = Callable[..., Gated]  # (*steps, limit=, usage=, ledger=) -> a run


@pytest.fixture
def gated() -> Iterator[Start]:
    runs: list[Gated] = []

    class Run(Gated):
        def __init__(
            self,
            *steps: str,
            limit: int = 4 * GIB,
            usage: int = 0,
            ledger: Ledger | None = None,
            kind: type[GateListener] = GateListener,
        ) -> None:
            super().__init__(list(steps), limit, usage, ledger, kind)
            runs.append(self)

    yield Run
    for run in runs:
        run.close()
        try:
            os.kill(run.spawned.pid, 9)
            os.waitpid(run.spawned.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def continued(line: dict[str, Any]) -> bool:
    """The call reached the file: /dev/null's ENOTTY, the status as the caller left it."""
    return (line["ret"], line["errno"], line["status"]) == (-1, errno.ENOTTY, UNTOUCHED)


def refused(line: dict[str, Any]) -> bool:
    """A full GPU's answer: the ioctl returns 0, NV_ERR_NO_MEMORY in the status."""
    return (line["ret"], line["status"]) == (0, NO_MEMORY)


def test_an_allocation_within_the_limit_goes_on_to_the_driver(gated: Start) -> None:
    run = gated(f"size={3 * GIB}")
    assert continued(run.line())
    assert run.answered() == [Outcome.ALLOWED] and run.errors.count == 0


def test_the_listener_fd_is_closed_in_any_later_child_of_its_holder(gated: Start) -> None:
    """A descriptor taken from SCM_RIGHTS is inheritable unless asked otherwise: a process
    the holder started later (posix_spawn closes nothing) would hold the listener and could
    answer the command's calls."""
    run = gated(f"size={GIB}")
    assert continued(run.line())
    assert not os.get_inheritable(run.fd)


def test_an_allocation_past_the_limit_is_refused_with_the_drivers_status_and_the_process_lives(
    gated: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    run = gated(f"size={2 * GIB}", f"size={GIB}", usage=3 * GIB)
    assert refused(run.line())
    assert continued(run.line())  # within the limit: the process went on and was served
    # Refused on an early pass, counted by the recheck worker: maybe after the next call.
    assert sorted(run.answered()) == [Outcome.ALLOWED, Outcome.REFUSED]
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert line.startswith("refused a GPU allocation of 2.00 GiB (RM_ALLOC/NVOS64 class 0x40, ")
    assert "holds 3.00 GiB" in line and "of its 4.00 GiB limit" in line


def test_what_was_let_through_counts_until_the_sampler_shows_it(gated: Start) -> None:
    """3 GiB let through, then 2 GiB asked: the gate waits for a pass that shows the first
    (the sampler then reads 3 GiB) and refuses."""
    run = gated(f"size={3 * GIB}", "wait=GO", f"size={2 * GIB}")
    assert continued(run.line())
    run.usage = 3 * GIB  # what the driver now holds for it
    run.go_on()
    assert refused(run.line())
    assert run.answered() == [Outcome.ALLOWED, Outcome.REFUSED]


def test_a_free_seen_by_the_next_pass_lets_the_retry_through(gated: Start) -> None:
    """PyTorch frees its cache after an out-of-memory and asks again."""
    run = gated(f"size={GIB}", "wait=GO", f"size={GIB}", usage=int(3.5 * GIB))
    assert refused(run.line())
    run.usage = GIB
    run.go_on()
    assert continued(run.line())


def test_a_free_just_before_an_allocation_makes_room_though_the_last_pass_came_before_it(
    gated: Start,
) -> None:
    """Frees are not gated: 3.9 GiB of 4 sampled, no refusal yet, then the command frees
    2 GiB and asks 2 GiB at once. The pass before the free showed no room: the call waits
    for an early pass, which shows the free, and goes on; it was refused a spurious
    out-of-memory on the older pass."""
    run = gated("wait=GO", f"size={2 * GIB}", usage=int(3.9 * GIB))
    run.usage = int(1.9 * GIB)  # what the driver holds once the command freed 2 GiB
    run.go_on()
    assert continued(run.line())
    assert run.answered() == [Outcome.ALLOWED] and run.passes == 1


def test_calls_looping_over_the_limit_cost_at_most_one_early_pass_each(gated: Start) -> None:
    """A workload that keeps asking past its limit (4 threads, 50 calls each): each call is
    refused on a pass begun after it arrived, and one pass serves every call that waits."""
    run = gated(f"size={GIB},threads=4,repeat=50", usage=int(3.5 * GIB))
    assert run.line()["counts"] == {f"0/0/{NO_MEMORY:#x}": 200}
    assert run.answered() == [Outcome.REFUSED] * 200 and run.errors.count == 0
    assert 0 < run.passes <= 200


@pytest.mark.parametrize(
    "step",
    [
        "form=nvos21",
        "form=vidheap,fn=2",
        "form=vidheap,fn=14",
        "form=vidheap,fn=6",
        "form=vidheap,fn=6,field=0",  # the driver allocates height * pitch: not the field
    ],
)
def test_each_form_is_refused_at_its_own_status(gated: Start, step: str) -> None:
    """The stand-in reads the status where its form keeps it: NVOS21 28, NVOS32 20."""
    run = gated(f"{step},size={5 * GIB}")
    assert refused(run.line())


@pytest.mark.parametrize("form", ["nvos64", "vidheap"])
def test_a_1_byte_ask_in_512_mib_pages_counts_512_mib(gated: Start, form: str) -> None:
    """The driver rounds a size up to the page size asked for (attr HUGE, attr2 512MB): 8 of
    them fill 4 GiB, and the 9th is refused (the gate counted 8 bytes, and let it on)."""
    step = f"form={form},size=1,attr={3 << 23},attr2={2 << 20}"
    run = gated(*[step] * 8, "wait=GO", step)
    for _ in range(8):
        assert continued(run.line())
    run.usage = 4 * GIB  # what the driver holds for the 8 calls let through
    run.go_on()
    assert refused(run.line())
    assert run.answered() == [Outcome.ALLOWED] * 8 + [Outcome.REFUSED]


@pytest.mark.parametrize(
    "step",
    [
        "form=vidheap,fn=2,loc=3",  # ANY: the driver allocates it as system memory
        "form=vidheap,fn=2,loc=1",  # PCI
        "form=vidheap,fn=2,flags=0x80000",  # VIRTUAL
        "form=vidheap,fn=2,egm=1",
        "form=vidheap,fn=5",  # INFO
        "class=0x3E",  # system memory
        "class=0x50A0",  # virtual
        "class=0x80",  # a context: decoded and let go on
        "class=0x42",  # EGM
    ],
)
def test_calls_that_take_no_video_memory_go_on_uncounted(gated: Start, step: str) -> None:
    run = gated(f"{step},size={5 * GIB}", f"size={4 * GIB}")
    assert continued(run.line())
    assert continued(run.line())  # nothing was counted: the whole limit is still there
    assert run.answered() == [Outcome.NOT_MEMORY, Outcome.ALLOWED]


def test_a_wrapped_call_is_refused_at_its_inner_parameters(gated: Start) -> None:
    run = gated(f"wrap=1,size={5 * GIB}", f"wrap=1,form=nvos21,size={5 * GIB}")
    assert refused(run.line())
    assert refused(run.line())


def test_a_wrapped_command_that_is_no_escape_goes_on(gated: Start) -> None:
    """The driver compares the inner command whole: 0x12B is not RM_ALLOC to it."""
    run = gated(f"wrap=1,inner=0x12B,size={5 * GIB}")
    assert continued(run.line())
    assert run.answered() == [Outcome.NOT_MEMORY]


@pytest.mark.parametrize("change", ["kind=0x47", "dir=2", "dir=1", "dir=0", "hi32=1"])
def test_a_request_with_its_type_byte_direction_or_upper_bits_changed_is_still_refused(
    gated: Start, change: str
) -> None:
    """The driver decodes only NR and SIZE: these reach it as the real allocation."""
    run = gated(f"{change},size={5 * GIB}")
    assert refused(run.line())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="int 0x80 is x86's")
@pytest.mark.parametrize(
    "step", ["abi=i386", "abi=i386hi", "abi=i386,far=1", "abi=i386hi,far=1,wrap=1"]
)
def test_an_i386_call_from_a_64_bit_process_is_refused(gated: Start, step: str) -> None:
    """Read as the driver reads it: the kernel passes the filter the whole 64-bit registers
    (junk in their upper halves included, `i386hi`) and the driver their lower halves,
    while the pointers inside the parameters are 64-bit fields it uses whole (one above
    4 GiB included)."""
    run = gated(f"{step},size={5 * GIB}")
    line = run.line()
    if line["errno"] == errno.ENOSYS and not run.outcomes:
        pytest.skip("this kernel has no i386 entry (IA32_EMULATION off)")
    assert refused(line)


def test_the_request_on_a_file_that_is_no_gpu_goes_on(gated: Start, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    run = gated(f"file={plain},size={5 * GIB}")
    assert continued(run.line())
    assert run.answered() == [Outcome.NOT_GPU]


def test_a_request_on_a_descriptor_that_is_not_open_goes_on_and_is_no_bug(gated: Start) -> None:
    """The kernel answers it EBADF (nothing reaches any driver): workload garbage, not a
    bug of ours in unexpected_errors_total, which a workload could otherwise fill at will."""
    run = gated(f"fd=999,size={5 * GIB}", f"size={5 * GIB}")
    line = run.line()
    assert (line["ret"], line["errno"]) == (-1, errno.EBADF)
    assert refused(run.line())  # the next call judged: the gate goes on
    assert run.answered() == [Outcome.NOT_GPU, Outcome.REFUSED]
    assert run.errors.count == 0


def test_a_request_on_a_file_of_a_hung_mount_does_not_hold_the_gate(
    gated: Start, tmp_path: Path
) -> None:
    """The gate looks at the file a call is on to tell an NVIDIA node: a `stat` that asks a
    FUSE daemon which never answers held the receiver for ever, and every later call of the
    command with it. Its cached attributes are enough (a device node's type and number do
    not change): the call goes on (to the hung file, the workload's own) and the next one
    on another thread is judged."""
    held: list[int] = []  # closed once the mount is gone: a flush would wait
    try:
        with hung_fuse(tmp_path / "mnt") as fuse:
            held.append(fd := os.open(fuse.file, os.O_RDONLY))
            os.set_inheritable(fd, True)
            fuse.hang()
            run = gated(f"fd={fd},size={5 * GIB},bg=1", f"size={5 * GIB}")
            assert refused(run.line())
            for _ in range(int(DEADLINE * 100)):  # it counts the call just after answering
                if len(run.outcomes) == 2:
                    break
                time.sleep(0.01)
            assert sorted(run.outcomes) == sorted([Outcome.NOT_GPU, Outcome.REFUSED])
            assert run.errors.count == 0
    finally:
        for fd in held:
            with contextlib.suppress(OSError):  # ENOTCONN: its flush had no mount to go to
                os.close(fd)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_without_cap_sys_admin_the_trampoline_sets_no_new_privs_and_the_gate_holds() -> None:
    """The kernel takes a filter from a process without CAP_SYS_ADMIN only under
    no_new_privs. (Running it as another uid is for a machine whose Python that uid can
    run: this one's is under /root.)"""
    host = Path(__file__).with_name("gate_host.py")
    no_admin = ["setpriv", "--inh-caps", "-all", "--bounding-set", "-sys_admin"]
    out = subprocess.run(
        [
            *no_admin,
            sys.executable,
            str(host),
            str(4 * GIB),
            str(3 * GIB),
            f"size={2 * GIB}",
            f"size={GIB}",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 3, out.stderr
    assert refused(lines[0]) and continued(lines[1])
    # The refusal, made on an early pass, is counted by the recheck worker: maybe after.
    assert sorted(lines[2]["outcomes"]) == ["allowed", "refused"] and lines[2]["exit"] == 0


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_a_command_that_makes_itself_not_dumpable_gets_its_calls_refused_never_let_on() -> None:
    """Without CAP_SYS_PTRACE the kernel lets the listener read a process of its user only
    while that process is dumpable: one prctl made every gated call unreadable, and each went
    on to the driver unjudged (outcome error, as a bug of ours). The listener runs as exec
    does without root: here root without CAP_SYS_PTRACE (its bounding set)."""
    host = Path(__file__).with_name("gate_host.py")
    no_ptrace = ["setpriv", "--inh-caps", "-all", "--bounding-set", "-sys_ptrace"]
    steps = [f"size={5 * GIB}", "undumpable", f"size={GIB}", "class=0x80"]
    out = subprocess.run(
        [*no_ptrace, sys.executable, str(host), str(4 * GIB), "0", *steps],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 4, (out.stdout, out.stderr)
    assert refused(lines[0])  # read and judged while it was dumpable: the gate saw it
    for line in lines[1:3]:  # unread, so not let on, whatever it asked
        assert (line["ret"], line["errno"], line["status"]) == (-1, errno.EPERM, UNTOUCHED)
    assert lines[3] == {"outcomes": ["refused", "refused", "refused"], "exit": 0}
    assert "cannot read" in out.stderr and "CAP_SYS_PTRACE" in out.stderr


class _Faulty(Ledger):
    """A bug in the gate, once."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.faults = 1

    def judge(self, ask_bytes: int, arrived: float) -> tuple[Verdict, View, float]:
        if self.faults:
            self.faults -= 1
            raise RuntimeError("a bug")
        return super().judge(ask_bytes, arrived)


def test_a_bug_lets_the_call_go_on_and_the_next_call_is_judged(
    gated: Start, caplog: pytest.LogCaptureFixture
) -> None:
    run = gated(f"size={5 * GIB}", f"size={5 * GIB}", ledger=_Faulty(4 * GIB))
    assert continued(run.line())
    assert refused(run.line())
    assert run.answered() == [Outcome.ERROR, Outcome.REFUSED] and run.errors.count == 1
    assert "unexpected error in the allocation gate loop" in caplog.text


def test_a_call_waiting_for_a_pass_goes_on_when_the_listener_stops(gated: Start) -> None:
    run = gated(f"size={3 * GIB}", "wait=GO", f"size={2 * GIB}")
    assert continued(run.line())
    run.sampling = False
    run.go_on()
    assert run.asked.wait(DEADLINE)  # the second call waits for a pass that never comes
    began = time.monotonic()
    run.listener.stop()
    assert time.monotonic() - began < DEADLINE / 2  # not the recheck's whole wait (a bound)
    assert continued(run.line())
    assert run.answered() == [Outcome.ALLOWED, Outcome.UNSURE]


def test_a_flood_of_gated_calls_from_many_threads_is_answered_call_by_call(gated: Start) -> None:
    """8 threads, 2000 calls: context-like objects (decoded, let go on) and allocations
    within the limit (counted), each answered once, none by mistake or error."""
    run = gated("class=0x80,threads=4,repeat=250", "size=1,threads=4,repeat=250")
    untouched = f"-1/{errno.ENOTTY}/{UNTOUCHED:#x}"
    assert run.line()["counts"] == {untouched: 1000}
    assert run.line()["counts"] == {untouched: 1000}
    outcomes = run.answered()
    assert (outcomes.count(Outcome.NOT_MEMORY), outcomes.count(Outcome.ALLOWED)) == (1000, 1000)
    assert len(outcomes) == 2000 and run.errors.count == 0
    assert run.ledger.view().since() == 1000  # every byte let through is counted once


class _Crashing(GateListener):
    """A receiver that stops on a bug past its guard, once."""

    crashed = False

    def _receive(self) -> None:
        if not self.crashed:
            self.crashed = True
            raise RuntimeError("a bug past the guard")
        super()._receive()


def waiting(fd: int) -> bool:
    """Whether a notified call waits on the listener fd (a bound, not a measure)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(DEADLINE * 1000)))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_stopped_receiver_is_restarted_by_its_owners_check_and_the_waiting_call_is_served(
    gated: Start, caplog: pytest.LogCaptureFixture
) -> None:
    run = gated(f"size={5 * GIB}", kind=_Crashing)
    assert waiting(run.fd)  # the call waits for an answer; it does not fail
    run.listener.check()
    assert refused(run.line())
    assert "the allocation gate's receiver stopped (a bug); it is restarted" in caplog.text


def test_once_the_command_has_ended_the_check_starts_nothing(gated: Start) -> None:
    run = gated(f"size={GIB}")
    assert continued(run.line())
    assert run.exit_code() == 0
    for _ in range(int(DEADLINE * 100)):  # the receiver sees the hang-up within its poll
        if not any(t.name == "allocation-gate" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    run.listener.check()
    assert not any(t.name == "allocation-gate" for t in threading.enumerate())


def test_with_the_listener_gone_a_gated_call_fails_with_enosys_and_nothing_hangs(
    gated: Start,
) -> None:
    """The kernel's limit, asserted so that a change is seen: once every copy of the fd is
    closed, the pending call and every later one fail at once with ENOSYS."""
    run = gated(f"size={GIB}", "wait=GO", f"size={GIB}", f"size={GIB}")
    assert continued(run.line())
    run.listener.stop()  # nobody reads: the next call waits
    run.go_on()
    assert waiting(run.fd), "the call was never notified"
    os.close(run.fd)
    pending, later = run.line(), run.line()
    assert (pending["ret"], pending["errno"]) == (-1, errno.ENOSYS)
    assert (later["ret"], later["errno"]) == (-1, errno.ENOSYS)
    assert run.exit_code() == 0


class _Judged(Ledger):
    """The ledger, with each ask it judged and its verdict kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.judged: list[tuple[int, Verdict]] = []

    def judge(self, ask_bytes: int, arrived: float) -> tuple[Verdict, View, float]:
        verdict, view, at = super().judge(ask_bytes, arrived)
        self.judged.append((ask_bytes, verdict))
        return verdict, view, at


def test_a_racing_thread_gets_a_bigger_size_past_the_gate_and_the_next_pass_stops_it(
    gated: Start,
) -> None:
    """The CONTINUE race, documented (the kernel's limit, asserted so that a change is
    seen): the gate reads 1 GiB and lets the call go on; a second thread has rewritten the
    size to 8 GiB while the call still waited, so 8 GiB reach the driver. The gate counted
    only the 1 GiB it read; once the sampler's pass shows what the driver holds, the next
    allocation is refused (and exec's sampling ends the command)."""
    ledger = _Judged(4 * GIB)
    run = gated(f"size={GIB},flip={8 * GIB},tries=2000", "wait=GO", f"size={GIB}", ledger=ledger)
    race = run.line()
    assert race["raced"] == 1, race  # seen within the bound: the race is real
    assert 0 < race["tries"] <= 2000
    allowed = [ask for ask, verdict in ledger.judged if verdict == Verdict.ALLOW]
    assert allowed == [GIB] * (race["tries"] - race["refused"])  # what it read, each once
    assert all(ask == 8 * GIB for ask, v in ledger.judged if v == Verdict.REFUSE)
    run.usage = 8 * GIB  # what the driver now holds for it
    run.sample()  # the sampler's next pass
    run.go_on()
    assert refused(run.line())
    outcomes = run.answered()
    assert outcomes.count(Outcome.REFUSED) == race["refused"] + 1 and run.errors.count == 0


class _Held(Ledger):
    """A gate that takes its time over its first verdict: it judges (an allowed ask is
    counted), then waits for the test before it answers."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.entered, self.release = threading.Event(), threading.Event()

    def judge(self, ask_bytes: int, arrived: float) -> tuple[Verdict, View, float]:
        judged = super().judge(ask_bytes, arrived)
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(DEADLINE)
        return judged


def test_a_receiver_held_in_a_call_does_not_hold_its_owners_stop() -> None:
    """A workload can hold the receiver inside one call for ever (its block on memory whose
    fault a process outside the command never serves: the listener's read waits on it):
    stop() waited for it, and exec never exited after its command.
    It gives up after a bound, says so, and leaves the fd open for the held thread."""
    ledger = _Held(4 * GIB)
    run = Gated([f"size={GIB}"], 4 * GIB, 0, ledger)
    try:
        assert ledger.entered.wait(DEADLINE)
        stopped: list[bool] = []
        stopper = threading.Thread(target=lambda: stopped.append(run.listener.stop()))
        stopper.start()
        stopper.join(DEADLINE)
        assert stopped == [False]  # came back while the receiver is still held
        ledger.release.set()
        assert continued(run.line())  # the held call was still answered
    finally:
        ledger.release.set()
        run.close()
        os.kill(run.spawned.pid, signal.SIGKILL)
        os.waitpid(run.spawned.pid, 0)


@pytest.mark.parametrize(
    ("size", "answer", "outcome"),
    [(GIB, continued, Outcome.ALLOWED), (5 * GIB, refused, Outcome.REFUSED)],
)
def test_a_call_a_signal_restarts_while_the_gate_judges_it_is_abandoned_once_and_judged_again(
    gated: Start, size: int, answer: Callable[[dict[str, Any]], bool], outcome: Outcome
) -> None:
    """SIGUSR1 with SA_RESTART interrupts the call while the gate holds its verdict: the
    kernel drops that notification (ENOENT) and issues the call again. The first is
    counted abandoned, its grant undone; the second is judged; the bytes count once."""
    ledger = _Held(4 * GIB)
    run = gated(f"restart=1,size={size}", ledger=ledger)
    assert ledger.entered.wait(DEADLINE)
    os.kill(run.spawned.pid, signal.SIGUSR1)
    assert waiting(run.fd), "the call was not issued again"  # while the first is held
    ledger.release.set()
    assert answer(run.line())
    assert run.answered() == [Outcome.ABANDONED, outcome] and run.errors.count == 0
    assert run.ledger.view().since() == (GIB if outcome == Outcome.ALLOWED else 0)


def test_a_call_a_signal_restarts_while_it_waits_for_a_pass_is_let_go_at_once(
    gated: Start,
) -> None:
    """The recheck worker waits for a pass for one call at a time: one that a signal
    restarted is dropped as abandoned at once, not after the whole wait, and its second
    notification is the one judged when the pass comes."""
    run = gated(f"size={GIB}", "wait=GO", f"restart=1,size={GIB}", usage=int(3.5 * GIB))
    assert refused(run.line())
    run.sampling = False
    run.asked.clear()
    run.go_on()
    assert run.asked.wait(DEADLINE)  # the second call waits for a pass
    os.kill(run.spawned.pid, signal.SIGUSR1)
    for _ in range(int(DEADLINE * 5)):  # a bound: half the recheck's wait (DEADLINE)
        if Outcome.ABANDONED in run.outcomes:
            break
        time.sleep(0.1)
    assert run.outcomes == [Outcome.REFUSED, Outcome.ABANDONED]
    run.usage, run.sampling = GIB, True  # the pass comes, and shows a free
    assert continued(run.line())
    assert run.answered() == [Outcome.REFUSED, Outcome.ABANDONED, Outcome.ALLOWED]


def went_on(line: dict[str, Any]) -> bool:
    """The call reached the file, whatever its status (which may not be readable)."""
    return (line["ret"], line["errno"]) == (-1, errno.ENOTTY)


PAST_USER_SPACE = [hex((1 << 64) - 16), hex(1 << 63), hex(1 << 47)]


@pytest.mark.parametrize(
    "step",
    [
        "argp=0x1000",  # below mmap_min_addr: never mapped
        *(f"argp={a}" for a in PAST_USER_SPACE),
        "at=4076",  # NVOS64 runs 28 bytes past the end of its mapping
        "params=0x1000",
        *(f"params={a}" for a in PAST_USER_SPACE),
        "wrap=1,argp=0x1000",
        "wrap=1,at=4076",  # the inner block, short
    ],
)
def test_parameters_the_gate_cannot_read_let_the_call_go_on_and_are_no_bug(
    gated: Start, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver answers such a call EFAULT; the gate lets it go on (it cannot allocate)
    and says it at debug, not as a bug of ours with a traceback: a workload's garbage is
    input. The receiver goes on: the next call is judged."""
    run = gated(f"{step},size={5 * GIB}", f"size={5 * GIB}")
    assert went_on(run.line())
    assert refused(run.line())
    assert run.answered() == [Outcome.ERROR, Outcome.REFUSED]
    assert run.errors.count == 0 and "unexpected error" not in caplog.text


@pytest.mark.parametrize("size", [(1 << 64) - 1, 1 << 63, 4 * GIB + 1])
def test_a_huge_size_is_refused_and_nothing_is_counted(gated: Start, size: int) -> None:
    run = gated(f"size={size}", f"form=vidheap,size={size}", f"size={4 * GIB}")
    assert refused(run.line()) and refused(run.line())
    assert continued(run.line())  # nothing of the refused ones was counted
    assert run.answered() == [Outcome.REFUSED, Outcome.REFUSED, Outcome.ALLOWED]


@pytest.mark.parametrize("at", ["1", "4048"])  # odd; the block's last byte on the page's last
def test_a_block_at_an_odd_address_or_the_end_of_its_mapping_is_refused_at_its_status(
    gated: Start, at: str
) -> None:
    run = gated(f"at={at},size={5 * GIB}")
    assert refused(run.line())


class _Slow(GateListener):
    """A receiver that waits for the test before it looks at its first call's task."""

    entered, release = threading.Event(), threading.Event()

    def _on_gpu(self, notif: Notification) -> bool:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(DEADLINE)
        return super()._on_gpu(notif)


def test_a_task_that_ends_before_its_call_is_read_is_abandoned_not_a_bug(gated: Start) -> None:
    _Slow.entered.clear()
    _Slow.release.clear()
    run = gated(f"size={GIB}", kind=_Slow)
    assert _Slow.entered.wait(DEADLINE)
    os.kill(run.spawned.pid, signal.SIGKILL)
    os.waitpid(run.spawned.pid, 0)
    _Slow.release.set()
    for _ in range(int(DEADLINE * 100)):
        if run.outcomes:
            break
        time.sleep(0.01)
    assert run.outcomes == [Outcome.ABANDONED] and run.errors.count == 0


def test_a_block_unmapped_before_its_refusal_is_written_is_refused_efault_never_let_on(
    gated: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """Another thread unmaps the block between the gate's read and its write of the
    status: the call is refused as the driver fails a block it cannot write back (EFAULT),
    not let go on past the limit (the block could be mapped again before the driver
    reads it), and it is no bug of ours."""
    ledger = _Held(4 * GIB)
    run = gated(f"unmap=GO,size={5 * GIB}", ledger=ledger)
    assert ledger.entered.wait(DEADLINE)  # refused, not yet written
    run.go_on()
    assert run.line() == {"unmapped": 1}
    ledger.release.set()
    line = run.line()
    assert (line["ret"], line["errno"]) == (-1, errno.EFAULT)
    assert run.answered() == [Outcome.REFUSED] and run.errors.count == 0
    assert "unexpected error" not in caplog.text and "it failed EFAULT" in caplog.text


def test_a_receiver_held_over_one_call_is_said_stalled_and_answers_again(
    gated: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """The receiver is held inside one call (as a workload's memory that never answers a
    read could hold it) while no other call waits: the owner's check says it is stalled
    after `STALL_AFTER`, and no longer once it answers; its progress is readable."""
    ledger = _Held(4 * GIB)
    run = gated(f"size={GIB}", ledger=ledger)
    assert ledger.entered.wait(DEADLINE)
    assert (run.listener.answered, run.listener.last_answer) == (0, None)
    for _ in range(int(STALL_AFTER * 100)):  # a bound: 10 times STALL_AFTER
        run.listener.check()
        if run.listener.stalled:
            break
        time.sleep(0.1)
    assert run.listener.stalled and "has not answered for 1 s" in caplog.text
    ledger.release.set()
    assert continued(run.line())
    for _ in range(int(DEADLINE * 100)):  # it counts the call just after answering it
        if run.listener.answered:
            break
        time.sleep(0.01)
    assert run.listener.answered == 1 and run.listener.last_answer is not None
    os.waitpid(run.spawned.pid, 0)  # its one step done: no task is left under the filter
    for _ in range(int(DEADLINE * 100)):
        if run.listener.ended:
            break
        time.sleep(0.01)
    run.listener.check()  # a listener that ended is not stalled (it once stayed so)
    assert not run.listener.stalled and "the allocation gate answers again" in caplog.text


def test_a_flood_of_gated_calls_does_not_starve_another_threads_call(gated: Start) -> None:
    """8 threads issue gated calls as fast as they can; another thread's allocation is
    answered while they go on, not after them: the kernel hands notifications out oldest
    first, and a thread has one call at a time, so a call waits behind at most one call
    of each flooding thread."""
    run = gated("bg=1,class=0x80,threads=8,repeat=500", f"size={GIB}")
    first, second = run.line(), run.line()
    assert continued(first) and first["step"] == f"size={GIB}"  # before the flood's end
    assert second["counts"] == {f"-1/{errno.ENOTTY}/{UNTOUCHED:#x}": 4000}
    outcomes = run.answered()
    assert outcomes.count(Outcome.ALLOWED) == 1 and len(outcomes) == 4001
    assert outcomes[-1] == Outcome.NOT_MEMORY  # the flood went on after it


def state(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _lines(fd: int) -> Iterator[dict[str, Any]]:
    buf = b""
    while True:
        while b"\n" not in buf:
            ready, _, _ = select.select([fd], [], [], DEADLINE)
            assert ready, "the gate host hung"
            chunk = os.read(fd, 4096)
            assert chunk, "the gate host ended early"
            buf += chunk
        raw, buf = buf.split(b"\n", 1)
        yield json.loads(raw)


def test_a_stopped_listener_makes_the_call_wait_never_fail_and_serves_it_once_continued() -> None:
    """The listener's process stopped (SIGSTOP) while a gated call comes: the call waits
    in the kernel (it neither fails nor goes on), and is judged once the listener runs
    again (SIGCONT)."""
    told, tell = os.pipe()
    host = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("gate_host.py")),
            str(4 * GIB),
            "0",
            f"size={GIB}",
            f"wait={told}",
            f"size={5 * GIB}",
        ],
        stdout=subprocess.PIPE,
        pass_fds=(told,),
    )
    os.close(told)
    try:
        assert host.stdout is not None
        lines = _lines(host.stdout.fileno())
        assert continued(next(lines))
        os.kill(host.pid, signal.SIGSTOP)
        for _ in range(int(DEADLINE * 100)):  # a bound: each of its threads stops
            if all(state(host.pid, tid) == "T" for tid in os.listdir(f"/proc/{host.pid}/task")):
                break
            time.sleep(0.01)
        os.write(tell, b"g")
        with open(f"/proc/{host.pid}/task/{host.pid}/children") as children:
            standin = int(children.read().split()[0])
        seen = ""
        for _ in range(int(DEADLINE * 100)):  # a bound: it is in the call at once
            with open(f"/proc/{standin}/syscall") as call:
                seen = call.read()
            if seen.split(" ", 1)[0] == "16":
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"the call never waited for the gate: {seen}")
        assert not select.select([host.stdout], [], [], 0)[0]  # it has not been answered
        os.kill(host.pid, signal.SIGCONT)
        assert refused(next(lines))
        assert next(lines) == {"outcomes": ["allowed", "refused"], "exit": 0}
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
        os.close(tell)


def test_a_signal_storm_on_a_call_that_waits_for_a_pass_does_not_let_it_go_on(
    gated: Start,
) -> None:
    """Each signal makes the kernel issue the waiting call again, as a new notification
    that waits for a pass too, the old ones abandoned: they must not fill the recheck
    queue so that the call finds it full and goes on (`unsure`) past its limit."""
    run = gated(f"size={GIB}", "wait=GO", f"restart=1,storm=3000,size={GIB}", usage=int(3.5 * GIB))
    assert refused(run.line())
    run.sampling = False
    run.asked.clear()
    run.go_on()
    assert run.line() == {"stormed": 3000}
    assert Outcome.UNSURE not in run.outcomes
    run.sampling = True  # the pass comes, and still shows 3.5 GiB
    assert refused(run.line())
    outcomes = run.answered()
    assert Outcome.ABANDONED in outcomes and Outcome.UNSURE not in outcomes
    assert outcomes.count(Outcome.REFUSED) == 2 and run.errors.count == 0
