"""The sidecar's settings: environment from the webhook, flags on top, errors that name the variable."""

import re
from typing import Any

import pytest

from enforcer.core.model import Action
from enforcer.core.parsing import ConfigError
from tests.helpers import configured

ENV = {
    "POD_NAME": "trainer-0",
    "POD_NAMESPACE": "ml",
    "POD_UID": "6b5ab4a6-3e21-4b5d-9a5f-2b1c9d6e4f7a",
    "NODE_NAME": "gpu-1",
    "VRAM_ENFORCER_LIMITS": '{"trainer": 12884901888, "sidecar": 0}',
}


def settings(env: dict[str, str] | None = None, **flags: str) -> Any:
    """The sidecar's settings from the environment and the flags (by their names)."""
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in flags.items()]
    return configured(["sidecar", *argv], {**ENV, **(env or {})})


def test_defaults_from_the_environment() -> None:
    s = settings()
    assert (s.pod_name, s.namespace, s.node_name) == ("trainer-0", "ml", "gpu-1")
    assert s.limits == {"trainer": 12884901888, "sidecar": 0}
    assert s.policy.action is Action.TERMINATE
    assert s.interval == pytest.approx(0.1)
    assert s.agent_socket == "/run/vram-enforcer/agent.sock"
    assert s.sidecar_mode == "native"
    assert s.api_access == "agent"  # the pod from the agent's watch: no API read of ours
    assert not s.undeclared_allowed
    assert not s.allocation_gate  # no holder unless the webhook says the pod is gated


def test_flags_override_the_environment() -> None:
    s = settings({"VRAM_ENFORCER_ACTION": "kill", "VRAM_ENFORCER_INTERVAL": "1s"}, action="restart")
    assert s.policy.action is Action.RESTART
    assert s.interval == 1.0
    assert settings({"VRAM_ENFORCER_GRACE_PERIOD": "30s"}).policy.grace_period == 30.0


def test_the_sidecar_has_no_metrics_port_and_0_1_0s_variable_changes_nothing() -> None:
    """0.1.0's webhook set VRAM_ENFORCER_METRICS_PORT: such a pod, restarted on a newer
    image, still starts; there is no flag for a port to serve."""
    assert settings({"VRAM_ENFORCER_METRICS_PORT": "9477"}) == settings()
    with pytest.raises(SystemExit):
        settings(metrics_port="9500")


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"POD_UID": ""}, {}, "POD_UID is missing; set it from the Downward API"),
        ({"VRAM_ENFORCER_LIMITS": ""}, {}, "VRAM_ENFORCER_LIMITS is missing"),
        (
            {"VRAM_ENFORCER_LIMITS": "{trainer: 1}"},
            {},
            "VRAM_ENFORCER_LIMITS: '{trainer: 1}' is not valid JSON",
        ),
        ({"VRAM_ENFORCER_LIMITS": "[1]"}, {}, "is not a JSON object"),
        ({"VRAM_ENFORCER_LIMITS": '{"a": -1}'}, {}, "gives container 'a' the limit -1"),
        ({"VRAM_ENFORCER_LIMITS": '{"a": true}'}, {}, "gives container 'a' the limit True"),
        ({}, {"limits": '{"a": 1.5}'}, "--limits: "),
        ({"VRAM_ENFORCER_ACTION": "nuke"}, {}, "VRAM_ENFORCER_ACTION: 'nuke' is not an action"),
        ({"VRAM_ENFORCER_WARN_AT": "0.9"}, {}, "VRAM_ENFORCER_WARN_AT: '0.9' is not a percentage"),
        ({"VRAM_ENFORCER_GRACE_PERIOD": "5"}, {}, "did you mean 5s?"),
        (
            {"VRAM_ENFORCER_SIDECAR_MODE": "sidecar"},
            {},
            "VRAM_ENFORCER_SIDECAR_MODE: 'sidecar' is not a choice; use one of: native, container",
        ),
        ({}, {"source": "nvml"}, "--host-proc is missing"),
        (
            {},
            {"source": "nvml", "host_proc": "/host/proc"},
            "--api-access: 'agent' needs --source agent (the pod and the Events go over the "
            "agent's socket); with --source nvml pass --api-access direct",
        ),
        ({"VRAM_ENFORCER_API_ACCESS": "etcd"}, {}, "VRAM_ENFORCER_API_ACCESS: 'etcd' is not a"),
        (
            {"VRAM_ENFORCER_LISTEN": "/run/vram-enforcer/sidecar.sock"},
            {"source": "nvml", "host_proc": "/host/proc", "api_access": "direct"},
            "--listen: '/run/vram-enforcer/sidecar.sock' needs --source agent",
        ),
        ({}, {"undeclared": "maybe"}, "--undeclared: 'maybe'"),
        ({"VRAM_ENFORCER_ALLOCATION_GATE": "on"}, {}, "--allocation-gate: 'on' needs --listen"),
        ({"VRAM_ENFORCER_ALLOCATION_GATE": "yes"}, {}, "VRAM_ENFORCER_ALLOCATION_GATE: 'yes'"),
    ],
)
def test_bad_values_name_the_variable_or_flag(
    env: dict[str, str], flags: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        settings(env, **flags)
    assert message in str(info.value)


def test_ceilings_from_the_webhook_and_only_with_the_agent() -> None:
    """Borrowing needs the agent: only it sees the whole GPU, and so only it can say when
    borrowed memory must be given back. A sidecar on NVML alone would be a way out."""
    ceilings = {"VRAM_ENFORCER_CEILINGS": '{"trainer": 21474836480}'}
    assert settings(ceilings).ceilings == {"trainer": 20 * 1024**3}
    assert settings().ceilings == {}
    same = {"VRAM_ENFORCER_CEILINGS": '{"trainer": 12884901888}'}  # the request: no borrowing
    assert settings(same).ceilings == {}
    with pytest.raises(ConfigError, match="needs --source agent: only the node agent sees"):
        settings(ceilings, source="nvml", host_proc="/host/proc", api_access="direct")
    with pytest.raises(ConfigError, match="gives container 'trainer' a ceiling below its limit"):
        settings({"VRAM_ENFORCER_CEILINGS": '{"trainer": 1}'})
    with pytest.raises(ConfigError, match="gives container 'other' a ceiling but no limit"):
        settings({"VRAM_ENFORCER_CEILINGS": '{"other": 1}'})


@pytest.mark.parametrize(
    "reporting", [{"VRAM_ENFORCER_DRY_RUN": "true"}, {"VRAM_ENFORCER_ACTION": "warn"}]
)
def test_a_sidecar_only_reporting_holds_its_containers_to_their_requests(
    reporting: dict[str, str],
) -> None:
    """What it borrowed could not be taken back: it borrows nothing, as the agent owes it
    (a pod admitted before the webhook refused such ceilings)."""
    ceilings = {"VRAM_ENFORCER_CEILINGS": '{"trainer": 21474836480}'}
    portions = {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"trainer": {"request": "0.25", "ceiling": "0.5"}}',
    }
    assert settings({**ceilings, **reporting}).ceilings == {}
    from decimal import Decimal

    held = settings({**portions, **reporting}).portions
    assert {n: (p.request, p.ceiling) for n, p in held.items()} == {
        "trainer": (Decimal("0.25"), None)
    }


