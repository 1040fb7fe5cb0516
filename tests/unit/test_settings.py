"""The declarations themselves: each mode's are consistent, and each builds its settings."""

from __future__ import annotations

import pytest

from enforcer.cli import MODES, build_parser, main
from enforcer.core.parsing import ConfigError
from enforcer.core.settings import switched_off
from tests.helpers import configured

# A command line for each mode with only what it requires, and the environment it needs.
MINIMAL = {
    "exec": (["exec", "--limit", "1Gi", "--", "true"], {}),
    "demo": (["demo"], {}),
    "agent": (
        ["agent", "--no-advertise", "--no-labels", "--no-serve-pods", "--hard-limits", "off"],
        {},
    ),
    "sidecar": (
        ["sidecar"],
        {"POD_NAME": "p", "POD_NAMESPACE": "n", "POD_UID": "u", "VRAM_ENFORCER_LIMITS": "{}"},
    ),
    "webhook": (
        ["webhook", "--tls-cert-file", "c", "--tls-key-file", "k", "--sidecar-image", "i"],
        {},
    ),
    "doctor": (["doctor"], {}),
    "recommend": (["recommend", "--prometheus", "http://localhost:9090"], {}),
    "interference": (["interference", "--workload", "a:1Gi:true", "--builtin", "matmul"], {}),
}


@pytest.mark.parametrize("name", sorted(MODES))
def test_keys_flags_and_variables_are_unique_and_every_value_has_a_parser(name: str) -> None:
    declared = MODES[name].declared
    for attribute in ("key", "flag", "env"):
        found = [getattr(s, attribute) for s in declared if getattr(s, attribute)]
        assert len(found) == len(set(found)), (name, attribute)
    assert all(s.parse is not None for s in declared if s.kind == "value")
    assert all(s.flag for s in declared if s.kind != "value")
    assert all(s.flag.startswith("--no-") for s in declared if switched_off(s))


@pytest.mark.parametrize("name", sorted(MODES))
def test_each_mode_builds_its_settings_from_the_defaults(name: str) -> None:
    argv, environ = MINIMAL[name]
    assert configured(argv, environ) is not None


@pytest.mark.parametrize("name", sorted(MODES))
def test_help_lists_every_flag_and_variable(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([name, "--help"])
    shown = capsys.readouterr().out
    for s in MODES[name].declared:
        assert not s.flag or s.flag in shown
        assert not s.env or s.env in shown


def _with(name: str, *words: str) -> list[str]:
    """MINIMAL's command line for `name`, with `words` among its flags (before exec's --)."""
    argv = MINIMAL[name][0]
    at = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:at], *words, *argv[at:]]


def _negative(metavar: str | None) -> str | None:
    """A negative value of the form a flag takes, for the flags that take a quantity or a
    duration."""
    if metavar and "QUANTITY" in metavar:
        return "-4Gi"
    return "-5s" if metavar == "DURATION" else None


NEGATIVE = [
    (name, s.flag, s.key, text)
    for name in sorted(MODES)
    for s in MODES[name].declared
    if s.flag and s.kind == "value" and (text := _negative(s.metavar))
]


@pytest.mark.parametrize(("name", "flag", "key", "text"), NEGATIVE)
def test_a_negative_quantity_or_duration_reaches_its_flags_check(
    name: str, flag: str, key: str, text: str
) -> None:
    """`--limit -4Gi` is the flag's value (argparse would take it for an option and say
    only "expected one argument"), and its check names the flag and the value."""
    argv = _with(name, flag, text)
    assert getattr(build_parser().parse_args(argv), key) == text
    with pytest.raises(ConfigError) as info:
        configured(argv, MINIMAL[name][1])
    message = str(info.value)
    assert message.startswith(f"{flag}: {text!r} "), message
    assert "is negative" in message


@pytest.mark.parametrize("words", [["--limit", "-4Gi"], ["--limit=-4Gi"]])
def test_a_negative_limit_exits_2_and_says_why(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["exec", *words, "--", "true"]) == 2
    assert capsys.readouterr().err == (
        "vram-enforcer exec: error: --limit: '-4Gi' is negative; a memory size must be 0 or more\n"
    )


ENVIRONMENT = "environment (a flag, where there is one, wins):\n"
WITH_ENVIRONMENT = [name for name in sorted(MODES) if any(s.env for s in MODES[name].declared)]


@pytest.mark.parametrize("name", WITH_ENVIRONMENT)
def test_the_environment_in_help_is_laid_out_as_argparse_lays_out_options(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long variable's name on a line of its own, never run into its description, and
    every description wrapped to the terminal, as argparse does with the flags above."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        build_parser().parse_args([name, "--help"])
    section = capsys.readouterr().out.split(ENVIRONMENT)[1].split("\n\n")[0].splitlines()
    assert all(len(line) <= 78 for line in section), section  # argparse: COLUMNS - 2
    heads = [line.strip() for line in section if not line.startswith("   ")]
    names = [s.env for s in MODES[name].declared if s.env]
    assert [head.split()[0] for head in heads] == names
    assert all(h == n or h.startswith(f"{n}  ") for h, n in zip(heads, names, strict=True))


def test_the_agent_and_the_webhook_take_the_same_gpu_resources_by_default() -> None:
    """What the webhook counts as a GPU (time-slicing's renamed `nvidia.com/gpu.shared`
    among them) the agent maps through the kubelet's pod-resources too (found by review of
    issue 43): a renamed replica's request is owed on its GPU before it starts."""
    agent = configured(*MINIMAL["agent"])
    webhook = configured(*MINIMAL["webhook"])
    assert agent.gpu_resources == webhook.admission.gpu_resources
    assert "nvidia.com/gpu.shared" in agent.gpu_resources


def test_the_agents_allocation_gate_is_off_by_default_and_needs_the_pods_served() -> None:
    """Each gated container's ceiling comes from the pods the agent serves (issue 45,
    step 2): without them, `on` is refused by name, not run unbounded."""
    agent = configured(*MINIMAL["agent"])
    assert (agent.allocation_gate, agent.kubelet_root) == ("off", "/var/lib/kubelet")
    argv, env = MINIMAL["agent"]
    with pytest.raises(ConfigError) as info:
        configured([*argv, "--allocation-gate", "on"], env)
    assert "--allocation-gate" in str(info.value) and "--no-serve-pods" in str(info.value)
    on = configured(
        ["agent", "--node-name", "n", "--allocation-gate", "on", "--kubelet-root", "/k"]
    )
    assert (on.allocation_gate, on.kubelet_root) == ("on", "/k")
