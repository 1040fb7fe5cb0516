"""The forms of the values people type: quantities, durations, percentages, ports, actions.

Every parser takes the text and the field it came from (a flag or an environment
variable), and names both in its error, with the form it accepts, so that a typo gives
one line a person can act on instead of a traceback or a silent guess. Each has the shape
`(text, field) -> value`, so that a setting's declaration (`enforcer.core.settings`) can
name it directly.

Quantities follow the Kubernetes grammar (apimachinery's `resource.Quantity`), so a limit
means the same thing on the command line as in a pod spec. We do not import
`kubernetes.utils.parse_quantity` for it: importing that module loads the whole client
(0.45 s and 36 MiB of RSS, measured), which `exec` and the sidecar cannot afford. The
tests check this parser against `parse_quantity` instead.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from decimal import Decimal

from enforcer.core.model import Action

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

# Kubernetes stores no quantity above 2^63-1 (apimachinery caps it), and Go's durations end
# at 2^63-1 ns: past these, a value means nothing the cluster could hold.
MAX_QUANTITY = 2**63 - 1
MAX_DURATION = (2**63 - 1) / 1e9
_HINTED = 32  # a hint repeats the value: only for values a person could have typed
_MAX_EXPONENT_DIGITS = 4  # 1e9999 is far past MAX_QUANTITY; longer exponents are not parsed

QUANTITY_FORM = "a Kubernetes quantity such as 4Gi, 512Mi, 8G or 4294967296 (bytes)"
DURATION_FORM = "a duration with a unit, such as 100ms, 5s, 1m30s or 2h"
PERCENT_FORM = "a percentage above 0% and at most 100%, such as 90%"


class ConfigError(ValueError):
    """A value that cannot be used, with the field it came from and how to fix it."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        where = f"{field}: {shown(value)}" if value is not None else field
        super().__init__(f"{where} {problem}")


