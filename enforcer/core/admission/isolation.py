"""The workload kept out of its sidecar, and within the enforcer's reach (pure): what the
webhook holds the other containers of a declaring pod to, ephemeral ones included.

**No ptrace of the sidecar.** The kernel lets a process read or write another's memory
(`/proc/<pid>/mem`, `process_vm_writev`, `ptrace`) or walk into its files
(`/proc/<pid>/root`) only past `__ptrace_may_access` (kernel/ptrace.c): the same uid, a
dumpable target, each unless the caller has CAP_SYS_PTRACE over it; then the security
modules, first `cap_ptrace_access_check` (security/commoncap.c), which refuses any caller,
whatever its uid and the target's dumpability, unless the target's *permitted*
capabilities are a subset of the caller's (its effective ones for /proc's checks,
PTRACE_MODE_FSCREDS; its permitted ones for ptrace(2) and process_vm_writev) in the same
user namespace, or the caller has CAP_SYS_PTRACE there. The sidecar runs as root with
CAP_KILL alone, and makes itself not dumpable about 100 ms after it starts
(`edge/dumpable.py`); in that window a root workload with the runtime's default
capabilities, KILL among them, passed every check, and a descriptor of the sidecar's
memory opened then stays open after. So every other container drops KILL (`drop_kill`):
outside the bounding set, it can enter no process's permitted set again (setuid programs
and file capabilities included; the runtimes leave the inheritable set empty), and the
sidecar's {KILL} is no subset of anything in the pod, at its first start and at every
restart. What gives KILL back, or CAP_SYS_PTRACE, is denied (`_OPENS_THE_SIDECAR`,
`privileged`). This holds while the sidecar holds a capability that no other container
does: it is KILL, and the sidecar needs it.

**One label for the pod.** AppArmor and SELinux mediate signals and ptrace between labels:
the runtime's default AppArmor profile (containerd's `cri-containerd.apparmor.d`, CRI-O's
`crio-default`) signals and ptrace-reads only peers under the same profile, and SELinux's
MCS keeps a domain from signalling another level. A container under another label than its
sidecar's cannot be signalled by it (EPERM), nor read by a confined agent. So every
container of a declaring pod runs under the sidecar's: the runtime's default AppArmor
profile (named by no field or annotation, or as `RuntimeDefault`), and the pod's SELinux
options, which a container may repeat but not change. The sidecar is given no
`appArmorProfile` of its own: the kubelet refuses a pod that names any profile but
`Unconfined`, RuntimeDefault included, on a node without AppArmor (`apparmor.isRequired`).
"""

from __future__ import annotations

from collections.abc import Mapping

from enforcer.core.admission.common import (
    Denied,
    Path,
    as_list,
    as_map,
    capability,
    containers_at,
)
from enforcer.core.admission.patch import Patch
from enforcer.core.admission.sidecar import NO_TOKEN_VOLUME, SOCKET_VOLUME
from enforcer.core.declaration import SIDECAR
from enforcer.core.parsing import shown
from enforcer.core.payloads import Container, PodSpec

KILL = "KILL"
# The sidecar's volumes, which no other container mounts: its socket, and the empty
# directory over its token (`sidecar.add_sidecar`).
SIDECARS_OWN = (SOCKET_VOLUME, NO_TOKEN_VOLUME)
# What a container may not add, normalised as the runtimes read it (any case, CAP_ or not).
_OPENS_THE_SIDECAR = {
    "SYS_PTRACE": "would let this container read and write the memory of the vram-enforcer "
    "sidecar, which enforces the pod's VRAM limits (ptrace); a pod that declares VRAM "
    "cannot add it",
    "ALL": "adds every capability, CAP_SYS_PTRACE among them, which would let this container "
    "read and write the memory of the vram-enforcer sidecar, which enforces the pod's VRAM "
    "limits; add only the ones it needs, never SYS_PTRACE or KILL",
    KILL: "is the one capability that the vram-enforcer sidecar holds: the kernel lets a "
    "process of the sidecar's uid read and write its memory when it holds every capability "
    "the sidecar holds, so the webhook drops KILL from the pod's other containers; the "
    "sidecar and the node agent do the signalling that VRAM enforcement needs",
}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
_RUNTIME_DEFAULT = "RuntimeDefault"
_LABEL_FIX = (
    "the vram-enforcer sidecar signals the pod's processes under the runtime's default "
    "profile, which another profile may refuse (EPERM), and VRAM enforcement would stop there"
)


