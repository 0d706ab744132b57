"""The window: after an exclusive container starts, how many shared containers may still run on
its CPUs, and for how long.  A shared container counts as on them when its cpuset cgroup's
effective CPUs (``cpuset.cpus.effective`` on cgroup v2, ``cpuset.effective_cpus`` on v1) or the
``Cpus_allowed_list`` of any of its tasks (threads included) meet them.

Runs on the host (cgroup v1) and in the guest (cgroup v2); only /proc and /sys are read.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.host import parse_cpu_list

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpuset_dir(pid: int) -> Path:
    """The cpuset cgroup directory of ``pid`` (the v1 cpuset hierarchy, or the v2 tree)."""
    unified = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            return CGROUP_ROOT / "cpuset" / path.lstrip("/")
        if number == "0" and not controllers:
            unified = CGROUP_ROOT / path.lstrip("/")
    # cgroup v2 only: the unified tree (on a hybrid host its cpuset is v1's, found above).
    if unified is None:
        raise LookupError(f"no cpuset cgroup for pid {pid}")
    return unified


def effective_cpus(directory: Path) -> set[int] | None:
    """The cgroup's effective CPUs; None when it is gone."""
    for name in ("cpuset.cpus.effective", "cpuset.effective_cpus"):
        try:
            return _cpus((directory / name).read_text())
        except FileNotFoundError:
            continue
    return None


def _tasks_allowed(directory: Path) -> list[set[int]]:
    try:
        pids = (directory / "cgroup.procs").read_text().split()
    except OSError:
        return []
    allowed = []
    for pid in pids:
        try:
            tids = [p.name for p in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
            allowed.append(_cpus(line.split(":", 1)[1]))
    return allowed


def exclusive_cpus(directory: Path) -> set[int]:
    """The new container's CPUs; a wrong path must fail, not read as "no CPU, no window"."""
    cpus = effective_cpus(directory)
    if not cpus:
        raise LookupError(f"no effective CPUs at {directory}")
    return cpus


def on_cpus(shared: Mapping[str, Path], cpus: set[int]) -> list[str]:
    """The shared containers (name -> cgroup directory) that may run on ``cpus`` now."""
    found = []
    for name, directory in shared.items():
        effective = effective_cpus(directory)
        if effective is None:
            continue
        if effective & cpus or any(allowed & cpus for allowed in _tasks_allowed(directory)):
            found.append(name)
    return found


def measure(
    shared: Mapping[str, Path], cpus: set[int], since: float, timeout: float = 30.0
) -> dict[str, Any]:
    """Look at every shared container until none is on ``cpus`` (or ``timeout`` passed).
    ``since``: ``time.monotonic()`` when the exclusive container was started (its
    StartContainer returned).  Returns the count the first look found, the seconds from
    ``since`` until a look found none (0.0 when the first did; None when none did in time),
    the looks made and how long the first one took."""
    first: list[str] | None = None
    looks = 0
    first_look_s = 0.0
    while True:
        began = time.monotonic()
        found = on_cpus(shared, cpus)
        looks += 1
        if first is None:
            first, first_look_s = found, time.monotonic() - began
        if not found:
            open_s: float | None = 0.0 if not first else time.monotonic() - since
            break
        if time.monotonic() - since > timeout:
            open_s = None
            break
        time.sleep(0.05)
    return {
        "on_cpu_first": len(first),
        "window_s": open_s,
        "looks": looks,
        "first_look_s": round(first_look_s, 4),
    }


def _cpus(text: str) -> set[int]:
    return set(parse_cpu_list(text))
