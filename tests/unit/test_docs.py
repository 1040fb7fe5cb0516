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
