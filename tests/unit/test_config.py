"""Quantities, durations and percentages: exact values, and errors that name the fix."""

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils import parse_quantity as k8s_parse_quantity

from enforcer.core.model import Action
from enforcer.core.parsing import (
    ConfigError,
    format_duration,
    parse_bytes,
    parse_duration,
    parse_percent,
    parse_port,
    parse_quantity,
)
from tests.helpers import configured


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4Gi", 4 * 1024**3),
        ("512Mi", 512 * 1024**2),
        ("8G", 8 * 10**9),
        ("1.5Gi", 1536 * 1024**2),
        ("12884901888", 12884901888),
        ("1e3", 1000),
        ("1E9", 10**9),
        ("0", 0),
        ("+2Ki", 2048),
        ("1000m", 1),
        ("2k", 2000),
    ],
)
def test_parse_bytes_accepts_kubernetes_quantities(text: str, expected: int) -> None:
    assert parse_bytes(text, field="--limit") == expected


def test_resource_unit_scales_a_bare_count() -> None:
    assert parse_bytes("3", field="limits", unit=1024**3) == 3 * 1024**3


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("4GB!", "did you mean 4Gi, or 4G for powers of 1000?"),
        ("4gb", "did you mean 4Gi"),
        ("4GiB", "did you mean 4Gi"),
        ("4 Gi", "is not a quantity"),
        ("", "is not a quantity"),
        ("-1Gi", "is negative"),
        ("4m", "'m' means milli"),
        ("0.5", "is not a whole number of bytes"),
        ("Infinity", "is not a quantity"),
        ("NaN", "is not a quantity"),
        ("1_000", "is not a quantity"),
        (" 4Gi", "is not a quantity"),
    ],
)
def test_bad_quantities_name_field_value_and_form(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes(text, field="--limit")
    message = str(info.value)
    assert message.startswith(f"--limit: {text!r} ")
    assert fragment in message


def test_not_a_whole_number_of_resource_units() -> None:
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_bytes("0.35", field="limits", unit=10)


# The grammar of apimachinery's resource.Quantity, as strings.
_number = st.from_regex(r"[+-]?(?:[0-9]{1,6}(?:\.[0-9]{0,3})?|\.[0-9]{1,3})", fullmatch=True)
_suffix = st.sampled_from(
    [
        "",
        "Ki",
        "Mi",
        "Gi",
        "Ti",
        "Pi",
        "Ei",
        "n",
        "u",
        "m",
        "k",
        "M",
        "G",
        "T",
        "P",
        "E",
        "e3",
        "E-2",
    ]
)


@given(_number, _suffix)
def test_parse_quantity_agrees_with_the_kubernetes_client(number: str, suffix: str) -> None:
    """Up to 2^63-1, the largest quantity the API server stores (it caps larger ones); the
    client parses past it, we refuse."""
    theirs = k8s_parse_quantity(number + suffix)
    if abs(theirs) > 2**63 - 1:
        with pytest.raises(ConfigError, match="is too large"):
            parse_quantity(number + suffix, field="q")
        return
    assert parse_quantity(number + suffix, field="q") == theirs


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("1e1000000", "is too large"),
        ("9" * 5000, "is too large"),
        ("9223372036854775808", "is too large"),
        ("1e" + "9" * 5000, "is too large"),
    ],
)
def test_quantities_past_what_kubernetes_holds_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_quantity(text, field="q")
    assert len(str(info.value)) < 200
    assert parse_quantity("9223372036854775807", field="q") == 2**63 - 1
    assert parse_quantity("0e99999", field="q") == 0


def test_durations_past_gos_are_refused_and_ports_are_ascii() -> None:
    with pytest.raises(ConfigError, match="is too long"):
        parse_duration("9" * 400 + "s", field="d")
    with pytest.raises(ConfigError, match="is too long"):
        parse_duration("2562048h", field="d")
    assert parse_duration("2562047h", field="d") == 2562047 * 3600
    for text in ("\u00b2", "\u0661", "9" * 5000, "65536", "-1"):
        with pytest.raises(ConfigError, match="is not a TCP port"):
            parse_port(text, field="p")


