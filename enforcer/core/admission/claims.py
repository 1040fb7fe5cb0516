"""DRA mode: declared VRAM becomes a claim from a ResourceClaimTemplate of ours, one per
size and namespace (`vram-enforcer-16gi`), and our claims are read back as limits (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from enforcer.core.admission.common import (
    AdmissionSettings,
    Path,
    as_list,
    as_map,
    containers,
)
from enforcer.core.admission.patch import Patch
from enforcer.core.parsing import (
    ConfigError,
    format_quantity,
    parse_bytes,
)
from enforcer.core.payloads import (
    PodSpec,
)


def claim_template_name(limit: int) -> str:
    """The ResourceClaimTemplate a declaration of `limit` bytes becomes a claim from, one per
    size and namespace: `vram-enforcer-16gi`."""
    return f"vram-enforcer-{format_quantity(limit).lower()}"


def claim_template(namespace: str, limit: int, settings: AdmissionSettings) -> dict[str, object]:
    """That template: one request of `limit` bytes of the DeviceClass's memory capacity."""
    assert settings.dra_class is not None  # noqa: S101 - only asked in DRA mode
    exactly = {
        "deviceClassName": settings.dra_class,
        "capacity": {"requests": {settings.dra_capacity: format_quantity(limit)}},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": claim_template_name(limit),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "vram-enforcer"},
        },
        "spec": {"spec": {"devices": {"requests": [{"name": "vram", "exactly": exactly}]}}},
    }


def claim_vram(patch: Patch, where: Path, limit: int, settings: AdmissionSettings) -> None:
    """DRA mode: the container's VRAM becomes a claim from the template of its size, which
    the scheduler places on one GPU with that much room; the extended resource goes.

    A declaration of 0 asks for no GPU: it becomes no claim (a claim of 0 bytes would still
    be given a share of a GPU), and stays as it is (0 of a resource fits any node), so that
    the sidecar holds the container to 0 on every GPU.

    When extended resource names can carry capacity requests (KEP-6406, provisional), the
    scheduler will make this claim itself, and this step can be dropped."""
    if limit == 0:
        return
    claim = f"vram-{patch.get(where)['name']}"
    resources = (*where, "resources")
    for part in ("limits", "requests"):
        listed = patch.get((*resources, part))
        if isinstance(listed, dict) and settings.resource_name in listed:
            alone = len(listed) == 1  # the part goes with it
            patch.remove(
                (*resources, part) if alone else (*resources, part, settings.resource_name)
            )
    if claim in _claim_names(patch.get(("spec",))):
        return  # claimed on an earlier pass
    patch.append((*resources, "claims"), {"name": claim})
    patch.append(
        ("spec", "resourceClaims"),
        {"name": claim, "resourceClaimTemplateName": claim_template_name(limit)},
    )


def _claim_names(spec: Mapping[str, object]) -> set[str]:
    return {str(as_map(rc).get("name")) for rc in as_list(spec.get("resourceClaims"))}


_TEMPLATE_SIZE = re.compile(r"vram-enforcer-([0-9]+)([kmgtpe]i)?")


def template_size(name: str) -> int | None:
    """The bytes a template of ours claims, from its name (`vram-enforcer-16gi`); None for
    a name that is not one of ours."""
    size = _TEMPLATE_SIZE.fullmatch(name)
    if size is None:
        return None
    quantity = size[1] + (size[2] or "").capitalize()  # the name is lowercase: 16gi
    try:
        return parse_bytes(quantity, field="resourceClaimTemplateName")
    except ConfigError:
        return None  # past what Kubernetes holds: not a template of ours


def claimed_limits(spec: PodSpec) -> dict[str, int]:
    """DRA mode, on a later pass: each container's limit from the claim an earlier pass made
    (`vram-<container>` from the template `vram-enforcer-<size>`), since the declaration it
    came from is gone. Written by hand, that claim is a declaration like any other."""
    templates = {
        str(rc.get("name")): str(rc.get("resourceClaimTemplateName") or "")
        for rc in map(as_map, as_list(spec.get("resourceClaims")))
    }
    found = {}
    for c in containers(spec):
        claim = f"vram-{c['name']}"
        claims = {
            as_map(rc).get("name") for rc in as_list(as_map(c.get("resources")).get("claims"))
        }
        size = template_size(templates.get(claim, ""))
        if claim in claims and size is not None:
            found[c["name"]] = size
    return found