def shown(value: object, width: int = 60) -> str:
    """`repr(value)` for a message, cut short: a value thousands of characters long (or
    deep) would bury the sentence that says what to fix."""
    text = repr(value) if not isinstance(value, (dict, list)) else _brief(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _brief(value: dict[object, object] | list[object]) -> str:
    """A container's repr without walking all of it (it may nest past the recursion limit)."""
    kind = "a map" if isinstance(value, dict) else "a list"
    return f"<{kind} of {len(value)}>"


def parse_quantity(text: str, field: str) -> Decimal:
    """Parse a Kubernetes quantity exactly, as the API server would."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or text != text.strip():
        raise ConfigError(field, text, f"is not a quantity; use {QUANTITY_FORM}{_hint(text)}")
    number = Decimal(match["number"])  # exact, however long: the regex admits only digits
    suffix = match["suffix"] or ""
    too_large = ConfigError(
        field, text, "is too large; Kubernetes holds no quantity above 2^63-1 (about 8Ei)"
    )
    if suffix[:1] in ("e", "E") and len(suffix.lstrip("eE+-")) > _MAX_EXPONENT_DIGITS:
        if number == 0:
            return Decimal(0)
        raise too_large  # or too small to be anything but 0, which the API server rounds up
    try:
        if suffix in _BINARY:
            value = number * (Decimal(1024) ** _BINARY[suffix])
        elif suffix in _DECIMAL:
            value = number.scaleb(_DECIMAL[suffix])
        else:
            value = number.scaleb(int(suffix[1:])) if suffix else number
    except ArithmeticError:  # decimal's Overflow: an exponent past what it can hold
        raise too_large from None
    if abs(value) > MAX_QUANTITY:
        raise too_large
    return value


def _hint(text: object) -> str:
    """Suggest the right suffix for the usual mistakes: `4GB`, `4gb`, `4GiB`, `4 Gi`."""
    m = (
        re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\W*", text)
        if isinstance(text, str) and len(text) <= _HINTED
        else None
    )
    if m is None:
        return ""
    prefix = m[2].lower().removesuffix("b").removesuffix("i")
    if prefix not in ("k", "m", "g", "t", "p", "e"):
        return ""
    binary, decimal = prefix.upper() + "i", "k" if prefix == "k" else prefix.upper()
    return f" (did you mean {m[1]}{binary}, or {m[1]}{decimal} for powers of 1000?)"


def parse_bytes(text: str, field: str, unit: int = 1) -> int:
    """A non-negative whole number of bytes; `unit` scales a bare count (`--resource-unit`)."""
    value = parse_quantity(text, field=field) * unit
    if value < 0:
        raise ConfigError(field, text, "is negative; a memory size must be 0 or more")
    if value != value.to_integral_value():
        milli = "; 'm' means milli (1/1000), write Mi for mebibytes" if text.endswith("m") else ""
        raise ConfigError(field, text, f"is not a whole number of bytes{milli}")
    return int(value)


_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def format_quantity(n: int) -> str:
    """Bytes as the shortest exact binary quantity: 8589934592 -> 8Gi."""
    for suffix, shift in _SUFFIXES:
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def kubernetes_version(git_version: str) -> tuple[int, int] | None:
    """(major, minor) of an API server's gitVersion (`v1.37.2`, `v1.31.4-gke.100`)."""
    m = re.match(r"v?(\d+)\.(\d+)", git_version)
    return (int(m[1]), int(m[2])) if m else None


def parse_duration(text: str, field: str) -> float:
    """A Go-style duration (`100ms`, `1m30s`) in seconds; a bare number is refused."""
    stripped = text.strip() if isinstance(text, str) else ""
    if stripped == "0":
        return 0.0
    pos, total = 0, 0.0
    while stripped and pos < len(stripped):
        m = _DURATION_PART.match(stripped, pos)
        if m is None:
            break
        total += float(m[1]) * _DURATION_UNITS[m[2]]
        pos = m.end()
    if not stripped or pos != len(stripped):
        if stripped.startswith("-") and _reads_as_duration(stripped[1:]):
            raise ConfigError(field, text, "is negative; a duration is 0 or more, such as 5s")
        bare = len(stripped) <= _HINTED and re.fullmatch(r"[0-9]+(?:\.[0-9]*)?", stripped)
        hint = f" (did you mean {stripped}s?)" if bare else ""
        raise ConfigError(field, text, f"is not a duration; use {DURATION_FORM}{hint}")
    if not total <= MAX_DURATION:  # also infinity: float("9" * 400) is inf
        raise ConfigError(field, text, "is too long; a duration is at most 2562047h (292 years)")
    return total


def _reads_as_duration(text: str) -> bool:
    """Whether `text` reads as a duration: a negative one is then said to be negative."""
    try:
        parse_duration(text, field="")
    except ConfigError:
        return False
    return True


def parse_percent(text: str, field: str) -> float:
    """A percentage in (0%, 100%], returned as a fraction."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)%", text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(field, text, f"is not a percentage; use {PERCENT_FORM}")
    value = float(m[1])
    if not 0 < value <= 100:
        raise ConfigError(field, text, f"is out of range; use {PERCENT_FORM}")
    return value / 100


def parse_positive_duration(text: str, field: str, minimum: float = 0.001) -> float:
    """A duration that must be at least `minimum` seconds (for intervals and periods)."""
    value = parse_duration(text, field=field)
    if value < minimum:
        raise ConfigError(field, text, f"is too short; use at least {format_duration(minimum)}")
    return value


def format_duration(seconds: float) -> str:
    """The inverse of `parse_duration` for the values we print (`5s`, `100ms`)."""
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


def parse_action(text: str, field: str, allowed: tuple[Action, ...]) -> Action:
    choices = ", ".join(a.value for a in allowed)
    try:
        action = Action(text.strip().lower())
    except ValueError:
        raise ConfigError(field, text, f"is not an action; use one of: {choices}") from None
    if action not in allowed:
        raise ConfigError(field, text, f"is not available here; use one of: {choices}")
    return action


_RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def parse_resource_name(text: str, field: str) -> str:
    """An extended resource name: `<domain>/<name>`, outside kubernetes.io."""
    if not _RESOURCE_NAME.fullmatch(text) or len(text) > 253:
        raise ConfigError(
            field,
            text,
            "is not an extended resource name; use domain/name, e.g. vram-enforcer.io/vram",
        )
    if text.split("/", maxsplit=1)[0].endswith("kubernetes.io"):
        raise ConfigError(
            field,
            text,
            "is in the reserved kubernetes.io domain; use your own, e.g. vram-enforcer.io/vram",
        )
    return text


def ascii_int(text: str, max_digits: int) -> int | None:
    """A whole number written in at most `max_digits` ASCII digits, else None. (`isdigit()`
    alone admits "²" and Arabic-Indic digits, which `int()` refuses or reads; and a number
    thousands of digits long is past Python's int-to-string limit.)"""
    if not (text.isascii() and text.isdigit()) or len(text) > max_digits:
        return None
    return int(text)


def parse_port(text: str, field: str) -> int:
    """A TCP port; 0 asks the kernel for a free one."""
    port = ascii_int(text, 5)
    if port is None or port > 65535:
        raise ConfigError(field, text, "is not a TCP port; use 1-65535 (0 picks a free one)")
    return port


LIMITS_FORM = 'a JSON object of container name to bytes, e.g. {"trainer": 12884901888}'

# The JSON values read here are an object of values, or of objects (portions): nothing
# nests deeper. A tenant's `[[[...` would take the decoder past Python's recursion limit,
# so the depth is bounded before decoding.
MAX_JSON_DEPTH = 8
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_LEVEL = {"[": 1, "{": 1, "]": -1, "}": -1}


def _nests_deeper(text: str, depth: int) -> bool:
    """Whether more than `depth` brackets are open at once in `text`, outside its strings:
    the most levels a decoder goes down before it ends, or fails. Counted in C (the text
    may be megabytes), up to the first level too deep."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    levels = itertools.accumulate(map(_LEVEL.__getitem__, brackets))
    return next(filter(depth.__lt__, levels), None) is not None


def json_object(text: str, field: str, form: str) -> dict[str, object]:
    """A JSON object nested at most MAX_JSON_DEPTH deep, or an error that shows `form`,
    the shape expected."""
    if _nests_deeper(text, MAX_JSON_DEPTH):
        raise ConfigError(field, text, f"nests deeper than {MAX_JSON_DEPTH} levels; use {form}")
    try:
        doc = json.loads(text)
    except ValueError:  # JSONDecodeError, and a number past Python's digit limit
        raise ConfigError(field, text, f"is not valid JSON; use {form}") from None
    if not isinstance(doc, dict):
        raise ConfigError(field, text, f"is not a JSON object; use {form}")
    return doc


def parse_limits(text: str, field: str) -> dict[str, int]:
    """Container name -> bytes, each at most MAX_QUANTITY, as Kubernetes holds them."""
    doc = json_object(text, field, LIMITS_FORM)
    limits: dict[str, int] = {}
    for name, value in doc.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUANTITY:
            raise ConfigError(
                field,
                text,
                f"gives container {name!r} the limit {shown(value)}; "
                "limits are whole bytes from 0 to 2^63-1",
            )
        limits[name] = value
    return limits


def as_text(text: str, field: str) -> str:
    """Any text, as it is (a path, a name, an address)."""
    return text


# An absolute path without whitespace: the chart's schema holds a value to the same pattern.
ABSOLUTE_PATH = r"^/[^\t\n\v\f\r ]*$"


def absolute_path(text: str, field: str) -> str:
    """An absolute path (a directory of the host's, as the kubelet's `--root-dir`)."""
    if not re.match(ABSOLUTE_PATH, text):
        raise ConfigError(
            field, text, "is not an absolute path without spaces, e.g. /var/lib/kubelet"
        )
    return text


def parse_names(text: str, field: str) -> tuple[str, ...]:
    """Comma-separated names (container names cannot hold commas)."""
    return tuple(name for name in text.split(",") if name)


def choice(*choices: str) -> Callable[[str, str], str]:
    """A parser that accepts one of `choices`."""

    def parse(text: str, field: str) -> str:
        if text not in choices:
            raise ConfigError(field, text, f"is not a choice; use one of: {', '.join(choices)}")
        return text

    return parse


def actions(*allowed: Action) -> Callable[[str, str], Action]:
    """A parser of the actions a mode allows."""
    return lambda text, field: parse_action(text, field, allowed)


def duration_or_off(minimum: float) -> Callable[[str, str], float | None]:
    """A parser of durations of at least `minimum` seconds, or `0` (None: turned off)."""

    def parse(text: str, field: str) -> float | None:
        seconds = parse_duration(text, field)
        if seconds == 0:
            return None
        if seconds < minimum:
            raise ConfigError(field, text, f"is too short; use at least {minimum:g}s, or 0 for off")
        return seconds

    return parse


def positive_duration(minimum: float) -> Callable[[str, str], float]:
    """A parser of durations of at least `minimum` seconds (intervals, periods)."""
    return lambda text, field: parse_positive_duration(text, field, minimum)


def parse_unit(text: str, field: str) -> int:
    """Bytes per unit of the extended resource: at least one."""
    unit = parse_bytes(text, field)
    if unit < 1:
        raise ConfigError(field, text, "must be at least 1 byte, e.g. 1 or 1Gi")
    return unit
