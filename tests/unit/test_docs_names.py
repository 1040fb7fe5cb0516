"""The names an operator types or reads (Event reasons, metrics, annotation and label keys)
are the same in the docs and in the code: each one the docs, the chart or the code's own
messages name is one the code defines, and each one the code defines is in docs/. A name
removed or renamed in the code fails here until its docs follow, and a new one until it
is documented. Nothing here lists today's names: they come from the code."""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from enforcer.cli import MODES, build_parser
from enforcer.core.reasons import Reason
from enforcer.edge.metrics import (
    AgentTelemetry,
    PodsCollector,
    PodsView,
    Telemetry,
    WebhookTelemetry,
)
from tests.unit.test_docs import _module_names

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "vram-enforcer"
DOCS = ROOT / "docs"

REASON = re.compile(r"\bVRAM[A-Z]\w+")
METRIC = re.compile(r"\bvram_enforcer_\w+")
KEY = re.compile(r"\bvram-enforcer\.io/([\w.-]*\w)(\.\*)?")  # `gpu.*`: all keys under it
ENV = re.compile(r"\bVRAM_[A-Z_]*[A-Z]\b")

# The names a family is read by, by its type: a histogram by its own too (`_created` is
# nobody's to read).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("", "_bucket", "_count", "_sum"),
    "gauge": ("",),
}
ANY_TYPE = tuple(sorted({s for suffixes in SUFFIXES.values() for s in suffixes}))
SAMPLE = re.compile(r"_(?:total|bucket|count|sum)$")  # a sample's name -> its family's

# The example alerts of operations.md are named by us, after what they watch for; an alert
# is no Event, whatever its name (`- alert: VRAMEnforcerBlind`).
ALERT = re.compile(r"alert: *VRAM\w+")


def _readers() -> list[Path]:
    """Where the names are read by operators: the docs, the examples, the chart's README,
    values and templates (NOTES.txt, comments), its dashboards."""
    return [
        *sorted(DOCS.glob("*.md")),
        ROOT / "README.md",
        *sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file()),
        *sorted(p for p in CHART.rglob("*") if p.is_file()),
    ]


