"""Guaranteed pod starts on the guest node (tests/harness/README.md, "Guest node"): systemd as
PID 1, cgroup v2, containerd 2.3.4 on runc's systemd driver, with the daemon and without.

Under TCG every absolute time is about 10x the host's, and other work on the host moves it:
only ratios taken in the same run mean something, so the two sides alternate within every
round (which one goes first alternates too) on the same runtime and the same running shared
containers; the daemon is started for the plugin side and stopped for the other.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from harness import guest_runtimes, guest_vm
from harness.guest import Guest
from harness.guest_node import GuestNode

RUNTIME = "containerd-2.3"


def bench_guest_pod_starts(
    shared_counts: tuple[int, ...] = (0, 8), rounds: int = 4, warmup: int = 1
) -> dict[str, Any]:
    report: dict[str, Any] = {"rounds": rounds, "cells": {}}
    say = lambda text: print(f"[guest bench] {text}", flush=True)  # noqa: E731
    # One guest at a time on the machine: a VM left by a dead run is stopped first.
    if stale := guest_vm.reap_stale():
        raise RuntimeError(f"an earlier guest could not be stopped: {stale}")
    guest_runtimes.prepare()
    with Guest.boot(log=say) as guest:
        report["accel"] = guest.vm.accel_reason
        report["boot_s"] = guest.boot_seconds
        report["topology"] = guest.kernel_topology().summary()
        node = GuestNode(guest)
        runtime = node.use(RUNTIME)
        address = runtime.cri_socket
        running = 0
        try:
            for count in sorted(shared_counts):
                if count > running:
                    node.stop_daemon()  # the shared pods start on every CPU, as before
                    guest.call(
                        "bench.guest_side:start_shared", address=address, count=count - running
                    )
                    running = count
                samples: dict[str, list[dict[str, Any]]] = {"plugin": [], "none": []}
                for i in range(warmup + rounds):
                    for side in ("plugin", "none") if i % 2 else ("none", "plugin"):
                        if side == "plugin":
                            node.start_daemon()
                        else:
                            node.stop_daemon()
                        sample = guest.call(
                            "bench.guest_side:timed_guaranteed_start",
                            address=address,
                            label=f"{count}-{i}-{side}",
                        )
                        say(f"{count} shared, round {i}, {side}: {sample}")
                        if i >= warmup:
                            samples[side].append(sample)
                report["cells"][count] = _cell(samples)
        finally:
            node.clear()
    return report


def _cell(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    cell: dict[str, Any] = {}
    for side, rows in samples.items():
        cell[side] = {
            key: statistics.median(r[key] for r in rows) * 1e3
            for key in ("run_pod_s", "create_s", "start_s", "pod_start_s")
        }
    # A 1-CPU container is pinned when its first process saw one CPU (one thread of a core:
    # whole cores are only asked for with full-pcpus-only).
    cell["misplaced"] = sum(not r["first_line"].isdigit() for r in samples["plugin"])
    cell["unpinned_without"] = sum(not r["first_line"].isdigit() for r in samples["none"])
    return cell


def lines(report: dict[str, Any]) -> list[str]:
    out = [
        "## Guest node (systemd driver, cgroup v2)",
        "",
        f"A QEMU guest built by the test harness ({report['accel']}; booted in "
        f"{report['boot_s']} s): {report['topology']}; systemd 252 as PID 1, cgroup v2 only, "
        f"containerd 2.3.4 with runc's systemd driver (`SystemdCgroup = true`), pods placed as "
        f"kubelet's systemd driver places them. A 1-CPU Guaranteed pod is started and removed "
        f"with the daemon (packaging's unit) and without it, the two sides alternating within "
        f"each of {report['rounds']} measured rounds after a warm-up round, beside *n* running "
        f"Burstable pods. Under emulation absolute times are about 10x the host's and move "
        f"with the host's load: read the ratios.",
        "",
        "| shared containers | pod start, plugin | no plugin | ratio | CreateContainer, plugin "
        "| no plugin | ratio | misplaced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for count, cell in sorted(report["cells"].items()):
        p, n = cell["plugin"], cell["none"]
        out.append(
            f"| {count} | {p['pod_start_s']:.0f} ms | {n['pod_start_s']:.0f} ms | "
            f"{p['pod_start_s'] / n['pod_start_s']:.2f} | {p['create_s']:.0f} ms | "
            f"{n['create_s']:.0f} ms | {p['create_s'] / n['create_s']:.2f} | {cell['misplaced']} |"
        )
    out += [
        "",
        "*misplaced*: plugin-side pods whose first line (`Cpus_allowed_list` of the container's "
        "first process) was not one CPU. Not measured here yet: the count of `runc update`s "
        "per start, the window, and cells with 32 or more shared containers.",
        "",
    ]
    return out


if __name__ == "__main__":
    started = time.monotonic()
    print("\n".join(lines(bench_guest_pod_starts(rounds=1, warmup=0))))
    print(f"{time.monotonic() - started:.0f} s")
