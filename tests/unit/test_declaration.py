"""What a pod declares, as the agent and the sidecar read it: its resources, or what the
webhook froze into its sidecar's environment; and portions of a GPU in bytes."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from enforcer.core.declaration import (
    Declaration,
    Declares,
    Portion,
    Undeclared,
    dra_ceilings,
    encode_portions,
    of_pod,
    parse_portions,
    portion_basis,
    unreadable,
)
from enforcer.core.model import Device, GiB, MiB
from enforcer.core.parsing import ConfigError
from enforcer.core.payloads import Pod

RES = "vram-enforcer.io/vram"
SIDECAR = "vram-enforcer"
H100 = Device(0, "GPU-0", "H100", 80 * GiB, 0)
A100 = Device(1, "GPU-1", "A100", 40 * GiB, 0)
IN_MIG = Device(2, "GPU-2", "A100", 40 * GiB, 0)
MIG = Device(3, "MIG-2a", "1g.5gb", 5 * GiB, 0, parent_uuid="GPU-2")
ML = frozenset({"ml"})  # the namespaces that opted in: the pods' own, but where said


def pod(limit: str | None, **env: str) -> Pod:
    resources = {"limits": {RES: limit}} if limit else {}
    sidecar_env = [{"name": k, "value": v} for k, v in env.items()]
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "resources": resources}],
        "initContainers": [{"name": SIDECAR, "env": sidecar_env}],
    }
    return {"metadata": {"uid": "u", "namespace": "ml", "name": "p"}, "spec": spec}  # type: ignore[typeddict-item]


def test_resources_declare_and_the_sidecars_ceilings_lift_them() -> None:
    assert of_pod(pod("4Gi"), Declares(RES), opted_in=ML) == Declaration({"main": 4 * GiB})
    borrowing = pod("4Gi", VRAM_ENFORCER_CEILINGS=json.dumps({"main": 16 * GiB}))
    lifted = Declaration({"main": 4 * GiB}, {"main": 16 * GiB})
    assert of_pod(borrowing, Declares(RES), opted_in=ML) == lifted
    # Resources are what the scheduler counted: the sidecar's LIMITS never override them.
    other = pod("4Gi", VRAM_ENFORCER_LIMITS=json.dumps({"main": 80 * GiB}))
    assert of_pod(other, Declares(RES), opted_in=ML) == Declaration({"main": 4 * GiB})
    refused = of_pod(pod("lots"), Declares(RES), opted_in=ML)
    assert isinstance(refused, Undeclared) and "is not a quantity" in refused.reason


def test_a_pod_declaring_by_kai_is_read_from_its_sidecars_environment() -> None:
    frozen = pod(
        None,
        VRAM_ENFORCER_LIMITS="{}",
        VRAM_ENFORCER_PORTIONS=encode_portions({"main": Portion(Decimal("0.5"), Decimal("0.8"))}),
    )
    got = of_pod(frozen, Declares(RES), opted_in=ML)
    assert got == Declaration(portions={"main": Portion(Decimal("0.5"), Decimal("0.8"))})
    assert got.in_bytes(80 * GiB) == ({"main": 40 * GiB}, {"main": 64 * GiB})
    assert got.in_bytes(None) == ({}, {})  # not counted at all until a GPU's memory is known
    bytes_ = pod(None, VRAM_ENFORCER_LIMITS=json.dumps({"main": 2 * GiB}))
    assert of_pod(bytes_, Declares(RES), opted_in=ML) == Declaration({"main": 2 * GiB})
    # Anything malformed (never the webhook's) declares nothing, saying why; no env, nothing.
    garbled = pod(None, VRAM_ENFORCER_LIMITS="{", VRAM_ENFORCER_PORTIONS="{}")
    malformed = of_pod(garbled, Declares(RES), opted_in=ML)
    assert isinstance(malformed, Undeclared) and "is not valid JSON" in malformed.reason
    no_limits = pod(None, VRAM_ENFORCER_PORTIONS='{"main": {"request": "0.5"}}')
    assert not of_pod(no_limits, Declares(RES), opted_in=ML)


def test_a_portion_counts_against_the_smallest_whole_gpu_as_kai_counts_it() -> None:
    """KAI's `MemoryOfEveryGpuOnNode`: the memory in MiB, floored to a multiple of 100."""
    assert portion_basis([H100, A100]) == 40900 * MiB
    assert portion_basis([H100, IN_MIG, MIG]) == 81900 * MiB  # a GPU in MIG mode is no whole GPU
    # An H100 80GB HBM3 as NVML reports it: 81559 MiB. KAI gives a 0.5 share 40750 MiB.
    real = portion_basis([Device(0, "GPU-0", "NVIDIA H100 80GB HBM3", 81559 * MiB, 0)])
    assert real == 81500 * MiB
    assert Portion(Decimal("0.5"), Decimal("0.7")).in_bytes(real) == (40750 * MiB, 57050 * MiB)
    assert Portion(Decimal("0.33333")).in_bytes(real)[0] == 27166 * MiB  # whole MiB, down
    assert portion_basis([IN_MIG, MIG]) is None
    assert portion_basis([Device(0, "GPU-0", "?", None, None)]) is None
    # Rounded down: a share is never more than its portion.
    assert Portion(Decimal("0.33333")).in_bytes(3 * MiB) == (0, None)
    # A ceiling that rounds down to its request borrows nothing.
    barely = Declaration(portions={"a": Portion(Decimal("0.5"), Decimal("0.5000001"))})
    assert barely.in_bytes(1000 * MiB) == ({"a": 500 * MiB}, {})


