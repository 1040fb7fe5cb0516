"""values.schema.json against the programs' own settings: a chart value that becomes a flag
takes what the flag's parser takes (enforcer/core/settings/), and nothing it refuses.

A value the chart takes and its program refuses installs fine and crash-loops; the
webhook's, with failurePolicy Fail, then blocks every pod of the opted-in namespaces. The
forms are made by tests/chart/values_schema.py; here, every flag the templates write is
held to its setting on the same samples, and the made forms to their parsers on generated
values too. Helm itself rendering the chart: tests/chart/test_chart_render.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from fractions import Fraction
from functools import cache
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft7Validator, ValidationError, validators

from enforcer.core.parsing import MAX_QUANTITY, ConfigError
from enforcer.core.settings import Setting
from enforcer.core.settings import agent as agent_settings
from enforcer.core.settings import webhook as webhook_settings
from tests.chart.values_schema import (
    BINARY_SUFFIXES,
    CHART_FLAGS,
    DECIMAL_SUFFIXES,
    DURATION_UNITS,
    FORMS_FILE,
    MAX_DURATION,
    NAMESPACE_BOUNDS,
    SCHEMA,
    ChartFlag,
    Duration,
    Form,
    duration_part_digits,
    forms,
    generate,
    whole_digits,
)

CHART = SCHEMA.parent
DECLARED = {"agent": agent_settings.DECLARED, "webhook": webhook_settings.DECLARED}
# The flags whose value is no chart value's as it is: fixed, or made of several values
# that each have their schema.
NOT_A_VALUE = {
    ("webhook", "--sidecar-image"): "image.repository (not empty), image.tag, image.digest",
}

DURATIONS = [
    "0",
    "0s",
    "00",
    "0.0s",
    "0h0m",
    "1ns",
    "1us",
    "1µs",
    "1ms",
    "5ms",
    "9ms",
    "9.999ms",
    "10ms",
    "10.00ms",
    "0.01s",
    ".01s",
    "10000us",
    "10000µs",
    "10000000ns",
    "10.5ms",
    "11ms",
    "20ms",
    "50ms",
    "99ms",
    "99.9ms",
    "100ms",
    "0.1s",
    "100000us",
    "100000000ns",
    "101ms",
    "200ms",
    "500ms",
    "999ms",
    "1s",
    "1000ms",
    "1.5s",
    "2s",
    "5s",
    "30s",
    "31s",
    "60s",
    "1m",
    "2m",
    "1m30s",
    "1h",
    "1h30m",
    "2h45m30s",
    "1s500ms",
    "0.5h",
    "1.h",
    "0.0001h",
    "0.0002m",
    "99999h",
    "100000h",
    "2562047h",
    "2562048h",
    "5",
    "0.5",
    "5 s",
    " 5s",
    "5s ",
    "5s\n",
    "-1s",
    "+1s",
    "1d",
    "1S",
    "1.5.5s",
    "ms",
    "s",
    "",
    "1e3s",
    "5ms5ms",
    "50ms50ms",
    "30s1m",
    "1m1m",
]
QUANTITIES = [
    "0",
    "00",
    "0.0",
    "1",
    "+1",
    "-1",
    "-0",
    "512",
    "1.5",
    "1.0",
    "1.",
    ".5",
    "500m",
    "1000m",
    "0m",
    "100u",
    "1n",
    "1000000000n",
    "1k",
    "1.5k",
    "1.0005k",
    "1.234k",
    "512Mi",
    "1Gi",
    "1.5Gi",
    "1.25Gi",
    "1.125Gi",
    "1.0625Gi",
    "1.3Gi",
    "0.1Ki",
    ".5Ki",
    "1.Gi",
    ".Gi",
    "2Gi",
    "80Gi",
    "8191Pi",
    "1Ei",
    "7Ei",
    "8Ei",
    "0.5Ei",
    "9E",
    "10E",
    "9e18",
    "1e9",
    "1E3",
    "1e19",
    "1e-3",
    "1e+3",
    "0e5",
    "4GB",
    "4gb",
    "4G",
    "4 Gi",
    " 4Gi",
    "4Gi ",
    "4Gi\n",
    "NaN",
    "inf",
    "1e",
    "Gi",
    "",
    "9223372036854775807",
    "9223372036854775808",
    "999999999999999999",
    "1000000000000000000",
    "10m",
    "0.5",
    "2",
    "250m",
    "0.001",
]
WORDS = [
    "auto",
    "off",
    "Auto",
    "none",
    "env",
    "native",
    "container",
    "json",
    "text",
    "JSON",
    "required",
    "gpu.nvidia.com",
    "vram-enforcer.io/vram",
    "kubernetes.io/vram",
    "x.kubernetes.io/vram",
    "example.com/VRAM_1",
    "example.com/vram\n",
    "-bad/x",
    "a/b",
    "a/b/c",
    f"{'a' * 250}.io/vram",
    "nvidia",
    "a,b",
    "",
    " ",
    "a\nb",
    "é",
    "uuid",
    "memory",
]
PORTS = [-1, 0, 1, 80, 8443, 9477, 65535, 65536]
# A form's value as a number (`--set agent.reserve=0`; a values file's 1073741824, which
# reaches the templates as a float).
AS_NUMBERS: list[object] = [0, 1, 60, -1, 1073741824, 1073741824.0, 2**63, 0.5, 1e-05, 2.5e9]
LISTS: list[list[str]] = [
    [],
    [""],
    ["gpu.nvidia.com"],
    ["nvidia.com/gpu", "amd.com/gpu"],
    ["a,b"],
    ["terminate"],
    ["terminate", "kill", "restart", "warn"],
    ["Warn"],
    [" kill"],
    ["kill", "kill"],
    ["explode"],
    ["warn", ""],
]
BOUNDS: list[dict[str, Any]] = [
    {},
    {"research": {}},
    {"research": {"actions": ["warn", "terminate"]}},
    {"research": {"actions": []}},
    {"research": {"actions": ["explode"]}},
    {"research": {"maxGracePeriod": "2m"}},
    {"research": {"maxGracePeriod": "2"}},
    {"research": {"maxGracePeriod": 120}},
    {"research": {"allowOptOut": True}},
    {"research": {"allowOptOut": "yes"}},
    {"research": {"maxCeiling": "40Gi"}},
    {"research": {"maxCeiling": "500m"}},
    {"research": {"maxCeiling": 40}},
    {"research": {"maxCeiling": 0, "maxGracePeriod": 0}},
    {"research": {"maxCeiling": 42949672960.0}},
    {"research": {"burst": True}},
    {"research": []},
]

# Where the chart refuses, on purpose, what the program takes: why -> samples (a list as
# its JSON). Each is one for some flag (test_each_stricter_sample_is_one).
STRICTER: dict[str, set[object]] = {
    "no spaces around a duration": {" 5s", "5s ", "5s\n"},
    "a duration's parts in the order h, m, s, ms, us, ns, each unit once": {"30s1m", "1m1m"},
    "a minimum reached by one part alone": {"5ms5ms", "50ms50ms"},
    "durations under 100000h (11 years)": {"100000h", "2562047h"},
    "no sign on 0": {"-0"},
    "no milli or nano of a byte, even where whole": {"0m", "1000m", "1000000000n"},
    "at most three decimals before a binary suffix": {"1.0625Gi"},
    "no more digits than keep any number of that suffix under 2^63-1": {
        "1000000000000000000",
        "9223372036854775807",
        "8191Pi",
        "1Ei",
        "7Ei",
        "9E",
    },
    "an exponent of 0 to 18": {"1e-3", 1e-05},
    "port 0 (a free one) is no port a Service or a probe can name": {0},
    "names are not empty": {"", '[""]', '["warn", ""]', "[]"},
    "actions as the programs print them, once each": {'[" kill"]', '["Warn"]', '["kill", "kill"]'},
}


def _re2(pattern: str) -> str:
    """`pattern` as Go's RE2, Helm's engine, reads it: `$` is the end of the text, not
    also the place before a final newline as in Python."""
    return re.sub(r"(?<!\\)\$", r"\\Z", pattern)


def _pattern(
    validator: Any, pattern: str, instance: object, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if isinstance(instance, str) and not re.search(_re2(pattern), instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


Validator = validators.extend(Draft7Validator, {"pattern": _pattern})


@cache
def _schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(SCHEMA.read_text())
    return doc


@cache
def _defaults() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return doc


def _with(path: str, value: object) -> dict[str, Any]:
    """The chart's defaults, with `value` at `path`."""
    values: dict[str, Any] = json.loads(json.dumps(_defaults()))
    *parents, last = path.split(".")
    node = values
    for key in parents:
        node = node[key]
    node[last] = value
    return values