def test_portions_of_a_gpu_from_the_webhook() -> None:
    """KAI's gpu-fraction, frozen by the webhook: a portion is not also a limit in bytes,
    and a ceiling on one needs the agent, as any ceiling does."""
    from decimal import Decimal

    from enforcer.core.declaration import Portion

    portions = {
        "VRAM_ENFORCER_LIMITS": "{}",
        "VRAM_ENFORCER_PORTIONS": '{"main": {"request": "0.5", "ceiling": "0.8"}}',
    }
    assert settings(portions).portions == {"main": Portion(Decimal("0.5"), Decimal("0.8"))}
    assert settings().portions == {}
    with pytest.raises(ConfigError, match="gives a ceiling, which needs --source agent"):
        settings(portions, source="nvml", host_proc="/host/proc", api_access="direct")
    twice = {"VRAM_ENFORCER_PORTIONS": '{"trainer": {"request": "0.5"}}'}
    with pytest.raises(
        ConfigError,
        match="gives container 'trainer' a portion, and "
        "VRAM_ENFORCER_LIMITS a limit in bytes; give it one of them",
    ):
        settings(twice)
    with pytest.raises(
        ConfigError, match=re.escape("VRAM_ENFORCER_PORTIONS: '0.5' is not a JSON object")
    ):
        settings({"VRAM_ENFORCER_PORTIONS": "0.5"})
    # On several GPUs (KAI's gpu-fraction-num-devices): only a declaring container's.
    spread = {**portions, "VRAM_ENFORCER_GPUS": '{"main": 2}'}
    assert settings(spread).gpus == {"main": 2} and settings().gpus == {}
    with pytest.raises(ConfigError, match="names container 'other', which declares no request"):
        settings({**portions, "VRAM_ENFORCER_GPUS": '{"other": 2}'})


def test_dry_run_from_the_environment_as_the_webhook_writes_it() -> None:
    """The webhook's action `dry-run` is `VRAM_ENFORCER_DRY_RUN=true` beside the would-be
    action; the node agent's backstop reads the same variables with the same parsers."""
    from tests.unit.test_backstop import policy_of

    written = {"VRAM_ENFORCER_ACTION": "terminate", "VRAM_ENFORCER_DRY_RUN": "true"}
    assert settings(written).policy.dry_run is True
    assert policy_of({**ENV, **written}).dry_run is True
    assert settings({"VRAM_ENFORCER_DRY_RUN": "False"}).policy.dry_run is False
    assert settings().policy.dry_run is False
    with pytest.raises(ConfigError, match="VRAM_ENFORCER_DRY_RUN: 'yes' is not a switch; use"):
        settings({"VRAM_ENFORCER_DRY_RUN": "yes"})
