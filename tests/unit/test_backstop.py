"""What the agent enforces for a pod whose sidecar is silent: the sidecar's own policy,
read from the environment the webhook gave it."""

from __future__ import annotations

from enforcer.core.model import Action
from enforcer.modes.backstop import policy_of


def test_the_pods_policy_comes_from_its_sidecars_environment() -> None:
    got = policy_of(
        {
            "VRAM_ENFORCER_ACTION": "kill",
            "VRAM_ENFORCER_GRACE_PERIOD": "5s",
            "VRAM_ENFORCER_WARN_AT": "80%",
        }
    )
    assert (got.action, got.grace_period, got.warn_at) == (Action.KILL, 5.0, 0.8)
    assert policy_of({"VRAM_ENFORCER_ACTION": "restart"}).action is Action.RESTART
    # Unreadable (never the webhook's): the sidecar's defaults, never an error.
    default = policy_of({})
    assert policy_of({"VRAM_ENFORCER_ACTION": "explode"}) == default
    assert default.action is Action.TERMINATE