@cache
def _forms() -> dict[str, dict[str, Any]]:
    doc: dict[str, dict[str, Any]] = json.loads(FORMS_FILE.read_text())
    return doc


def _text(value: object) -> str:
    """`value` as the templates write it (_helpers.tpl, "vram-enforcer.text"): a whole
    float (a values file's number) as its digits."""
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:g}"  # as Go's %v: 0.5, 1e-05
    return str(value)


def _in_form(name: str, text: str, words: tuple[str, ...] = ()) -> bool:
    """Whether the templates take `text` in the form `name` ("vram-enforcer.inForm")."""
    return text in words or all(re.search(_re2(p), text) for p in _forms()[name]["patterns"])


def _bounds_in_form(bounds: object) -> bool:
    if not isinstance(bounds, dict):
        return True  # the schema's to refuse
    return all(
        _in_form(form.name, _text(given[key]))
        for given in bounds.values()
        if isinstance(given, dict)
        for key, form in NAMESPACE_BOUNDS.items()
        if key in given
    )


def _chart_takes(path: str, value: object) -> bool:
    """The schema's verdict, then the templates' on the value's form."""
    if not Validator(_schema()).is_valid(_with(path, value)):
        return False
    for flag in CHART_FLAGS:
        if flag.path == path and flag.form is not None:
            return _in_form(flag.form.name, _text(value), flag.words)
    return path != "webhook.tenants.namespaces" or _bounds_in_form(value)


