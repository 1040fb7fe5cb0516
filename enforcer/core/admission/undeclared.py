"""A container that asks for a GPU and declares no VRAM (pure): denied, declared with the
operator's default, or admitted as it is, as its namespace says (`Bounds.undeclared_gpu`).

Time-slicing hands one GPU to several containers: one that declares nothing would hold
as much of its memory as it likes beside pods held to their limits. A GPU is asked for
with one of the operator's extended resources (`--gpu-resources`), in `limits` or
`requests`, by a container or an init container. Ephemeral containers can ask for none
(the API server refuses their `resources`): in an injected pod the sidecar holds them to
0 as every container that declares nothing; elsewhere they are the pod's, observed.

`default` declares as a LimitRange does: `resources.limits[<resource-name>]` is written on
the container, so the scheduler counts it, and the pod is then enforced as any declaring
pod (in DRA mode, the declaration becomes a claim). A pod whose GPU share KAI Scheduler's
annotations declare is left to them, and in DRA mode a container with claims of its own
declares through them (the sidecar takes its limits from their allocations).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from enforcer.core.admission.common import AdmissionSettings, Denied, containers
from enforcer.core.parsing import ConfigError, format_quantity, parse_quantity, shown
from enforcer.core.payloads import PodSpec
from enforcer.core.pod import json_map, json_maps
from enforcer.core.tenancy import DEFAULT, DENY, Bounds, in_namespace

_FIELDS = ("initContainers", "containers")
_EXAMPLE = 8 * 1024**3


@dataclass(frozen=True, slots=True)
class Asking:
    """A container that asks for a GPU: where, and with which resource and value."""

    name: str
    field: str  # its resources' path, for the message
    value: object


def asking(
    spec: Mapping[str, object], declaring: Collection[str], settings: AdmissionSettings
) -> list[Asking]:
    """Each container not in `declaring` that asks for one of the GPU resources. Read before
    the pod's shape is checked, as `declared_limits` reads: a field of the wrong type counts
    as absent."""
    found = []
    for spec_field in _FIELDS:
        for c in json_maps(spec.get(spec_field)):
            name = c.get("name")
            if not isinstance(name, str) or name in declaring:
                continue
            resources = json_map(c.get("resources"))
            for part in ("limits", "requests"):
                listed = json_map(resources.get(part))
                resource = next((r for r in settings.gpu_resources if _asks(listed.get(r))), None)
                if resource is not None:
                    where = f"spec.{spec_field}[{name!r}].resources.{part}[{resource!r}]"
                    found.append(Asking(name, where, listed[resource]))
                    break
    return found


def _asks(value: object) -> bool:
    """Whether a resource's value asks for some of it: `0` asks for none. A value that is
    no quantity is the API server's to refuse; until then it counts as asking."""
    if value is None:
        return False
    try:
        return parse_quantity(str(value), "") != 0
    except ConfigError:
        return True


def declaring(
    spec: Mapping[str, object], limits: Mapping[str, int], settings: AdmissionSettings
) -> set[str]:
    """The containers that declare VRAM: by the resource, or in DRA mode by claims of their
    own (a later pass finds our claim where the declaration was)."""
    names = set(limits)
    if settings.dra_class is not None:
        names |= {
            str(c.get("name"))
            for spec_field in _FIELDS
            for c in json_maps(spec.get(spec_field))
            if json_map(c.get("resources")).get("claims")
        }
    return names


def defaults(
    spec: Mapping[str, object],
    limits: Mapping[str, int],
    bounds: Bounds,
    settings: AdmissionSettings,
    namespace: str,
) -> dict[str, int]:
    """Container name -> the VRAM it is declared with (`default`), for each container that
    asks for a GPU and declares none (`limits` are the declared ones); {} to admit the pod
    as it is (`observe`). Denied (`deny`), naming the first such container and the fix."""
    if bounds.undeclared_gpu not in (DENY, DEFAULT):
        return {}
    found = asking(spec, declaring(spec, limits, settings), settings)
    if not found:
        return {}
    if bounds.undeclared_gpu == DENY:
        first = found[0]
        unit = settings.resource_unit
        example = declared_quantity(max(unit, _EXAMPLE - _EXAMPLE % unit), settings)
        raise Denied(
            f"{first.field}: {shown(first.value)} asks for a GPU, and container "
            f"{first.name!r} declares no VRAM, which is not allowed {in_namespace(namespace)}: "
            "a GPU shared with other pods needs each one's limit. Declare the most GPU memory "
            f"it may use in its resources.limits, e.g. {settings.resource_name}: {example} "
            "(the operator chooses with the webhook's --undeclared-gpu or --namespace-bounds)"
        )
    return {a.name: bounds.default_vram for a in found}


def with_defaults(
    spec: PodSpec, limits: Mapping[str, int], defaults: Mapping[str, int]
) -> dict[str, int]:
    """The declared limits and the defaults given, in the pod's order of containers, as a
    later pass reads them back (else its sidecar's environment would differ)."""
    merged = {**limits, **defaults}
    return {c["name"]: merged[c["name"]] for c in containers(spec) if c["name"] in merged}


def declared_quantity(limit: int, settings: AdmissionSettings) -> str:
    """A limit in bytes as the resource declares it: a quantity, or a count of units."""
    unit = settings.resource_unit
    return format_quantity(limit) if unit == 1 else str(limit // unit)
