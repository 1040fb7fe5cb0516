"""KAI Scheduler's annotations, read as KAI reads them: every form, with the values and
refusals of KAI's own validation (pkg/common/resources in KAI's source)."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest

from enforcer.core import kai
from enforcer.core.declaration import Declaration, Portion
from enforcer.core.model import GiB, MiB
from enforcer.core.parsing import ConfigError

CONTAINERS = ("main", "helper")
INITS = ("fetch",)
asked: list[tuple[int | None, int, str, object]] = []


def allow(ceiling: int | None, request: int, key: str, value: object) -> None:
    asked.append((ceiling, request, key, value))


def read(annotations: dict[str, str]) -> Declaration:
    asked.clear()
    return kai.declaration(annotations, CONTAINERS, INITS, allow)


def test_gpu_memory_is_mib_on_each_gpu_of_the_first_container() -> None:
    assert read({"gpu-memory": "2000"}) == Declaration({"main": 2000 * MiB})
    assert read({"gpu-memory": "2000", "gpu-fraction-num-devices": "2"}) == Declaration(
        {"main": 4000 * MiB},
        gpus={"main": 2},  # 2000 MiB on each of 2 GPUs, never 4000 on one
    )
    named = {"gpu-memory": "1024", "gpu-fraction-container-name": "helper"}
    assert read(named) == Declaration({"helper": GiB})
    assert read({**named, "gpu-fraction-container-name": "fetch"}) == Declaration({"fetch": GiB})
    assert asked == []  # no limit above a request: nothing to bound


def test_a_fraction_is_a_portion_of_each_gpu_counted_later() -> None:
    assert read({"gpu-fraction": "0.5"}) == Declaration(portions={"main": Portion(Decimal("0.5"))})
    two = read({"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"})
    assert two == Declaration(portions={"main": Portion(Decimal("0.50"))}, gpus={"main": 2})


def test_a_fraction_of_20_digits_after_the_point_stays_exact_on_the_most_gpus() -> None:
    got = read({"gpu-fraction": "1e-20", "gpu-fraction-num-devices": "9999"})
    assert got == Declaration(portions={"main": Portion(Decimal("9.999e-17"))}, gpus={"main": 9999})


def test_limits_above_the_request_are_ceilings_within_what_the_operator_allows() -> None:
    got = read({"gpu-memory": "2048", "gpu-memory.limit": "8Gi", "gpu-fraction-num-devices": "2"})
    assert got == Declaration({"main": 4 * GiB}, {"main": 16 * GiB}, gpus={"main": 2})
    assert asked == [(16 * GiB, 4 * GiB, "gpu-memory.limit", "8Gi")]
    got = read({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8"})
    assert got == Declaration(portions={"main": Portion(Decimal("0.5"), Decimal("0.8"))})
    assert asked == [(None, 0, "gpu-fraction.limit", "0.8")]  # bytes only once the GPU is known
    key = "kai.scheduler/container.main.gpu-memory.portion.limit"
    got = read({"gpu-fraction": "0.5", key: "0.75"})
    assert got == Declaration(portions={"main": Portion(Decimal("0.5"), Decimal("0.75"))})
    # A limit equal to the request borrows nothing, and asks nothing.
    assert read({"gpu-memory": "1024", "gpu-memory.limit": "1Gi"}) == Declaration({"main": GiB})
    assert asked == []


def test_nvfractions_is_a_request_and_limit_for_one_named_container() -> None:
    req = "nvidia.com/container.helper.gpu-memory.request"
    lim = "nvidia.com/container.helper.gpu-memory.limit"
    assert read({req: "4Gi"}) == Declaration({"helper": 4 * GiB})
    assert read({req: "4Gi", lim: "12Gi"}) == Declaration({"helper": 4 * GiB}, {"helper": 12 * GiB})
    assert asked == [(12 * GiB, 4 * GiB, lim, "12Gi")]
    # gpu-memory beside it must say the same; the binder's device list is not a declaration.
    same = {req: "2000Mi", "gpu-memory": "2000", "nvidia.com/container.helper.gpus.devices": "x"}
    assert read(same) == Declaration({"helper": 2000 * MiB})
    assert kai.declares({req: "1Gi"}) and kai.declares({"gpu-memory": "1"})
    assert not kai.declares({"nvidia.com/container.helper.gpus.devices": "GPU-1", "gpu-x": "1"})


def refuse(ceiling: int | None, request: int, key: str, value: object) -> None:
    raise ConfigError(key, value, "is above what is allowed")


def test_a_limit_the_operator_does_not_allow_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("gpu-fraction.limit: '0.8' is above what is allowed")
    ):
        kai.declaration(
            {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8"}, CONTAINERS, (), refuse
        )
    # Without a limit above the request nothing is asked.
    assert kai.declaration({"gpu-fraction": "0.5"}, CONTAINERS, (), refuse)


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        (
            {"gpu-fraction": "1"},
            "['gpu-fraction']: '1' is not a portion of a GPU above 0 and below 1",
        ),
        ({"gpu-fraction": "0"}, "is not a portion of a GPU above 0 and below 1"),
        ({"gpu-fraction": "half"}, "['gpu-fraction']: 'half' is not a portion"),
        ({"gpu-fraction": "NaN"}, "is not a portion"),
        (
            {"gpu-fraction": "1e-999999999"},
            "['gpu-fraction']: '1e-999999999' has more than 20 digits after the point",
        ),
        (
            {"gpu-fraction": "0.5", "gpu-fraction.limit": "0." + "9" * 21},
            "['gpu-fraction.limit']: '0.999999999999999999999' has more than 20",
        ),
        ({"gpu-memory": "0"}, "['gpu-memory']: '0' is not a whole number of MiB above 0"),
        ({"gpu-memory": "2Gi"}, "['gpu-memory']: '2Gi' is not a whole number of MiB above 0"),
        (
            {"gpu-memory": "9" * 5000},
            "is not a whole number of MiB above 0",
        ),  # not int()'s ValueError
        (
            {"gpu-memory": "1", "gpu-fraction-num-devices": "9" * 5000},
            "is not a whole number of GPUs above 0",
        ),
        (
            {"gpu-memory": "1", "gpu-fraction": "0.5"},
            "is set beside gpu-fraction; KAI takes one or the other",
        ),
        ({"gpu-fraction-num-devices": "2"}, "is set without gpu-fraction or gpu-memory"),
        (
            {"gpu-memory": "1", "gpu-fraction-num-devices": "0"},
            "is not a whole number of GPUs above 0",
        ),
        (
            {"gpu-memory": "1", "gpu-fraction-container-name": "nope"},
            "'nope' names no container of the pod",
        ),
        ({"gpu-memory": "2048", "gpu-memory.limit": "1Gi"}, "is below gpu-memory (2048 MiB)"),
        ({"gpu-memory": "2048", "gpu-memory.limit": "4096"}, "has no unit; KAI takes a quantity"),
        ({"gpu-memory.limit": "4Gi"}, "is set without gpu-memory"),
        ({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.5"}, "is not above gpu-fraction (0.5)"),
        (
            {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8000001"},
            "more than 5 digits after the point",
        ),
        (
            {
                "gpu-fraction": "0.5",
                "kai.scheduler/container.helper.gpu-memory.portion.limit": "0.8",
            },
            "names container 'helper', but gpu-fraction is for 'main'",
        ),
        (
            {
                "gpu-fraction": "0.5",
                "gpu-fraction.limit": "0.8",
                "kai.scheduler/container.main.gpu-memory.portion.limit": "0.9",
            },
            "is set beside gpu-fraction.limit; use one",
        ),
        ({"nvidia.com/container.main.gpu-memory.limit": "4Gi"}, "a limit needs a request"),
        (
            {"nvidia.com/container.x.gpu-memory.request": "4Gi"},
            "names container 'x', which the pod does not have",
        ),
        (
            {
                "nvidia.com/container.main.gpu-memory.request": "4Gi",
                "nvidia.com/container.helper.gpu-memory.request": "4Gi",
            },
            "names a second container",
        ),
        (
            {
                "nvidia.com/container.main.gpu-memory.request": "8Gi",
                "nvidia.com/container.main.gpu-memory.limit": "4Gi",
            },
            "is below the container's request",
        ),
        ({"nvidia.com/container.main.gpu-memory.request": "lots"}, "is not a quantity"),
        (
            {"nvidia.com/container.main.gpu-memory.request": "2Gi", "gpu-memory": "1000"},
            "differs from the NvFractions request of container 'main'",
        ),
        (
            {"nvidia.com/container.main.gpu-memory.request": "2Gi", "gpu-fraction": "0.5"},
            "is set beside NvFractions annotations",
        ),
        (
            {
                "nvidia.com/container.main.gpu-memory.request": "2Gi",
                "gpu-memory": "2048",
                "gpu-memory.limit": "4Gi",
            },
            "give the limit as nvidia.com/container.main.gpu-memory.limit",
        ),
    ],
)
def test_what_kai_refuses_is_denied_naming_the_annotation(
    annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=r"^metadata\.annotations\[") as caught:
        read(annotations)
    assert message in str(caught.value)


def test_nothing_of_kais_declares_nothing() -> None:
    assert read({"other": "x"}) == Declaration()
    assert not read({})
