"""The docs name tests as proof of what they claim: every test they name must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_test_that_security_md_names_exists() -> None:
    named = re.findall(
        r"`(tests/[\w/]+\.py)::(test_\w+)`", (ROOT / "docs" / "security.md").read_text()
    )
    assert len(named) >= 30  # the table of guarantees is there
    missing = [f"{path}::{name}" for path, name in named
               if not (ROOT / path).exists() or name not in defined_tests(ROOT / path)]  # fmt: skip
    assert missing == []


def test_the_tree_in_architecture_md_lists_every_module_and_no_other() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("## Modules", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    folders: list[str] = []
    listed: set[str] = set()
    for line in tree.strip("\n").splitlines()[1:]:  # below "enforcer/"
        match = re.match(r"^([│ ]*)(?:[├└]── )(\S+)", line)
        assert match, f"not a tree line: {line!r}"
        depth = len(match.group(1)) // 4
        name = match.group(2)
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            listed.add("/".join(["enforcer", *folders, name]))
    package = ROOT / "enforcer"
    present = {
        str(path.relative_to(ROOT)) for path in package.rglob("*.py")
        if not (path.name == "__init__.py" and path.parent != package / "core" / "settings")
    }  # fmt: skip
    assert listed == present
