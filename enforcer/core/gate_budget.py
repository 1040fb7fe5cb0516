"""How fast the node agent reads one container's gated calls (pure): a budget of calls, a
sustained rate and a burst, after which the container's next call is read later.

On Kubernetes every gated container's listener is a thread of the agent, and each call
costs the agent 60 to 110 µs of Python under the GIL (`bench/gate_bench.py`). The filter
matches a request by its number on any fd, so a container can issue the escapes in a loop,
from many threads, and take most of a core from the agent's NVML pass, its usage server
and its API loops: every other tenant's enforcement. Over its budget, a container's
listener reads its next call only at its turn: the calling thread waits in the kernel,
so the cost falls on the flooding tenant alone. Nothing is refused, nothing fails, and
no other container's call waits for it.

The figures are ones a real CUDA program does not meet. A context's creation makes a few
hundred `RM_ALLOC`s of other classes (client, device, channels, events; the research
note's estimate, not yet counted on a GPU: `tests/gpu/offline.sh gate` can), so eight
processes each creating a context, one a GPU as DDP's do, stay within `BURST`. PyTorch's
caching allocator asks the driver only on a cache miss, at most some hundreds of calls a
second while it warms up or loads a model, and none in a warm step; `RATE` is a few times
that. One that does make more only starts slower (1 ms a call past its burst), it never
fails. A flooding container costs the agent at most `RATE` calls' time a second, after
one `BURST` (13% of a core, the waits' wake-ups included: `bench/gate_bench.py`'s flood
arm).

`exec` has none: its listener serves one command, whose only rival for the GIL is `exec`'s
own loop, which watches that same command. A flood there slows only its own command's
sampling (the listener hands the GIL over at each of its syscalls), and no other tenant
shares the process.

The arithmetic is the generic cell rate algorithm (a token bucket kept as one time): each
call read moves `due` on by one call's share of a second, and a call whose turn lies
further ahead than the burst allows waits for it. A turn is taken (reserved) before the
wait, so the listeners of one container, which share its budget, queue for theirs. A wait
shorter than `quantum` is not waited: the call is read at once, ahead of its turn, and
the turns after it wait the longer, so a throttled listener sleeps once per `quantum` of
calls rather than once per call (waking it costs the agent about what a call does). The
rate holds; its calls can run `quantum` ahead of it, `rate * quantum` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

RATE = 1000.0  # calls a second a container is read at, sustained: a few times PyTorch's peak
BURST = 5000  # calls read at once before the rate applies: CUDA starting on 8 GPUs, 8 times
QUANTUM = 0.02  # s: a shorter wait is not waited (20 calls at RATE per wake-up)


@dataclass(frozen=True, slots=True)
class Budget:
    """One container's budget: `rate` calls a second after a burst of `burst`, a wait under
    `quantum` s not waited; `due` (monotonic) is when its calls would have been read had
    each come at `rate` from an empty budget, the burst's room before it (-inf: nothing
    read yet)."""

    rate: float = RATE
    burst: int = BURST
    quantum: float = QUANTUM
    due: float = float("-inf")

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1 or self.quantum < 0:
            raise ValueError(
                f"a budget needs a rate above 0, a burst of 1 or more and a quantum of 0 or "
                f"more: {self}"
            )

    def take(self, now: float) -> tuple[Budget, float]:
        """The turn of the next call, read at `now` or later: the budget after it, and how
        many seconds from `now` it waits first (0 within the budget, or under `quantum`)."""
        share = 1.0 / self.rate
        wait = max(0.0, self.due - (self.burst - 1) * share - now)
        return replace(self, due=max(self.due, now) + share), wait if wait >= self.quantum else 0.0
