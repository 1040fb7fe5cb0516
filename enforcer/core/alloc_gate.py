"""The allocation gate's decision (pure): let one video-memory allocation go on, refuse it,
or look again after a fresh sample, from what the command is owed and what it holds.

What it holds is the sampler's last pass plus what the gate let through since: NVML shows
an allocation only some time after the driver made it (`SETTLE`), so a grant is counted
until a pass that began `SETTLE` after it. Counting one twice for that long errs toward a
recheck, never toward an overshoot. A refusal makes the next pass matter too: a workload
told "out of memory" frees what it caches and asks again (PyTorch does), so a call over
the limit is refused at once only on a pass newer than the last refusal. Usage the sampler
could not read never makes room: the last good pass and the grants since stay until the
next good pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

SETTLE = 0.05  # s, from a call let through until NVML shows it (to be measured on a GPU)
MAX_GRANTS = 4096  # kept apart; beyond that the two oldest are merged into one


class Verdict(StrEnum):
    ALLOW = "allowed"
    REFUSE = "refused"
    RECHECK = "recheck"  # over the limit on a view that frees since the last pass may change


@dataclass(frozen=True, slots=True)
class View:
    """What the gate knows of the command tree: its limit (bytes, summed over GPUs), the
    sampler's last good pass (its usage and monotonic time; None before the first), the
    allocations let through (monotonic time, bytes), oldest first, and the last refusal.

    `since_bytes` is `since()` kept as a running total, so that judging a call costs the
    same with a thousand grants outstanding as with none (a flood of calls reaches that);
    None (the default) counts it from `grants` once, on creation."""

    limit_bytes: int
    sampled_bytes: int = 0
    sampled_at: float | None = None
    grants: tuple[tuple[float, int], ...] = ()
    refused_at: float | None = None
    since_bytes: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.since_bytes is None:
            counted = sum(self._counted(at, n) for at, n in self.grants)
            object.__setattr__(self, "since_bytes", counted)

    def _counted(self, at: float, n: int) -> int:
        """`n` if a grant made at `at` is one the last pass may not show yet, else 0."""
        return n if self.sampled_at is None or at > self.sampled_at - SETTLE else 0

    def since(self) -> int:
        """Bytes let through that the last pass may not show yet."""
        return self.since_bytes or 0

    def held(self) -> int:
        return self.sampled_bytes + self.since()

    def fresh(self) -> bool:
        """The last pass shows every allocation let through and every free made after the
        last refusal: looking again cannot help."""
        if self.sampled_at is None or self.since():
            return False
        return self.refused_at is None or self.sampled_at > self.refused_at

    def settled_after(self) -> float:
        """The time after which a pass that begins shows every grant and every free made
        after the last refusal (-inf: any pass does)."""
        newest = self.grants[-1][0] + SETTLE if self.grants else float("-inf")
        return max(newest, float("-inf") if self.refused_at is None else self.refused_at)

    def saw(self, used_bytes: int, at: float) -> View:
        """After a good pass that began at `at`: the grants it shows are dropped (and the
        total counted afresh from those left, once a pass)."""
        cutoff = at - SETTLE
        return replace(
            self,
            sampled_bytes=used_bytes,
            sampled_at=at,
            grants=tuple(g for g in self.grants if g[0] > cutoff),
            since_bytes=None,
        )

    def granted(self, at: float, n: int) -> View:
        # Concatenated: one copy of the grants, where (*grants, g) makes two (a list first).
        grants = self.grants + ((at, n),)  # noqa: RUF005
        since = (self.since_bytes or 0) + self._counted(at, n)
        if len(grants) > MAX_GRANTS:  # the merged pair counts until its newer one expires
            (old, a), (t, b) = grants[0], grants[1]
            grants = ((t, a + b),) + grants[2:]  # noqa: RUF005
            since += self._counted(t, a + b) - self._counted(old, a) - self._counted(t, b)
        # Made directly, not by replace(): this is the one change on every allowed call.
        return View(
            self.limit_bytes, self.sampled_bytes, self.sampled_at, grants, self.refused_at, since
        )

    def refused(self, at: float) -> View:
        return replace(self, refused_at=at)

    def ungranted(self, at: float, n: int) -> View:
        """A grant whose call never went on (its caller was interrupted): not held."""
        if (at, n) not in self.grants:
            return self
        grants = list(self.grants)
        grants.remove((at, n))
        since = (self.since_bytes or 0) - self._counted(at, n)
        return replace(self, grants=tuple(grants), since_bytes=since)


def decide(ask_bytes: int, view: View) -> tuple[Verdict, int]:
    """The verdict on one allocation of `ask_bytes`, and what the tree held when judged."""
    held = view.held()
    if held + ask_bytes <= view.limit_bytes:
        return Verdict.ALLOW, held
    if ask_bytes > view.limit_bytes or view.fresh():
        return Verdict.REFUSE, held
    return Verdict.RECHECK, held  # PyTorch frees its cache and retries: a new pass may see room