def test_a_share_spread_over_gpus_is_read_with_its_gpus_and_counted_per_gpu() -> None:
    """KAI's `gpu-fraction: 0.33333` on 2 GPUs: the webhook writes the product and the
    count; each GPU's share is rounded as KAI rounds it there (27166 MiB of 81500), so the
    pod is owed twice that, not the product rounded once (54332 MiB, not 54333)."""
    spread = pod(
        None,
        VRAM_ENFORCER_LIMITS="{}",
        VRAM_ENFORCER_PORTIONS=encode_portions({"main": Portion(Decimal("0.66666"))}),
        VRAM_ENFORCER_GPUS='{"main": 2}',
    )
    got = of_pod(spread, Declares(RES), opted_in=ML)
    assert got == Declaration(portions={"main": Portion(Decimal("0.66666"))}, gpus={"main": 2})
    assert got.in_bytes(81500 * MiB) == ({"main": 2 * 27166 * MiB}, {})
    in_bytes = pod(None, VRAM_ENFORCER_LIMITS='{"main": 8}', VRAM_ENFORCER_GPUS='{"main": 2}')
    assert of_pod(in_bytes, Declares(RES), opted_in=ML) == Declaration(
        {"main": 8}, gpus={"main": 2}
    )
    for text, problem in [
        ('{"main": 1}', "gives container 'main' 1 GPUs"),
        ('{"main": "2"}', "gives container 'main' '2' GPUs"),
        ('{"main": 10000}', "use a whole number from 2 to 9999"),
        ('{"other": 2}', "names container 'other', which declares no request to spread"),
    ]:
        bad = pod(None, VRAM_ENFORCER_LIMITS='{"main": 8}', VRAM_ENFORCER_GPUS=text)
        refused = of_pod(bad, Declares(RES), opted_in=ML)
        assert isinstance(refused, Undeclared), text
        assert refused.reason.startswith("VRAM_ENFORCER_GPUS") and problem in refused.reason


def test_portions_round_trip_and_bad_ones_name_the_variable() -> None:
    given = {"main": Portion(Decimal("1.50")), "b": Portion(Decimal("0.2"), Decimal("0.7"))}
    assert parse_portions(encode_portions(given), "P") == given
    for text, problem in [
        ("[]", "is not a JSON object"),
        ('{"a": {"request": 0.5}}', "is not a portion of a GPU"),
        ('{"a": {"request": "-1"}}', "is not a portion of a GPU"),
        ('{"a": {"request": "0.5", "ceiling": "0.5"}}', "a ceiling at or below its request"),
        ('{"a": {"request": "0.5", "limit": "0.9"}}', "use {"),
    ]:
        with pytest.raises(ConfigError, match=r"^P") as caught:
            parse_portions(text, "P")
        assert problem in str(caught.value)


