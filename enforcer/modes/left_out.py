"""The pods that a bug left out of a loop's pass, said once each while they are.

One bad object never stops the handling of the others: the lender, the hard limiter and
the backstop each handle a pod in a guarded step of its own (`LoopGuard.result`). A pod
whose data trips a bug is left out of that pass, the bug is counted as the loop's, and
this says which pod it was, and what it means for it, once; not on every pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Set

from enforcer.core.payloads import Pod


class LeftOut:
    def __init__(self, log: logging.Logger, loop: str, step: str, meanwhile: str) -> None:
        """`loop`: the guard's label; `step`: what failed ("reading what it is owed");
        `meanwhile`: what that means for the pod until it passes again."""
        self._log = log
        self._loop = loop
        self._step = step
        self._meanwhile = meanwhile
        self._said: frozenset[str] = frozenset()

    def say(self, pods: Mapping[str, Pod], left_out: Set[str]) -> None:
        """`left_out`: the UIDs of `pods` this pass left out."""
        for uid in left_out - self._said:
            meta = pods[uid].get("metadata") or {}
            self._log.error(
                "pod %s/%s: %s failed (a bug, counted in "
                'vram_enforcer_unexpected_errors_total{loop="%s"}): %s',
                meta.get("namespace"),
                meta.get("name"),
                self._step,
                self._loop,
                self._meanwhile,
            )
        self._said = frozenset(left_out)
