"""The chart values that become the programs' flags, and the forms they are checked in,
made from the bounds the programs hold those flags to: forms.json (the patterns, read by
templates/_helpers.tpl's "vram-enforcer.inForm") and values.schema.json's definitions
(each form's type: a text, or a number, read as its digits).

A value the chart accepts and its program refuses is a pod that crash-loops, and for the
webhook, with `failurePolicy: Fail`, every pod of every opted-in namespace refused. So the
chart must take no value its program refuses. The forms are checked by the templates, not
by the schema, because Helm's schema errors print the whole pattern that failed (a
kilobyte of regular expression) where the template names the value, the form and an
example (issue 43, item 12). Durations and quantities are regular expressions (Go's RE2 in
Helm, Python's `re` in the tests: the patterns use what both read alike), so each form is a
pattern of a part of what the parsers of enforcer/core/parsing.py take, sized so that
every value it matches parses:

- a duration is Go-style parts in the order h, m, s, ms, us, ns (`100ms`, `1m30s`), each
  under 10^5 hours, 10^7 minutes, ...: no sum of them reaches parsing.MAX_DURATION. A
  minimum holds when one part alone reaches it (`5ms5ms` is refused: write `10ms`), by a
  margin that the parser's float arithmetic cannot undo: at the very minimum, a part is
  taken only where the parser takes it too (it refuses `100000us` as under `100ms`);
- a quantity is a number and a suffix (no milli, micro or nano for bytes), under 2^63-1
  by the number of its digits; bytes are whole: a decimal suffix keeps as many decimals as
  it has zeros, a binary one at most three (`1.5Gi`, `0.125Ti`).

`CHART_FLAGS` lists every value the chart passes as a flag; tests/unit/test_chart_schema.py
holds it to the templates, values.schema.json and forms.json to `generate` and `forms`, and
every form to its setting's own parser. After a change of a form or a bound:

    .venv/bin/python -m tests.chart.values_schema    # rewrites values.schema.json, forms.json
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from enforcer.core.parsing import MAX_QUANTITY, format_duration

CHART = Path(__file__).resolve().parents[2] / "helm" / "vram-enforcer"
SCHEMA = CHART / "values.schema.json"
# The patterns each form's values are held to, read by the templates (_helpers.tpl).
FORMS_FILE = CHART / "forms.json"

# parsing.MAX_DURATION, exactly: Go's last duration, 2^63-1 ns.
MAX_DURATION = Fraction(2**63 - 1, 10**9)
# The duration units in the order a duration's parts are taken, in seconds (us and µs are
# one part).
DURATION_UNITS: tuple[tuple[str, Fraction], ...] = (
    ("h", Fraction(3600)),
    ("m", Fraction(60)),
    ("s", Fraction(1)),
    ("ms", Fraction(1, 10**3)),
    ("(?:us|µs)", Fraction(1, 10**6)),
    ("ns", Fraction(1, 10**9)),
)
DECIMAL_SUFFIXES = {"k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}  # powers of 1000
BINARY_SUFFIXES = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
SMALL_SUFFIXES = {"m": 1, "u": 2, "n": 3}  # powers of 1/1000: a CPU's, never bytes'
BINARY_DECIMALS = 3  # 1.125Gi yes, 1.0625Gi no (the pattern would list 2^d fractions)
# Above a minimum by less than two units of this significant digit, a part is refused: the
# parser's float arithmetic could take it for less than the minimum (within 1e-15 of it).
SAFE_DIGITS = 6


@dataclass(frozen=True, slots=True)
class Duration:
    """A duration of at least `minimum` seconds (a part alone), or, with `off`, also 0."""

    minimum: Fraction = Fraction(0)
    off: bool = False

    @property
    def name(self) -> str:
        if not self.minimum:
            return "duration"
        bound = "From" + format_duration(float(self.minimum))
        return f"duration{'ZeroOr' if self.off else ''}{bound}"


@dataclass(frozen=True, slots=True)
class Quantity:
    """A quantity: whole bytes (`minimum` 0 or 1), or any amount 0 or more (a CPU's)."""

    bytes: bool = True
    minimum: Literal[0, 1] = 0

    @property
    def name(self) -> str:
        if not self.bytes:
            return "cpu"
        return "bytesFrom1" if self.minimum else "bytes"


Form = Duration | Quantity
How = Literal["text", "join", "json", "switch", "sidecar-mode"]


@dataclass(frozen=True, slots=True)
class ChartFlag:
    """A chart value that becomes a flag: `how` it is written there (as it is; a list
    joined with commas; a map as JSON; a boolean that gives the flag or not; the sidecar
    mode, which the chart resolves), the form the chart checks it in (None: the schema is
    written by hand, and the tests hold it to the flag's parser all the same), and `words`
    it takes besides its form."""

    path: str
    mode: Literal["agent", "webhook"]
    flag: str
    how: How = "text"
    form: Form | None = None
    words: tuple[str, ...] = ()


CHART_FLAGS: tuple[ChartFlag, ...] = (
    ChartFlag("agent.interval", "agent", "--interval", form=Duration(Fraction("0.01"))),
    ChartFlag(
        "agent.utilizationInterval",
        "agent",
        "--utilization-interval",
        form=Duration(Fraction("0.1"), off=True),
    ),
    ChartFlag("agent.reserve", "agent", "--reserve", form=Quantity()),
    ChartFlag("agent.reclaimWatermark", "agent", "--reclaim-watermark", form=Quantity()),
    ChartFlag("agent.resync", "agent", "--resync", form=Duration(Fraction(1))),
    ChartFlag("agent.evictionTimeout", "agent", "--eviction-timeout", form=Duration()),
    ChartFlag("resource.name", "agent", "--resource-name"),
    ChartFlag("resource.name", "webhook", "--resource-name"),
    ChartFlag("resource.unit", "agent", "--resource-unit", form=Quantity(minimum=1)),
    ChartFlag("resource.unit", "webhook", "--resource-unit", form=Quantity(minimum=1)),
    ChartFlag("agent.advertise", "agent", "--no-advertise", "switch"),
    ChartFlag("agent.labels", "agent", "--no-labels", "switch"),
    ChartFlag("agent.perProcessMetrics", "agent", "--per-process-metrics", "switch"),
    ChartFlag("agent.hardLimits", "agent", "--hard-limits"),
    ChartFlag("agent.gpuResources", "agent", "--gpu-resources", "join"),
    ChartFlag("dra.drivers", "agent", "--dra-drivers", "join"),
    ChartFlag("dra.drivers", "webhook", "--dra-drivers", "join"),
    ChartFlag("dra.uuidAttribute", "agent", "--dra-uuid-attribute"),
    ChartFlag("dra.uuidAttribute", "webhook", "--dra-uuid-attribute"),
    ChartFlag("dra.capacity", "agent", "--dra-capacity"),
    ChartFlag("dra.capacity", "webhook", "--dra-capacity"),
    ChartFlag("agent.metricsPort", "agent", "--metrics-port"),
    ChartFlag("agent.logFormat", "agent", "--log-format"),
    ChartFlag("allocationGate.kubeletRoot", "agent", "--kubelet-root"),
    ChartFlag("allocationGate.unprovenDrivers", "agent", "--allocation-gate-unproven", "switch"),
    ChartFlag("webhook.port", "webhook", "--port"),
    ChartFlag("webhook.sidecarMode", "webhook", "--sidecar-mode", "sidecar-mode"),
    ChartFlag(
        "webhook.shmDefault", "webhook", "--shm-default", form=Quantity(), words=("auto", "off")
    ),
    ChartFlag("webhook.gpuExposure", "webhook", "--gpu-exposure"),
    ChartFlag("webhook.draDeviceClass", "webhook", "--dra-device-class"),
    ChartFlag("webhook.runtimeClassName", "webhook", "--runtime-class"),
    ChartFlag("webhook.frameworkEnv", "webhook", "--no-framework-env", "switch"),
    ChartFlag("webhook.toolkitMemoryLimits", "webhook", "--toolkit-memory-limits", "switch"),
    ChartFlag("webhook.kaiAnnotations", "webhook", "--kai-annotations", "switch"),
    ChartFlag("webhook.tenants.actions", "webhook", "--tenant-actions", "join"),
    ChartFlag("webhook.tenants.maxGracePeriod", "webhook", "--max-grace-period", form=Duration()),
    ChartFlag("webhook.tenants.maxCeiling", "webhook", "--max-vram-ceiling", form=Quantity()),
    ChartFlag("webhook.tenants.allowOptOut", "webhook", "--allow-opt-out", "switch"),
    ChartFlag("webhook.tenants.namespaces", "webhook", "--namespace-bounds", "json"),
    ChartFlag("webhook.defaultAction", "webhook", "--default-action"),
    ChartFlag("webhook.gpuResources", "webhook", "--gpu-resources", "join"),
    ChartFlag("webhook.undeclaredGpu", "webhook", "--undeclared-gpu"),
    ChartFlag("webhook.defaultVram", "webhook", "--default-vram", form=Quantity()),
    ChartFlag(
        "webhook.sidecarResources.cpu", "webhook", "--sidecar-cpu", form=Quantity(bytes=False)
    ),
    ChartFlag("webhook.sidecarResources.memory", "webhook", "--sidecar-memory", form=Quantity()),
    ChartFlag("webhook.metricsPort", "webhook", "--metrics-port"),
    ChartFlag("webhook.logFormat", "webhook", "--log-format"),
)
# Values inside --namespace-bounds' JSON, each in the form of the cluster-wide bound.
NAMESPACE_BOUNDS: dict[str, Form] = {
    "maxGracePeriod": Duration(),
    "maxCeiling": Quantity(),
    "defaultVram": Quantity(),
}


# Numbers, as the parsers read them: digits with an optional fraction, or a fraction alone.


def _decimal(value: Fraction) -> tuple[str, str]:
    """The integer digits and the decimals (no trailing zero) of a terminating `value`."""
    whole, rest = divmod(value, 1)
    digits = ""
    while rest:
        whole_digit, rest = divmod(rest * 10, 1)
        digits += str(whole_digit)
        if len(digits) > 60:
            raise ValueError(f"{value} does not terminate")
    return str(whole), digits


def _at_least(value: Fraction) -> str:
    """A number (`[0-9]+(\\.[0-9]*)?|\\.[0-9]+`) of at least `value` > 0, terminating."""
    whole, decimals = _decimal(value)
    fraction = r"(?:\.[0-9]*)?"
    if whole == "0":
        same_whole = "0*"
        bigger = [f"0*[1-9][0-9]*{fraction}"]
    else:
        same_whole = f"0*{whole}"
        bigger = [f"0*[1-9][0-9]{{{len(whole)},}}{fraction}"]
        bigger += [
            f"0*{whole[:i]}[{int(d) + 1}-9][0-9]{{{len(whole) - i - 1}}}{fraction}"
            for i, d in enumerate(whole)
            if d != "9"
        ]
    if not decimals:
        return "|".join([*bigger, f"{same_whole}{fraction}"])
    bigger += [
        f"{same_whole}\\.{decimals[:j]}[{int(d) + 1}-9][0-9]*"
        for j, d in enumerate(decimals)
        if d != "9"
    ]
    return "|".join([*bigger, f"{same_whole}\\.{decimals}[0-9]*"])


def _exactly(value: Fraction) -> str:
    """A number equal to a terminating `value`, however many zeros it is written with."""
    whole, decimals = _decimal(value)
    if not decimals:
        return f"0*{whole}(?:\\.0*)?"
    return f"0*\\.{decimals}0*" if whole == "0" else f"0*{whole}\\.{decimals}0*"


def _safely_above(value: Fraction) -> Fraction:
    """A number above `value` by more than float arithmetic can lose: two units of its
    SAFE_DIGITS-th significant digit."""
    quantum = Fraction(10) ** (math.floor(math.log10(value)) - SAFE_DIGITS + 1)
    return (value // quantum + 2) * quantum


def _under(digits: int) -> str:
    """A number under 10^digits."""
    whole = f"0*[0-9]{{1,{digits}}}" if digits else "0+"
    return f"(?:{whole}(?:\\.[0-9]*)?|\\.[0-9]+)"


# Durations.


def duration_part_digits(unit: Fraction) -> int:
    """How many whole digits a part may have: six parts of at most that stay under
    MAX_DURATION."""
    return math.floor(math.log10(MAX_DURATION / 6 / unit))


def _duration(number: str | None) -> str:
    """Parts in the order of DURATION_UNITS, each a number of `number` (None: under its
    digit bound); or `0`. The empty string matches too: the schema adds minLength."""
    parts = "".join(
        f"(?:{number or _under(duration_part_digits(size))}{unit})?"
        for unit, size in DURATION_UNITS
    )
    return f"^(?:0|{parts})$"


def _reaching(minimum: Fraction) -> str:
    """A duration that has a part of at least `minimum` seconds alone, as the parser takes
    it: above it by a safe margin, or at it where the parser's float arithmetic holds."""
    parts = []
    for unit, size in DURATION_UNITS:
        exact = minimum / size
        numbers = [_at_least(_safely_above(exact))]
        try:
            at_minimum = _exactly(exact)
            whole, decimals = _decimal(exact)
        except ValueError:  # 1/6000 of a minute: no number is exactly that
            pass
        else:
            if float(f"{whole}.{decimals}") * float(size) >= float(minimum):
                numbers.append(at_minimum)
        parts.append(f"(?:{'|'.join(numbers)}){unit}")
    # A part starts the text or follows a unit (each ends in h, m or s); after it, the
    # text ends or the next part's number starts.
    return f"^(?:.*[hms])?(?:{'|'.join(parts)})(?:[.0-9].*)?$"


# Quantities.


def whole_digits(multiplier: Fraction) -> int:
    """How many whole digits a number may have before `multiplier`: it stays under 2^63-1."""
    return math.floor(math.log10(MAX_QUANTITY / multiplier))


def _quantity(whole_bytes: bool) -> str:
    binary_fractions = sorted(
        f"{n:0{d}d}"
        for d in range(1, BINARY_DECIMALS + 1)
        for n in range(1, 10**d)
        if n % 10 and n % 5**d == 0  # n / 10^d bytes times 1024^k is whole
    )
    binary = f"(?:{'|'.join(binary_fractions)})"
    suffixes: list[tuple[str, Fraction, str, str]] = [("", Fraction(1), "0*", "0+")]
    for suffix, power in DECIMAL_SUFFIXES.items():
        decimals = f"[0-9]{{0,{3 * power}}}0*"
        suffixes.append((suffix, Fraction(1000) ** power, decimals, f"[0-9]{{1,{3 * power}}}0*"))
    for suffix, power in BINARY_SUFFIXES.items():
        suffixes.append((suffix, Fraction(1024) ** power, f"{binary}?0*", f"(?:{binary}0*|0+)"))
    if not whole_bytes:
        suffixes += [(s, Fraction(1, 1000**p), "", "") for s, p in SMALL_SUFFIXES.items()]
    if not whole_bytes:  # any decimals
        suffixes = [(s, multiplier, "[0-9]*", "[0-9]+") for s, multiplier, _, _ in suffixes]
    numbers = []
    for suffix, multiplier, decimals, some_decimals in suffixes:
        digits = whole_digits(multiplier)
        whole = f"0*[0-9]{{1,{digits}}}" if digits else "0+"
        numbers.append(f"(?:{whole}(?:\\.{decimals})?|\\.{some_decimals}){suffix}")
    # One digit times 10^0..18: under 2^63-1, and whole.
    numbers.append("0*[0-9][eE]\\+?(?:1[0-8]|[0-9])")
    return f"^\\+?(?:{'|'.join(numbers)})$"


# The forms, as the chart checks them (templates/_helpers.tpl, "vram-enforcer.inForm"), and
# the schema's definitions, which hold a value's type only: Helm's schema errors print the
# whole pattern that failed (a kilobyte of regular expression) and nothing of what it means,
# where the template names the value, the form and an example.


def _forms_of_flags() -> list[Form]:
    return [f.form for f in CHART_FLAGS if f.form] + list(NAMESPACE_BOUNDS.values())


def forms() -> dict[str, dict[str, Any]]:
    """Each form by its name: what it takes (`want`, `example`), and the `patterns` a
    value's text must all match (forms.json)."""
    return dict(sorted((form.name, _form(form)) for form in _forms_of_flags()))


def _form(form: Form) -> dict[str, Any]:
    if isinstance(form, Quantity):
        if not form.bytes:
            return {
                "want": "a CPU quantity, 0 or more",
                "example": "10m, 0.5 or 2",
                "patterns": [_quantity(whole_bytes=False)],
            }
        if form.minimum:
            return {
                "want": "a whole number of bytes, at least 1, as a Kubernetes quantity",
                "example": "1 or 1Gi",
                "patterns": [_quantity(whole_bytes=True), "^\\+?[.0]*[1-9]"],
            }
        return {
            "want": "a whole number of bytes as a Kubernetes quantity (no milli, as in 500m; "
            "no more decimals than its suffix makes whole)",
            "example": "512Mi, 1.5Gi, 80Gi or 0",
            "patterns": [_quantity(whole_bytes=True)],
        }
    hours = 10 ** duration_part_digits(DURATION_UNITS[0][1])
    # "." : not empty (the duration's pattern takes the empty string).
    duration = [_duration(None), "."]
    if not form.minimum:
        return {
            "want": f"a duration (parts in the order h, m, s, ms, us, ns; under {hours}h) or 0",
            "example": "100ms, 1m30s, 2h or 0",
            "patterns": duration,
        }
    at_least = format_duration(float(form.minimum))
    reaching = _reaching(form.minimum)
    if form.off:
        zero = _duration("(?:0+(?:\\.0*)?|\\.0+)")
        return {
            "want": f"0 (off), or a duration of at least {at_least} in one of its parts",
            "example": f"0, {at_least} or 1s",
            "patterns": [*duration, f"{zero}|{reaching}"],
        }
    return {
        "want": f"a duration of at least {at_least} in one of its parts (not 5ms5ms)",
        "example": f"{at_least}, {format_duration(float(form.minimum * 10))} or 1m30s",
        "patterns": [*duration, reaching],
    }


def definitions() -> dict[str, dict[str, Any]]:
    """Every form's definition in the schema, by its name: its type. A number is a text
    of its digits (`--set agent.reserve=0`, `maxCeiling: 85899345920`): a CPU's may have
    decimals."""
    found = {}
    for form in _forms_of_flags():
        made = _form(form)
        number = "number" if isinstance(form, Quantity) and not form.bytes else "integer"
        found[form.name] = {
            "description": f"{made['want']}; e.g. {made['example']}",
            "type": ["string", number],
        }
    return dict(sorted(found.items()))


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/definitions/{name}"}


def _at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """The schema of the value at `path` (dotted), from the root's."""
    for key in path.split("."):
        schema = schema["properties"][key]
    return schema


def generate(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its definitions, and the schema of each value of a generated form,
    made anew: each such value refers to its form's definition."""
    made: dict[str, Any] = json.loads(json.dumps(schema))
    made["definitions"] = definitions()
    for flag in CHART_FLAGS:
        if flag.form is not None:
            ref = _ref(flag.form.name)
            words = {"anyOf": [{"enum": list(flag.words)}, ref]}
            _replace(_at(made, flag.path), words if flag.words else ref)
    bounds = _at(made, "webhook.tenants.namespaces")["additionalProperties"]["properties"]
    for key, form in NAMESPACE_BOUNDS.items():
        _replace(bounds[key], _ref(form.name))
    return made


def _replace(schema: dict[str, Any], new: dict[str, Any]) -> None:
    schema.clear()
    schema.update(new)


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    SCHEMA.write_text(render(generate(json.loads(SCHEMA.read_text()))))
    FORMS_FILE.write_text(render(forms()))


if __name__ == "__main__":
    main()
