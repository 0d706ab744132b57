"""The update storm (e2e/storm.py) as a benchmark: how long CRI calls take while kubelet-like
UpdateContainerResources calls race the daemon's own changes to the same containers, exclusive
containers come and go and CPU 1 goes offline and back - with the daemon, and with no plugin.

Two private containerd instances of one version, one with the daemon and one with no plugin,
each with the same shared containers; the storm runs on each in turn, in alternating slices
(daemon, none, daemon, none), so that both sides see the machine in the same state.  CPU
hotplug is machine-wide: the daemon also handles the hotplug of the other side's slices.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from e2e import storm as storm_mod
from e2e.cpu_hotplug import check_hotpluggable, restore_cpu
from e2e.daemon import Daemon
from e2e.storm import SHARED, Storm, burstable
from harness.containerd import Containerd

from .stats import summary

SIDES = ("daemon", "none")
SLICES = 2  # per side, alternating


def bench_update_storm(version: str, seconds: float) -> dict:
    """``seconds`` of storm per side, in SLICES slices."""
    check_hotpluggable()
    took: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    counts: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    failed: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    ran = dict.fromkeys(SIDES, 0.0)
    cycles = dict.fromkeys(SIDES, 0)
    hangs: list[tuple[str, str]] = []  # (side, what hung)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.callback(restore_cpu)
        runtimes = {side: stack.enter_context(Containerd(version, debug=False)) for side in SIDES}
        daemon = Daemon(runtimes["daemon"].nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        shared = {}
        for side, runtime in runtimes.items():
            cri = runtime.cri()
            shared[side] = [cri.run(f"s{i}", [burstable(f"s{i}")])[f"s{i}"] for i in range(SHARED)]
        for _ in range(SLICES):
            for side in SIDES:
                storm = Storm(runtimes[side], shared[side])
                slice_took, stuck = storm_mod.run(storm, seconds / SLICES)
                ran[side] += slice_took
                cycles[side] += storm.cycles
                counts[side].update(storm.calls.ok)
                failed[side].update(storm.calls.failed)
                hangs += [(side, hang) for hang in storm.calls.hangs]
                hangs += [(side, f"{name} still blocked in a call") for name in stuck]
                for method, samples in storm.calls.took.items():
                    took[side].setdefault(method, []).extend(samples)
        outside = daemon.records("outside-reply")
        unsolicited = {side: storm_mod.unsolicited_updates(rt) for side, rt in runtimes.items()}
    methods = sorted(set(took["daemon"]) | set(took["none"]))
    return {
        "version": version,
        "seconds": {side: round(s, 1) for side, s in ran.items()},
        "hotplug_cycles": cycles,
        "calls": {side: sum(c.values()) for side, c in counts.items()},
        "failed": {side: sum(c.values()) for side, c in failed.items()},
        "hangs": hangs,
        "per_method": {
            method: {side: summary(took[side][method]) for side in SIDES if took[side].get(method)}
            for method in methods
        },
        "longest_ms": {
            side: max(max(v) for v in took[side].values()) * 1e3 for side in SIDES if took[side]
        },
        "outside_reply_changes": len(outside),
        "unsolicited_updates": unsolicited,
    }
