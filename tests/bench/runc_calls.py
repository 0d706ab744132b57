"""Counting the runtime's runc calls in a benchmark: the runtime's runc (containerd's runc
options ``BinaryName``) is pointed at a small wrapper that appends its arguments to a log, one
line per call, and runs the real runc.  Only benchmarks install it; the tests run runc itself.

Used on both sides of the guest benchmark: on the host (bench_host_starts.py) and in the guest
(guest_side.py), which imports nothing from the host harness here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

# runc's commands; the first argument that is one of them is the command (the global options
# before it - --root, --log, --log-format, --systemd-cgroup - take paths and formats as values).
COMMANDS = frozenset(
    {
        *("checkpoint", "create", "delete", "events", "exec", "features", "kill", "list"),
        *("pause", "ps", "restore", "resume", "run", "spec", "start", "state", "update"),
    }
)


def wrapper(real_runc: str | Path, log: str | Path) -> str:
    """The wrapper script: ``echo`` is the shell's builtin, so a call costs no extra process."""
    return f"""#!/bin/sh
# Written by tests/bench/runc_calls.py (benchmarks only): each runc call logged, then run.
echo "$*" >> {log}
exec {real_runc} "$@"
"""


def log_size(log: str | Path) -> int:
    """Where the log ends now: a benchmark reads the calls made after this offset."""
    try:
        return Path(log).stat().st_size
    except FileNotFoundError:
        return 0


def calls(log: str | Path, start: int, end: int | None = None) -> list[tuple[str, str]]:
    """``(command, container id)`` of every call logged between two offsets; the container is
    runc's last argument (``runc update --resources - <id>``)."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read(None if end is None else end - start).decode(errors="replace")
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        args = line.split()
        command = next((a for a in args if a in COMMANDS), "")
        found.append((command, args[-1] if args else ""))
    return found


def updates_by_target(
    logged: Iterable[tuple[str, str]], roles: Mapping[str, str], default: str = "other"
) -> dict[str, int]:
    """The ``update`` calls counted by what they targeted: ``roles`` maps container ids to a
    role (``"guaranteed"``, ``"sandbox"``, ``"shared"``, ...); any other id is ``default``."""
    targets = [target for command, target in logged if command == "update"]
    return dict(Counter(roles.get(target, default) for target in targets))