def _setting(flag: ChartFlag) -> Setting[Any]:
    (setting,) = [s for s in DECLARED[flag.mode] if s.flag == flag.flag]
    return setting


def _as_flag(flag: ChartFlag, value: object) -> str:
    """The text the templates write after `flag=` for `value`."""
    if flag.how == "join":
        assert isinstance(value, list)
        return ",".join(str(v) for v in value)
    if flag.how == "json":
        if isinstance(value, dict):  # the templates write each bound as text
            value = {
                namespace: {
                    key: _text(v) if key in NAMESPACE_BOUNDS else v for key, v in given.items()
                }
                if isinstance(given, dict)
                else given
                for namespace, given in value.items()
            }
        return json.dumps(value)
    if flag.how == "sidecar-mode" and value == "auto":
        return "native"  # the chart resolves it (helpers.tpl)
    return _text(value)


def _program_takes(setting: Setting[Any], text: str) -> bool:
    assert setting.parse is not None
    try:
        setting.parse(text, setting.flag or setting.key)
    except ConfigError:
        return False
    return True


def _samples(flag: ChartFlag) -> list[Any]:
    """What to try for `flag`: samples of the kind of its default value."""
    default = _defaults()
    for key in flag.path.split("."):
        default = default[key]
    if flag.how == "join":
        return LISTS
    if flag.how == "json":
        return BOUNDS
    if isinstance(default, int):
        return PORTS
    return DURATIONS + QUANTITIES + WORDS + (AS_NUMBERS if flag.form else [])


def _key(sample: object) -> object:
    return json.dumps(sample) if isinstance(sample, list | dict) else sample


def _stricter(sample: object) -> bool:
    return any(_key(sample) in samples for samples in STRICTER.values())


# The templates' flags.


