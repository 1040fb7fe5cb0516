"""The kernel rule that the webhook's `isolation.drop_kill` relies on (issue 42, item 5), on
real processes: a workload with the capabilities the runtime gives its container as the
webhook patched it cannot open the memory of a sidecar that is still dumpable (the ~100 ms
after each of its starts) read-write; with the runtime's defaults, as before the fix, a
root one could. The runtime is the outermost boundary: what it makes of a container's
`securityContext.capabilities` is containerd's rule, below; the kernel's checks are real.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from enforcer.core.admission import AdmissionSettings, mutate, review
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)

SETTINGS = AdmissionSettings("ghcr.io/vram-enforcer/vram-enforcer:0.2.0", "native", "v/vram", 1)
# What containerd gives a container (oci.populateDefaultUnixSpec), before its
# securityContext.capabilities: KILL among them.
RUNTIME_DEFAULT = frozenset(
    [
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    ]
)
KILL_BIT = 1 << 5  # CAP_KILL in /proc/<pid>/status


def held(container: dict[str, Any]) -> frozenset[str]:
    """The bounding set that containerd gives `container` (`WithCapabilities`: ALL first,
    then each name upper-cased), and so a root process's permitted and effective ones."""
    caps = (container.get("securityContext") or {}).get("capabilities") or {}
    add = {c.upper() for c in caps.get("add") or ()}
    drop = {c.upper() for c in caps.get("drop") or ()}
    kept = frozenset() if "ALL" in drop else RUNTIME_DEFAULT
    return (kept | add) - drop - {"ALL"}


def as_container(caps: frozenset[str], *argv: str, uid: int = 0) -> list[str]:
    """`argv` run with `caps` alone as its bounding set (a root process's permitted set on
    exec), as `uid`."""
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(caps))])
    user = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"] if uid else []
    return ["setpriv", *user, "--inh-caps", "-all", "--bounding-set", bounding, *argv]


@pytest.fixture
def sidecar() -> Iterator[int]:
    """A process as the sidecar is in its first ~100 ms: root, CAP_KILL alone, still
    dumpable. Its pid."""
    proc = subprocess.Popen(as_container(frozenset({"KILL"}), "sleep", "60"))
    try:
        proc_dir = Path(f"/proc/{proc.pid}")
        wait_for(lambda: (proc_dir / "comm").read_text() == "sleep\n", what="the exec")
        status = (proc_dir / "status").read_text().splitlines()
        permitted = next(line for line in status if line.startswith("CapPrm:"))
        assert int(permitted.split()[1], 16) == KILL_BIT
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def opens_memory(caps: frozenset[str], pid: int, uid: int = 0) -> bool:
    """Whether a process with `caps`, as `uid`, opens `/proc/<pid>/mem` read-write (the
    kernel's PTRACE_MODE_ATTACH_FSCREDS check), as the issue's takeover did."""
    out = subprocess.run(
        as_container(caps, "sh", "-c", f"exec 3<>/proc/{pid}/mem", uid=uid),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 or "Permission denied" in out.stderr, out.stderr
    return out.returncode == 0


def workload(**context: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "trainer",
        "image": "nvcr.io/nvidia/pytorch:24.05-py3",
        "resources": {"limits": {"v/vram": "1Gi"}},
    }
    return {**c, "securityContext": context} if context else c


def admitted(container: dict[str, Any]) -> dict[str, Any]:
    """`container` as the webhook admits it in a pod of its own."""
    p = {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": [container]}}
    out = jsonpatch.apply_patch(p, mutate(p, SETTINGS))
    return next(c for c in out["spec"]["containers"] if c["name"] == "trainer")


def test_a_root_workload_cannot_open_a_starting_sidecars_memory_once_admitted(
    sidecar: int,
) -> None:
    """Before the webhook dropped KILL, the same workload opened it: the kernel's rule
    (`cap_ptrace_access_check`) holds here, and the fix is what closes it."""
    for before in (workload(), workload(runAsUser=0, capabilities={"add": ["NET_ADMIN"]})):
        assert opens_memory(held(before), sidecar)  # the door, as the issue found it
        after = admitted(copy.deepcopy(before))
        assert not opens_memory(held(after), sidecar)
        assert "KILL" not in held(after)


def test_a_non_root_workload_cannot_either(sidecar: int) -> None:
    """A workload of another uid is refused by the uid check before the capabilities are
    looked at; admitted, it holds no KILL to come back with as root (a setuid program gets
    at most the bounding set), and as root it is refused as above."""
    caps = held(admitted(workload(runAsUser=1000)))
    assert not opens_memory(RUNTIME_DEFAULT, sidecar, uid=1000)
    assert not opens_memory(caps, sidecar, uid=1000)
    assert not opens_memory(caps, sidecar) and "KILL" not in caps


def test_an_ephemeral_container_added_later_cannot_either(sidecar: int) -> None:
    """`kubectl debug` on an injected pod: the debugger is root with the runtime's defaults
    unless the webhook drops KILL from it too."""
    stored = {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": [workload()]}}
    stored = jsonpatch.apply_patch(stored, mutate(stored, SETTINGS))
    debugger = {"name": "debugger", "image": "busybox", "targetContainerName": "trainer"}
    updated = copy.deepcopy(stored)
    updated["spec"]["ephemeralContainers"] = [debugger]
    doc = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "UPDATE",
            "subResource": "ephemeralcontainers",
            "object": updated,
            "oldObject": stored,
        },
    }
    out = review(doc, SETTINGS)
    assert out.result == "patched"
    ops = json.loads(base64.b64decode(out.review["response"]["patch"]))
    (added,) = jsonpatch.apply_patch(updated, ops)["spec"]["ephemeralContainers"]
    assert opens_memory(held(debugger), sidecar)
    assert not opens_memory(held(added), sidecar)
