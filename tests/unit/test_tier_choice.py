"""The choice of enforcement tier, over plain data: what each probe finding makes of it, and
that the reason names what a person acts on."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from enforcer.core.model import LimitOutcome, LimitResult
from enforcer.core.tier_choice import (
    CANDIDATES,
    Candidate,
    Fit,
    Probe,
    TierName,
    candidates,
    choose,
    driver_fit,
    gate_fit,
)

A, B, M = "GPU-a", "GPU-b", "GPU-m"
R615 = Probe(
    driver_version="615.43.02",
    nvml_error="",
    cgroup_v2="/sys/fs/cgroup",
    dmem=True,
    root=True,
    whole_gpus=(A, B),
    mig_gpus=(),
    answers=((A, None), (B, None)),
    cgroup="/sys/fs/cgroup/kubepods.slice",
)


def test_an_r615_node_with_dmem_handed_down_gets_the_driver_tier_on_every_whole_gpu() -> None:
    choice = choose(R615)
    assert (choice.tier, choice.gpus, choice.refuses) == (TierName.DRIVER, (A, B), True)
    assert choice.why == (
        "driver 615.43.02, cgroup v2 at /sys/fs/cgroup (the kernel's dmem controller)"
    )
    assert choice.gaps == ()
    assert choice.said().startswith(f"tier driver-limit on {A}, {B}, sampling as the backstop: ")


def test_a_driver_before_r615_is_too_old_whatever_else_is_there() -> None:
    choice = choose(dataclasses.replace(R615, driver_version="550.54.15"))
    assert (choice.tier, choice.gpus, choice.refuses) == (TierName.SAMPLING, (A, B), False)
    assert choice.why == "driver 550.54.15 has no per-cgroup limits: R615+"
    assert choice.said() == f"tier sampling on {A}, {B}: {choice.why}"


def test_an_nvml_without_the_limit_calls_is_too_old_even_on_a_615_version() -> None:
    choice = choose(dataclasses.replace(R615, limit_calls=False, answers=()))
    assert choice.why == "driver 615.43.02 has no per-cgroup limits: R615+"


def test_a_cgroup_without_dmem_files_is_told_apart_from_a_driver_too_old() -> None:
    """NOT_SUPPORTED from one cgroup on an R615 driver is that cgroup's, and names it."""
    unsupported = LimitOutcome(LimitResult.UNSUPPORTED, "Not Supported")
    probe = dataclasses.replace(R615, answers=((A, unsupported), (B, unsupported)))
    choice = choose(probe)
    assert choice.tier is TierName.SAMPLING
    assert choice.why == (
        "cgroup /sys/fs/cgroup/kubepods.slice has no dmem files (Not Supported): the driver "
        "cannot count it"
    )
    assert "R615" not in choice.why


def test_children_without_dmem_name_the_first_ancestor_that_does_not_hand_it_down() -> None:
    probe = dataclasses.replace(R615, no_dmem_at="/sys/fs/cgroup/kubepods.slice")
    choice = choose(probe)
    assert choice.tier is TierName.SAMPLING
    assert choice.why == (
        "cgroups below /sys/fs/cgroup/kubepods.slice have no dmem files: dmem is missing from "
        "/sys/fs/cgroup/kubepods.slice's cgroup.subtree_control"
    )


def test_without_the_kernels_dmem_controller_subtree_control_does_not_matter() -> None:
    """The driver's misc backend (Linux < 6.14) needs no dmem files: it is said, not refused."""
    probe = dataclasses.replace(R615, dmem=False, no_dmem_at="/sys/fs/cgroup")
    choice = choose(probe)
    assert choice.tier is TierName.DRIVER
    assert "no dmem controller: misc backend" in choice.why


def test_one_gpu_that_cannot_leaves_the_others_under_the_driver_and_says_why() -> None:
    failed = LimitOutcome(LimitResult.FAILED, "Unknown Error")
    probe = dataclasses.replace(R615, answers=((A, None), (B, failed)), mig_gpus=(M,))
    choice = choose(probe)
    assert (choice.tier, choice.gpus) == (TierName.DRIVER, (A,))
    assert choice.gaps == (
        f"{B}: reading the limit of cgroup /sys/fs/cgroup/kubepods.slice failed (Unknown Error)",
        f"{M} in MIG mode: NVML takes no MIG handle",
    )
    assert choice.why.endswith("; ".join(choice.gaps))


def test_only_mig_gpus_leave_sampling_alone() -> None:
    choice = choose(dataclasses.replace(R615, whole_gpus=(), answers=(), mig_gpus=(M,)))
    assert (choice.tier, choice.gpus) == (TierName.SAMPLING, (M,))
    assert choice.why == f"{M} in MIG mode: NVML takes no MIG handle"


