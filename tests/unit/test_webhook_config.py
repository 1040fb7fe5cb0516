"""The webhook's flags: defaults from the CLI, errors that name the flag, the value and the fix."""

from typing import Any

import pytest

from enforcer.core.parsing import ConfigError
from tests.helpers import configured

REQUIRED = [
    "webhook",
    "--tls-cert-file",
    "tls.crt",
    "--tls-key-file",
    "tls.key",
    "--sidecar-image",
    "img:1",
]


def settings(*extra: str) -> Any:
    return configured([*REQUIRED, *extra])


def test_defaults() -> None:
    s = settings()
    assert (
        s.port,
        s.admission.sidecar_mode,
        s.admission.resource_name,
        s.admission.resource_unit,
    ) == (
        8443,
        "auto",
        "vram-enforcer.io/vram",
        1,
    )
    assert (
        s.admission.framework_env,
        s.admission.shm_default,
        s.admission.gpu_exposure,
        s.admission.runtime_class,
    ) == (
        True,
        "auto",
        "none",
        None,
    )
    assert (s.admission.sidecar_cpu, s.admission.sidecar_memory, s.metrics_port) == (
        "10m",
        "48Mi",
        None,
    )


def test_flags() -> None:
    s = settings(
        "--port",
        "0",
        "--sidecar-mode",
        "container",
        "--resource-unit",
        "1Gi",
        "--no-framework-env",
        "--shm-default",
        "8Gi",
        "--gpu-exposure",
        "env",
        "--runtime-class",
        "nvidia",
    )
    assert (
        s.port,
        s.admission.sidecar_mode,
        s.admission.resource_unit,
        s.admission.framework_env,
    ) == (
        0,
        "container",
        1024**3,
        False,
    )
    assert (s.admission.shm_default, s.admission.gpu_exposure, s.admission.runtime_class) == (
        "8Gi",
        "env",
        "nvidia",
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--sidecar-mode", "sidecar"],
            "--sidecar-mode: 'sidecar' is not a choice; use one of: native, container, auto",
        ),
        (["--gpu-exposure", "all"], "--gpu-exposure: 'all' is not a choice; use one of: none, env"),
        (["--runtime-class", "nvidia"], "--runtime-class: 'nvidia' needs --gpu-exposure env"),
        (["--shm-default", "big"], "--shm-default: 'big' is not a quantity"),
        (["--resource-unit", "0"], "--resource-unit: '0' must be at least 1 byte"),
        (
            ["--resource-name", "nvidia.com gpu"],
            "--resource-name: 'nvidia.com gpu' is not an extended resource name",
        ),
        (["--sidecar-memory", "128MB"], "--sidecar-memory: '128MB' is not a quantity"),
        (["--port", "70000"], "--port: '70000' is not a TCP port"),
        (
            ["--kai-annotations", "--dra-device-class", "gpu.nvidia.com"],
            "--kai-annotations cannot be combined with --dra-device-class",
        ),
    ],
)
def test_bad_flags(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings(*flags)
    assert message in str(caught.value)


def test_tenant_bounds_default_to_no_warn_30s_and_no_opting_out() -> None:
    from enforcer.core.model import Action
    from enforcer.core.tenancy import Bounds

    tenancy = settings().admission.tenancy
    assert tenancy.bounds("any") == Bounds(
        (Action.TERMINATE, Action.KILL, Action.RESTART), 30.0, False
    )
    loose = settings(
        "--tenant-actions",
        "warn,terminate",
        "--max-grace-period",
        "2m",
        "--allow-opt-out",
        "--namespace-bounds",
        '{"research": {"maxGracePeriod": "5m"}}',
    ).admission.tenancy
    assert loose.default == Bounds((Action.WARN, Action.TERMINATE), 120.0, True)
    # a namespace's bounds start from the cluster-wide ones: what it leaves out stays
    assert loose.bounds("research") == Bounds((Action.WARN, Action.TERMINATE), 300.0, True)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tenant-actions", "explode"], "--tenant-actions: 'explode' is not an action"),
        (["--tenant-actions", ","], "--tenant-actions: ',' is empty"),
        (["--max-grace-period", "5"], "--max-grace-period: '5' is not a duration"),
        (["--namespace-bounds", "[1]"], "--namespace-bounds: '[1]' is not a JSON object"),
        (
            ["--namespace-bounds", '{"ml": {"actions": "warn"}}'],
            "--namespace-bounds 'ml'.actions: 'warn' must be a list",
        ),
        (
            ["--namespace-bounds", '{"ml": {"maxGracePeriod": "soon"}}'],
            "--namespace-bounds 'ml'.maxGracePeriod: 'soon' is not a duration",
        ),
        (
            ["--namespace-bounds", '{"ml": {"allowOptout": true}}'],
            "must be an object of actions, maxGracePeriod, allowOptOut",
        ),
        (
            ["--undeclared-gpu", "default"],
            "--undeclared-gpu: 'default' declares a default VRAM for each container that asks "
            "for a GPU and declares none, and no default is set; set the webhook's "
            "--default-vram (or the namespace's defaultVram), e.g. 8Gi",
        ),
        (
            ["--namespace-bounds", '{"ml": {"undeclaredGpu": "default"}}'],
            "--namespace-bounds 'ml'.undeclaredGpu: 'default' declares a default VRAM",
        ),
        (
            ["--undeclared-gpu", "allow"],
            "--undeclared-gpu: 'allow' is not a choice; use one of: deny, observe, default",
        ),
        (
            ["--namespace-bounds", '{"ml": {"undeclaredGpu": "allow"}}'],
            "--namespace-bounds 'ml'.undeclaredGpu: 'allow' must be one of: deny, observe, default",
        ),
        (
            ["--undeclared-gpu", "default", "--default-vram", "0"],
            "--undeclared-gpu: 'default' declares a default VRAM",
        ),
        (
            ["--default-vram", "1500Mi", "--resource-unit", "1Gi"],
            "--default-vram: 1572864000 (bytes) is not a whole number of 1073741824-byte units",
        ),
        (["--default-action", "off"], "--default-action: 'off' is not an action; use one of: "),
        (
            ["--namespace-bounds", '{"ml": {"defaultAction": "observe"}}'],
            "--namespace-bounds 'ml'.defaultAction: 'observe' is not an action",
        ),
        (["--gpu-resources", ","], "--gpu-resources: ',' is empty; list the GPU resources"),
        (["--gpu-resources", "gpu"], "--gpu-resources: 'gpu' is not an extended resource name"),
    ],
)
def test_bad_tenant_bounds_name_the_flag_and_the_fix(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings(*flags)
    assert message in str(info.value)


def test_undeclared_gpus_are_denied_and_pods_terminated_unless_the_operator_says_otherwise() -> (
    None
):
    from enforcer.core.tenancy import Bounds

    admission = settings().admission
    assert admission.gpu_resources == ("nvidia.com/gpu", "nvidia.com/gpu.shared")
    default = admission.tenancy.default
    assert (default.undeclared_gpu, default.default_vram, default.default_action) == (
        "deny",
        0,
        "terminate",
    )
    tenancy = settings(
        "--gpu-resources",
        "nvidia.com/gpu, nvidia.com/mig-1g.10gb.shared",
        "--undeclared-gpu",
        "default",
        "--default-vram",
        "8Gi",
        "--default-action",
        "dry-run",
        "--namespace-bounds",
        '{"prod": {"defaultAction": "terminate", "undeclaredGpu": "deny"},'
        ' "lab": {"undeclaredGpu": "observe"}, "ml": {"defaultVram": "16Gi"}}',
    ).admission.tenancy
    on = Bounds(default_action="dry-run", undeclared_gpu="default", default_vram=8 * 1024**3)
    assert tenancy.default == on
    assert tenancy.bounds("prod") == Bounds(default_vram=8 * 1024**3)
    assert tenancy.bounds("lab").undeclared_gpu == "observe"
    assert tenancy.bounds("ml").default_vram == 16 * 1024**3
    # a namespace may give the default where the cluster denies
    ml = settings(
        "--namespace-bounds", '{"ml": {"undeclaredGpu": "default", "defaultVram": "4Gi"}}'
    )
    assert ml.admission.tenancy.bounds("ml").undeclared_gpu == "default"
