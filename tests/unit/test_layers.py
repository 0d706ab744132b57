"""The package layering of docs/architecture.md §1 holds in the source: nothing imports upward."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nri_cpuplugin"
DOC = ROOT / "docs" / "architecture.md"

# Lowest first; a package may import only from packages before it.  nri/ sits on base/ alone.
ORDER = ("base", "core", "storage", "hardware", "ops", "nri", "daemon", "hook", "cli")


# What nri_cpuplugin/__init__.py itself defines (``from .. import __version__``): beneath
# every layer, importable from all of them.
ROOT_NAMES = {"__version__"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "nri_cpuplugin" or len(parts) < 2 or parts[1] in ROOT_NAMES:
        return None
    return parts[1]


def import_graph() -> dict[str, set[str]]:
    """Package -> packages it imports (module level or inside functions); nri/pb/ excluded."""
    graph: dict[str, set[str]] = {name: set() for name in ORDER}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT).with_suffix("").parts
        if relative[1:3] == ("nri", "pb") or len(relative) < 2:
            continue
        source = relative[1]
        if source == "__init__":
            continue
        package = list(relative[:-1])  # what a relative import is relative to
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    names = [".".join([*base, node.module])] if node.module else [
                        ".".join([*base, alias.name]) for alias in node.names
                    ]  # fmt: skip
                else:
                    names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = _layer(name)
                if target is not None and target != source:
                    graph[source].add(target)
    return graph


def test_nothing_imports_upward():
    upward = {
        (source, target)
        for source, targets in import_graph().items()
        for target in targets
        if ORDER.index(target) >= ORDER.index(source)
    }
    assert not upward, f"imports against the layering of docs/architecture.md: {sorted(upward)}"


def test_the_documented_graph_is_the_real_one():
    section = DOC.read_text().split("## 1. Layers", 1)[1].split("\n## ", 1)[0]
    documented = {
        package: set() if imports.strip() == "-" else {p.strip() for p in imports.split(",")}
        for package, imports in re.findall(r"^\| `(\w+)` \| ([^|]+) \|$", section, re.M)
    }
    assert documented == import_graph()
