"""The allocation gate's BPF program, run by a small classic-BPF interpreter over a table
of calls: every allocation escape in every ABI goes to the listener, whatever its type
byte, direction or upper bits; everything else is allowed."""

from __future__ import annotations

import struct

import pytest

from enforcer.edge.seccomp_filter import (
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_ARM,
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    instructions,
    program,
)

X64, I386, A64, ARM = AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM
IOCTL = {X64: 16, I386: 54, A64: 29, ARM: 54}
ALLOW, NOTIFY = SECCOMP_RET_ALLOW, SECCOMP_RET_USER_NOTIF


def run(arch: int, nr: int, arg1: int) -> int:
    """What the program returns for one call (only the instructions it uses: ld, and, jeq, ret)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, 3, arg1, 0, 0, 0, 0)
    a, pc, prog = 0, 0, instructions()
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == 0x20:
            (a,) = struct.unpack_from("<I", data, k)
        elif code == 0x54:
            a &= k
        elif code == 0x15:
            pc += jt if a == k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


def ioc(nr: int, size: int, kind: int = ord("F"), direction: int = 3) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


ESCAPES = [ioc(0x2B, 32), ioc(0x2B, 48), ioc(0x4A, 184), ioc(0xD3, 16)]


@pytest.mark.parametrize("arch", [X64, I386, A64, ARM])
@pytest.mark.parametrize("cmd", ESCAPES)
def test_every_escape_in_every_abi_goes_to_the_listener(arch: int, cmd: int) -> None:
    assert run(arch, IOCTL[arch], cmd) == NOTIFY


@pytest.mark.parametrize("nr", [0x40000010, 0x40000202])
def test_x32_ioctls_go_to_the_listener(nr: int) -> None:
    assert run(X64, nr, ioc(0x2B, 48)) == NOTIFY


@pytest.mark.parametrize(
    "cmd",
    [
        ioc(0x2B, 48, kind=ord("G")),
        ioc(0x2B, 48, direction=2),  # _IOR
        ioc(0x2B, 48, direction=1),  # _IOW
        ioc(0x2B, 48, direction=0),
        (1 << 32) | ioc(0x2B, 48),  # the kernel drops the upper half of cmd
        (0xFFFFFFFF << 32) | ioc(0xD3, 16),
    ],
)
def test_what_the_driver_does_not_decode_changes_nothing(cmd: int) -> None:
    assert run(X64, 16, cmd) == NOTIFY


@pytest.mark.parametrize(
    ("arch", "nr", "cmd"),
    [
        (X64, 16, ioc(0x2A, 32)),  # RM_CONTROL: the busiest escape, not an allocation
        (X64, 16, 0x5401),  # TCGETS
        (X64, 16, ioc(0x2C, 48)),  # a neighbour NR
        (X64, 16, ioc(0x2B, 40)),  # NVOS64 before 535: not offered the gate
        (X64, 16, ioc(0xD3, 24)),  # an XFER of another size: the driver refuses it
        (X64, 0, ioc(0x2B, 48)),  # read(2) with the same argument
        (I386, 16, ioc(0x2B, 48)),  # i386's 16 is lchown
        (A64, 16, ioc(0x2B, 48)),
        (0x12345678, 16, ioc(0x2B, 48)),  # an arch that cannot occur
    ],
)
def test_every_other_call_is_allowed(arch: int, nr: int, cmd: int) -> None:
    assert run(arch, nr, cmd) == ALLOW


def test_the_program_is_the_kernels_struct_sock_filter() -> None:
    assert len(program()) == 8 * len(instructions())
    assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in instructions())
