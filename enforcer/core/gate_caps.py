"""How many gated processes the agent serves with threads of their own: every `kubectl
exec`, and any pod that names the gating profile, hands the agent a listener fd, and each
served fd costs two threads. Beyond a cap per pod and one per node, an fd is served by the
one shared overflow reader (`edge/gate_overflow.py`), which lets its calls go on (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PER_POD = 16  # listener fds of one pod served by threads of their own
NODE_WIDE = 512  # over all pods: 1024 threads at most


@dataclass(frozen=True, slots=True)
class Caps:
    """`per_pod`: fds of one pod (by the pod UID in its process's cgroup; processes whose
    pod is not known share one cap, None); `node_wide`: fds over the node."""

    per_pod: int = PER_POD
    node_wide: int = NODE_WIDE

    def overflows(self, served: Mapping[str | None, int], pod: str | None) -> bool:
        """Whether one more fd of `pod` goes to the overflow reader, with `served`: the fds
        served by threads of their own, by pod."""
        return served.get(pod, 0) >= self.per_pod or sum(served.values()) >= self.node_wide
