"""The operator guide's reference tables say what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from nri_cpuplugin.ops.config import KNOWN_KEYS, Settings
from nri_cpuplugin.ops.metrics import Metrics

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"


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


def test_every_audit_action_is_documented():
    text = GUIDE.read_text()
    package = GUIDE.parents[1] / "nri_cpuplugin"
    source = "\n".join(p.read_text() for p in package.rglob("*.py"))
    # Audit records written directly (``audit.record``) and the engine's events (``events.event``).
    actions = set(re.findall(r'\b(?:record|event)\(\s*"([a-z-]+)"', source))
    assert actions, "no audit actions found in the source"
    missing = [a for a in sorted(actions) if f"`{a}`" not in text]
    assert not missing, f"audit actions not in the operator guide: {missing}"
