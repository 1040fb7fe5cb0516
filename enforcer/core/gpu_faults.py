"""Which GPUs NVML cannot read, said once they have failed a few passes in a row, and said
back once they have been read as many (pure): a GPU that fails now and then floods neither
the log nor the Node's Events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

FAULT_PASSES = 3  # passes in a row a GPU must fail (or be read) before that is said


@dataclass(frozen=True, slots=True)
class Faults:
    """What has been said: GPU UUID -> why it cannot be read; and, for each GPU whose
    passes disagree with that, how many in a row have."""

    said: Mapping[str, str] = field(default_factory=dict)
    streaks: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Change:
    """A GPU to say: unreadable, and why (`why`), or readable again (`why` is None)."""

    gpu: str
    why: str | None


def passed(faults: Faults, failed: Mapping[str, str]) -> tuple[Faults, tuple[Change, ...]]:
    """One more NVML pass, `failed` the GPUs it could not read (and why): what is said now,
    and what changed."""
    said, streaks = dict(faults.said), dict(faults.streaks)
    changes: list[Change] = []
    # Those with a streak too: a pass that reads a GPU not yet said to fail ends its streak.
    for gpu in sorted({*failed, *said, *streaks}):
        if (gpu in failed) == (gpu in said):
            streaks.pop(gpu, None)
            continue
        streaks[gpu] = streaks.get(gpu, 0) + 1
        if streaks[gpu] < FAULT_PASSES:
            continue
        del streaks[gpu]
        if gpu in failed:
            said[gpu] = failed[gpu]
        else:
            del said[gpu]
        changes.append(Change(gpu, failed.get(gpu)))
    return Faults(said, streaks), tuple(changes)
