"""Ephemeral containers added to a running pod (`kubectl debug`: an UPDATE of the pod's
`ephemeralcontainers` subresource), held to what its other containers are held to (pure).

The webhook sees a pod when it is created; an ephemeral container comes later, through a
subresource of its own. In a pod the webhook injected, a new one is held to the rules of
`isolation`: it drops KILL, and is denied what would let it ptrace the sidecar or run under
another label; it sets no limit or reservation of its own through the NVIDIA toolkit's
hook (`sidecar.toolkit_env`: soft 0, no hard limit); nor may it target the sidecar
(`targetContainerName`, which the chart's policy refuses too). In any pod, none is named
like the sidecar. Whether the pod is ours, and its SELinux options, are read from the
stored pod (`oldObject`): the rest of the request's copy is the requester's to write (the
API server keeps only its ephemeral containers). Ephemeral containers added before are
left as they are: the API server refuses any change to them, and an upgrade must not make
a running pod's update fail.
"""

from __future__ import annotations

from collections.abc import Mapping

from enforcer.core import shapes
from enforcer.core.admission import isolation
from enforcer.core.admission.common import Denied, as_list, as_map
from enforcer.core.admission.patch import Patch
from enforcer.core.admission.sidecar import toolkit_env
from enforcer.core.declaration import SIDECAR
from enforcer.core.payloads import PatchOperation

EPHEMERAL = "ephemeralcontainers"  # the subresource


def mutate_ephemeral(
    pod: Mapping[str, object], stored: Mapping[str, object]
) -> list[PatchOperation]:
    """The JSON patch that holds the ephemeral containers `pod` adds to `stored`; [] when
    the pod is not one the webhook injected."""
    try:
        checked = shapes.check(pod)
    except shapes.ShapeError as exc:
        raise Denied(str(exc)) from None
    old = as_map(stored.get("spec"))
    before = {as_map(e).get("name") for e in as_list(old.get("ephemeralContainers"))}
    injected = any(
        as_map(c).get("name") == SIDECAR
        for field in ("initContainers", "containers")
        for c in as_list(old.get(field))
    )
    added = [
        (i, e)
        for i, e in enumerate((checked.get("spec") or {}).get("ephemeralContainers") or ())
        if e["name"] not in before
    ]
    for _, e in added:
        where = f"spec.ephemeralContainers[{e['name']!r}]"
        if e["name"] == SIDECAR:
            raise Denied(
                f"{where}: {SIDECAR!r} is the name of the enforcer's sidecar; name the "
                "ephemeral container otherwise"
            )
        if not injected:
            continue
        if e.get("targetContainerName") == SIDECAR:
            raise Denied(
                f"{where}.targetContainerName: {SIDECAR!r} is the enforcer's sidecar, which "
                "enforces the pod's VRAM limits: a debugging container aimed at it is a way "
                "into its processes and its files; target the pod's own containers"
            )
        isolation.check_container(e, where, as_map(old.get("securityContext")))
    if not injected:
        return []
    patch = Patch(checked)
    for i, _ in added:
        isolation.drop_kill(patch, ("spec", "ephemeralContainers", i))
        toolkit_env(patch, ("spec", "ephemeralContainers", i), None)
    return patch.ops
