"""Guaranteed pod starts on the guest node (tests/harness/README.md, "Guest node"): systemd as
PID 1, cgroup v2, containerd 2.3.4 on runc's systemd driver, with the daemon and without.

Under TCG every absolute time is about 10x the host's, and other work on the host moves it:
only ratios taken in the same run mean something, so the three sides - the daemon, a plugin
that changes nothing (noop_plugin.py: the floor of any NRI plugin on this node) and no plugin -
take turns within every round (which one goes first rotates too) on the same runtime and the
same running shared containers; the daemon is started for its side and stopped for the others.

Beside the times: the runtime's ``runc update`` calls per start, by target (containerd's runc is
the counting wrapper of runc_calls.py, in this benchmark only), and the window - shared
containers still allowed on the new container's CPU after its StartContainer returned
(shared_window.py).  bench_host_starts.py measures the same on the host's cgroupfs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from harness import guest_runtimes, guest_vm
from harness.guest import Guest, GuestError
from harness.guest_node import GuestNode
from harness.guest_runtimes import NRI_SOCKET, RUNC

from . import runc_calls
from .stats import summary

RUNTIME = "containerd-2.3"
COUNTING_RUNC = "/usr/local/sbin/nri-bench-runc"
RUNC_LOG = "/run/nri-bench-runc.log"
# Seconds a pod start may take in the guest (a Burstable one while the cell's pods start).
POD_START_BUDGET = 30.0
SIDES = ("plugin", "noop", "none")


def bench_guest_pod_starts(
    shared_counts: tuple[int, ...] = (0, 8, 32),
    rounds: int = 8,
    warmup: int = 1,
    budget_s: float = 3600.0,
) -> dict[str, Any]:
    """The cells in increasing order of shared containers; a cell whose estimated time (the
    previous cell's, plus its new shared pods at the last measured start rate) would end past
    ``budget_s`` from the start is left out and said so."""
    report: dict[str, Any] = {"rounds": rounds, "cells": {}, "skipped": {}, "shared_start_s": {}}
    say = lambda text: print(f"[guest bench] {text}", flush=True)  # noqa: E731
    began = time.monotonic()
    # One guest at a time on the machine: a VM left by a dead run is stopped first.
    if stale := guest_vm.reap_stale():
        raise RuntimeError(f"an earlier guest could not be stopped: {stale}")
    guest_runtimes.prepare()
    with Guest.boot(log=say) as guest:
        report["accel"] = guest.vm.accel_reason
        report["boot_s"] = guest.boot_seconds
        report["topology"] = guest.kernel_topology().summary()
        guest.write(COUNTING_RUNC, runc_calls.wrapper(RUNC, RUNC_LOG), 0o755)
        node = GuestNode(guest, runc=COUNTING_RUNC)
        address = node.use(RUNTIME).cri_socket
        running, per_pod, cell_s, log_end = 0, 10.0, 0.0, 0
        # No clean-up of the pods at the end: removing 100 of them takes minutes under TCG,
        # and the guest's disk is a snapshot that powering off discards.
        for count in sorted(shared_counts):
            estimate = cell_s + (count - running) * per_pod
            if time.monotonic() - began + estimate > budget_s:
                report["skipped"][count] = round(estimate)
                say(f"{count} shared: left out, its estimated {estimate:.0f} s end past the budget")
                continue
            cell_began = time.monotonic()
            if count > running:
                node.stop_daemon()  # the shared pods start on every CPU, as before
                guest.call(
                    "bench.guest_side:start_shared",
                    timeout=120 + POD_START_BUDGET * (count - running),
                    address=address,
                    count=count - running,
                    first=running,
                )
                took = time.monotonic() - cell_began
                report["shared_start_s"][count] = round(took / (count - running), 1)
                per_pod, running = took / (count - running), count
                say(f"{count} shared pods running ({per_pod:.1f} s a pod)")
            rounds_began = time.monotonic()
            samples, log_end = _cell_rounds(guest, node, address, count, rounds + warmup, log_end)
            report["cells"][count] = cell_summary({s: v[warmup:] for s, v in samples.items()})
            cell_s = time.monotonic() - rounds_began
    report["total_s"] = round(time.monotonic() - began)
    return report


def _cell_rounds(
    guest: Guest, node: GuestNode, address: str, count: int, rounds: int, log_end: int
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    samples: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for i in range(rounds):
        for side in SIDES[i % 3 :] + SIDES[: i % 3]:
            label = f"{count}-{i}-{side}"
            if side == "plugin":
                node.start_daemon()
            else:
                node.stop_daemon()
            noop = _start_noop(guest, label) if side == "noop" else None
            try:
                sample = guest.call(
                    "bench.guest_side:timed_guaranteed_start",
                    timeout=600,
                    address=address,
                    label=label,
                    pinned=side == "plugin",
                    runc_log=RUNC_LOG,
                    since=log_end,
                )
            finally:
                if noop:
                    guest.run(["systemctl", "stop", noop], timeout=120)
            log_end = sample["log_end"]
            print(f"[guest bench] {count} shared, round {i}, {side}: {sample}", flush=True)
            samples[side].append(sample)
    return samples, log_end


def _start_noop(guest: Guest, label: str, timeout: float = 120.0) -> str:
    """The plugin that changes nothing, started as a transient unit of its own (a new name each
    time, so its journal holds one "ready"); returns the unit once it has registered."""
    unit = f"nri-bench-noop-{label}.service"
    env = [f"--setenv={k}={v}" for k, v in guest.python_env().items()]
    argv = ["systemd-run", f"--unit={unit}", "--collect", *env]
    started = guest.run([*argv, "/usr/bin/python3", "-m", "bench.noop_plugin", NRI_SOCKET])
    if not started.ok:
        raise GuestError(f"the no-op plugin did not start: {started.describe()}")
    deadline = time.monotonic() + timeout
    while "ready" not in guest.run(["journalctl", "-o", "cat", "-u", unit], timeout=60).stdout:
        if time.monotonic() > deadline:
            guest.run(["systemctl", "stop", unit], timeout=120)
            raise GuestError(f"the no-op plugin did not register in {timeout} s")
        time.sleep(1)
    return unit


def _totals(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def cell_summary(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One cell from its measured samples (every side), for the guest and the host alike."""
    cell: dict[str, Any] = {}
    for side, rows in samples.items():
        windows = [r["window_s"] for r in rows]
        cell[side] = {
            **{key: summary([r[key] for r in rows]) for key in ("create_s", "pod_start_s")},
            "n": len(rows),
            "updates_start": _totals(r["updates_start"] for r in rows),
            "updates_removal": _totals(r["updates_removal"] for r in rows),
            "updates_between": _totals(r["updates_between"] for r in rows),
            "on_cpu_first": sum(r["on_cpu_first"] for r in rows),
            "shared_seen": sum(r["shared"] for r in rows),
            # None: some look never found the CPU free within the measurement's timeout.
            "window_max_s": None if None in windows else max(windows, default=0.0),
            # A 1-CPU container is pinned when its first process saw one CPU (one thread of a
            # core: whole cores are only asked for with full-pcpus-only).
            "one_cpu": sum(r["first_line"].isdigit() for r in rows),
        }
    return cell


def _per_start(totals: dict[str, int], n: int) -> str:
    """``runc update``s per start: all, and those on shared containers in brackets."""
    shared = totals.get("shared", 0) + totals.get("shared-sandbox", 0)
    return f"{sum(totals.values()) / n:.1f} ({shared / n:.1f})"


def _ms(s: dict[str, Any]) -> str:
    """Median / max: whole ms for the guest's seconds, a decimal for the host's ms."""
    if s["median_ms"] >= 100:
        return f"{s['median_ms']:.0f} / {s['max_ms']:.0f} ms"
    return f"{s['median_ms']:.1f} / {s['max_ms']:.1f} ms"


def table(cells: dict[int, dict[str, Any]]) -> list[str]:
    """Plugin against no plugin; where the cells have a no-op side, its ratios beside."""
    noop = all("noop" in cell for cell in cells.values())
    extra = " | no-op ratio" if noop else ""
    out = [
        f"| shared containers | pod start, plugin (median / max) | no plugin | ratio{extra} "
        f"| CreateContainer, plugin (median / max) | no plugin | ratio{extra} "
        "| runc updates per start, plugin (on shared) | no plugin | window: found / open "
        "| misplaced |",
        "|---" * (11 + 2 * noop) + "|",
    ]
    for count, cell in sorted(cells.items()):
        p, n = cell["plugin"], cell["none"]
        window = "-" if p["window_max_s"] is None else f"{p['window_max_s']:.2f} s"
        out.append(
            f"| {count} | {_columns(cell, 'pod_start_s', noop)} | "
            f"{_columns(cell, 'create_s', noop)} | {_per_start(p['updates_start'], p['n'])} | "
            f"{_per_start(n['updates_start'], n['n'])} | {p['on_cpu_first']} / {window} | "
            f"{p['n'] - p['one_cpu']} |"
        )
    return out


def _columns(cell: dict[str, Any], key: str, noop: bool) -> str:
    """Plugin, no plugin, their ratio, and the no-op's ratio where there is one."""
    none = cell["none"][key]["median_ms"]
    ratios = [cell[side][key]["median_ms"] / none for side in ("plugin", "noop")[: 1 + noop]]
    return " | ".join(
        [_ms(cell["plugin"][key]), _ms(cell["none"][key]), *(f"{r:.2f}" for r in ratios)]
    )


def targets(cells: dict[int, dict[str, Any]]) -> str:
    """What the counted ``runc update``s targeted, cell by cell."""

    def show(totals: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(totals.items())) or "none"

    parts = []
    for count, cell in sorted(cells.items()):
        sides = [
            f"{label}: starts {show(cell[side]['updates_start'])}; removals "
            f"{show(cell[side]['updates_removal'])}"
            for side, label in (("plugin", "plugin"), ("none", "no plugin"))
        ]
        parts.append(
            f"*{count} shared* ({cell['plugin']['n']} starts a side) - " + "; ".join(sides)
        )
    return "; ".join(parts)


def lines(report: dict[str, Any], host: dict[str, Any] | None = None) -> list[str]:
    out = [
        "## Guest node (systemd driver, cgroup v2)",
        "",
        f"A QEMU guest built by the test harness ({report['accel']}; booted in "
        f"{report['boot_s']} s): {report['topology']}; systemd 252 as PID 1, cgroup v2 only, "
        f"containerd 2.3.4 with runc 1.1.5's systemd driver (`SystemdCgroup = true`), pods "
        f"placed as kubelet's systemd driver places them. A 1-CPU Guaranteed pod is started "
        f"(RunPodSandbox, CreateContainer, StartContainer, each timed) and removed with the "
        f"daemon (packaging's unit), with a plugin that subscribes to CreateContainer and changes "
        f"nothing (*no-op ratio*: the floor of any NRI plugin on this node, against no plugin) "
        f"and with no plugin, the three sides taking turns within each of {report['rounds']} "
        f"measured rounds after a warm-up round (the daemon started for its side and stopped "
        f"for the others), beside *n* running Burstable pods of one container "
        f"each. Under emulation absolute times are about 10x the host's and move with the "
        f"host's load: read the ratios (medians; with {report['rounds']} samples a side the "
        f"p99 is the max). Whole run: {report['total_s'] / 60:.0f} min.",
        "",
        *table(report["cells"]),
        "",
        *_legend(),
        "",
        f"What the `runc update`s targeted (totals over the measured starts; *guaranteed*: the "
        f"new container itself, *shared*: a Burstable pod's container, *-sandbox*: a pod's "
        f"pause container): {targets(report['cells'])}.",
        "",
        _limits(report),
        "",
    ]
    if host:
        out += _host_lines(host)
    return out


def _legend() -> list[str]:
    return [
        "*runc updates per start*: `runc update` calls the runtime made (containerd's runc "
        "options `BinaryName` point at a wrapper that logs each call and runs runc; in this "
        "benchmark only) from RunPodSandbox until the container's first line was read, per "
        "start, all targets and, in brackets, those on shared containers or their sandboxes. "
        "*window*: right after StartContainer returned, every shared container's "
        "`cpuset.cpus.effective` and every one of its tasks' `Cpus_allowed_list` (threads "
        "included) read, again and again until none meets the new container's CPUs "
        "(`cpuset.cpus.effective` of its own cgroup); *found*: shared containers on it at the "
        "first look, summed over the starts; *open*: the longest time from StartContainer's "
        "return until a look found none (0 when the first look found none). Without the plugin "
        "every shared container is on it, as expected: one look each time. *misplaced*: "
        "plugin-side pods whose first line (`Cpus_allowed_list` of the container's first "
        "process) was not one CPU.",
    ]


def _limits(report: dict[str, Any]) -> str:
    rates = ", ".join(f"{s} s a pod up to {n}" for n, s in sorted(report["shared_start_s"].items()))
    text = f"Starting the shared pods (daemon stopped) took {rates or '-'}."
    for count, estimate in sorted(report["skipped"].items()):
        text += (
            f" The cell with {count} shared containers was left out: it would have taken about "
            f"{estimate / 60:.0f} min more (new shared pods at the last start rate, plus the "
            f"previous cell's rounds), past the run's time budget."
        )
    return text


def _host_lines(host: dict[str, Any]) -> list[str]:
    return [
        "### The same on the host's cgroupfs",
        "",
        f"The same starts, measured the same way (bench_host_starts.py) on this host: "
        f"containerd {host['release']}, runc 1.1.5 with the cgroupfs driver, cgroup v1, two "
        f"private instances side by side (one with the daemon, one with no plugin, as in "
        f"*Dense nodes*), the sides alternating within each of {host['rounds']} measured "
        f"rounds after 2 warm-up rounds; the daemon keeps running. The window and *misplaced* "
        f"are read as in the guest (`cpuset.effective_cpus` on cgroup v1).",
        "",
        *table(host["cells"]),
        "",
        f"What the `runc update`s targeted: {targets(host['cells'])}.",
        "",
    ]


if __name__ == "__main__":
    started = time.monotonic()
    print("\n".join(lines(bench_guest_pod_starts(shared_counts=(0, 8), rounds=1, warmup=0))))
    print(f"{time.monotonic() - started:.0f} s")
