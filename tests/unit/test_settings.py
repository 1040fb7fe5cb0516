"""The declarations themselves: each mode's are consistent, and each builds its settings."""

from __future__ import annotations

import pytest

from enforcer.cli import MODES, build_parser
from enforcer.core.settings import switched_off
from tests.helpers import configured

# A command line for each mode with only what it requires, and the environment it needs.
MINIMAL = {
    "exec": (["exec", "--limit", "1Gi", "--", "true"], {}),
    "agent": (["agent", "--no-advertise", "--no-labels", "--no-serve-pods", "--hard-limits", "off"], {}),
    "sidecar": (["sidecar"], {"POD_NAME": "p", "POD_NAMESPACE": "n", "POD_UID": "u",
                              "VRAM_ENFORCER_LIMITS": "{}"}),
    "webhook": (["webhook", "--tls-cert-file", "c", "--tls-key-file", "k", "--sidecar-image", "i"], {}),
    "doctor": (["doctor"], {}),
    "interference": (["interference", "--workload", "a:1Gi:true", "--builtin", "matmul"], {}),
}  # fmt: skip


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
