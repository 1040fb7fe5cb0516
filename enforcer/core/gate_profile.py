"""The allocation gate's seccomp profile for Kubernetes (pure): the JSON file the node agent
writes under the kubelet's seccomp root, which the webhook names as a container's
`Localhost` profile.

A `Localhost` profile replaces RuntimeDefault whole, so the gating profile is containerd's
RuntimeDefault for the default capability set (`runtime_default.py`, generated from
containerd's source) with `ioctl` split in two: the driver's allocation requests (NR and
SIZE bits, whatever the fd, type byte or direction) go to the listener
(`SCMP_ACT_NOTIFY`), every other ioctl is allowed. The allow is `ioctl if args[1] >= 0`, true
of every value, not a bare `ioctl`: libseccomp 2.5.4 (what runc links on Debian 12 and
others) folds a conditional rule into an unconditional one of the same syscall, and the
NOTIFY rules would silently vanish. `architectures` lists each ABI the kernel hands a
process (x86_64 with i386 and x32; aarch64 with ARM), so a call through `int 0x80` is gated
too. The plain variant is RuntimeDefault itself: a node where the gate is not proven gets
the same confinement, and no container fails to start for want of a listener.
"""

from __future__ import annotations

import copy
from typing import Any

from enforcer.core import runtime_default
from enforcer.core.rm_abi import GATED, IOC_NR_SIZE_MASK

# The file, relative to the kubelet's seccomp root (`<root-dir>/seccomp`): the webhook's
# `localhostProfile`. Versioned: a new gate that needs another profile gets another name.
PROFILE_NAME = "vram-enforcer/gpu-v1.json"
# runc sends it with each container's listener fd: what the listener recognises as ours
LISTENER_METADATA = "vram-enforcer/gpu-v1"

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}  # uname's machine -> containerd's


def supports(machine: str) -> bool:
    """Whether there is a profile for a node of `machine` (uname -m)."""
    return machine in _GOARCH


def _gated_ioctl() -> list[dict[str, Any]]:
    notify = [
        {
            "names": ["ioctl"],
            "action": "SCMP_ACT_NOTIFY",
            "args": [
                {
                    "index": 1,
                    "value": IOC_NR_SIZE_MASK,
                    "valueTwo": request,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        }
        for request in GATED
    ]
    # Every other ioctl: `>= 0` holds for every value, but unlike a bare `ioctl` it keeps
    # libseccomp from folding the NOTIFY rules away.
    allow = {
        "names": ["ioctl"],
        "action": "SCMP_ACT_ALLOW",
        "args": [{"index": 1, "value": 0, "op": "SCMP_CMP_GE"}],
    }
    return [*notify, allow]


def profile(machine: str, listener_path: str | None) -> dict[str, Any]:
    """The profile for a node of `machine` (`supports` it): gating, with the listener at
    `listener_path`, or plain RuntimeDefault where that is None."""
    found = copy.deepcopy(runtime_default.PROFILES[_GOARCH[machine]])
    if listener_path is None:
        return found
    rules: list[dict[str, Any]] = []
    for rule in found["syscalls"]:
        names = [n for n in rule["names"] if n != "ioctl"]
        if names:
            rules.append({**rule, "names": names})
    found["syscalls"] = [*rules, *_gated_ioctl()]
    found["listenerPath"] = listener_path
    found["listenerMetadata"] = LISTENER_METADATA
    return found
