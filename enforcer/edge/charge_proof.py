"""Whether the driver charges a cgroup's processes to the hard limit it holds them to: the
proof asked before a hard limit is claimed, by `exec` for its command tree and by the agent
for each pod (`hard_limits.charged`, `hard_limits.proven`), read one way for both."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from enforcer.core.hard_limits import EVIDENCE_BYTES, charged, proven
from enforcer.core.model import HeldLimit
from enforcer.edge.nvml import Nvml


@dataclass(frozen=True, slots=True)
class Proof:
    """The driver's answer on one GPU: whether the limit binds the cgroup's processes, from
    what it charges to the limit (`charged_bytes`) against what NVML lists for them."""

    gpu: str
    binds: bool
    charged_bytes: int
    listed_bytes: int


class ChargeProof:
    """Asks the driver, each pass, until it has answered for a cgroup."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        # (cgroup, GPU) -> reads in a row on which the driver charged the cgroup nothing.
        self._misses: dict[tuple[str, str], int] = {}

    def read(self, cgroup: str, listed: Mapping[str, int]) -> Proof | None:
        """The answer on the first GPU where there is one (`listed`: what NVML lists for the
        cgroup's processes on each GPU its limit is on): binds as soon as the driver charges
        them; does not once it has charged nothing on UNCHARGED_READS reads in a row; None
        until then. A GPU where they hold too little to tell is not asked."""
        for gpu, amount in listed.items():
            if amount < EVIDENCE_BYTES:
                continue
            held = self._nvml.memory_limit(gpu, cgroup)
            if not isinstance(held, HeldLimit):
                continue
            key = (cgroup, gpu)
            verdict = charged(amount, held.charged_bytes)
            self._misses[key], binds = proven(self._misses.get(key, 0), verdict)
            if binds is not None:
                return Proof(gpu, binds, held.charged_bytes, amount)
        return None

    def keep(self, cgroups: AbstractSet[str]) -> None:
        """Forget the counts of all cgroups but these (the others are gone)."""
        self._misses = {key: n for key, n in self._misses.items() if key[0] in cgroups}
