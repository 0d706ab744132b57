"""The operator guide's reference tables and lists say what the code does; README.md's tables
stay readable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from nri_cpuplugin.core.engine import _CHANGE_ACTIONS
from nri_cpuplugin.ops.config import KNOWN_KEYS, Settings
from nri_cpuplugin.ops.metrics import Metrics

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"
README = GUIDE.parents[1] / "README.md"
LONGEST_CELL = 300  # characters: a longer cell is a paragraph, which belongs in docs/


def table(marker: str) -> list[list[str]]:
    text = GUIDE.read_text()
    body = text.split(f"<!-- {marker}:", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_config_reference_matches_the_code():
    rows = table("config-reference")
    keys = [row[0].strip("`") for row in rows]
    assert sorted(keys) == KNOWN_KEYS
    defaults = {name: getattr(Settings, name) for name in Settings._fields}
    documented = {row[0].strip("`"): row[1] for row in rows}
    for key, field in (
        ("state_dir", "state_dir"),
        ("cfs_quota", "cfs_quota"),
        ("sysfs", "sysfs"),
        ("log_level", "log_level"),
        ("nri.socket", "nri_socket"),
        ("nri.name", "nri_name"),
        ("nri.index", "nri_index"),
    ):
        assert documented[key] == f"`{defaults[field]}`", key


def test_metrics_reference_matches_the_registry():
    documented = {row[0].strip("`") for row in table("metrics-reference")}
    exported = set()
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add(name)
    assert documented == exported


def recorded_actions() -> set[str]:
    """Every audit action the package records: the literal first argument of ``record`` and
    ``event`` calls (the journal's ``ACTION``), the hook's failure actions (``_fail``) and the
    engine's hotplug changes (``_CHANGE_ACTIONS``)."""
    package = GUIDE.parents[1] / "nri_cpuplugin"
    actions = {action for action, _ in _CHANGE_ACTIONS.values()}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            where = {"record": 0, "event": 0, "_fail": 4}.get(name or "")
            if where is None or len(node.args) <= where:
                continue
            arg = node.args[where]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                actions.add(arg.value)
    return actions


def action_list() -> set[str]:
    """The actions section 8's list names (the paragraph that starts the list)."""
    text = GUIDE.read_text()
    paragraph = text.split("`ACTION` one of:", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`([a-z][a-z-]*)`", paragraph))


def test_every_audit_action_is_in_the_guides_list():
    actions = recorded_actions()
    assert {"allocate", "metrics-failed", "cpu-replaced", "hook-input"} <= actions
    listed = action_list()
    assert not actions - listed, f"recorded, not in the operator guide's list: {actions - listed}"
    assert not listed - actions, f"listed but never recorded: {listed - actions}"


def test_readme_table_cells_stay_short():
    rows = [line for line in README.read_text().splitlines() if line.startswith("|")]
    long = [
        f"{cell[:60]}... ({len(cell)} characters)"
        for row in rows
        for cell in (c.strip() for c in row.strip("|").split("|"))
        if len(cell) > LONGEST_CELL
    ]
    assert rows and not long, "README.md cells over 300 characters:\n" + "\n".join(long)