def _flags_in_templates() -> set[tuple[str, str, str]]:
    """(mode, flag, chart value) for each flag the agent's and the webhook's arguments
    take from a chart value: in the flag's own line, or through the `with` or `if` around
    it, or the helper it includes."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    found = set()
    for mode, name in (("agent", "agent.yaml"), ("webhook", "webhook-deployment.yaml")):
        text = (CHART / "templates" / name).read_text()
        args = text.split("args:", 1)[1].split("env:" if mode == "agent" else "ports:", 1)[0]
        around: list[list[str]] = []
        for raw in args.splitlines():
            line = raw.strip()
            block = re.match(r"\{\{-? (if|with|else|end)\b(.*?)-?\}\}", line)
            if block and block[1] in ("if", "with"):
                around.append(re.findall(r"\.Values\.([\w.]+)", block[2]))
            elif block and block[1] == "end":
                around.pop()
            match = re.match(r"- (--[\w-]+)(=?)(.*)", line)
            if not match:
                continue
            paths = re.findall(r"\.Values\.([\w.]+)", match[3])
            paths += re.findall(r'"path" "([\w.]+)"', match[3])
            for helper in re.findall(r'include "([\w.-]+)"', match[3]):
                body = helpers.split(f'define "{helper}"', 1)[1].split("{{- end -}}\n\n", 1)[0]
                paths += re.findall(r"\.Values\.([\w.]+)", body)
            if not paths and ("{{ . }}" in match[3] or "toJson ." in match[3] or not match[2]):
                paths = around[-1]  # the value the `with` or `if` around the flag names
            found |= {(mode, match[1], path) for path in paths}
    return found


def test_every_flag_the_templates_take_from_a_value_is_checked() -> None:
    listed = {(f.mode, f.flag, f.path) for f in CHART_FLAGS}
    in_templates = {f for f in _flags_in_templates() if (f[0], f[1]) not in NOT_A_VALUE}
    assert in_templates == listed, (
        f"in the templates, not in CHART_FLAGS (tests/chart/values_schema.py): "
        f"{sorted(in_templates - listed)}; listed, not in the templates: "
        f"{sorted(listed - in_templates)}"
    )


@pytest.mark.parametrize("flag", CHART_FLAGS, ids=lambda f: f"{f.mode}:{f.flag}")
def test_each_flag_is_a_setting_of_its_program(flag: ChartFlag) -> None:
    setting = _setting(flag)
    assert (setting.kind == "switch") == (flag.how == "switch")


def test_the_schema_is_made_from_the_forms() -> None:
    assert generate(_schema()) == _schema() and forms() == _forms(), (
        "values.schema.json or forms.json differs from its forms: "
        ".venv/bin/python -m tests.chart.values_schema"
    )


def _patterns(schema: object) -> Iterator[str]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _patterns(item)


def test_a_schema_error_is_short_enough_to_read() -> None:
    """Helm prints the whole pattern a value failed and nothing else of the schema (issue
    43, item 12: errors of 1-2 kB): the schema keeps short ones, the forms' are the
    templates'."""
    assert max(len(p) for p in _patterns(_schema())) <= 80


def test_the_templates_check_each_value_in_its_form() -> None:
    """Each flag of a form is written through "vram-enforcer.formed" with that form (and
    words): the schema holds its type alone."""
    written = {}
    for name in ("agent.yaml", "webhook-deployment.yaml"):
        for line in (CHART / "templates" / name).read_text().splitlines():
            found = re.search(r'- (--[\w-]+)=.*"path" "([\w.]+)" "form" "(\w+)"', line)
            if found:
                listed = line.split("(list", 1)[1] if "(list" in line else ""
                written[found[1], found[2]] = (found[3], tuple(re.findall(r'"(\w+)"', listed)))
    assert written == {
        (f.flag, f.path): (f.form.name, f.words) for f in CHART_FLAGS if f.form is not None
    }
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    bounds = helpers.split('define "vram-enforcer.namespaceBounds"', 1)[1]
    (listed,) = re.findall(r"range \$key, \$form := dict ((?:\"\w+\" ?)+)", bounds)
    pairs = re.findall(r'"(\w+)" "(\w+)"', listed)
    assert dict(pairs) == {key: form.name for key, form in NAMESPACE_BOUNDS.items()}


# The same samples, for the chart and for the program.


