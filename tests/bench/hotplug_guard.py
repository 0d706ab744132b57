"""Telling measurements that CPU hotplug disturbed from those it did not.

On a machine shared with other work, something else may take a CPU offline and back (the
hotplug tests and benchmarks do): the kernel then moves every task off that CPU and, on
cgroup v1, shrinks every cpuset for good, and the plugin re-pins its containers.  A round
that overlapped such a change measured that, not what it says it measured, so the benchmarks
that pin containers to CPU 1 repeat it instead, after giving the node's cgroups back the
CPUs the kernel took from them.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType

from harness import host


class OnlineGuard:
    """Polls the online CPU list in a thread while in use (``with OnlineGuard() as guard``);
    :attr:`changes` counts every change seen."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.expected = host.online_cpus()
        self.changes = 0
        self.last_change = 0.0  # time.monotonic() of the last change seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> OnlineGuard:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        last = self.expected
        while not self._stop.wait(self.period):
            now = host.online_cpus()
            if now != last:
                self.changes += 1
                self.last_change = time.monotonic()
                last = now

    def wait_all_online(self, quiet: float = 2.0, timeout: float = 300.0) -> None:
        """Until every CPU online at the start is online again and no change was seen for
        ``quiet`` seconds (hotplug tests take a CPU down and up in quick succession);
        at once when nothing changed lately."""
        deadline = time.monotonic() + timeout
        while host.online_cpus() != self.expected or time.monotonic() - self.last_change < quiet:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"CPUs {self.expected} not all online and left alone for {timeout:g} s "
                    f"(online now: {host.online_cpus()}): something else on the machine keeps "
                    "taking them offline"
                )
            time.sleep(0.2)


def restore_cpusets(top_cgroup: str) -> None:
    """Give every cgroup of a node's tree (``top_cgroup`` and below) its parent's CPUs again,
    top-down: after CPU hotplug, cgroup v1 leaves each cpuset without the CPU that went
    offline, also once it is back, and no new container below can then be given that CPU.
    Only for a node without containers: theirs are the runtime's and the plugin's to set.
    cgroup v2 restores the CPUs by itself."""
    if "cpuset" not in host.cgroup_hierarchies():
        return
    for directory, _, _ in os.walk(host.cgroup_dir(top_cgroup, "cpuset")):  # top-down
        mine, parent = Path(directory, "cpuset.cpus"), Path(directory).parent / "cpuset.cpus"
        want = parent.read_text().strip()
        if mine.read_text().strip() != want:
            mine.write_text(want)
