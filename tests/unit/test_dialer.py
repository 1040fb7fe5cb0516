"""The agent's dials of sidecars, each on a thread of its own: a dial that hangs costs the
others nothing, and one namespace's hung dials never stop another's (issue 42, item 7)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from enforcer.edge import sidecar_dialer
from enforcer.edge.metrics import AgentTelemetry
from enforcer.edge.sidecar_dialer import Dialer, Dialled
from tests.helpers import wait_for


class Hanging:
    """A dial that waits until released: a path that does not answer, as a stand-in for
    the kernel's wait."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.dialled: list[str] = []

    def __call__(self, cid: str) -> Dialled:
        self.dialled.append(cid)
        self.released.wait(30)
        return "released"


@pytest.fixture
def hanging() -> Iterator[Hanging]:
    dial = Hanging()
    yield dial
    dial.released.set()


def test_hung_dials_are_said_once_and_bounded_per_namespace_and_on_the_node(
    hanging: Hanging, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sidecar_dialer, "MOST_HUNG", 6)
    now = [0.0]
    dials = Dialer(
        hanging, lambda: None, AgentTelemetry().unexpected.labels("x"), 5.0, lambda: now[0]
    )
    dials.start({f"a{i}": "a" for i in range(5)} | {"b0": "b", "b1": "b"})
    wait_for(lambda: len(hanging.dialled) == 7, what="the dials")
    now[0] = 5.0  # every one past its deadline: hung
    said = dials.collect()
    assert set(said) == {*(f"a{i}" for i in range(5)), "b0", "b1"}
    assert all("has not ended after 5s" in str(why) for why in said.values())
    assert dials.collect() == {}  # said once
    # "a" holds 5 hung dials (more than 4: they were started before they hung), "b" 2: on
    # the node 7, past MOST_HUNG. A namespace with none hung still gets its dials; "a" and
    # "b", which hold hung ones, get no new one; a dial in flight is not started twice.
    dials.start({"a9": "a", "b9": "b", "c0": "c", "a0": "a"})
    wait_for(lambda: "c0" in hanging.dialled, what="the other namespace's dial")
    assert hanging.dialled.count("a0") == 1 and "a9" not in hanging.dialled
    assert "b9" not in hanging.dialled
    hanging.released.set()
    wait_for(lambda: not dials.in_flight, what="the dials to end")
    assert set(dials.collect().values()) == {"released"}
