"""DRA allocations to limits per GPU (`enforcer.core.dra`), and usage folded per GPU.

The objects are the API server's own (tests/fixtures/dra, from the real scheduler); each
bad case is derived from them by changing one field.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from enforcer.core.attribution import PodProcesses, PodUnits, pod_units
from enforcer.core.declaration import Declaration
from enforcer.core.dra import (
    Allocations,
    DraSettings,
    GpuUnit,
    allocations,
    claim_names,
    shareable_gpus,
    with_ceilings,
)
from enforcer.core.model import GiB, ProcessKey, ProcessUsage, Sample
from enforcer.core.owed import owed
from enforcer.core.pod import ContainerRef
from enforcer.core.policy import PolicyConfig, decide

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dra"
GPU0 = "GPU-00000000-aaaa-bbbb-cccc-000000000000"
GPU1 = "GPU-00000001-aaaa-bbbb-cccc-000000000000"
NVIDIA = DraSettings()

Doc = dict[str, Any]


def load(name: str) -> Doc:
    doc: Doc = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


@pytest.fixture
def pod() -> Doc:
    return load("pod")


@pytest.fixture
def claim() -> Doc:
    return load("claim")


@pytest.fixture
def slices() -> list[Doc]:
    return [load("slice")]


def by_name(*claims: Doc) -> dict[str, Doc]:
    return {c["metadata"]["name"]: c for c in claims}


def result(claim: Doc, index: int = 0) -> Doc:
    found: Doc = claim["status"]["allocation"]["devices"]["results"][index]
    return found


def test_the_schedulers_allocation_is_the_containers_limit_on_that_gpu(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    assert got.problems == () and got.unresolved == frozenset()
    (unit,) = got.units
    assert (unit.gpu, unit.containers, unit.limit_bytes) == (GPU0, ("c",), 4 * GiB)
    assert unit.shares[0].claim == claim["metadata"]["name"]
    assert unit.shares[0].device == "gpu.nvidia.com/gpu-node/gpu-0"


def test_claim_names_come_from_the_spec_or_the_status(pod: Doc) -> None:
    assert claim_names(pod) == {
        "vram": pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    }
    pod["spec"]["resourceClaims"].append({"name": "mine", "resourceClaimName": "shared-claim"})
    del pod["status"]["resourceClaimStatuses"]
    assert claim_names(pod) == {"vram": None, "mine": "shared-claim"}


def test_a_claim_two_containers_use_is_one_limit_for_both(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    second = copy.deepcopy(pod["spec"]["containers"][0])
    second["name"] = "d"
    pod["spec"]["containers"].append(second)
    (unit,) = allocations(pod, by_name(claim), slices, NVIDIA, {}).units
    assert (unit.containers, unit.limit_bytes, unit.name) == (("c", "d"), 4 * GiB, f"c+d@{GPU0}")


def test_two_shares_of_one_gpu_add_up_and_a_request_picks_its_own(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    extra = copy.deepcopy(result(claim))
    extra.update(request="more", consumedCapacity={"memory": "2Gi"}, shareID="other")
    claim["status"]["allocation"]["devices"]["results"].append(extra)
    (unit,) = allocations(pod, by_name(claim), slices, NVIDIA, {}).units
    assert unit.limit_bytes == 6 * GiB  # the container uses the whole claim
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "vram", "request": "more"}]
    (unit,) = allocations(pod, by_name(claim), slices, NVIDIA, {}).units
    assert unit.limit_bytes == 2 * GiB


def test_shares_on_two_gpus_are_two_units(pod: Doc, claim: Doc, slices: list[Doc]) -> None:
    extra = copy.deepcopy(result(claim))
    extra.update(device="gpu-1", consumedCapacity={"memory": "1Gi"})
    claim["status"]["allocation"]["devices"]["results"].append(extra)
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    assert [(u.gpu, u.limit_bytes) for u in got.units] == [(GPU0, 4 * GiB), (GPU1, 1 * GiB)]


def test_other_drivers_allocations_are_not_ours(pod: Doc, claim: Doc, slices: list[Doc]) -> None:
    result(claim)["driver"] = "nic.example.com"
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    assert got == Allocations()
    # ...unless that driver is configured, and then its slices must name the GPU too
    other = DraSettings(drivers=frozenset({"nic.example.com"}))
    assert (
        "cannot be matched to an NVML GPU"
        in allocations(pod, by_name(claim), slices, other, {}).problems[0]
    )


def test_a_domain_qualified_uuid_attribute_counts(pod: Doc, claim: Doc, slices: list[Doc]) -> None:
    attributes = slices[0]["spec"]["devices"][0]["attributes"]
    attributes["gpu.nvidia.com/uuid"] = attributes.pop("uuid")
    (unit,) = allocations(pod, by_name(claim), slices, NVIDIA, {}).units
    assert unit.gpu == GPU0


def test_only_the_newest_generation_of_a_pool_counts(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    newer = copy.deepcopy(slices[0])
    newer["spec"]["pool"]["generation"] = 2
    newer["spec"]["devices"][0]["attributes"]["uuid"] = {"string": "GPU-replaced"}
    (unit,) = allocations(pod, by_name(claim), [newer, slices[0]], NVIDIA, {}).units
    assert unit.gpu == "GPU-replaced"


# --- what cannot be proven: a problem naming the field and the fix, and nothing enforced ---


def unresolved(got: Allocations, *words: str) -> None:
    assert got.units == () and got.unresolved == frozenset({"c"})
    (problem,) = got.problems
    for word in words:
        assert word in problem, problem


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (None, ("consumedCapacity.memory is missing", "DRAConsumableCapacity")),
        ("lots", ("consumedCapacity.memory: 'lots' is not a quantity",)),
        (16, ("consumedCapacity.memory: 16 is not a quantity",)),
        ("-1Gi", ("not a whole number of bytes",)),
        ("0.5", ("not a whole number of bytes",)),
    ],
)
def test_a_consumed_capacity_missing_or_malformed(
    pod: Doc, claim: Doc, slices: list[Doc], value: object, words: tuple[str, ...]
) -> None:
    if value is None:
        del result(claim)["consumedCapacity"]
    else:
        result(claim)["consumedCapacity"]["memory"] = value
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    name = claim["metadata"]["name"]
    unresolved(got, f"ResourceClaim {name!r}: status.allocation.devices.results[0]", *words)


def test_a_device_no_slice_of_the_node_lists(pod: Doc, claim: Doc, slices: list[Doc]) -> None:
    result(claim)["device"] = "gpu-7"
    unresolved(
        allocations(pod, by_name(claim), slices, NVIDIA, {}),
        "gpu.nvidia.com/gpu-node/gpu-7",
        "cannot be matched to an NVML GPU",
    )
    del slices[0]["spec"]["devices"][0]["attributes"]["uuid"]
    result(claim)["device"] = "gpu-0"
    unresolved(allocations(pod, by_name(claim), slices, NVIDIA, {}), "'uuid' attribute")


def test_a_claim_not_made_not_read_or_not_allocated(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    unresolved(
        allocations(pod, {}, slices, NVIDIA, {}), "could not be read", "get on resourceclaims"
    )
    del claim["status"]
    unresolved(allocations(pod, by_name(claim), slices, NVIDIA, {}), "has no allocation")
    del pod["status"]["resourceClaimStatuses"]
    unresolved(allocations(pod, by_name(claim), slices, NVIDIA, {}), "has not been made yet")


# --- usage per GPU, and what the policy makes of it ------------------------------------------


def two_tenants(pod: Doc, claim: Doc) -> tuple[Doc, dict[str, Doc]]:
    """Containers c (the claim of 4Gi on GPU 0) and n, a neighbour with 8Gi on GPU 0."""
    neighbour = copy.deepcopy(claim)
    neighbour["metadata"]["name"] = "neighbour-claim"
    result(neighbour)["consumedCapacity"]["memory"] = "8Gi"
    pod["spec"]["resourceClaims"].append({"name": "n", "resourceClaimName": "neighbour-claim"})
    pod["spec"]["containers"].append(
        {"name": "n", "image": "gpu:1", "resources": {"claims": [{"name": "n"}]}}
    )
    return pod, by_name(claim, neighbour)


def sample(*usage: tuple[int, str, int]) -> Sample:
    return Sample(
        0.0,
        (),
        tuple(ProcessUsage(ProcessKey(pid, pid * 10), gpu, used) for pid, gpu, used in usage),
    )


def per_gpu(
    usage: Sample, owner: dict[ProcessKey, str], got: Allocations, allowed: bool = False
) -> PodUnits:
    """The tick's units of a DRA pod whose containers are `owner`'s, as its sidecar makes
    them from what its claims give it (`owed`)."""
    refs = tuple(ContainerRef(name, "containers") for name in dict.fromkeys(owner.values()))
    seen = PodProcesses(dict.fromkeys(owner, ""), owner, refs)
    return pod_units(usage, seen, owed(Declaration(claims=True), got, None), allowed, False)


def test_over_its_claim_on_its_gpu_is_stopped_and_the_neighbour_within_is_not(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    pod, claims = two_tenants(pod, claim)
    got = allocations(pod, claims, slices, NVIDIA, {})
    owner = {ProcessKey(1, 10): "c", ProcessKey(2, 20): "n"}
    # c holds 5Gi of its 4Gi; n 7Gi of its 8Gi: 12Gi on a 24Gi GPU, yet c is over
    units = per_gpu(sample((1, GPU0, 5 * GiB), (2, GPU0, 7 * GiB)), owner, got).units
    assert {u.name: (u.used_bytes, u.limit_bytes) for u in units} == {
        f"c@{GPU0}": (5 * GiB, 4 * GiB),
        f"n@{GPU0}": (7 * GiB, 8 * GiB),
    }
    decision = decide(units, PolicyConfig(), {}, now=0.0)
    (enforcement,) = decision.enforcements
    assert enforcement.victim.key == ProcessKey(1, 10) and enforcement.unit.device_uuid == GPU0


def test_usage_on_a_gpu_it_was_not_given_is_over_a_limit_of_zero(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    owner = {ProcessKey(1, 10): "c"}
    usage = sample((1, GPU0, 1 * GiB), (1, GPU1, 1 * GiB))
    units = per_gpu(usage, owner, got).units
    assert {u.name: (u.used_bytes, u.limit_bytes) for u in units} == {
        f"c@{GPU0}": (1 * GiB, 4 * GiB),
        f"c@{GPU1}": (1 * GiB, 0),
    }
    (enforcement,) = decide(units, PolicyConfig(), {}, now=0.0).enforcements
    assert enforcement.unit.name == f"c@{GPU1}"
    assert enforcement.victim.by_device == ((GPU1, 1 * GiB),)  # the GPU 1 usage only
    # held to zero there however undeclared containers are treated: it claims a GPU
    assert [u.name for u in per_gpu(usage, owner, got, allowed=True).units] == [
        f"c@{GPU0}",
        f"c@{GPU1}",
    ]


def test_an_unresolved_container_is_enforced_on_no_gpu(
    pod: Doc, claim: Doc, slices: list[Doc]
) -> None:
    del result(claim)["consumedCapacity"]
    got = allocations(pod, by_name(claim), slices, NVIDIA, {})
    usage = sample((1, GPU0, 20 * GiB), (1, GPU1, 20 * GiB))
    # the enforcer saw the usage: attributed to c, which is unresolved, so no unit at all
    assert got.unresolved == {"c"}
    assert per_gpu(usage, {ProcessKey(1, 10): "c"}, got).units == ()


def test_the_gpus_dra_can_place_by_memory_and_the_sidecar_can_name(slices: list[Doc]) -> None:
    both = ["gpu.nvidia.com/gpu-node/gpu-0", "gpu.nvidia.com/gpu-node/gpu-1"]
    assert shareable_gpus(slices, NVIDIA) == both
    first, second = slices[0]["spec"]["devices"]
    del first["allowMultipleAllocations"]  # allocated whole: no consumedCapacity to enforce
    del second["attributes"]["uuid"]  # cannot be matched to an NVML GPU
    assert shareable_gpus(slices, NVIDIA) == []
    assert shareable_gpus(slices, DraSettings(drivers=frozenset({"other"}))) == []


def test_a_ceiling_raises_only_a_containers_one_allocation_above_its_size() -> None:
    """The webhook's DRA mode gives a declaring container one claim on one GPU: its
    ceiling is there. On two GPUs, or in an allocation containers share, which GPU (or
    whose) the ceiling is for would be a guess: it raises nothing."""
    one = GpuUnit("GPU-0", ("a",), 4 * GiB, ())
    shared = GpuUnit("GPU-0", ("b", "c"), 4 * GiB, ())
    wide = (GpuUnit("GPU-0", ("d",), 2 * GiB, ()), GpuUnit("GPU-1", ("d",), 2 * GiB, ()))
    low = GpuUnit("GPU-1", ("e",), 8 * GiB, ())  # allocated more than its ceiling
    found = Allocations((one, shared, *wide, low), unresolved=frozenset({"f"}))
    ceilings = {name: 6 * GiB for name in "abcdef"}
    raised, requests = with_ceilings(found, ceilings)
    assert raised.units == (GpuUnit("GPU-0", ("a",), 6 * GiB, ()), shared, *wide, low)
    assert requests == {"a@GPU-0": 4 * GiB}
    assert raised.unresolved == frozenset({"f"})
    assert with_ceilings(found, {}) == (found, {})
