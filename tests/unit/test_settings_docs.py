"""docs/configuration.md's tables of settings are made from the declarations: a setting
that is added, renamed or given another default without the docs fails here.

To rewrite the tables after changing a declaration:
    .venv/bin/python tests/unit/test_settings_docs.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from enforcer.cli import MODES
from enforcer.core.settings import markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BLOCK = re.compile(r"(<!-- settings: (\w+) [^>]*-->\n)(.*?)(<!-- end settings -->)", re.DOTALL)


def regenerated(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + markdown(MODES[m[2]].declared) + m[4], text)


def test_every_mode_has_its_table() -> None:
    assert sorted(m[2] for m in BLOCK.finditer(DOC.read_text())) == sorted(MODES)


def test_the_tables_are_the_declarations() -> None:
    text = DOC.read_text()
    assert regenerated(text) == text, f"rewrite them: {sys.executable} {__file__}"


if __name__ == "__main__":
    DOC.write_text(regenerated(DOC.read_text()))
