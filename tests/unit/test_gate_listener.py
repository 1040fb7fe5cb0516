"""The allocation gate listener's reading of a notification, over plain bytes."""

from __future__ import annotations

import struct

from enforcer.edge.gate_listener import _NOTIF, LineQuota, Notification
from enforcer.edge.seccomp_filter import AUDIT_ARCH_I386, AUDIT_ARCH_X86_64


def test_the_receive_buffer_is_the_kernels_struct_and_small_enough_to_release_the_gil() -> None:
    """fcntl.ioctl copies a buffer of up to 1024 bytes and releases the GIL while RECV
    blocks; a larger one is passed in place with the GIL held, which would freeze exec's
    sampler while the receiver waits."""
    assert _NOTIF.size == 80  # struct seccomp_notif; fcntl releases the GIL up to 1024


def raw(arch: int, fd: int, cmd: int, argp: int, nr: int = 16) -> bytes:
    return struct.pack("<QIIiIQ6Q", 7, 4242, 0, nr, arch, 0, fd, cmd, argp, 0, 0, 0)


def test_the_request_keeps_its_low_32_bits_and_a_compat_callers_pointer_its_low_32() -> None:
    native = Notification.unpack(raw(AUDIT_ARCH_X86_64, 3, (1 << 32) | 0xC030462B, 1 << 40))
    assert (native.id, native.tid, native.fd, native.cmd, native.argp) == (
        7,
        4242,
        3,
        0xC030462B,
        1 << 40,
    )
    compat = Notification.unpack(raw(AUDIT_ARCH_I386, 3, 0xC030462B, (1 << 40) | 0x1000))
    assert compat.argp == 0x1000


def test_an_x32_callers_pointer_is_its_low_32_bits_as_the_kernel_passes_it_on() -> None:
    """x32's ioctl (514 with the x32 bit) is `compat_sys_ioctl`, whose argument the kernel
    cuts to 32 bits; its arch is x86_64's, so only the number says it is x32. Read whole,
    junk in the upper half made the gate read elsewhere (outcome error: the call went on)
    while the driver used the low half. No x32 on this machine's kernel: read over bytes."""
    x32 = Notification.unpack(raw(AUDIT_ARCH_X86_64, 3, 0xC030462B, (1 << 40) | 0x1000, 0x40000202))
    assert x32.argp == 0x1000


def test_refusal_lines_are_at_most_five_a_second_and_those_held_back_are_counted() -> None:
    quota = LineQuota()
    assert [quota.take(10.0 + i / 100) for i in range(8)] == [0, 0, 0, 0, 0, None, None, None]
    assert quota.take(11.0) == 3  # the next second's first line says the three held back
    assert quota.take(11.1) == 0