def _code() -> list[Path]:
    return sorted((ROOT / "enforcer").rglob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _literals(path: Path) -> Iterator[str]:
    """A module's string constants, as Python joins them: a name split over two lines of
    adjacent literals is whole here."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


@functools.cache
def _texts() -> tuple[tuple[str, str], ...]:
    """(where, text) of every file that names what an operator reads."""
    found = [(str(p.relative_to(ROOT)), p.read_text()) for p in _readers()]
    for path in _code():
        for text in [*_literals(path), path.read_text()]:  # the text: its comments
            found.append((str(path.relative_to(ROOT)), text))
    return tuple(found)


@functools.cache
def _served_by() -> dict[str, dict[str, str]]:
    """Each component that serves metrics -> its families -> their type."""
    agent = AgentTelemetry()
    agent.registry.register(PodsCollector(PodsView, per_process=True))
    registries = {
        "agent": agent.registry,
        "webhook": WebhookTelemetry().registry,
        "exec": Telemetry({}).registry,
    }
    return {
        who: {m.name: m.type for m in registry.collect() if m.name.startswith("vram_enforcer_")}
        for who, registry in registries.items()
    }


def _metric_families() -> dict[str, set[str]]:
    """Each metric family the code serves -> the names a scrape shows it by. From the
    registries themselves (a family named through a helper, `family("...")`), and from every
    `PREFIX + "..."` and whole `"vram_enforcer_..."` literal (a collector built elsewhere)."""
    families: dict[str, set[str]] = {}
    for served in _served_by().values():
        for name, kind in served.items():
            families.setdefault(name, set()).update(name + s for s in SUFFIXES.get(kind, ("",)))
    for path in _code():
        literals = [s for s in _literals(path) if re.fullmatch(r"vram_enforcer_\w*[^\W_]", s)]
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.left, ast.Name)
                and node.left.id == "PREFIX"
                and isinstance(node.right, ast.Constant)
            ):
                literals.append("vram_enforcer_" + str(node.right.value))
        for literal in literals:
            families.setdefault(literal, {literal + s for s in ANY_TYPE})
    return families


def _keys() -> set[str]:
    """Every `vram-enforcer.io/...` key the code reads or writes (a whole literal), and every
    one the chart's templates write."""
    keys = {m[1] for path in _code() for s in _literals(path) if (m := KEY.fullmatch(s))}
    for path in (CHART / "templates").glob("*.yaml"):
        keys |= {m[1] for m in KEY.finditer(path.read_text())}
    return keys


def test_the_code_defines_names_of_each_kind() -> None:
    """The readers of the code below work: they find what is there today."""
    assert len(Reason) >= 10
    assert {"vram_enforcer_container_used_bytes", "vram_enforcer_admission_requests"} <= set(
        _metric_families()
    )
    assert {"inject", "vram", "action", "gpu.memory"} <= _keys()


def test_every_event_reason_named_is_one_the_code_posts() -> None:
    posted = {r.value for r in Reason}
    named = {
        (where, name) for where, text in _texts() for name in REASON.findall(ALERT.sub("", text))
    }
    assert sorted((w, n) for w, n in named if n not in posted) == []


def test_every_event_reason_the_code_posts_is_in_the_docs() -> None:
    documented = {n for p in DOCS.glob("*.md") for n in REASON.findall(p.read_text())}
    assert sorted(r.value for r in Reason if r.value not in documented) == []


def test_every_metric_named_is_one_the_code_serves() -> None:
    served = set().union(*_metric_families().values())
    named = {
        (where, name)
        for where, text in _texts()
        for name in METRIC.findall(text)
        if not name.endswith("_")  # the first half of a name split over two literals
    }
    assert sorted((w, n) for w, n in named if n not in served) == []


def test_every_metric_the_code_serves_is_in_the_docs() -> None:
    documented = {n for p in DOCS.glob("*.md") for n in METRIC.findall(p.read_text())}
    missing = [family for family, names in _metric_families().items() if not names & documented]
    assert sorted(missing) == []


def test_every_annotation_and_label_key_named_is_one_the_code_knows() -> None:
    known = _keys()
    wrong = []
    for where, text in _texts():
        for key, every in KEY.findall(text):
            found = any(k.startswith(key + ".") for k in known) if every else key in known
            if not found:
                wrong.append((where, key))
    assert sorted(set(wrong)) == []


def test_every_annotation_and_label_key_of_the_code_is_in_the_docs() -> None:
    documented = {m[0] for p in DOCS.glob("*.md") for m in KEY.findall(p.read_text())}
    assert sorted(_keys() - documented) == []


def _flags() -> dict[str, set[str]]:
    """Each mode -> the flags its parser takes (`--help` included)."""
    parser = build_parser()
    (modes,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: set(p._option_string_actions) for name, p in modes.choices.items()}


# `vram-enforcer MODE ...` up to where its own words end: a ` -- ` (exec's command), a shell
# comment, pipe or chain, a backtick (inline code), or the end of the (joined) line. Not
# the namespace or the container of that name (`kubectl -n vram-enforcer exec ...`).
COMMAND = re.compile(
    r"(?<![\w/.=-])(?<!-n )(?<!-c )(?<!namespace )vram-enforcer "
    rf"({'|'.join(MODES)})\b((?:\\\n|[^`#|;&\n])*)"
)
# The docs' short forms: `exec --request 2Gi` (inline code), the agent's `--interval`.
SHORT = re.compile(rf"`({'|'.join(MODES)})( --[^`]*)`|\b({'|'.join(MODES)})'s `(--[\w-]+)")
QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")  # a --workload's command, a value

# Deliberate: (mode, flag) the docs name that the mode does not take, each with why.
NOT_A_FLAG = {
    ("webhook", "--agent-socket"): "install.md's upgrade notes: gone since 0.2.0",
}


def _commands(text: str) -> Iterator[tuple[str, str]]:
    """(mode, the words after it) of each `vram-enforcer MODE` command line in `text`, and
    of each short form."""
    for mode, words in COMMAND.findall(text):
        yield mode, QUOTED.sub("", words.replace("\\\n", " ")).split(" -- ")[0]
    for inline, words, owner, flag in SHORT.findall(text):
        yield inline or owner, words or flag


def test_every_flag_a_command_line_gives_is_one_of_that_command() -> None:
    """`vram-enforcer MODE ... --flag` in the docs, the examples, the chart, and each mode's
    own --help (its epilog: a flag of its own, or of the command line it shows)."""
    flags = _flags()
    texts = [(where, text) for where, text in _texts() if not where.endswith(".py")]
    texts += [(f"{name} --help", mode.epilog()) for name, mode in MODES.items()]
    wrong = set()
    for where, text in texts:
        for mode, words in _commands(text):
            if mode in flags:
                named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", words))
                wrong |= {
                    (where, mode, flag)
                    for flag in named - flags[mode]
                    if (mode, flag) not in NOT_A_FLAG
                }
    assert sorted(wrong) == []


def test_every_flag_a_modes_help_names_is_its_own() -> None:
    """Outside the command lines it shows, a mode's --help names its own flags only."""
    flags = _flags()
    wrong = set()
    for name, mode in MODES.items():
        prose = COMMAND.sub("", QUOTED.sub("", mode.epilog()))
        named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", prose))
        wrong |= {(name, flag) for flag in named - flags[name]}
    assert sorted(wrong) == []


def test_each_annotation_the_webhook_bounds_is_said_with_its_bound_in_its_help() -> None:
    """A webhook setting that bounds what an annotation may ask (its help names the
    annotation) is named beside that annotation in `webhook --help`: a tenant reading it
    learns that the annotation alone may be denied (`inject: "false"`, `action: warn`)."""
    lines: dict[str, str] = {}
    key = ""
    for line in MODES["webhook"].epilog().splitlines():
        if match := re.match(r"  vram-enforcer\.io/([\w.-]+)", line):
            key = match[1]
            lines[key] = line
        elif key and line.startswith(" " * 20):
            lines[key] += line
        else:
            key = ""
    bounds = [
        (m[0], s.flag)
        for s in MODES["webhook"].declared
        for m in KEY.findall(s.help)
        if s.flag and m[0] != "vram"  # the resource, not an annotation
    ]
    assert len(bounds) >= 3
    assert sorted((k, f) for k, f in bounds if f not in lines.get(k, "")) == []


def _environment() -> set[str]:
    """The environment variables the code reads or writes: each setting's, the workload's."""
    return {s for path in _code() for s in _literals(path) if ENV.fullmatch(s)}


def test_every_environment_variable_named_is_one_the_code_reads_or_writes() -> None:
    known = _environment()
    assert "VRAM_LIMIT_BYTES" in known and "VRAM_ENFORCER_ACTION" in known
    named = {(where, name) for where, text in _texts() for name in ENV.findall(text)}
    assert sorted((w, n) for w, n in named if n not in known) == []
    documented = {n for p in DOCS.glob("*.md") for n in ENV.findall(p.read_text())}
    assert sorted(known - documented) == []


def _value_paths(schema: dict[str, Any], at: str = "") -> Iterator[str]:
    """Every chart value the schema takes, as a dotted path; `*` where the keys are the
    user's (`webhook.tenants.namespaces.*.actions`)."""
    for key, sub in schema.get("properties", {}).items():
        yield at + key
        yield from _value_paths(sub, f"{at}{key}.")
    if isinstance(schema.get("additionalProperties"), dict):
        yield at + "*"
        yield from _value_paths(schema["additionalProperties"], f"{at}*.")


# Names written like a chart value that are files (`agent.yaml`) or API groups
# (`resource.k8s.io`).
NOT_VALUES = (".py", ".yaml", ".sock", ".io", ".com")
# A chart value in the docs: `agent.hardLimits`, `webhook.tenants.maxCeiling: "0"`, or
# `--set agent.reserve=0` (in a command).
VALUE = r"((?:{top})(?:\.[A-Za-z]\w*)+)"


def test_every_chart_value_named_is_one_the_chart_takes() -> None:
    """What the docs call a chart value is one values.schema.json takes: a value renamed in
    the chart fails here until the docs follow. A module's name written like a value
    (`agent.Passes`, `dra.allocations`) is test_docs.py's to check, a file's is not one."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = [re.compile(re.escape(p).replace(r"\*", r"[^.]+")) for p in _value_paths(schema)]
    modules = _module_names()
    value = VALUE.format(top="|".join(schema["properties"]))
    shown = re.compile(rf"`{value}(?:[=:][^`]*)?`|--set(?:-string)? {value}=")
    wrong = set()
    for where, text in _texts():
        if where.endswith((".md", "values.yaml")):
            for name in {a or b for a, b in shown.findall(text)}:
                first, second = name.split(".")[:2]
                if second in modules.get(first, ()) or name.endswith(NOT_VALUES):
                    continue
                if not any(p.fullmatch(name) for p in paths):
                    wrong.add((where, name))
    assert sorted(wrong) == []


def test_each_metric_of_operations_md_is_served_by_its_component_with_its_type() -> None:
    """A row of a component's table (`### exec`, `### The webhook`, the agent's two) names
    series that component serves, of the type the row says: a metric moved, gone from one
    component or made a counter fails here."""
    served = _served_by()
    metrics = (DOCS / "operations.md").read_text().split("\n## Metrics", 1)[1]
    metrics = metrics.split("\n## ", 1)[0]
    wrong, checked = [], set()
    for section in metrics.split("\n### ")[1:]:
        title = section.splitlines()[0]
        for who in [w for w in served if w in title]:  # the table of one component
            checked.add(who)
            wrong += [(title, *row) for row in _rows_not_served(section, served[who])]
    assert checked == set(served)
    assert wrong == []


def _rows_not_served(section: str, served: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(name, the type its row says, the type served) of each name wrong in `section`."""
    wrong = []
    for names, kind in re.findall(r"^\| (`vram_enforcer_[^|]*) \| (\w+) \|", section, re.M):
        for name in re.findall(r"`(vram_enforcer_\w+)`", names):
            family = next((f for f in (name, SAMPLE.sub("", name)) if f in served), name)
            if served.get(family) != kind:
                wrong.append((name, kind, served.get(family)))
    return wrong