def _verdicts(flag: ChartFlag) -> Iterator[tuple[object, bool, bool]]:
    """(sample, whether the program takes it, whether the chart does) for each sample."""
    setting = _setting(flag)
    for sample in _samples(flag):
        yield (
            sample,
            _program_takes(setting, _as_flag(flag, sample)),
            _chart_takes(flag.path, sample),
        )


FLAGS_WITH_VALUES = [f for f in CHART_FLAGS if f.how != "switch"]


@pytest.mark.parametrize("flag", FLAGS_WITH_VALUES, ids=lambda f: f"{f.mode}:{f.flag}")
def test_the_chart_takes_what_the_flag_takes(flag: ChartFlag) -> None:
    wrong = []
    for sample, program, chart in _verdicts(flag):
        if chart and not program:
            wrong.append(f"{sample!r}: the chart takes it, {flag.flag} refuses it")
        elif program and not chart and not _stricter(sample):
            wrong.append(f"{sample!r}: {flag.flag} takes it, the chart refuses it")
    assert not wrong, f"{flag.path}:\n" + "\n".join(wrong)


def test_each_stricter_sample_is_one() -> None:
    """STRICTER lists no sample that the chart and its program now agree on."""
    found = {
        _key(sample)
        for flag in FLAGS_WITH_VALUES
        for sample, program, chart in _verdicts(flag)
        if program and not chart
    }
    listed = set().union(*STRICTER.values())
    assert listed <= found, f"no longer stricter: {listed - found}"


@pytest.mark.parametrize(
    "flag", [f for f in CHART_FLAGS if f.how == "switch"], ids=lambda f: f.path
)
def test_a_switch_is_a_boolean(flag: ChartFlag) -> None:
    schema = _schema()
    for key in flag.path.split("."):
        schema = schema["properties"][key]
    assert schema == {"type": "boolean"}


def test_the_bounds_of_a_namespace_have_the_forms_of_the_cluster_wide_ones() -> None:
    bounds = _schema()["properties"]["webhook"]["properties"]["tenants"]["properties"]
    for key, form in NAMESPACE_BOUNDS.items():
        assert bounds["namespaces"]["additionalProperties"]["properties"][key] == {
            "$ref": f"#/definitions/{form.name}"
        }


# Generated values: whatever the chart takes, the program takes; and it takes the
# ordinary forms the program takes.


def _parser_of(form: Form) -> Setting[Any]:
    return _setting(next(f for f in CHART_FLAGS if f.form == form))


FORMS = list(dict.fromkeys(f.form for f in CHART_FLAGS if f.form is not None))
_digits = st.text("0123456789", min_size=1, max_size=25)
NUMBERS = st.one_of(
    _digits,
    st.builds(lambda w, d: f"{w}.{d}", _digits, st.text("0123456789", max_size=25)),
    st.builds(lambda d: f".{d}", _digits),
    st.sampled_from(["0", "1", "10", "100", "1000", "9", "0.5", "0.01", "0.1", "10000"]),
)
SUFFIXES = st.sampled_from(
    [
        "",
        "k",
        "M",
        "G",
        "T",
        "P",
        "E",
        "Ki",
        "Mi",
        "Gi",
        "Ti",
        "Pi",
        "Ei",
        "m",
        "u",
        "n",
        "e3",
        "e18",
        "e19",
        "E-3",
        "e+2",
        "ns",
        "us",
        "µs",
        "ms",
        "s",
        "h",
        " ",
        "+",
        ".",
    ]
)
ANY_TEXT = st.one_of(
    st.builds(
        lambda sign, parts: sign + "".join(n + s for n, s in parts),
        st.sampled_from(["", "", "+", "-"]),
        st.lists(st.tuples(NUMBERS, SUFFIXES), min_size=1, max_size=7),
    ),
    st.text("0123456789.+-eEkKMGTPimunsµh ", max_size=12),
)


def _written(value: Fraction, decimals: int = 30) -> str:
    """`value` >= 0 as a decimal number, cut after `decimals` decimals."""
    whole, rest = divmod(value, 1)
    digits = ""
    while rest and len(digits) < decimals:
        digit, rest = divmod(rest * 10, 1)
        digits += str(digit)
    return f"{whole}.{digits}" if digits else str(whole)


