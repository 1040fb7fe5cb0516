"""Each setting of each mode, declared once: its flag, its environment variable, its
default, its parser and its help.

From the declarations come the command line's parsers (`enforcer.cli`), the reading of
the environment (`resolve`) and the tables of `docs/configuration.md` (`markdown`; a test
holds the page to them). A mode's settings are then built by a typed function that reads
each value by its declaration (`values[GRACE_PERIOD]` is a float), so that mypy checks
every name and type, and a rename cannot fail only at run time.

Precedence: a flag given on the command line, then the environment variable, then the
default. An error names the one the value came from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

from enforcer.core.parsing import ConfigError

T = TypeVar("T")

Kind = Literal["value", "switch", "count"]


@dataclass(frozen=True, slots=True, eq=False)
class Setting(Generic[T]):
    """One setting: where it is read from, how it is parsed, and what it means.

    `help` is the line in `--help`; `doc` (when longer) the meaning in the docs.
    """

    key: str
    help: str
    parse: Callable[[str, str], T] | None = None
    kind: Kind = "value"
    flag: str | None = None
    env: str | None = None
    default: str | None = None
    metavar: str | None = None
    required: str | None = None  # what to do when it is missing; None: it may be absent
    doc: str | None = None
    shown_default: str | None = None  # the docs' default, when `default` does not say it

    @property
    def variable(self) -> str:
        """Its environment variable, for what writes it (the webhook, the sidecar's)."""
        if self.env is None:
            raise ValueError(f"the setting {self.key!r} has no environment variable")
        return self.env


def value(
    key: str,
    parse: Callable[[str, str], T],
    help: str,
    **options: Any,
) -> Setting[T]:
    return Setting(key, help, parse, "value", **options)


def switch(key: str, flag: str, help: str, **options: Any) -> Setting[bool]:
    """A flag without a value: True when given (`--dry-run`), or, for a `--no-` flag,
    False when given (`--no-labels` sets `labels` to False)."""
    return Setting(key, help, None, "switch", flag=flag, **options)


def verbosity(shown_default: str) -> Setting[int]:
    """`-v` lowers the log threshold one level per time it is given."""
    return Setting(
        "verbose",
        "more logging (-vv for debug)",
        None,
        "count",
        flag="-v",
        shown_default=shown_default,
        doc="more logging: each `-v` one level more; at debug, a handled error's log line "
        "is followed by its chain of causes",
    )


def switched_off(setting: Setting[Any]) -> bool:
    return setting.kind == "switch" and bool(setting.flag and setting.flag.startswith("--no-"))


class Values:
    """The value of each setting of a mode, looked up by its declaration."""

    def __init__(self, parsed: Mapping[str, object]) -> None:
        self._parsed = dict(parsed)

    def __getitem__(self, setting: Setting[T]) -> T:
        return cast(T, self._parsed[setting.key])


Given = Mapping[str, "str | int | bool | None"]
"""What the command line gave, by key (None, False or 0: not given)."""


def resolve(declared: Sequence[Setting[Any]], given: Given, environ: Mapping[str, str]) -> Values:
    """Each setting from its flag, else its environment variable, else its default.

    Raises ConfigError, naming the flag or the variable, for a value that does not parse
    or a required one that is missing. An empty variable counts as absent.
    """
    parsed: dict[str, object] = {}
    for s in declared:
        if s.kind == "switch":
            parsed[s.key] = _switch(s, given, environ)
            continue
        if s.kind == "count":
            parsed[s.key] = int(given.get(s.key) or 0)
            continue
        text, field = _source(s, given, environ)
        if text is None:
            if s.required is not None:
                raise ConfigError(s.env or s.flag or s.key, None, f"is missing; {s.required}")
            parsed[s.key] = None
            continue
        assert s.parse is not None  # noqa: S101 - every value setting has a parser
        parsed[s.key] = s.parse(text, field)
    return Values(parsed)


def _switch(s: Setting[Any], given: Given, environ: Mapping[str, str]) -> bool:
    """A switch given on the command line, else its variable (`true` or `false`: what the
    webhook writes into a sidecar's environment), else off."""
    if given.get(s.key):
        return not switched_off(s)
    text = environ.get(s.env) if s.env else None
    if not text:
        return switched_off(s)
    if text.strip().lower() not in ("true", "false"):
        raise ConfigError(s.env or s.key, text, "is not a switch; use true or false")
    return text.strip().lower() == "true"


def _source(s: Setting[Any], given: Given, environ: Mapping[str, str]) -> tuple[str | None, str]:
    flag_value = given.get(s.key)
    if flag_value is not None and s.flag:
        return str(flag_value), s.flag
    if s.env and environ.get(s.env):
        return environ[s.env], s.env
    return s.default, s.flag or s.env or s.key


def help_text(s: Setting[Any]) -> str:
    """The line `--help` shows (with `%` escaped for argparse)."""
    if s.kind != "value":
        text = s.help
    elif s.required is not None:
        text = f"{s.help} (required{f', or ${s.env}' if s.env else ''})"
    else:
        where = f"${s.env}, else " if s.env else ""
        default = s.default if s.default is not None else s.shown_default or "none"
        text = f"{s.help} [default: {where}{default}]"
    return _for_argparse(text)


def environment_text(s: Setting[Any]) -> str:
    """The description of `s.env` in the environment section of `--help`."""
    return _for_argparse(s.help + (f" [{s.default}]" if s.default else ""))


def _for_argparse(text: str) -> str:
    """Help as argparse shows it: no Markdown backticks, and `%` escaped."""
    return text.replace("`", "").replace("%", "%%")


def markdown(declared: Sequence[Setting[Any]]) -> str:
    """The table of docs/configuration.md for a mode: one row per setting."""
    with_env = any(s.env for s in declared)
    head = ["flag", "default", "meaning"]
    if with_env:
        head.insert(0, "variable")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in declared:
        cells = [_cell(s.env)] if with_env else []
        cells += [_flag_cell(s), _default_cell(s), (s.doc or s.help).replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _cell(text: str | None) -> str:
    return f"`{text}`" if text else ""


def _flag_cell(s: Setting[Any]) -> str:
    if not s.flag:
        return ""
    if s.kind == "count":
        return "`-v`, `-vv`"
    shown = s.flag if s.kind == "switch" or not s.metavar else f"{s.flag} {s.metavar}"
    return f"`{shown}`".replace("|", "\\|")


def _default_cell(s: Setting[Any]) -> str:
    if s.shown_default is not None:
        return s.shown_default
    if s.required is not None:
        return "required"
    if s.kind == "switch":
        return "off"
    if s.default == "":
        return "empty"
    return f"`{s.default}`" if s.default is not None else "none"
