"""A non-blocking retry schedule built from tenacity's wait strategies.

The enforcement loop must never sleep inside a retry: a termination in flight still needs
its SIGKILL on time while NVML or the agent is down. So instead of wrapping a call in
`tenacity.retry`, a failing component asks this schedule whether it may try again yet,
and tenacity decides how long the pause after each failure is: 0.1 s doubling up to 10 s,
plus up to 0.1 s of jitter so that many enforcers do not retry in lockstep.
"""

from __future__ import annotations

import tenacity
from tenacity.wait import wait_base


class Backoff:
    """Spaces out retries after consecutive failures; success resets it."""

    def __init__(self, wait: wait_base | None = None) -> None:
        self._wait = wait or (
            tenacity.wait_exponential(multiplier=0.1, max=10.0) + tenacity.wait_random(0, 0.1)
        )
        self._state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        self.failures = 0
        self.next_attempt = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.next_attempt

    def failed(self, now: float, most: float | None = None) -> float:
        """Record a failure at `now`; returns the pause before the next attempt, at most
        `most` (something else is due then)."""
        self.failures += 1
        self._state.attempt_number = self.failures
        delay = float(self._wait(self._state))
        if most is not None:
            delay = min(delay, most)
        self.next_attempt = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.next_attempt = 0.0
