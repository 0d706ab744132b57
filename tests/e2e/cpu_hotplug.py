"""Taking CPU 1 of this 2-CPU machine offline and back, for the e2e tests that need real CPU
hotplug (``/sys/devices/system/cpu/cpu1/online``).

Taking a CPU offline affects everything on the machine, so whoever does it brings the CPU back
before returning, whatever happened (``cpu_offline`` restores it in ``finally``);
``restore_cpu`` is idempotent and never raises, and it also runs at interpreter exit, for a test
process torn down mid-test.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host

CPU = 1
ONLINE_FILE = Path(f"/sys/devices/system/cpu/cpu{CPU}/online")


def set_online(value: bool) -> None:
    ONLINE_FILE.write_text("1" if value else "0")


def restore_cpu() -> None:
    """Bring the CPU back if it is offline (idempotent; never raises)."""
    with contextlib.suppress(OSError):
        if ONLINE_FILE.read_text().strip() != "1":
            set_online(True)


atexit.register(restore_cpu)  # even if the test process is torn down mid-test


@contextlib.contextmanager
def cpu_offline() -> Iterator[None]:
    set_online(False)
    try:
        yield
    finally:
        restore_cpu()


def check_hotpluggable() -> None:
    """Fail (never skip) unless CPU 1 can be taken offline and both CPUs are online now."""
    if not ONLINE_FILE.exists():
        pytest.fail(f"{ONLINE_FILE} missing: CPU {CPU} is not hot-pluggable on this machine")
    if host.online_cpus() != [0, 1]:
        pytest.fail(f"expected CPUs 0-1 online before the test, found {host.online_cpus()}")