def test_a_dra_mode_pod_declares_nothing_in_its_sidecars_env_its_claims_are_its_limits() -> None:
    """The webhook's DRA mode turns each declaration into a claim and still tells the
    sidecar the sums; the agent must hold the pod to each claim on its GPU, not to a sum
    on every GPU (its hard limits, its backstop, its reclaims)."""
    env = {"VRAM_ENFORCER_LIMITS": json.dumps({"main": 8 * GiB})}
    kai = of_pod(pod(None, **env), Declares(RES), opted_in=ML)
    assert isinstance(kai, Declaration) and kai.requests == {"main": 8 * GiB}  # KAI's way
    dra = of_pod(pod(None, **env, VRAM_ENFORCER_LIMITS_FROM="dra"), Declares(RES), opted_in=ML)
    assert dra == Declaration(claims=True) and not dra and dra_ceilings(dra) == {}
    lifted = pod(
        None,
        **env,
        VRAM_ENFORCER_LIMITS_FROM="dra",
        VRAM_ENFORCER_CEILINGS=json.dumps({"main": 12 * GiB}),
    )
    assert dra_ceilings(of_pod(lifted, Declares(RES), opted_in=ML)) == {"main": 12 * GiB}
    # The ceilings of a pod that is not in DRA mode lie above its declaration, not claims.
    assert (
        dra_ceilings(
            of_pod(
                pod("4Gi", VRAM_ENFORCER_CEILINGS=json.dumps({"main": 12 * GiB})),
                Declares(RES),
                opted_in=ML,
            )
        )
        == {}
    )


# What a tenant can write into a container named like the sidecar, in a namespace that the
# webhook does not mutate (issue 35, item 8): each of these made every pass of the agent's
# lender, hard limiter and backstop raise, for every pod of the node.
POISON = {
    "deep": {"VRAM_ENFORCER_LIMITS": "[" * 100_000},  # RecursionError in json
    "deep object": {"VRAM_ENFORCER_LIMITS": '{"a":' * 100_000},
    "overflowing portion": {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"main": {"request": "1E+999999"}}',
    },
    "tiny portion": {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"main": {"request": "0E-1000026"}}',
    },
    "long portion": {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": json.dumps({"main": {"request": f"0.{'0' * 30}1"}}),
    },
    "portion of 10,000 GPUs": {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"main": {"request": "10000"}}',
    },
    "huge integer": {"VRAM_ENFORCER_LIMITS": json.dumps({"main": 10**4000})},
    "past 2^63-1": {"VRAM_ENFORCER_LIMITS": json.dumps({"main": 2**63})},
    "past the digit limit": {"VRAM_ENFORCER_LIMITS": '{"main": ' + "9" * 5000 + "}"},
    "wrong types": {"VRAM_ENFORCER_LIMITS": '{"main": "8Gi"}'},
    "wrong portion types": {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"main": {"request": ["0.5"]}}',
    },
}


@pytest.mark.parametrize("kind", POISON)
def test_a_sidecar_environment_the_webhook_never_wrote_declares_nothing_and_says_why(
    kind: str,
) -> None:
    got = of_pod(pod(None, **POISON[kind]), Declares(RES), opted_in=ML)
    assert isinstance(got, Undeclared), got
    assert got.reason.startswith("VRAM_ENFORCER_") and len(got.reason) < 400
    assert unreadable(got) == f"declares nothing: {got.reason}"


def test_the_depth_and_the_digits_are_bounded_before_anything_is_decoded() -> None:
    deep = of_pod(pod(None, **POISON["deep"]), Declares(RES), opted_in=ML)
    assert isinstance(deep, Undeclared) and "nests deeper than 8 levels" in deep.reason
    # Brackets within strings are no nesting; eight levels are read.
    assert parse_portions('{"a[[[[[[[[[": {"request": "0.5"}}', "P") == {
        "a[[[[[[[[[": Portion(Decimal("0.5"))
    }
    eight = '{"a": ' + "[" * 7 + "]" * 7 + "}"
    with pytest.raises(ConfigError, match="gives container 'a' <a list of 1>"):
        parse_portions(eight, "P")  # read, and refused for its shape
    with pytest.raises(ConfigError, match="nests deeper than 8 levels"):
        parse_portions(eight.replace("[", "[[", 1).replace("]", "]]", 1), "P")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        parse_portions("{" * 8, "P")  # unclosed, and no deeper than 8: the decoder says
    huge = of_pod(pod(None, **POISON["huge integer"]), Declares(RES), opted_in=ML)
    assert isinstance(huge, Undeclared) and "whole bytes from 0 to 2^63-1" in huge.reason
    # What the webhook writes for a KAI share is read back: at most 20 digits after the
    # point, times at most 9999 GPUs, in any notation decimal prints.
    for text in ("0.5", "1E-20", "9998.99999999999999990001", "0.00000012345678901234"):
        read = parse_portions(json.dumps({"a": {"request": text}}), "P")
        assert read["a"].request == Decimal(text)


