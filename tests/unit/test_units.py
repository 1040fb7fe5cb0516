"""A unit's name is built and read back in one place (`core/units.py`): every form the
sidecar, the agent and the metrics use reads back as the unit that wrote it."""

import pytest

from enforcer.core.units import POD_UNIT, Unit, of_sole_container

FORMS = [
    ("trainer", Unit(("trainer",))),
    ("trainer@GPU-0a1b", Unit(("trainer",), "GPU-0a1b")),
    ("a+b@GPU-0a1b", Unit(("a", "b"), "GPU-0a1b")),
    ("ml/train-0/trainer", Unit(("trainer",), pod="ml/train-0")),
    ("ml/train-0/a+b@GPU-0a1b", Unit(("a", "b"), "GPU-0a1b", "ml/train-0")),
    # An old-style MIG UUID holds slashes: the GPU is everything after the first `@`.
    ("trainer@MIG-GPU-0a1b/1/0", Unit(("trainer",), "MIG-GPU-0a1b/1/0")),
    ("ml/p/trainer@MIG-GPU-0a1b/1/0", Unit(("trainer",), "MIG-GPU-0a1b/1/0", "ml/p")),
    (POD_UNIT, Unit()),
]


@pytest.mark.parametrize(("name", "unit"), FORMS)
def test_each_form_of_a_units_name_reads_back_as_the_unit_that_wrote_it(
    name: str, unit: Unit
) -> None:
    assert str(unit) == name
    assert Unit.of(name) == unit


def test_a_unit_is_described_by_its_containers_and_its_gpu() -> None:
    assert Unit.of("trainer").described() == "container 'trainer'"
    assert Unit.of("a+b@GPU-1").described() == "containers 'a' and 'b' on GPU GPU-1"
    assert Unit.of(POD_UNIT).described() == "the pod as a whole"
    assert str(Unit.of("ml/p/a+b@GPU-1").on_all_gpus) == "ml/p/a+b"


def test_only_a_unit_of_one_container_is_that_containers() -> None:
    inits = {"trainer": 7, "a": 8}
    assert of_sole_container("trainer@GPU-1", inits) == 7
    assert of_sole_container("a+b@GPU-1", inits) is None  # shared: nobody's alone
    assert of_sole_container(POD_UNIT, inits) is None  # the pod's: no container's
    assert Unit.of(POD_UNIT).containers == ()  # never matched to any container's processes
