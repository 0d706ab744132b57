"""The project's hooks.d files as a CRI-O of the harness loads them (shared by the CRI-O hook
tests and the CRI-O benchmark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.runc import hook_env

from e2e.daemon import REPO

HOOKS = REPO / "hooks"


def hook_files(program: Path, state_dir: Path, *extra: str) -> dict[str, dict[str, Any]]:
    """The committed hooks.d files, pointed at ``program`` and ``state_dir``."""
    files = {}
    for f in sorted(HOOKS.glob("*.json")):
        doc = json.loads(f.read_text())
        stage = doc["hook"]["args"][-1]
        doc["hook"]["path"] = str(program)
        doc["hook"]["args"] = [
            "nri-cpuplugin-hook", "--state-dir", str(state_dir), "--reserved-cpus", "0",
            *extra, stage,
        ]  # fmt: skip
        doc["hook"]["env"] = [*doc["hook"].get("env", []), *hook_env()]
        files[f.name] = doc
    return files
