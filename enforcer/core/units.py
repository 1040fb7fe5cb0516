"""A unit's name: what one limit applies to, said as one string on the wire, in metric
labels, in Events and in the logs; built and read back here alone.

    trainer                   a container
    trainer@GPU-…             a container's share on one GPU (a KAI share over N GPUs)
    a+b@GPU-…                 the containers that share an allocation on one GPU (DRA)
    ml/train-0/trainer        as the agent names a pod's unit among the node's
    (pod)                     what cannot be proven to be any container's, reported only

Container names, pods and namespaces are DNS names: they hold no `+`, `@` or `/`. A GPU's
UUID holds no `@` (an old MIG UUID holds `/`: the GPU is read after the first `@`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

POD_UNIT = "(pod)"


@dataclass(frozen=True, slots=True)
class Unit:
    containers: tuple[str, ...] = ()  # sorted where several share; none: the pod as a whole
    gpu: str | None = None  # the GPU its limit is on; None: its limit is on all its GPUs
    pod: str = ""  # `namespace/name`, where the unit is named among the node's

    def __str__(self) -> str:
        if not self.containers:
            return POD_UNIT
        name = "+".join(self.containers)
        if self.gpu is not None:
            name = f"{name}@{self.gpu}"
        return f"{self.pod}/{name}" if self.pod else name

    @classmethod
    def of(cls, name: str) -> Unit:
        """The unit a name says (the inverse of `str`)."""
        if name == POD_UNIT:
            return cls()
        head, at, gpu = name.partition("@")
        pod, _, containers = head.rpartition("/")
        return cls(tuple(containers.split("+")), gpu if at else None, pod)

    @property
    def sole(self) -> str | None:
        """Its container, where it has one; None for containers that share (or the pod)."""
        return self.containers[0] if len(self.containers) == 1 else None

    @property
    def on_all_gpus(self) -> Unit:
        """The same containers, their GPU left out (as a reclaim's reason names them)."""
        return Unit(self.containers, None, self.pod)

    def described(self) -> str:
        """As log lines and Events name it: `container 'trainer' on GPU GPU-...`."""
        if not self.containers:
            return "the pod as a whole"
        who = (
            f"container {self.containers[0]!r}"
            if len(self.containers) == 1
            else "containers " + " and ".join(repr(n) for n in self.containers)
        )
        return who if self.gpu is None else f"{who} on GPU {self.gpu}"


def of_sole_container(name: str, by_container: Mapping[str, T]) -> T | None:
    """What `by_container` holds for the container of a unit that has one (`trainer`,
    `trainer@GPU-...`); None for a unit that containers share (`a+b@GPU-...`), or for a
    container it does not hold."""
    sole = Unit.of(name).sole
    return by_container.get(sole) if sole is not None else None
