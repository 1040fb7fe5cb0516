"""The tier probe on real files and the fake NVML: the first ancestor that does not hand dmem
down, NVIDIA's hook in a CDI spec on the host, a FIFO not waited on, a hung mount bounded,
the real cgroup v2 hierarchy answered by the driver's Get, and nothing ever set."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.tier_choice import TierName, choose
from enforcer.edge import cgroupfs
from enforcer.edge.nvml import Nvml
from enforcer.edge.nvml_source import gpu_device_majors
from enforcer.edge.tier_probe import (
    TierProbe,
    _ptrace_blocked,
    _seccomp_notify,
    own_cgroup,
    pods_cgroup,
)
from tests.hung_fuse import hung_fuse
from tests.unit.test_cdi import hook_spec

HOOK_SPEC = hook_spec("GPU-00000000-fake-4000-8000-000000000000")


@pytest.fixture
def nvml(fake_nvml: Any) -> Iterator[Nvml]:
    fake_nvml.state.support_memory_limits()
    fake_nvml.write()
    session = Nvml()
    yield session
    session.shutdown()


def _tree(root: Path, handed_down: dict[str, str]) -> None:
    """A cgroupfs-shaped tree of plain files: each directory's controllers and what it
    hands down (`cgroup.subtree_control`)."""
    for rel, subtree in handed_down.items():
        at = root / rel
        at.mkdir(parents=True, exist_ok=True)
        (at / "cgroup.controllers").write_text("cpu memory dmem\n")
        (at / "cgroup.subtree_control").write_text(subtree + "\n")


def test_the_first_ancestor_without_dmem_is_named_and_nothing_is_set(
    nvml: Nvml, fake_nvml: Any, tmp_path: Path
) -> None:
    root = tmp_path / "cgroup"
    _tree(root, {"": "cpu memory dmem", "kubepods.slice": "cpu memory"})
    probe = TierProbe(pods_cgroup(root), tmp_path / "host").probe(nvml)
    assert (probe.dmem, probe.no_dmem_at) == (True, str(root / "kubepods.slice"))
    choice = choose(probe)
    assert choice.tier is TierName.SAMPLING
    assert choice.why == (
        f"cgroups below {root / 'kubepods.slice'} have no dmem files: dmem is missing from "
        f"{root / 'kubepods.slice'}'s cgroup.subtree_control"
    )
    assert fake_nvml.limit_records() == []


def test_nvidias_hook_in_a_cdi_spec_on_the_host_is_found_and_a_fifo_not_waited_on(
    nvml: Nvml, tmp_path: Path
) -> None:
    host = tmp_path / "host"
    (host / "etc/cdi").mkdir(parents=True)
    (host / "var/run/cdi").mkdir(parents=True)
    os.mkfifo(host / "etc/cdi/a-fifo.yaml")  # nobody writes it: opening it to read would wait
    (host / "var/run/cdi/nvidia.yaml").write_text(HOOK_SPEC)
    (host / "etc/cdi/other.json").write_text('{"kind": "vendor.com/device"}')
    started = time.monotonic()
    probe = TierProbe(own_cgroup, host, within=30).probe(nvml)
    assert time.monotonic() - started < 10
    assert probe.toolkit_hook == ("GPU-00000000-fake-4000-8000-000000000000",)
    assert probe.unreadable == ""


def test_the_hierarchys_root_is_judged_by_what_it_hands_down_not_by_the_drivers_get(
    nvml: Nvml, fake_nvml: Any, tmp_path: Path
) -> None:
    """Limited cgroups are made below the root (no kubepods yet, or exec run from the root
    cgroup), which the kernel gives no dmem files: the driver's Get there says nothing of
    the cgroups below it, which get dmem files where the root hands dmem down."""
    root = tmp_path / "cgroup"
    _tree(root, {"": "cpu memory dmem"})
    probe = TierProbe(pods_cgroup(root), tmp_path / "host").probe(nvml)
    assert probe.cgroup == probe.cgroup_v2 == str(root)
    assert probe.answers == (("GPU-00000000-fake-4000-8000-000000000000", None),)
    assert choose(probe).tier is TierName.DRIVER
    assert fake_nvml.limit_records() == []


def test_the_hosts_cdi_specs_are_found_where_var_run_links_to_run(
    nvml: Nvml, tmp_path: Path
) -> None:
    """On most distributions /var/run is an absolute link to /run, which resolves in the
    agent's own root, not the host's: the host's run/cdi is read too."""
    host = tmp_path / "host"
    (host / "run/cdi").mkdir(parents=True)
    (host / "var").mkdir()
    (host / "var/run").symlink_to("/nonexistent-run-of-this-test")
    (host / "run/cdi/nvidia.yaml").write_text(HOOK_SPEC)
    probe = TierProbe(own_cgroup, host).probe(nvml)
    assert probe.toolkit_hook == ("GPU-00000000-fake-4000-8000-000000000000",)