def test_each_missing_piece_is_its_own_reason() -> None:
    cases = {
        "NVML cannot be read (no driver)": dict(nvml_error="no driver", driver_version=""),
        "no cgroup v2 hierarchy: the driver's limits need one": dict(cgroup_v2="", cgroup=""),
        "not root: NVML's Set needs root (reading a limit does not)": dict(root=False),
        "cannot tell whether the driver can hold limits: /etc/cdi did not answer within 2 s": (
            dict(unreadable="/etc/cdi did not answer within 2 s")
        ),
    }
    for why, change in cases.items():
        choice = choose(dataclasses.replace(R615, **change))  # type: ignore[arg-type]
        assert (choice.tier, choice.why) == (TierName.SAMPLING, why)


def test_the_toolkit_hook_is_said_where_the_driver_holds_limits() -> None:
    choice = choose(dataclasses.replace(R615, toolkit_hook=(A,)))
    assert (
        f"NVIDIA's apply-cuda-memory-limits hook is configured (CDI) for {A}: it sets a "
        "container's own cgroup at creation" in choice.why
    )


def test_a_tier_between_the_driver_and_sampling_is_one_more_candidate() -> None:
    """Issue 45's tier goes behind the driver's: tried where the driver cannot, chosen with
    the driver's reasons for being passed over."""

    def refusing(probe: Probe) -> Fit:
        return Fit(probe.whole_gpus, (), ("the allocation calls are refused",))

    candidates: tuple[Candidate, ...] = (
        (TierName.DRIVER, driver_fit),
        (TierName.SAMPLING, refusing),  # any name: the test needs only a third entry
    )
    old = dataclasses.replace(R615, driver_version="550.54.15")
    choice = choose(old, candidates)
    assert choice.gpus == (A, B)
    assert choice.why == (
        "the allocation calls are refused; driver 550.54.15 has no per-cgroup limits: R615+"
    )
    assert choose(R615, candidates).tier is TierName.DRIVER  # the better one still wins


# A driver 550 machine where the allocation gate can serve: only `--allocation-gate on` asks.
GATE = dataclasses.replace(
    R615,
    driver_version="550.54.15",
    seccomp_notify="",
    machine="x86_64",
    gpu_majors=(195, 508),
)


def test_the_gate_is_no_candidate_unless_asked_for() -> None:
    assert candidates(gate=False) == CANDIDATES
    assert [tier for tier, _ in candidates(gate=True)] == [TierName.DRIVER, TierName.GATE]
    assert choose(GATE).tier is TierName.SAMPLING  # doctor's and the agent's choice


def test_asked_for_the_gate_holds_a_driver_550_on_every_whole_gpu_and_says_it_is_unverified() -> (
    None
):
    choice = choose(GATE, candidates(gate=True))
    assert (choice.tier, choice.gpus, choice.refuses) == (TierName.GATE, (A, B), True)
    assert choice.said() == (
        f"tier allocation-gate on {A}, {B}, sampling as the backstop: the driver's allocation "
        "calls are checked before they run (cooperative: a racing thread can get past; "
        "sampling is the backstop); not yet verified on driver branch 550 "
        "(tests/gpu/offline.sh gate); driver 550.54.15 has no per-cgroup limits: R615+"
    )


def test_the_driver_limit_wins_over_the_gate_where_it_can_hold() -> None:
    choice = choose(dataclasses.replace(GATE, driver_version="615.43.02"), candidates(gate=True))
    assert choice.tier is TierName.DRIVER


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"nvml_error": "Driver Not Loaded"}, "NVML cannot be read (Driver Not Loaded)"),
        (
            {"driver_version": "525.147.05"},
            "driver 525.147.05: the allocation gate knows the layouts of 535-599",
        ),
        (
            {"driver_version": "615.43.02", "limit_calls": False},
            "driver 615.43.02: the allocation gate knows the layouts of 535-599",
        ),
        (
            {"seccomp_notify": "the kernel's seccomp actions (actions_avail) lack user_notif"},
            "no allocation gate: the kernel's seccomp actions (actions_avail) lack user_notif",
        ),
        (
            {"seccomp_notify": "kernel 5.4.0 has no SECCOMP_USER_NOTIF_FLAG_CONTINUE (5.5+)"},
            "no allocation gate: kernel 5.4.0 has no SECCOMP_USER_NOTIF_FLAG_CONTINUE (5.5+)",
        ),
        ({"machine": "ppc64le"}, "no allocation gate for ppc64le"),
        (
            {"ptrace_blocked": "cannot read the command's parameters: kernel.yama.ptrace_scope=3"},
            "no allocation gate: cannot read the command's parameters: kernel.yama.ptrace_scope=3",
        ),
        ({"gpu_majors": ()}, "no allocation gate: no NVIDIA device node on this machine"),
        ({"mig_gpus": (M,)}, f"{M} in MIG mode: the allocation gate does not gate MIG yet"),
    ],
)
def test_each_reason_the_gate_cannot_hold_is_said(change: dict[str, Any], reason: str) -> None:
    probe = dataclasses.replace(GATE, **change)
    assert gate_fit(probe) == Fit((), (reason,))
    choice = choose(probe, candidates(gate=True))
    assert choice.tier is TierName.SAMPLING
    assert reason in choice.gaps