def _edges(form: Form) -> st.SearchStrategy[str]:
    """Parts at the edges of `form`, in each unit: its minimum, its digit bounds and its
    largest value, give or take a little (where float arithmetic and the bounds bite); one
    part, or a few in the order of their units or in any."""
    if isinstance(form, Duration):
        units = [(u.replace("(?:us|µs)", "µs"), size) for u, size in DURATION_UNITS]
        units.append(("us", Fraction(1, 10**6)))
        edges = [
            (u, size, e)
            for u, size in units
            for e in (
                form.minimum / size,
                Fraction(10) ** duration_part_digits(size),
                MAX_DURATION / size,
            )
            if e
        ]
    else:
        units = [("", Fraction(1))] + [
            (s, Fraction(base) ** p)
            for table, base in ((DECIMAL_SUFFIXES, 1000), (BINARY_SUFFIXES, 1024))
            for s, p in table.items()
        ]
        edges = [
            (u, size, e)
            for u, size in units
            for e in (
                Fraction(1),
                Fraction(1, 8),
                Fraction(1, 16),
                Fraction(10) ** whole_digits(size),
                MAX_QUANTITY / size,
            )
        ]
    part = st.builds(
        lambda edge, power, sign: (
            edge[1],
            _written(max(edge[2] + sign * Fraction(10) ** power, Fraction(0))) + edge[0],
        ),
        st.sampled_from(edges),
        st.integers(-20, 3),
        st.sampled_from([-1, 0, 0, 1]),
    )
    parts = st.lists(part, min_size=1, max_size=3)
    return st.one_of(
        part.map(lambda p: p[1]),
        parts.map(lambda ps: "".join(p[1] for p in sorted(ps, key=lambda p: -p[0]))),
        parts.map(lambda ps: "".join(p[1] for p in ps)),
    )


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
@given(data=st.data())
def test_whatever_the_chart_takes_its_program_takes(form: Form, data: st.DataObject) -> None:
    text = data.draw(st.one_of(ANY_TEXT, _plain(form), _edges(form)))
    if _in_form(form.name, text):
        assert _program_takes(_parser_of(form), text), text


def _plain_number(digits: int) -> st.SearchStrategy[str]:
    whole = st.integers(0, 10**digits - 1).map(str)
    return st.one_of(
        whole,
        st.builds(lambda w, d: f"{w}.{d}", whole, st.text("0123456789", min_size=1, max_size=3)),
    )


def _plain(form: Form) -> st.SearchStrategy[str]:
    """The forms people write: `1m30s`, `1.5Gi`, `250m`."""
    if isinstance(form, Duration):
        units = [u.replace("(?:us|µs)", "us") for u, _ in DURATION_UNITS]
        parts = st.lists(st.sampled_from(range(len(units))), min_size=1, max_size=3, unique=True)
        return st.builds(
            lambda picked, numbers: "".join(
                n + units[i] for i, n in zip(sorted(picked), numbers, strict=False)
            ),
            parts,
            st.lists(_plain_number(4), min_size=3, max_size=3),
        )
    suffixes = ["", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"] + ([] if form.bytes else ["m"])
    return st.builds(lambda n, s: n + s, _plain_number(3), st.sampled_from(suffixes))


def _alone_reaches(form: Duration, text: str) -> bool:
    """Whether a part of `text` alone is a value the program takes, or all are 0."""
    parts = re.findall(r"[0-9.]+[a-zµ]+", text)
    setting = _parser_of(form)
    return all(float(p.rstrip("hmnsuµ")) == 0 for p in parts) or any(
        _program_takes(setting, p) for p in parts
    )


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
@given(data=st.data())
def test_the_chart_takes_the_plain_forms_its_program_takes(form: Form, data: st.DataObject) -> None:
    text = data.draw(_plain(form))
    if not _program_takes(_parser_of(form), text):
        return
    if isinstance(form, Duration) and not _alone_reaches(form, text):
        return  # 50ms50ms reaches 100ms only together: the chart asks for one part
    assert _in_form(form.name, text), text