@given(st.text(max_size=12))
def test_parse_quantity_never_raises_anything_but_config_error(text: str) -> None:
    try:
        value = parse_quantity(text, field="q")
    except ConfigError as exc:
        assert exc.field == "q"
    else:
        assert isinstance(value, Decimal)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("100ms", 0.1),
        ("5s", 5.0),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("1.5s", 1.5),
        ("0", 0.0),
        ("250us", 0.00025),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text, field="--grace-period") == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("5", "did you mean 5s?"),
        ("abc", "is not a duration"),
        ("5s5", "is not a duration"),
        ("", "is not a duration"),
        ("-1s", "is negative"),
    ],
)
def test_bad_durations(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("?", r"\?")) as info:
        parse_duration(text, field="--grace-period")
    assert str(info.value).startswith("--grace-period: ")


def test_format_duration_round_trips() -> None:
    for seconds in (0.02, 0.1, 1.0, 5.0, 90.0, 2.5):
        assert parse_duration(format_duration(seconds), field="x") == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "fraction"), [("90%", 0.9), ("100%", 1.0), ("0.5%", 0.005)])
def test_parse_percent(text: str, fraction: float) -> None:
    assert parse_percent(text, field="--warn-at") == pytest.approx(fraction)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("150%", "out of range"),
        ("0%", "out of range"),
        ("0.9", "not a percentage"),
        ("ninety", "not a percentage"),
    ],
)
def test_bad_percentages(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_percent(text, field="--warn-at")
    assert f"--warn-at: {text!r}" in str(info.value)


def exec_argv(*flags: str) -> list[str]:
    return ["exec", "--limit", "4Gi", *flags, "--", "python", "train.py"]


def test_exec_settings_defaults() -> None:
    s = configured(exec_argv())
    assert s.command == ("python", "train.py")
    assert s.limit_bytes == 4 * 1024**3
    assert s.policy.action is Action.TERMINATE
    assert s.policy.grace_period == 5.0
    assert s.interval == pytest.approx(0.1)
    assert s.name == "python"
    assert s.allocation_gate == "off"  # experimental: asked for only


def test_the_allocation_gate_is_asked_for_and_goes_with_hard_limits_required() -> None:
    assert configured(exec_argv("--allocation-gate", "on")).allocation_gate == "on"
    s = configured(exec_argv("--allocation-gate", "on", "--hard-limits", "required"))
    assert (s.allocation_gate, s.hard_limits) == ("on", "required")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["exec", "--limit", "4Gi"], "CMD is missing; put the command after --"),
        (["exec", "--", "python"], "--limit is missing; give the GPU memory limit"),
        (
            exec_argv("--action", "restart"),
            "--action: 'restart' is not available here; use one of: terminate, kill, warn",
        ),
        (exec_argv("--action", "nuke"), "--action: 'nuke' is not an action"),
        (exec_argv("--interval", "1ms"), "--interval: '1ms' is too short; use at least 10ms"),
        (exec_argv("--metrics-port", "70000"), "--metrics-port: '70000' is not a TCP port"),
        (["exec", "--limit", "4GB!", "--", "true"], "--limit: '4GB!' is not a quantity"),
        (
            exec_argv("--allocation-gate", "auto"),
            "--allocation-gate: 'auto' is not a choice; use one of: off, on",
        ),
        (
            exec_argv("--allocation-gate", "on", "--hard-limits", "off"),
            "--allocation-gate: 'on' cannot go with --hard-limits off: the gate refuses",
        ),
        (
            exec_argv("--allocation-gate", "on", "--dry-run"),
            "--allocation-gate: 'on' cannot go with --dry-run: the gate refuses",
        ),
        (
            exec_argv("--allocation-gate", "on", "--action", "warn"),
            "--allocation-gate: 'on' cannot go with --action warn: the gate refuses",
        ),
    ],
)
def test_exec_settings_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        configured(argv)
    assert message in str(info.value)
