"""The agent's allocation gate with the real runc (issue 45, step 2): runc reads the profile
`NodeGate` writes (as containerd hands a `Localhost` profile to it unchanged: the e2e test
shows that part on the real kubelet), installs the filter in a container of the kubelet's
cgroup shape, and hands the container's listener fd with its state to the gate's socket;
the gate finds the container by that cgroup, holds it to its ceiling from a pass, and the
container's driver call over it gets the driver's out-of-memory status while one within
goes on. The container runs as uid 65532, the stand-in of the driver's callers
(rm_standin.py) from this tree on the host's Python, over /dev/null.

runc is tests/e2e/build-runc.sh's where it is built (runc 1.3.7 with Debian's libseccomp
2.5.4), else the system's; skipped without one, or without root and cgroup v2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enforcer.core import gate_profile
from enforcer.core.lending import Tenant, Tenants
from enforcer.modes.node_gate import NodeGate, container_ceiling
from tests.helpers import scratch_cgroup, wait_for
from tests.integration.test_node_gate import proven  # noqa: F401 - a fixture

GIB = 1 << 30
HERE = Path(__file__).resolve().parent
BUILT_RUNC = Path.home() / ".cache" / "vram-enforcer" / "runc-1.3.7" / "runc"
UID = "5e0a8c4d-1b2f-4c3d-8e9f-0a1b2c3d4e5f"
CID = "9f" * 32
NULL_MAJOR = os.major(os.stat("/dev/null").st_rdev)
NO_MEMORY, UNTOUCHED = 0x51, 0xFFFFFFFF
DEADLINE = 60.0  # s: a bound for a hang, never a measure


def runc() -> str | None:
    if BUILT_RUNC.is_file() and os.access(BUILT_RUNC, os.X_OK):
        return str(BUILT_RUNC)
    return shutil.which("runc")


class _Errors:
    def __init__(self) -> None:
        self.count = 0.0

    def inc(self, amount: float = 1) -> None:
        self.count += amount


def bundle(
    where: Path, binary: str, cgroup: str, steps: list[str], seccomp: dict[str, Any]
) -> Path:
    """runc's own default spec, with the host's Python and this tree read-only in an empty
    root, the stand-in as uid 65532, the container's cgroup as the kubelet names one, and
    the profile NodeGate wrote as its seccomp section."""
    root = where / "rootfs"
    root.mkdir(parents=True)
    subprocess.run([binary, "spec"], cwd=where, check=True)
    spec: dict[str, Any] = json.loads((where / "config.json").read_text())
    python = os.path.realpath(sys.executable)
    binds = ["/usr", "/lib", "/lib64", "/bin", "/etc", sys.base_prefix, str(HERE)]
    spec["mounts"] += [
        {"destination": p, "source": p, "type": "bind", "options": ["rbind", "ro"]}
        for p in dict.fromkeys(binds)
        if os.path.isdir(p)
    ]
    spec["process"].update(
        terminal=False,
        user={"uid": 65532, "gid": 65532},
        args=[python, "-I", "-S", str(HERE / "rm_standin.py"), "wait=0", *steps],
        noNewPrivileges=True,
    )
    spec["root"] = {"path": str(root), "readonly": True}
    spec["linux"]["cgroupsPath"] = cgroup
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    spec["linux"]["resources"]["devices"] = [{"allow": True, "access": "rwm"}]
    spec["linux"]["seccomp"] = seccomp
    (where / "config.json").write_text(json.dumps(spec))
    return where


@pytest.fixture
def leaf() -> Iterator[Path]:
    with scratch_cgroup() as root:
        path = root / "kubepods" / f"pod{UID}" / CID
        yield path


@pytest.mark.usefixtures("proven")
def test_runc_hands_the_container_to_the_agents_gate_which_holds_it_to_its_ceiling(
    tmp_path: Path, leaf: Path
) -> None:
    binary = runc()
    if binary is None:
        pytest.skip("needs runc (tests/e2e/build-runc.sh, or apt-get install runc)")
    tenants = Tenants.of(
        [Tenant("ml/p/c", "ml", request=GIB, ceiling=4 * GIB, priority=0, ids=frozenset({CID}))]
    )
    errors, labels = _Errors(), []
    gate = NodeGate(
        tmp_path / "kubelet",
        tmp_path / "run" / "seccomp.sock",
        Path("/proc"),
        {NULL_MAJOR},
        lambda cid: container_ceiling(tenants, "580.142", cid),
        errors,
        recheck_wait=DEADLINE,
        label=labels.append,
        driver=lambda: "580.142",
    )
    assert gate.start() is None
    profile = json.loads((tmp_path / "kubelet" / "seccomp" / gate_profile.PROFILE_NAME).read_text())
    over = f"form=nvos64,class=0x40,size={2 * GIB}"
    within = f"form=nvos64,class=0x40,size={GIB // 2}"
    wrapped = f"form=nvos21,class=0x40,size={2 * GIB},wrap=1"
    cgroup = "/" + str(leaf.relative_to(leaf.parents[3]))  # below the v2 root: ours
    where = bundle(tmp_path / "bundle", binary, cgroup, [over, within, wrapped], profile)
    run = subprocess.Popen(
        [binary, "--root", str(tmp_path / "state"), "run", "--bundle", str(where), CID],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(run.stdout.read() if run.stdout else b""))
    reader.start()
    try:
        wait_for(lambda: gate.gated() == {CID: 1} or run.poll() is not None, DEADLINE, "runc")
        assert gate.gated() == {CID: 1}, run.stderr.read() if run.stderr else ""
        wait_for(lambda: labels == ["pending", "v1"], what="the label of a proven runtime")
        # The agent's passes, as its sampler makes them: the container holds 3 GiB over
        # its GPUs (what the gate lets through never reaches /dev/null's "driver").
        sampling = threading.Event()

        def sampler() -> None:
            while not sampling.wait(0.05):
                gate.saw({CID: {"GPU-a": 3 * GIB}}, time.monotonic())

        gate.saw({CID: {"GPU-a": 3 * GIB}}, time.monotonic())
        passes = threading.Thread(target=sampler)
        passes.start()
        assert run.stdin is not None
        run.stdin.write(b"g")  # the stand-in's `wait=0`: its calls begin after the pass
        run.stdin.close()
        try:
            assert run.wait(DEADLINE) == 0, run.stderr.read() if run.stderr else ""
        finally:
            sampling.set()
            passes.join()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        reader.join()
        gate.stop()
    lines = [json.loads(line) for line in out[0].splitlines()]
    by_step = {line["step"]: line for line in lines}
    assert (by_step[over]["ret"], by_step[over]["status"]) == (0, NO_MEMORY), lines
    assert (by_step[within]["ret"], by_step[within]["status"]) == (-1, UNTOUCHED), lines
    assert (by_step[wrapped]["ret"], by_step[wrapped]["status"]) == (0, NO_MEMORY), lines
    assert errors.count == 0
