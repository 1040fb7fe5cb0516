"""What the agent enforces for a pod whose sidecar is silent (and whether its hard limiter
limits it): the sidecar's own policy, read from the environment the webhook gave it."""

from __future__ import annotations

from typing import cast

from enforcer.core.model import Action
from enforcer.core.payloads import Pod
from enforcer.core.policy import PolicyConfig
from enforcer.core.settings.sidecar import pod_policy

SIDECAR = "vram-enforcer"


def policy_of(env: dict[str, str], namespace: str = "ml") -> PolicyConfig:
    """The policy the agent reads for a pod of `namespace` whose sidecar has `env`; only
    `ml` opted in."""
    variables = [{"name": k, "value": v} for k, v in env.items()]
    pod = {
        "metadata": {"namespace": namespace, "name": "p"},
        "spec": {"containers": [{"name": "c"}, {"name": SIDECAR, "env": variables}]},
    }
    return pod_policy(cast(Pod, pod), SIDECAR, frozenset({"ml"}))


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
    assert default.action is Action.TERMINATE and not default.dry_run


def test_a_dry_run_is_read_only_where_the_webhook_wrote_it() -> None:
    """`VRAM_ENFORCER_DRY_RUN=true`, as the webhook writes it for the action `dry-run`: in a
    namespace that opted in, the pod is not enforced; elsewhere a pod's author wrote it."""
    dry = {"VRAM_ENFORCER_DRY_RUN": "true"}
    assert policy_of(dry).dry_run
    assert not policy_of(dry, namespace="elsewhere").dry_run
    assert not policy_of({"VRAM_ENFORCER_DRY_RUN": "false"}).dry_run