def test_unreadable_ceilings_take_away_only_the_borrowing() -> None:
    """The resources are what the scheduler counted: a pod cannot shed its limit by
    spoiling its sidecar's environment, only its leave to borrow."""
    spoiled = of_pod(pod("4Gi", VRAM_ENFORCER_CEILINGS="[" * 100_000), Declares(RES), opted_in=ML)
    assert isinstance(spoiled, Declaration)
    assert (spoiled.requests, spoiled.ceilings) == ({"main": 4 * GiB}, {})
    assert unreadable(spoiled).startswith("borrows nothing: VRAM_ENFORCER_CEILINGS: ")
    assert unreadable(of_pod(pod("4Gi"), Declares(RES), opted_in=ML)) == ""


def test_a_sidecar_environment_outside_the_namespaces_that_opted_in_is_not_read() -> None:
    """The webhook writes a sidecar's environment only in namespaces labelled
    vram-enforcer.io/inject=enabled; anywhere else a container named like the sidecar is its
    author's (issue 35, item 8(b)). There it declares nothing (memory the scheduler never
    counted, which the lender would owe it) and gives no ceiling (no borrowing); what the
    resources declare still counts, as the scheduler counted it; and it is said why."""
    elsewhere = frozenset({"other"})  # "ml", the pods' namespace, has not opted in
    ceilings = {"VRAM_ENFORCER_CEILINGS": json.dumps({"main": 16 * GiB})}
    borrower = of_pod(pod("4Gi", **ceilings), Declares(RES), opted_in=elsewhere)
    assert isinstance(borrower, Declaration)
    assert (borrower.requests, borrower.ceilings) == ({"main": 4 * GiB}, {})
    why = (
        "namespace 'ml' is not labelled vram-enforcer.io/inject=enabled (or is the agent's "
        "own), so the webhook never wrote its sidecar's environment"
    )
    assert unreadable(borrower) == f"borrows nothing: {why}: VRAM_ENFORCER_CEILINGS not read"
    limits = {"VRAM_ENFORCER_LIMITS": json.dumps({"main": 8 * GiB})}
    portions = {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": encode_portions({"main": Portion(Decimal("0.5"))}),
    }
    dra = {**limits, **ceilings, "VRAM_ENFORCER_LIMITS_FROM": "dra"}
    for env in (limits, portions, dra):
        forged = of_pod(pod(None, **env), Declares(RES), opted_in=elsewhere)
        assert isinstance(forged, Undeclared) and dra_ceilings(forged) == {}, forged
        assert forged.reason == f"{why}: {', '.join(env)} not read"
        assert unreadable(forged) == f"declares nothing: {forged.reason}"
        trusted = of_pod(pod(None, **env), Declares(RES), opted_in=ML)
        assert trusted or dra_ceilings(trusted), trusted  # read where its namespace opted in
    # A pod that carries no such variable is read as it is, with nothing to say.
    plain = of_pod(pod("4Gi", VRAM_ENFORCER_ACTION="warn"), Declares(RES), opted_in=elsewhere)
    assert plain == Declaration({"main": 4 * GiB}) and unreadable(plain) == ""
    read = of_pod(pod("4Gi", **ceilings), Declares(RES), opted_in=ML)
    assert isinstance(read, Declaration) and read.ceilings == {"main": 16 * GiB}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
VALUES = (
    st.text(max_size=40)
    | JSON.map(json.dumps)
    | st.builds(lambda name, value: json.dumps({name: value}), st.sampled_from(["main", "x"]), JSON)
    | st.builds(lambda value: json.dumps({"main": {"request": value}}), JSON)
)
VARIABLES = [
    "VRAM_ENFORCER_LIMITS",
    "VRAM_ENFORCER_CEILINGS",
    "VRAM_ENFORCER_PORTIONS",
    "VRAM_ENFORCER_LIMITS_FROM",
]


@given(
    env=st.dictionaries(st.sampled_from(VARIABLES), VALUES), limit=st.sampled_from([None, "4Gi"])
)
def test_any_sidecar_environment_gives_a_declaration_or_why_not_never_an_error(
    env: dict[str, str], limit: str | None
) -> None:
    got = of_pod(pod(limit, **env), Declares(RES), opted_in=ML)
    if isinstance(got, Declaration):
        got.in_bytes(80 * GiB)  # counted in bytes without an error, too
    else:
        assert got.reason