def check_pod(spec: PodSpec, annotations: Mapping[str, object]) -> None:
    """Deny what would let a declaring pod's containers ptrace its sidecar, or put any of
    them under another AppArmor or SELinux label than the sidecar's."""
    for key, value in annotations.items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default":
            raise Denied(
                f"metadata.annotations[{key!r}]: {shown(value)} puts container "
                f"{key[len(APPARMOR_ANNOTATION) :]!r} under another AppArmor profile than "
                f"the runtime's default; {_LABEL_FIX}. Remove the annotation (or use "
                "'runtime/default')"
            )
    pod = spec.get("securityContext") or {}
    _check_apparmor(pod, "spec.securityContext", "every container of the pod, the sidecar too,")
    options = _selinux(pod)
    if options and "level" not in options:
        raise Denied(
            f"spec.securityContext.seLinuxOptions: {_listed(options)} names no level: the "
            "runtime then gives each container a level of its own (kubernetes/kubernetes"
            "#90759), and the vram-enforcer sidecar could not signal the others' processes; "
            "add a level (for example 's0:c123,c456'), or remove the options"
        )
    for where, c in containers_at(spec):
        if c["name"] != SIDECAR:
            check_container(c, _field(where, c), pod)


def check_container(c: Container, where: str, pod: Mapping[str, object]) -> None:
    """Deny what would let one container of a declaring pod ptrace the sidecar, mount its
    volumes, or run under another label than the sidecar's (`pod`: the pod's
    securityContext)."""
    for i, mount in enumerate(as_list(c.get("volumeMounts"))):
        name = as_map(mount).get("name")
        if name in SIDECARS_OWN:
            raise Denied(
                f"{where}.volumeMounts[{i}].name: {shown(name)} is the vram-enforcer "
                "sidecar's own volume (its socket, where the node agent reaches it): another "
                "container may not mount it, or it could take the socket away or flood it. "
                "Remove the mount"
            )
    sc = c.get("securityContext") or {}
    if sc.get("privileged") is True:
        raise Denied(
            f"{where}.securityContext.privileged: true gives this container every "
            "capability, CAP_SYS_PTRACE among them, which would let it read and write the "
            "memory of the vram-enforcer sidecar, which enforces the pod's VRAM limits; "
            "remove it (a pod that declares VRAM runs unprivileged)"
        )
    for added in as_list(as_map(sc.get("capabilities")).get("add")):
        name = capability(added)
        if name in _OPENS_THE_SIDECAR:
            raise Denied(
                f"{where}.securityContext.capabilities.add: {shown(added)} "
                f"{_OPENS_THE_SIDECAR[name]}. Remove it"
            )
    _check_apparmor(sc, f"{where}.securityContext", "this container")
    mine, pods = _selinux(sc), _selinux(pod)
    if mine and mine != pods:
        raise Denied(
            f"{where}.securityContext.seLinuxOptions: {_listed(mine)} are not the pod's "
            f"({_listed(pods)}, spec.securityContext.seLinuxOptions): the runtime would run "
            "this container under an SELinux label of its own, whose processes the "
            "vram-enforcer sidecar, under the pod's, may not signal; remove them (the pod's "
            "apply to every container)"
        )


def drop_kill_beside_the_sidecar(patch: Patch) -> None:
    """Drop KILL from every container of the pod but the sidecar (init ones too)."""
    for where, c in containers_at(patch.get(("spec",))):
        if c["name"] != SIDECAR:
            drop_kill(patch, where)


def drop_kill(patch: Patch, where: Path) -> None:
    """Drop KILL from the container at `where`, keeping what it drops and adds already;
    nothing where it drops KILL or ALL (any case, as the runtimes read it)."""
    drop = (*where, "securityContext", "capabilities", "drop")
    if not any(str(c).upper() in ("ALL", KILL) for c in patch.get(drop) or ()):
        patch.append(drop, KILL)


def _check_apparmor(sc: Mapping[str, object], where: str, whom: str) -> None:
    profile = as_map(sc.get("appArmorProfile"))
    if profile and profile.get("type") != _RUNTIME_DEFAULT:
        raise Denied(
            f"{where}.appArmorProfile.type: {shown(profile.get('type'))} puts {whom} under "
            f"another AppArmor profile than the runtime's default; {_LABEL_FIX}. Remove it "
            f"(or use type {_RUNTIME_DEFAULT})"
        )


def _selinux(sc: Mapping[str, object]) -> dict[str, object]:
    """The SELinux options set (an empty string is unset, as the runtime reads it)."""
    return {k: v for k, v in as_map(sc.get("seLinuxOptions")).items() if v}


def _listed(options: Mapping[str, object]) -> str:
    return ", ".join(f"{k} {shown(v, 40)}" for k, v in sorted(options.items())) or "none"


def _field(where: Path, c: Container) -> str:
    """`spec.containers['trainer']`, as denials name a container."""
    return f"spec.{where[1]}[{c['name']!r}]"
