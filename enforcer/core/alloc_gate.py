"""The allocation gate's decision (pure): let one video-memory allocation go on, refuse it,
or look again after a fresh sample, from what the command is owed and what it holds.

What it holds is the sampler's last pass plus what the gate let through since: NVML shows
an allocation only some time after the driver made it (`SETTLE`), so a grant is counted
until a pass that began `SETTLE` after it. Counting one twice for that long errs toward a
recheck, never toward an overshoot. Frees are not gated, so only a pass sees them: a
workload that frees 2 GiB and then asks 2 GiB would be refused a spurious out-of-memory on
a pass taken before its free. A call over the limit is therefore refused only on a pass
that began after it arrived, and so after every free its caller made before asking (a
retry after an out-of-memory, as PyTorch makes once it has freed its cache, is one such
call). Usage the sampler could not read never makes room: the last good pass and the
grants since stay until the next good pass, and a pass that could not read, begun after
the call, refuses it on them as a good one would.
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
    allocations let through (monotonic time, bytes), oldest first, and when the last pass
    began, good or not (`tried_at`).

    `since_bytes` is `since()` kept as a running total, so that judging a call costs the
    same with a thousand grants outstanding as with none (a flood of calls reaches that);
    None (the default) counts it from `grants` once, on creation."""

    limit_bytes: int
    sampled_bytes: int = 0
    sampled_at: float | None = None
    grants: tuple[tuple[float, int], ...] = ()
    tried_at: float | None = None
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

    def fresh(self, arrived: float) -> bool:
        """The last good pass shows every allocation let through, and the last pass began
        after a call that arrived at `arrived`, so after every free its caller made before
        it (one that could not read shows no free): looking again cannot help."""
        if self.sampled_at is None or self.tried_at is None or self.since():
            return False
        return self.tried_at > arrived

    def settled_after(self, arrived: float) -> float:
        """The time after which a pass that begins is `fresh` for a call that arrived at
        `arrived`: it shows every grant and every free made before the call."""
        return max(self.grants[-1][0] + SETTLE, arrived) if self.grants else arrived

    def saw(self, used_bytes: int, at: float) -> View:
        """After a good pass that began at `at`: the grants it shows are dropped (and the
        total counted afresh from those left, once a pass)."""
        cutoff = at - SETTLE
        return replace(
            self,
            sampled_bytes=used_bytes,
            sampled_at=at,
            tried_at=at,
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
            self.limit_bytes, self.sampled_bytes, self.sampled_at, grants, self.tried_at, since
        )

    def tried(self, at: float) -> View:
        """After a pass begun at `at` that could not read the tree's usage."""
        return replace(self, tried_at=at)

    def ungranted(self, at: float, n: int) -> View:
        """A grant whose call never went on (its caller was interrupted): not held."""
        if (at, n) not in self.grants:
            return self
        grants = list(self.grants)
        grants.remove((at, n))
        since = (self.since_bytes or 0) - self._counted(at, n)
        return replace(self, grants=tuple(grants), since_bytes=since)


def decide(ask_bytes: int, view: View, arrived: float) -> tuple[Verdict, int]:
    """The verdict on one allocation of `ask_bytes` whose call arrived at `arrived`
    (monotonic), and what the tree held when judged."""
    held = view.held()
    if held + ask_bytes <= view.limit_bytes:
        return Verdict.ALLOW, held
    if ask_bytes > view.limit_bytes or view.fresh(arrived):
        return Verdict.REFUSE, held
    return Verdict.RECHECK, held  # a free made before the call may not be sampled yet
