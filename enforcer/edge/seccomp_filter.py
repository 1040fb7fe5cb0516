"""The allocation gate's seccomp filter as a classic BPF program: every ioctl whose NR and
SIZE bits are one of the driver's allocation escapes goes to our listener, whatever its fd,
type byte, direction or upper bits; every other call is allowed.

Hand-written rather than built with libseccomp, so the project gains no C dependency. It
covers every ABI the kernel hands a process: a 64-bit program can still enter through
i386's `int 0x80` (and x32; ARM's EABI on arm64), and the driver serves those through the
same handler (`.compat_ioctl`), so each has its own arm. An architecture not listed cannot
occur on an x86_64 or aarch64 kernel.
"""

from __future__ import annotations

import struct

from enforcer.core.rm_abi import GATED, IOC_NR_SIZE_MASK

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
AUDIT_ARCH_ARM = 0x40000028
COMPAT_ARCHES = (AUDIT_ARCH_I386, AUDIT_ARCH_ARM)  # their pointers are 32 bits

# ioctl's number in each ABI: an arch's syscalls, by the label of the arm that checks them
X32_BIT = 0x40000000  # on an x86_64 syscall number: x32, whose pointers are 32 bits
_IOCTL_NRS = {
    "x86_64": (16, X32_BIT | 16, X32_BIT | 514),  # native; x32's bit on 16 and on x32's 514
    "compat": (54,),  # i386 and ARM EABI
    "aarch64": (29,),
}

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000

# struct seccomp_data: nr, arch, instruction pointer, args[6] (args[1]'s low half: little-endian)
_NR, _ARCH, _ARG1_LOW = 0, 4, 24

_LD_W_ABS, _ALU_AND_K, _JEQ_K, _RET_K = 0x20, 0x54, 0x15, 0x06

Insn = tuple[int, int | str, int | str, int]  # code, jump-if-true, jump-if-false, k


def _arm(label: str, nrs: tuple[int, ...]) -> list[tuple[str | None, Insn]]:
    """One ABI's arm: load the syscall number; ioctl goes on to the request's check."""
    insns: list[tuple[str | None, Insn]] = [(label, (_LD_W_ABS, 0, 0, _NR))]
    for i, nr in enumerate(nrs):
        last = i == len(nrs) - 1
        insns.append((None, (_JEQ_K, "cmd", "allow" if last else 0, nr)))
    return insns


def _listing() -> list[tuple[str | None, Insn]]:
    arches = [
        (AUDIT_ARCH_X86_64, "x86_64"),
        (AUDIT_ARCH_I386, "compat"),
        (AUDIT_ARCH_AARCH64, "aarch64"),
        (AUDIT_ARCH_ARM, "compat"),
    ]
    insns: list[tuple[str | None, Insn]] = [(None, (_LD_W_ABS, 0, 0, _ARCH))]
    for i, (arch, label) in enumerate(arches):
        last = i == len(arches) - 1
        insns.append((None, (_JEQ_K, label, "allow" if last else 0, arch)))
    for label, nrs in _IOCTL_NRS.items():
        insns += _arm(label, nrs)
    insns += [("cmd", (_LD_W_ABS, 0, 0, _ARG1_LOW)), (None, (_ALU_AND_K, 0, 0, IOC_NR_SIZE_MASK))]
    for i, request in enumerate(GATED):
        last = i == len(GATED) - 1
        insns.append((None, (_JEQ_K, "notify", "allow" if last else 0, request)))
    insns += [("allow", (_RET_K, 0, 0, SECCOMP_RET_ALLOW))]
    insns += [("notify", (_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF))]
    return insns


def instructions() -> list[tuple[int, int, int, int]]:
    """The program, its jumps resolved to the relative offsets classic BPF takes."""
    listing = _listing()
    at = {label: i for i, (label, _) in enumerate(listing) if label}
    resolved = []
    for i, (_, (code, jt, jf, k)) in enumerate(listing):
        jumps = [j if isinstance(j, int) else at[j] - i - 1 for j in (jt, jf)]
        resolved.append((code, jumps[0], jumps[1], k))
    return resolved


def program() -> bytes:
    """The program as `struct sock_filter` entries, ready for `seccomp(2)`."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in instructions())
