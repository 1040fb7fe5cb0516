"""Which runs to make: warm-ups, each workload alone, each pair together, interleaved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    WARMUP = "warmup"  # alone, discarded
    SOLO = "solo"
    PAIR = "pair"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run of a round: a workload, and the neighbour it runs next to (None: alone)."""

    workload: str
    neighbour: str | None = None
    copy: int = 1  # 2 for the second copy of a workload paired with itself

    @property
    def label(self) -> str:
        return self.workload if self.copy == 1 else f"{self.workload} (copy 2)"


@dataclass(frozen=True, slots=True)
class Round:
    """Runs started together: one alone, or the two of a pair."""

    index: int  # 1, 2, ...
    phase: Phase
    repetition: int  # 1, 2, ... within its phase
    runs: tuple[RunSpec, ...]

    @property
    def label(self) -> str:
        if self.phase is Phase.PAIR:
            a, b = self.runs
            return f"{a.workload} next to {b.workload}, repetition {self.repetition}"
        what = "warm-up" if self.phase is Phase.WARMUP else "repetition"
        return f"{self.runs[0].workload} alone, {what} {self.repetition}"


def plan(names: Sequence[str], repeat: int, warmup: int) -> tuple[Round, ...]:
    """Warm-ups first, then `repeat` rounds of everything: each workload alone, then each
    unordered pair, a workload with a second copy of itself included.

    The repetitions are interleaved (all cells once, then all again) rather than run
    back to back, so that a slow drift of the machine (clocks, temperature, another
    tenant) falls on the runs alone and the paired runs alike instead of biasing their
    ratio. Warm-ups run alone only: what they warm (file cache, kernel caches, clocks) is
    the machine's, and the paired runs come after the runs alone.
    """
    specs: list[tuple[Phase, int, tuple[RunSpec, ...]]] = [
        (Phase.WARMUP, w, (RunSpec(name),)) for w in range(1, warmup + 1) for name in names
    ]
    for r in range(1, repeat + 1):
        specs += [(Phase.SOLO, r, (RunSpec(name),)) for name in names]
        specs += [
            (Phase.PAIR, r, (RunSpec(a, b), RunSpec(b, a, 2 if a == b else 1)))
            for i, a in enumerate(names)
            for b in names[i:]
        ]
    return tuple(Round(i, phase, r, runs) for i, (phase, r, runs) in enumerate(specs, 1))
