"""`vram-enforcer demo`'s settings: the few of `exec`'s that change what the demo shows.

The demo runs `exec` itself, so its flags are `exec`'s own declarations, with a limit
that has a default (`exec` requires one). None of them is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enforcer.core.parsing import parse_bytes
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings import Setting, Values, value, verbosity
from enforcer.core.settings.exec import ACTION, GRACE_PERIOD, INTERVAL, LOG_FORMAT

LIMIT = value(
    "limit",
    parse_bytes,
    "the command's GPU memory limit: it grows to 1536Mi of simulated GPU memory, so a "
    "limit of 1536Mi or more leaves it alone",
    flag="--limit",
    default="1Gi",
    metavar="QUANTITY",
    doc="GPU memory limit of the command the demo runs, which claims 256 MiB more "
    "simulated GPU memory every 0.25 s up to 1536 MiB, holds it 1 s and exits 0: a lower "
    "limit stops it, `1536Mi` or more leaves it alone",
)
VERBOSE = verbosity("the demo's lines")

DECLARED: tuple[Setting[Any], ...] = (LIMIT, ACTION, GRACE_PERIOD, INTERVAL, LOG_FORMAT, VERBOSE)


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """Everything `vram-enforcer demo` needs, validated."""

    limit_bytes: int
    policy: PolicyConfig
    interval: float


def demo_settings(values: Values) -> DemoSettings:
    policy = PolicyConfig(action=values[ACTION], grace_period=values[GRACE_PERIOD])
    return DemoSettings(values[LIMIT], policy, values[INTERVAL])
