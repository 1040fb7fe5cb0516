"""The docs name tests as proof of what they claim: every test they name must exist. They
also name modules, files and functions: each must exist where the docs say it is."""

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
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (ROOT / path).exists() or name not in defined_tests(ROOT / path)
    ]
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
        str(path.relative_to(ROOT))
        for path in package.rglob("*.py")
        if not (path.name == "__init__.py" and path.parent != package / "core" / "settings")
    }
    assert listed == present


PACKAGES = {"core", "edge", "modes", "settings", "workloads"}


def _module_names() -> dict[str, set[str]]:
    """Module name (its file's stem; a package's, its folder's) -> the names it defines or
    imports at top level."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "enforcer").rglob("*.py"):
        names = found.setdefault(path.parent.name if path.stem == "__init__" else path.stem, set())
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return found


def _pythonic(name: str) -> bool:
    """A function, constant or class name; not a chart value (`webhook.tenants`,
    `agent.hardLimits`), a file suffix or a header (`nvml.h`)."""
    return "_" in name.strip("_") or name[:1].isupper()


def test_every_module_file_and_function_the_docs_name_exists_where_they_say() -> None:
    modules = _module_names()
    where = {}
    for module, names in modules.items():
        for name in names:
            where.setdefault(name, set()).add(module)
    wrong = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        text = doc.read_text()
        for path in re.findall(r"`([\w/.-]+\.py)(?:::\w+)?`", text):
            if not (
                (ROOT / path).exists()
                or (ROOT / "enforcer" / path).exists()
                or any(ROOT.glob(f"*/**/{path}"))
            ):
                wrong.append(f"{doc.name}: no file {path}")
        for module, name in re.findall(r"`(\w+)\.(\w+)[\w.]*(?:\([^`]*\))?`", text):
            if name == "py":
                continue  # a file: checked above
            if module in PACKAGES:
                if name not in modules and name not in PACKAGES:
                    wrong.append(f"{doc.name}: no module {module}.{name}")
            elif module in modules:
                if _pythonic(name) and name not in modules[module]:
                    wrong.append(f"{doc.name}: {module}.{name}, which {module} does not define")
            elif name in where and _pythonic(name) and len(name) > 4:
                # a module that no longer exists, for a name that lives elsewhere now
                wrong.append(f"{doc.name}: {module}.{name}, which lives in {sorted(where[name])}")
        for link in re.findall(r"\]\(([^)#]+)", text) + re.findall(r"`(\.\./[^`]+)`", text):
            outside = not (doc.parent / link).resolve().is_relative_to(ROOT)
            if outside and not link.startswith(("http://", "https://", "mailto:")):
                wrong.append(f"{doc.name}: a link out of the repository: {link}")
    assert wrong == []


def test_every_thread_the_code_starts_is_named_in_architecture_md() -> None:
    """A thread's name (what `ps -L`, py-spy and a LoopGuard's log line show) is listed where
    its mode's threads are described, so that the list cannot go stale again."""
    started = set()
    for path in (ROOT / "enforcer").rglob("*.py"):
        text = path.read_text()
        for call in re.findall(r"(?:super\(\).__init__|threading.Thread)\((.*?)\)", text, re.S):
            started |= set(re.findall(r'name="([a-z-]+)"', call))
        started |= set(re.findall(r'name="([a-z-]+)", \*\*options', text))  # WatchedPods'
    assert "nvml-sampler" in started and "opted-in-namespaces" in started
    described = (ROOT / "docs" / "architecture.md").read_text()
    assert sorted(n for n in started if f"`{n}`" not in described) == []
