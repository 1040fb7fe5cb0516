"""Usage sources: where a tick's `Sample` comes from.

The interface alone, so that the pipeline takes any source without loading one: NVML
(`nvml_source.NvmlSource`) or the node agent (`agent_link.AgentLink`). Every source returns
a `SourceDown` value instead of raising, so that a tick without data is an ordinary,
reportable state.
"""

from __future__ import annotations

from typing import Protocol

from enforcer.core.model import Sample, SourceDown


class UsageSource(Protocol):
    def sample(self) -> Sample | SourceDown: ...

    def fileno(self) -> int | None:
        """A descriptor that turns readable when a new sample is waiting, if the source pushes."""

    def close(self) -> None: ...