def test_a_host_file_that_refuses_to_be_read_is_the_probes_answer_not_a_traceback(
    nvml: Nvml, tmp_path: Path
) -> None:
    def refused() -> tuple[Path | None, Path | None]:
        raise PermissionError(13, "Permission denied", "/host/sys/fs/cgroup")

    probe = TierProbe(refused, tmp_path).probe(nvml)
    assert "Permission denied" in probe.unreadable
    assert "did not answer" not in probe.unreadable
    assert not probe.conclusive
    assert choose(probe).tier is TierName.SAMPLING


def test_the_real_hierarchy_is_answered_by_the_drivers_get(nvml: Nvml, tmp_path: Path) -> None:
    """This process's own cgroup, on the machine's cgroup v2 mount: the fake driver (R615)
    answers its Get, so the driver tier is chosen where this process is root."""
    if cgroupfs.v2_root() is None:
        pytest.skip("no cgroup v2 hierarchy on this machine")
    probe = TierProbe(own_cgroup, tmp_path).probe(nvml)
    assert probe.cgroup == str(cgroupfs.own_dir())
    assert probe.answers == (("GPU-00000000-fake-4000-8000-000000000000", None),)
    expected = TierName.DRIVER if os.geteuid() == 0 and not probe.children_without_dmem else None
    if expected is not None:
        assert choose(probe).tier is expected


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)
def test_a_hung_cdi_directory_bounds_the_probe_and_is_not_read_again_while_it_hangs(
    nvml: Nvml, tmp_path: Path
) -> None:
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    with hung_fuse(host / "etc/cdi") as fuse:
        fuse.hang()
        probe = TierProbe(own_cgroup, host, within=0.5)
        started = time.monotonic()
        first = probe.probe(nvml)
        assert time.monotonic() - started < 5
        assert first.unreadable == f"{host / 'etc/cdi'} did not answer within 0.5 s"
        assert choose(first).why == (
            f"cannot tell whether the driver can hold limits: {first.unreadable}"
        )
        started = time.monotonic()
        again = probe.probe(nvml)  # its reader still waits: no second one is started
        assert time.monotonic() - started < 0.5
        assert again.unreadable == f"{host / 'etc/cdi'} has still not answered an earlier read"


def _proc(root: Path, actions: str | None, scope: str | None, cap_eff: str) -> Path:
    """A /proc of plain files: seccomp's actions, Yama's scope, this process's CapEff."""
    if actions is not None:
        (root / "sys/kernel/seccomp").mkdir(parents=True)
        (root / "sys/kernel/seccomp/actions_avail").write_text(actions + "\n")
    if scope is not None:
        (root / "sys/kernel/yama").mkdir(parents=True)
        (root / "sys/kernel/yama/ptrace_scope").write_text(scope + "\n")
    (root / "self").mkdir(parents=True)
    (root / "self/status").write_text(f"Name:\tx\nCapEff:\t{cap_eff}\n")
    return root


NOTIFY = "kill_process kill_thread trap errno user_notif trace log allow"


@pytest.mark.parametrize(
    ("actions", "release", "why"),
    [
        (NOTIFY, "6.1.0-18-amd64", ""),
        (NOTIFY, "5.5.0", ""),
        (
            NOTIFY,
            "5.4.0-150-generic",
            "kernel 5.4.0-150-generic has no SECCOMP_USER_NOTIF_FLAG_CONTINUE (5.5+)",
        ),
        (
            "kill_process errno allow",
            "6.1.0",
            "the kernel's seccomp actions (actions_avail) lack user_notif",
        ),
        (None, "6.1.0", "cannot read the kernel's seccomp actions (No such file or directory)"),
    ],
)
def test_the_gate_needs_user_notif_and_continue(
    tmp_path: Path, actions: str | None, release: str, why: str
) -> None:
    proc = _proc(tmp_path, actions, None, "0")
    assert _seccomp_notify(proc, release) == why


@pytest.mark.parametrize(
    ("scope", "cap_eff", "why"),
    [
        (None, "0", ""),
        ("1", "0", ""),
        ("2", "000001ffffffffff", ""),  # CAP_SYS_PTRACE (19) held
        (
            "2",
            "0000000000000000",
            "cannot read the command's parameters: kernel.yama.ptrace_scope=2",
        ),
        (
            "3",
            "000001ffffffffff",
            "cannot read the command's parameters: kernel.yama.ptrace_scope=3",
        ),
    ],
)
def test_yama_blocks_the_gate_at_scope_3_or_at_2_without_cap_sys_ptrace(
    tmp_path: Path, scope: str | None, cap_eff: str, why: str
) -> None:
    assert _ptrace_blocked(_proc(tmp_path, NOTIFY, scope, cap_eff)) == why


def test_the_probe_reads_what_the_gate_needs_of_this_machine(nvml: Nvml) -> None:
    probe = TierProbe(own_cgroup, Path("/")).probe(nvml)
    assert probe.machine == os.uname().machine
    assert probe.seccomp_notify == ""  # CI's kernels have had it since 5.5
    assert probe.gpu_majors == tuple(sorted(gpu_device_majors() or ()))
