"""The allocation gate's seccomp profile on each declaring container (webhook
`--allocation-gate on`): `Localhost` `vram-enforcer/gpu-v1.json`, the file the node agent
writes under each node's kubelet seccomp root (docs/architecture.md, "The allocation gate on
Kubernetes").

The file is RuntimeDefault's allowlist for the default capability set plus the gate, so it
replaces only what would have been RuntimeDefault (or no profile): a container that sets
another profile keeps it, a privileged container (no seccomp applies to it) and one that
adds a capability outside that set (whose RuntimeDefault would allow more than the file)
are left as they are, and the sidecar is never gated. Adding one of the default set (all
that Pod Security `baseline` lets a pod add: NET_BIND_SERVICE, CHOWN, ...) does not widen
containerd's RuntimeDefault, the file's source, so such a container is gated. Each
container left so is said, with why: sampling still holds its limit. A container that
already names our file (a reinvocation over our own output, or a user who asked for it) is
as wanted.

A pod any of whose containers runs under the file is gated: its sidecar is told so
(`holder_env`), and holds a second copy of the pod's listener fds (`gate_holder`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from enforcer.core.admission.common import as_list, as_map, capability, containers_at
from enforcer.core.admission.patch import Patch
from enforcer.core.declaration import SIDECAR
from enforcer.core.gate_profile import PROFILE_NAME
from enforcer.core.payloads import PodSpec
from enforcer.core.runtime_default import CAPABILITIES
from enforcer.core.settings.sidecar import ALLOCATION_GATE

GATED = {"type": "Localhost", "localhostProfile": PROFILE_NAME}


def why_not_gated(container: Mapping[str, Any], pod_profile: Mapping[str, object]) -> str | None:
    """Why a declaring container cannot be given the gate's profile, or None."""
    security = as_map(container.get("securityContext"))
    if security.get("privileged") is True:
        return "it is privileged, and no seccomp profile applies to a privileged container"
    added = as_list(as_map(security.get("capabilities")).get("add"))
    beyond = [str(c) for c in added if f"CAP_{capability(c)}" not in CAPABILITIES]
    if beyond:
        return (
            f"it adds capabilities ({', '.join(beyond)}), with which RuntimeDefault "
            "allows more than the gate's profile"
        )
    profile = as_map(security.get("seccompProfile")) or pod_profile
    kind = profile.get("type")
    if kind in (None, "RuntimeDefault") or profile == GATED:
        return None
    if kind == "Localhost":
        return f"it has a seccomp profile of its own ({profile.get('localhostProfile')})"
    return f"its seccomp profile is {kind}"


def gate_containers(patch: Patch, declaring: set[str], said: list[str] | None, gate: bool) -> None:
    """With `gate`, the gate's profile on each declaring container that can take it; each
    other said."""
    if not gate:
        return
    pod_profile = as_map(as_map(patch.get(("spec", "securityContext"))).get("seccompProfile"))
    for where, c in containers_at(patch.get(("spec",))):
        name = c["name"]
        if name not in declaring:  # the sidecar declares nothing
            continue
        why = why_not_gated(c, pod_profile)
        if why is None:
            patch.set((*where, "securityContext", "seccompProfile"), dict(GATED))
        elif said is not None:
            said.append(
                f"container {name!r}: its GPU allocations are not checked before they run "
                f"(the allocation gate), since {why}; sampling still holds its limit"
            )


def holder_env(spec: PodSpec) -> dict[str, str]:
    """The sidecar's `--allocation-gate on` where a container of the pod (the sidecar aside)
    runs under the gate's profile, its own or the pod's: the webhook's doing
    (`gate_containers`), or its author's, whose container is gated all the same on a node
    with the file. The sidecar then holds the pod's fds, so that an agent's restart never
    fails their calls with ENOSYS; elsewhere it runs no holder (nothing set)."""
    pod_profile = as_map(as_map(spec.get("securityContext")).get("seccompProfile"))
    gated = any(
        (as_map(as_map(c.get("securityContext")).get("seccompProfile")) or pod_profile) == GATED
        for _, c in containers_at(spec)
        if c["name"] != SIDECAR
    )
    return {ALLOCATION_GATE.variable: "on"} if gated else {}
