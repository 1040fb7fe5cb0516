"""The node agent's permissions are said in four places: the chart's ClusterRole, the
plain manifest for a cluster without Helm, the table of docs/configuration.md and the
chart's README. A rule added to one alone (as `delete pods`, `create pods/eviction` and
`list, watch namespaces` once were to the ClusterRole and not to the README) fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]

Rule = tuple[str, str, str]  # (API group, resource, verb)


def _rules(rules: list[dict[str, Any]]) -> set[Rule]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def chart() -> set[Rule]:
    """The rules of the agent's ClusterRole in the chart's template (plain YAML there)."""
    text = (ROOT / "helm" / "vram-enforcer" / "templates" / "agent.yaml").read_text()
    (role,) = [d for d in text.split("\n---\n") if re.search(r"^kind: ClusterRole$", d, re.M)]
    return _rules(yaml.safe_load(role[role.index("\nrules:") :])["rules"])


def manifest() -> set[Rule]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "rbac" / "agent.yaml").read_text())
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    return _rules(role["rules"])


def configuration_md() -> set[Rule]:
    """The table under the agent's settings: | `group` | `resource` | `verbs` | for |."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    agent = text.split("## `vram-enforcer agent`", 1)[1].split("\n## ", 1)[0]
    table = agent.split("| API group | resource | verbs | for |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([^`]*)` \| `([^`]+)` \| `([^`]+)` \|", table, re.M)
    return {
        (group.strip('"'), resource, verb.strip())
        for group, resource, verbs in rows
        for verb in verbs.split(",")
    }


def chart_readme() -> set[tuple[str, str]]:
    """(resource, verb) of the agent's row: `get, patch nodes`, `patch nodes/status`, ..."""
    text = (ROOT / "helm" / "vram-enforcer" / "README.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| agent |")]
    return {
        (resource, verb.strip())
        for verbs, resource in re.findall(r"`([a-z]+(?:, [a-z]+)*) ([a-z]+(?:/[a-z]+)?)`", row)
        for verb in verbs.split(",")
    }


def test_the_agents_permissions_are_the_same_wherever_they_are_said() -> None:
    rules = chart()
    assert ("", "nodes/status", "patch") in rules  # the template was read
    assert manifest() == rules
    assert configuration_md() == rules
    assert chart_readme() == {(resource, verb) for _, resource, verb in rules}
