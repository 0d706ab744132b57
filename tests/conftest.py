"""Marks every test by where it lives, so a subset can be chosen by marker as well as by path:
``unit`` (tests/unit: no root, no cgroups; `./dev unit`), ``system`` (tests/system: root, real
cgroups and network namespaces) and ``e2e`` (tests/e2e, marked by its own conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
KINDS = {HERE / "unit": pytest.mark.unit, HERE / "system": pytest.mark.system}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder, mark in KINDS.items():
            if folder in Path(item.path).resolve().parents:
                item.add_marker(mark)
