"""Marks every test by where it lives, so a subset can be chosen by marker as well as by path:
``unit`` (tests/unit: no root, no cgroups; `./dev unit`), ``system`` (tests/system: root, real
cgroups and network namespaces), ``e2e`` (tests/e2e, marked by its own conftest) and ``guest``
(tests/guest: the QEMU guest node, harness/guest.py).

The guest tests run after all the others: the guest keeps both host CPUs busy, and the host
tests measure timings that must not share them.  Those on the trixie guest come last, so that
the bookworm guest is booted once and powered off before the trixie one boots.  Its session
fixture boots the guest only when the first of them starts, so a run without guest tests never
boots it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# Property tests are judged by what they find, never by the clock or by luck: no per-example
# deadline (a busy CI machine makes any example slow) and the same examples on every run (a
# schedule found only on some runs is found by a longer local run, then kept as a case).
settings.register_profile("nri-cpuplugin", deadline=None, derandomize=True, database=None)
settings.load_profile("nri-cpuplugin")

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest"
KINDS = {
    HERE / "unit": pytest.mark.unit,
    HERE / "system": pytest.mark.system,
    GUEST: pytest.mark.guest,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "guest: runs on the QEMU guest node (tests/guest)")


def _in(folder: Path, item: pytest.Item) -> bool:
    return folder in Path(item.path).resolve().parents


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder, mark in KINDS.items():
            if _in(folder, item):
                item.add_marker(mark)
    # Stable: each group keeps its own order.
    items.sort(key=lambda item: (_in(GUEST, item), _on_trixie(item)))


def _on_trixie(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("guest") == "trixie"
