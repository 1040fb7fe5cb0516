"""The allocation gate's seccomp profile (issue 45, step 2): RuntimeDefault's allowlist with
the driver's allocation requests handed to the listener, in a shape libseccomp keeps."""

from __future__ import annotations

import json

import pytest

from enforcer.core import gate_profile, runtime_default

MASK = 0x3FFF00FF  # _IOC_SIZE | _IOC_NR
# RM_ALLOC NVOS21 and NVOS64, VID_HEAP_CONTROL, XFER: written out, not taken from rm_abi
REQUESTS = {0x0020002B, 0x0030002B, 0x00B8004A, 0x001000D3}
LISTENER = "/run/vram-enforcer/seccomp.sock"
ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_ARM", "SCMP_ARCH_AARCH64"],
}


def names(profile: dict[str, object], action: str = "SCMP_ACT_ALLOW") -> set[str]:
    rules = profile["syscalls"]
    assert isinstance(rules, list)
    return {n for r in rules if r["action"] == action and not r.get("args") for n in r["names"]}


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_plain_profile_is_runtime_default(machine: str) -> None:
    plain = gate_profile.profile(machine, None)
    goarch = {"x86_64": "amd64", "aarch64": "arm64"}[machine]
    assert plain == runtime_default.PROFILES[goarch]
    assert plain["architectures"] == ARCHES[machine]
    assert "listenerPath" not in plain and "ioctl" in names(plain)


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_gating_profile_notifies_the_four_requests_and_allows_every_other_ioctl(
    machine: str,
) -> None:
    gated = gate_profile.profile(machine, LISTENER)
    plain = gate_profile.profile(machine, None)
    assert gated["listenerPath"] == LISTENER
    assert gated["listenerMetadata"] == "vram-enforcer/gpu-v1"
    assert gated["architectures"] == ARCHES[machine]  # i386 and x32 (ARM) gated too
    assert gated["defaultAction"] == plain["defaultAction"] == "SCMP_ACT_ERRNO"
    ioctl = [r for r in gated["syscalls"] if "ioctl" in r["names"]]
    assert all(r["names"] == ["ioctl"] for r in ioctl)
    notify = [r for r in ioctl if r["action"] == "SCMP_ACT_NOTIFY"]
    assert {a["valueTwo"] for r in notify for a in r["args"]} == REQUESTS
    for rule in notify:
        assert rule["args"] == [
            {
                "index": 1,
                "value": MASK,
                "valueTwo": rule["args"][0]["valueTwo"],
                "op": "SCMP_CMP_MASKED_EQ",
            }
        ]
    # Every other ioctl allowed, but not by a bare rule: libseccomp 2.5.4 folds a bare
    # allow over the NOTIFY rules of the same syscall (the e2e test shows it under runc).
    (allow,) = [r for r in ioctl if r["action"] == "SCMP_ACT_ALLOW"]
    assert allow["args"] == [{"index": 1, "value": 0, "op": "SCMP_CMP_GE"}]
    assert len(ioctl) == 5
    # Nothing else changed: the same names allowed, the same conditional rules kept.
    assert names(gated) == names(plain) - {"ioctl"}
    others = [r for r in gated["syscalls"] if "ioctl" not in r["names"]]
    assert [r for r in others if r.get("args") or r["action"] != "SCMP_ACT_ALLOW"] == [
        r for r in plain["syscalls"] if r.get("args") or r["action"] != "SCMP_ACT_ALLOW"
    ]
    assert json.loads(json.dumps(gated)) == gated


def test_the_profile_is_built_afresh_each_time() -> None:
    """A caller that edits what it got changes neither the data nor the next profile."""
    first = gate_profile.profile("x86_64", LISTENER)
    first["syscalls"].clear()
    gate_profile.profile("x86_64", None)["syscalls"].clear()
    assert gate_profile.profile("x86_64", LISTENER)["syscalls"]
    assert runtime_default.PROFILES["amd64"]["syscalls"]


def test_only_x86_64_and_aarch64_nodes_have_a_profile() -> None:
    assert gate_profile.supports("x86_64") and gate_profile.supports("aarch64")
    assert not gate_profile.supports("ppc64le")
