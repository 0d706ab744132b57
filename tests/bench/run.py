"""``./dev bench``: run every benchmark and rewrite docs/benchmarks.md with the figures.

Benchmarks are not tests: they measure, side by side in one run, and report medians and p99s
with the machine they ran on.  Run them on an otherwise idle machine when possible.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

from harness.containerd import NRI as CONTAINERD_NRI
from harness.containerd import RELEASES as CONTAINERD_RELEASES
from topologies import topology

from . import scratch
from .bench_crio import SIDES as CRIO_SIDES
from .bench_crio import bench_crio_exclusive_start
from .bench_dbus import HOOK_LOADED, IMPORTS, bench_dbus_clients
from .bench_density import bench_dense_create, cgroup_write_floor, plot_density
from .bench_e2e import (
    ISOLATION_SETUPS,
    bench_audit_cost,
    bench_cold_start,
    bench_create_latency,
    bench_daemon_footprint,
    bench_exclusive_start_latency,
    bench_noisy_neighbour,
    plot_noisy_neighbour,
)
from .bench_guest import bench_guest_pod_starts
from .bench_guest import lines as guest_lines
from .bench_hook import bench_hook_contention, bench_hook_latency
from .bench_host_starts import bench_host_pod_starts
from .bench_hw import bench_hotplug_latency, bench_nic_inspection
from .bench_irqload import IRQS, RESCAN, WRITE_COST, bench_irq_load
from .bench_nic import bench_nic_read_ahead
from .bench_nri import (
    bench_create_decode_encode,
    bench_plugin_handlers,
    bench_synchronize,
)
from .bench_pod_starts import bench_concurrent_pod_starts
from .bench_policy import bench_decisions, bench_resize, churn_quality, resize_churn
from .bench_state import bench_commit
from .bench_storm import bench_update_storm

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
OUTPUT = ROOT / "docs" / "benchmarks.md"


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return (
        f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def _ms(value: float) -> str:
    return f"{value:.3f} ms"


def section_foundation(quick: bool) -> list[str]:
    big = topology("bench-2s-256t-8numa")
    decisions = bench_decisions(big, rounds=500 if quick else 5000)
    commit = bench_commit(n_assignments=200, repeats=60 if quick else 500, directory=scratch.root())
    churn = churn_quality(topology("epyc-1s-4numa"), steps=2000 if quick else 10_000)
    resize = bench_resize(big, rounds=500 if quick else 5000)
    resize_churn_counts = resize_churn(topology("epyc-1s-4numa"), 2000 if quick else 10_000)
    lines = [
        "## Foundation",
        "",
        "### Decision latency",
        "",
        f"Policy decisions on a 2-socket, 256-thread, 8-NUMA topology (generated sysfs) with "
        f"{decisions['live_containers']} live exclusive containers of 1, 2, 4, 8 and 16 CPUs: "
        "each round releases a random container and admits a new one (state snapshot, "
        "allocator, new state).",
        "",
        "| step | samples | median | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for step in ("admit", "release", "decision"):
        s = decisions[step]
        label = "allocate + release" if step == "decision" else step
        lines.append(
            f"| {label} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} | "
            f"{_ms(s['max_ms'])} |"
        )
    lines += [
        "",
        "Goal: p99 <= 1 ms per decision.",
        "",
        "### State commit latency",
        "",
        f"Durable commit (encode, write temp, fsync, rename, fsync dir) of a state with "
        f"{commit['n_assignments']} assignments ({commit['size_bytes']} bytes) in the lab "
        f"directory on the checkout's disk ({commit['filesystem']}).",
        "",
        "| part | median | p99 |",
        "|---|---|---|",
        f"| whole commit | {_ms(commit['total']['median_ms'])} | "
        f"{_ms(commit['total']['p99_ms'])} |",
        f"| of which fsync | {_ms(commit['fsync']['median_ms'])} | "
        f"{_ms(commit['fsync']['p99_ms'])} |",
        "",
        f"fsync share (median of per-commit fsync/total): {commit['fsync_share']:.0%}. "
        "Goal: p99 <= 5 ms.",
        "",
        "### Churn quality",
        "",
        "Random allocate/release steps on the EPYC-like topology (1 socket, 64 cores / 128 "
        "threads, 4 NUMA nodes, 8-core LLC groups), machine kept 60-95 % busy, request sizes "
        "1-16. The same seeded sequence drives both allocators. A *fit* is a request that "
        "could have been placed in one NUMA node (one LLC group) at that moment; *kept* is "
        "how many of those were.",
        "",
        "| allocator | requests | single-NUMA fits | kept in one NUMA | single-LLC fits | "
        "kept in one LLC |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in churn.items():
        lines.append(
            f"| {name} | {c['requests']} | {c['numa_fit']} | {c['numa_hit']} "
            f"({c['numa_rate']:.1%}) | {c['llc_fit']} | {c['llc_hit']} ({c['llc_rate']:.1%}) |"
        )
    lines += [
        "",
        "*kubelet order* is a re-implementation (tests/bench/kubelet_order.py) of the order "
        "kubelet documents - whole sockets, whole cores, then threads on the fullest socket - "
        "which does not see NUMA nodes inside a socket or LLC groups.",
        "",
        "### In-place resize",
        "",
        f"Grow and shrink decisions (the engine's, as the daemon answers UpdateContainer) on the "
        f"same 256-thread topology with {resize['live_containers']} live exclusive containers:",
        "",
        "| step | samples | median | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for step in ("grow", "shrink"):
        s = resize[step]
        lines.append(
            f"| {step} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} | "
            f"{_ms(s['max_ms'])} |"
        )
    lines += [
        "",
        f"Resize churn on the EPYC-like topology ({resize_churn_counts['grows']} grows among "
        "random create/remove/grow/shrink steps, machine kept 60-95 % busy): a grow *could stay* "
        "when the free CPUs of the container's current NUMA node (LLC group) were enough.",
        "",
        "| grows that could stay in their NUMA node | kept there | could stay in their LLC "
        "group | kept there |",
        "|---|---|---|---|",
        f"| {resize_churn_counts['numa_fit']} | {resize_churn_counts['numa_kept']} "
        f"({resize_churn_counts['numa_rate']:.1%}) | {resize_churn_counts['llc_fit']} | "
        f"{resize_churn_counts['llc_kept']} ({resize_churn_counts['llc_rate']:.1%}) |",
        "",
        "Goal: 100 % of both.",
        "",
    ]
    return lines


def _row(label: str, s: dict) -> str:
    return f"| {label} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} |"


def section_transport(quick: bool) -> list[str]:
    codec = bench_create_decode_encode(500 if quick else 5000)
    sync = bench_synchronize(1000, 5 if quick else 20)
    create = bench_create_latency(20 if quick else 150)
    return [
        "## NRI transport",
        "",
        f"Plugin-side cost of one CreateContainer of realistic size ({codec['request_bytes']} "
        "bytes: pod and container with 30 annotations each, 20 env vars, 10 mounts): bytes "
        "in -> decode -> no-op handler -> encode -> bytes out, no socket.",
        "",
        "| step | samples | median | p99 |",
        "|---|---|---|---|",
        _row("decode + no-op handler + encode", codec),
        "",
        f"Synchronize with {sync['containers']} containers and their pods "
        f"({sync['state_bytes'] / 1e6:.1f} MB, sent as {sync['chunks']} chunks below ttrpc's "
        "4 MiB limit as NRI >= 0.8 does), from a FAKE runtime built on our codecs over a real "
        "unix socket, until the final reply is decoded (includes the fake's encoding). "
        "Goal: <= 100 ms.",
        "",
        "| step | samples | median | p99 |",
        "|---|---|---|---|",
        _row("split Synchronize, 1000 containers", sync),
        "",
        "CRI CreateContainer through real containerd 2.1.9, two private instances side by "
        "side, calls alternating between them: one with a no-op plugin (our stub) connected, "
        "one with no plugin: the floor for any plugin on this path.",
        "",
        "| containerd 2.1.9 | samples | median | p99 |",
        "|---|---|---|---|",
        _row("no-op plugin connected", create["plugin"]),
        _row("no plugin", create["none"]),
        "",
        f"Median ratio: **{create['median_ratio']:.3f}** (goal <= 1.05).",
        "",
    ]


def section_plugin(quick: bool) -> list[str]:
    handlers = bench_plugin_handlers(100 if quick else 1000)
    listed = bench_plugin_handlers(100 if quick else 1000, synchronized=True)
    earmarked = bench_plugin_handlers(100 if quick else 1000, synchronized=True, earmarked=True)
    alone = bench_exclusive_start_latency(15 if quick else 60, neighbour=False)
    beside = bench_exclusive_start_latency(15 if quick else 60, neighbour=True)
    starts = [
        bench_concurrent_pod_starts(version, 3 if quick else 9)
        for version in (("2.1",) if quick else ("2.1", "1.7"))
    ]
    noisy = bench_noisy_neighbour(2.0 if quick else 3.0, 2 if quick else 8)
    plot = ROOT / "docs" / "noisy-neighbour.png"
    plot_noisy_neighbour(noisy, plot)
    footprint = bench_daemon_footprint(50 if quick else 200, 5 if quick else 10)
    lines = [
        "## The CPU plugin end to end",
        "",
        "The plugin's own handlers, in process, on this machine's topology (reserved CPU 0, "
        "exclusive CPU 1, one shared neighbour to update), until the answer; the state is "
        "committed with fsync to the checkout's disk. An exclusive creation is committed before "
        "its answer until the runtime has listed its containers (Synchronize), at the "
        "container's StartContainer from then on; what follows the answer is waited for "
        "between requests, outside the figures. A creation that takes all of its pod's "
        "earmark (a new pod each time, started with a 1-CPU limit; the neighbour moved when "
        "the pod started, so it is left out) is answered before it is decided:",
        "",
        "| handler | samples | median | p99 |",
        "|---|---|---|---|",
        _row("CreateContainer (exclusive), committed first", handlers["create_container"]),
        _row("CreateContainer (exclusive), after a Synchronize", listed["create_container"]),
        _row(
            "CreateContainer (exclusive), its pod's earmark, after a Synchronize",
            earmarked["create_container"],
        ),
        _row("StopContainer (release)", handlers["stop_container"]),
        "",
        "CRI CreateContainer + StartContainer of a Guaranteed 1-CPU container through real "
        "containerd 2.1.9 and runc, two instances side by side, alternating: one with "
        "`nri-cpuplugin run`, one with no plugin.",
        "",
        "| setup | side | samples | median | p99 |",
        "|---|---|---|---|---|",
    ]
    for label, result in (("no other container", alone), ("one shared neighbour", beside)):
        for side, name in (("plugin", "with nri-cpuplugin"), ("none", "no plugin")):
            s = result[side]
            lines.append(
                f"| {label} | {name} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} |"
            )
    lines += [
        "",
        f"Median ratio, no other container: **{alone['median_ratio']:.3f}**; with one shared "
        f"neighbour: **{beside['median_ratio']:.3f}** (goal <= 1.10). With a neighbour the "
        "daemon writes the neighbour's cgroup before CreateContainer returns: that is the cost "
        "of closing kubelet's reconcile window, which the node without a plugin does not pay "
        "(and does not close).",
        "",
    ]
    lines += _concurrent_starts(starts)
    lines += _isolation(noisy)
    lines += [
        "### Daemon footprint",
        "",
        f"`nri-cpuplugin run` RSS across {footprint['cycles']} create/start/stop/remove "
        "cycles of an exclusive container (containerd 2.1.9): "
        + ", ".join(f"after {k}: {v:.1f} MiB" for k, v in footprint["rss_mib"].items())
        + f"; growth after the first quarter {footprint['growth_mib_after_first_quarter']:.2f}"
        f" MiB. Goal <= 60 MB. Context switches of all its threads during "
        f"{footprint['idle_seconds']:g} s idle: **{footprint['idle_wakeups']}** (no periodic "
        "wake-ups).",
        "",
    ]
    return lines


def _concurrent_starts(results: list[dict]) -> list[str]:
    first = results[0]
    lines = [
        "### Concurrent pod starts",
        "",
        f"kubelet starts the pods it is given in parallel. {first['pods']} pods - one "
        f"Guaranteed pod with a 1-CPU container, {first['pods'] - 1} Burstable pods with one "
        "100m container each - started at once, each by its own thread sending "
        "RunPodSandbox, CreateContainer and StartContainer through CRI as kubelet's pod "
        "workers do; the wall time runs from the threads' release until the last "
        "StartContainer returned. Two private containerd instances of one version side by "
        "side, one with `nri-cpuplugin run`, one with no plugin; each round starts the pods "
        "on both in turn (which goes first alternates) and removes them again, after one "
        "warm-up round. With this few rounds the p99 would be the slowest round: the table "
        "gives that, as *max*.",
        "",
        "| containerd (NRI) | rounds | with nri-cpuplugin (median / max) | "
        "no plugin (median / max) | median ratio | max ratio | misplaced |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, n = r["plugin"], r["none"]
        lines.append(
            f"| {CONTAINERD_RELEASES[r['version']]} (NRI {CONTAINERD_NRI[r['version']]}) | "
            f"{r['rounds']} | {_ms(p['median_ms'])} / "
            f"{_ms(p['max_ms'])} | {_ms(n['median_ms'])} / {_ms(n['max_ms'])} | "
            f"**{r['median_ratio']:.3f}** | {r['max_ratio']:.3f} | {r['misplaced']} |"
        )
    disturbed = sum(r["disturbed"] for r in results)
    lines += [
        "",
        "Goal: median ratio <= 1.10. *misplaced* counts, once a round's last StartContainer "
        "returned on the node with the plugin, the containers the kernel lets run where the "
        "plugin says they must not (`Cpus_allowed_list` of their process): the exclusive one on "
        "the reserved CPU, a shared one on the exclusive CPU; summed over the "
        f"{' and '.join(str(r['checked']) for r in results)} rounds checked, warm-up included. "
        "Goal: 0.",
        "",
    ]
    if disturbed:
        lines[-1:] = [
            f"{disturbed} rounds were done again: CPU hotplug by other work on the machine "
            "overlapped them (tests/bench/hotplug_guard.py).",
            "",
        ]
    return lines


def _isolation(noisy: dict) -> list[str]:
    cpu = noisy["victim_cpu"]
    labels = {
        "plugin": "**plugin**",
        "bare": "**bare** pinning",
        "none": "**none**",
        "alone": "*alone* (reference)",
    }
    lines = [
        "### Isolation from a noisy neighbour",
        "",
        "A latency-sensitive Guaranteed 1-CPU victim (a static C loop timing its own "
        "iterations with CLOCK_MONOTONIC, ~0.5 ms of work each) next to a Burstable "
        "aggressor burning 2 threads, on a 2-CPU node (containerd 2.1.9), in three setups "
        "and a reference:",
        "",
        f"- **plugin**: the node runs `nri-cpuplugin run` (reserved CPU 0); the victim gets CPU "
        f"{cpu}, and the aggressor, already burning, is moved to CPU 0 when the victim is "
        "created.",
        "- **bare**: no plugin; the same placement by hand - the cpuset fields of the CRI "
        "requests, as kubelet's static CPU manager would send them, which runc writes into each "
        f"container's cpuset cgroup: victim on CPU {cpu}, aggressor on CPU 0. This is the "
        "physical limit of that placement on this machine: the plugin's result, with nothing "
        "of the plugin running.",
        "- **none**: no plugin and no pinning; victim and aggressor float over both CPUs.",
        f"- *alone*: the victim pinned by hand to CPU {cpu}, no aggressor.",
        "",
        "On this VM the two vCPUs interfere through the host: a busy CPU 0 slows CPU "
        f"{cpu} down however the guest places its tasks, so next to the aggressor the victim "
        "is slower than alone whatever the placement, and comparing with *alone* would measure "
        "the hypervisor. The yardstick is **bare**, in the same run. Each of the "
        f"{noisy['rounds']} rounds runs every setup once ({noisy['seconds']:g} s of victim "
        "each), in an order that rotates from round to round. As on a production node, the "
        "runtime processes the benchmark starts (containerd, shims, the plugin) live in a "
        "cpuset cgroup holding only the reserved CPU 0.",
        "",
        "| setup | victim's CPUs | other containers' CPUs | iterations | median | p99 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for setup in ISOLATION_SETUPS:
        r = noisy[setup]
        others = ", ".join(r["others_cpus"]) or "-"
        lines.append(
            f"| {labels[setup]} | {', '.join(r['victim_cpus'])} | {others} | {r['n']} | "
            f"{_ms(r['median_ms'])} | {_ms(r['p99_ms'])} | {_ms(r['max_ms'])} |"
        )
    none, bare = noisy["none"], noisy["bare"]
    lines += [
        "",
        f"plugin / bare: median **{noisy['median_ratio']:.3f}**, p99 "
        f"**{noisy['p99_ratio']:.3f}** (goal <= 1.10 both). For comparison none / bare: "
        f"median {none['median_ms'] / bare['median_ms']:.3f}, p99 "
        f"{none['p99_ms'] / bare['p99_ms']:.3f}.",
        "",
        f"Who could take CPU {cpu} from the victim, summed over the runs of each setup:",
        "",
        f"| setup | victim's involuntary context switches (per s) | other containers' tasks "
        f"allowed on CPU {cpu} | ... that last ran on CPU {cpu} | pods' sandbox tasks allowed "
        f"on CPU {cpu} | tasks outside the node seen running on CPU {cpu}: kernel threads / "
        "processes |",
        "|---|---|---|---|---|---|",
    ]
    for setup in ISOLATION_SETUPS:
        r = noisy[setup]
        seconds = noisy["seconds"] * noisy["rounds"]
        lines.append(
            f"| {labels[setup]} | {r['nivcsw']} ({r['nivcsw'] / seconds:.0f}) | "
            f"**{r['allowed']}** | **{r['ran']}** | {r['sandbox_allowed']} | "
            f"{r['outside_kthreads']} / {r['outside_processes']} |"
        )
    lines += [
        "",
        "- *involuntary context switches*: the kernel's count for the victim's process over "
        "its timed loops (`nonvoluntary_ctxt_switches` of /proc/<pid>/status, read by the "
        "victim itself with getrusage so that none of the loop is missed): each time the "
        "scheduler gave the victim's CPU to another task. The hypervisor descheduling the "
        "vCPU itself is not counted; it shows only in the iteration times.",
        "- *other containers' tasks*: distinct tasks of the node's other containers that, in "
        f"any of the samples taken every 0.2 s while the victim ran, had CPU {cpu} in "
        "`Cpus_allowed_list` (/proc/<tid>/status) or had last run on it (field 39 of "
        "/proc/<tid>/stat). Zero in both columns means none of the victim's involuntary "
        "switches came from another container. Goal: 0 with the plugin. In **none** the "
        f"victim has no CPU of its own; CPU {cpu} is shown for comparison.",
        "- *pods' sandbox tasks*: the pause processes of the node's pods (the victim's own "
        "included), which sleep for the pod's life; no setup places them.",
        "- *outside the node*: tasks of the machine in none of the node's cgroups seen running "
        f"on CPU {cpu} (last ran there, and their run time in /proc/<tid>/schedstat grew "
        "between two samples; a lower bound). The per-CPU kernel threads (timers, RCU, "
        "workqueues, the block layer) run there on any node. The processes are other work "
        "on this shared machine, not confined to CPU 0 as a node's system daemons would be. "
        "With no other container allowed there, these are what the pinned victim's "
        "involuntary switches come from.",
        "",
        "![victim iteration time distributions](noisy-neighbour.png)",
        "",
    ]
    if noisy["repeated"]:
        lines[-1:] = [
            f"{len(noisy['repeated'])} runs were done again: CPU hotplug by other work on the "
            "machine overlapped them (tests/bench/hotplug_guard.py).",
            "",
        ]
    return lines


def section_hook(quick: bool) -> list[str]:
    latency = bench_hook_latency(30 if quick else 200)
    shared = bench_hook_contention(32, 1 if quick else 3, exclusive=False)
    exclusive = bench_hook_contention(32, 1 if quick else 3, exclusive=True)
    ratio = latency["ratio"]
    lines = [
        "## OCI hook",
        "",
        "`createRuntime` wall time per invocation, installed as packaging/README.md says (a venv "
        f"of the distribution's Python, `pip install`; {latency['interpreter']}) and started as "
        "the runtime starts it (state JSON on stdin, PATH only).  Half the samples place an "
        "exclusive container (its pod's network namespace, with a veth and a macvlan, read for "
        f"NIC locality; {latency['shared_containers']} shared containers rewritten; a stale "
        "entry released), half a burstable one; the state is committed each time.  Containers "
        "are a cgroup and a process each, so that only the hook is timed; audit records go to a "
        "real systemd-journald.  Side by side in one "
        "run: the launcher `nri-cpuplugin install-hook` writes (what hooks/*.json runs), pip's "
        "console script, and a bare start of the same interpreter.",
        "",
        "| program | samples | median | p99 | ratio to `python -c pass` (median / p99) |",
        "|---|---|---|---|---|",
        _row("launcher (`install-hook`)", latency["launcher"])
        + f" **{ratio['launcher']['median']:.2f}** / {ratio['launcher']['p99']:.2f} |",
        _row("console script (`nri-cpuplugin-hook`)", latency["console_script"])
        + f" {ratio['console_script']['median']:.2f} / {ratio['console_script']['p99']:.2f} |",
        _row("`python -c pass`", latency["bare"]) + " 1.00 |",
        "",
        "Goal: median <= 50 ms and ratio <= 2.5.",
        "",
        "32 launcher invocations started at once (one per container), per round:",
        "",
        "| containers | rounds | total (median) | longest lock wait | succeeded / refused |",
        "|---|---|---|---|---|",
    ]
    for label, result in (("Burstable (all share)", shared), ("1 exclusive CPU each", exclusive)):
        lines.append(
            f"| {label} | {result['rounds']} | {_ms(result['total_median_ms'])} | "
            f"{_ms(result['longest_lock_wait_ms'])} | {result['succeeded']} / "
            f"{result['refused']} |"
        )
    lines.append("")
    return lines


def section_operations(quick: bool) -> list[str]:
    audit = bench_audit_cost(100 if quick else 1000)
    cold = bench_cold_start(200, 20)
    return [
        "## Operations",
        "",
        "The plugin's CreateContainer + StopContainer handlers (one exclusive container, state "
        "committed with fsync) with every decision sent to a real systemd-journald (private "
        "mount namespace, native protocol) vs auditing switched off; two plugins with their own "
        "state directories, calls alternating.",
        "",
        "| audit | samples | median | p99 |",
        "|---|---|---|---|",
        _row("journald", audit["journald"]),
        _row("off", audit["off"]),
        "",
        f"Median ratio: **{audit['median_ratio']:.3f}** (goal <= 1.05); "
        f"{audit['allocate_entries']} `ACTION=allocate` entries read back from the journal.",
        "",
        f"Cold start: `nri-cpuplugin run` started next to containerd 2.1.9 already running "
        f"{cold['containers']} containers in {cold['pods']} pods: synchronized "
        f"**{cold['seconds'] * 1000:.0f} ms** after the process started ({cold['message']}).",
        "",
    ]


def section_hardware(quick: bool) -> list[str]:
    hotplug = bench_hotplug_latency(5 if quick else 20)
    nic = bench_nic_inspection(50 if quick else 300)
    return [
        "## Hardware awareness",
        "",
        f"CPU 1 of this machine taken offline and back {hotplug['cycles']} times under "
        "containerd 2.1.9 with the daemon, an exclusive container on CPU 1 and a shared one on "
        "CPU 0. From the kernel's uevent (as received by the benchmark's own netlink socket, "
        "multicast at the same instant as the daemon's) until the affected container's cgroup "
        "holds its new cpuset and its process runs there:",
        "",
        "| event | cycles | median | max |",
        "|---|---|---|---|",
        f"| offline | {hotplug['offline']['n']} | {_ms(hotplug['offline']['median_ms'])} | "
        f"{_ms(hotplug['offline']['max_ms'])} |",
        f"| online | {hotplug['online']['n']} | {_ms(hotplug['online']['median_ms'])} | "
        f"{_ms(hotplug['online']['max_ms'])} |",
        "",
        "The plugin's CreateContainer handler for an exclusive container whose pod has its own "
        "network namespace (real netns, veth; veth + macvlan on the host NIC), against the same "
        "handler for a host-network pod (no inspection), alternating:",
        "",
        "| pod network | samples | median | p99 |",
        "|---|---|---|---|",
        _row("host network (no inspection)", nic["create_host_network"]),
        _row("netns with veth", nic["create_netns_veth"]),
        _row("netns with veth + macvlan", nic["create_netns_veth_macvlan"]),
        "",
        f"Added median: {nic['added_median_ms_veth']:.2f} ms (ratio "
        f"{nic['ratio_veth']:.2f}) with veth, {nic['added_median_ms_veth_macvlan']:.2f} ms "
        f"(ratio {nic['ratio_veth_macvlan']:.2f}) with veth + macvlan.",
        "",
    ]


def section_density(quick: bool) -> list[str]:
    counts = (0, 8) if quick else (0, 8, 32, 100)
    # The goal (1.10x) is a few percent above the no-op floor: with 30 rounds the medians
    # moved by about 5 % between runs, more than the differences measured.
    rounds = 6 if quick else 80
    versions = sorted(CONTAINERD_RELEASES, key=lambda v: tuple(map(int, v.split("."))))
    results = [bench_dense_create(version, n, rounds) for version in versions for n in counts]
    plot = ROOT / "docs" / "dense-node-create.png"
    plot_density(results, plot)
    lines = [
        "## Dense nodes",
        "",
        "A Guaranteed pod with one 1-CPU container started as kubelet starts it "
        "(RunPodSandbox with the pod's resources, CreateContainer, StartContainer) while N "
        "Burstable containers run; four private containerd instances of one version side by "
        'side, one with `nri-cpuplugin run`, one with its `pin_at = "start"` (below), '
        "one with a plugin that changes nothing (*no-op "
        "ratio*: the floor of any plugin, measured in the same run) and one with no plugin, in "
        f"turn, {rounds} rounds each, a new pod each round. The daemon earmarks CPU 1 for the "
        "pod when its sandbox starts and moves the shared containers off it then, by writing "
        "their cgroups (one `cpuset.cpus` write each, through files kept open since each "
        "container started; *RunPodSandbox ratio*); the exclusive container's CreateContainer "
        "takes the earmark and moves nobody. *Window open* counts shared containers still "
        "allowed on CPU 1 when CreateContainer returned (summed over the rounds). *Stop "
        "ratio*: StopContainer (no grace period) of the same container, which gives its CPU "
        "back to the shared containers. *Restart ratio*: the container created again in its "
        "running pod once every side has stopped its own (kubelet's restart of a container, "
        "after a pause): its previous CPU comes back from the shared pool, so the shared "
        "containers move before that CreateContainer returns, as without earmarks. *Specs "
        "converged* is the time from a restart of the daemon, with an exclusive container "
        "running, until the runtime's "
        "stored spec of every shared container moved by direct writes names the shared pool "
        "again (daemon start-up, Synchronize, one `runc update` per lagging container): what "
        "the runtime would re-apply when the daemon is not there to answer. Every ratio is "
        "plugin / no plugin, medians.",
        "",
        "| containerd (NRI) | running shared | create, plugin (median / p99) | create, no plugin | "
        "ratio | no-op ratio | create+start ratio | RunPodSandbox ratio | window open | "
        "stop ratio | restart ratio | specs converged |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, n = r["create"]["plugin"], r["create"]["none"]
        label = f"{CONTAINERD_RELEASES[r['version']]} ({CONTAINERD_NRI[r['version']]})"
        lines.append(
            f"| {label} | {r['running']} | {_ms(p['median_ms'])} / {_ms(p['p99_ms'])} | "
            f"{_ms(n['median_ms'])} / {_ms(n['p99_ms'])} | {r['create_ratio']:.2f} | "
            f"{r['noop_create_ratio']:.2f} | {r['create_start_ratio']:.2f} | "
            f"{r['sandbox_ratio']:.2f} | {r['window_open']} | {r['stop_ratio']:.2f} | "
            f"{r['recreate_ratio']:.2f} | {r['converge_s']:.2f} s |"
        )
    lines += ["", f"![create latency against running shared containers]({plot.name})", ""]
    lines += _pinned_at_start(results)
    lines += _dense_budget(results, counts)
    return lines + _nic_read_ahead(versions, 8 if quick else 30)


def _pinned_at_start(results: list[dict]) -> list[str]:
    lines = [
        "### Pinning at start",
        "",
        'The same rounds, on a fourth containerd whose daemon runs with `[nri] pin_at = "start"`: '
        "it is not consulted at CreateContainer, and decides each container at its "
        "StartContainer, before the first instruction (the systemd driver too, through "
        "systemd's D-Bus API; "
        'docs/architecture.md, "Pinning at start"). Ratios against the same no-plugin side. '
        "*Window open* as above (the earmark moved the shared containers when the pod "
        "started); *misplaced* counts started exclusive containers not on CPU 1 alone (also "
        "counted for the default daemon: " + ", ".join(f"{r['misplaced']}" for r in results) + ").",
        "",
        "| containerd (NRI) | running shared | create ratio | create+start ratio | "
        "RunPodSandbox ratio | window open | misplaced | stop ratio | restart ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r["at_start"]
        label = f"{CONTAINERD_RELEASES[r['version']]} ({CONTAINERD_NRI[r['version']]})"
        lines.append(
            f"| {label} | {r['running']} | {a['create_ratio']:.2f} | "
            f"{a['create_start_ratio']:.2f} | {a['sandbox_ratio']:.2f} | {a['window_open']} | "
            f"{a['misplaced']} | {a['stop_ratio']:.2f} | {a['recreate_ratio']:.2f} |"
        )
    return [*lines, ""]


def _dense_budget(results: list[dict], counts: tuple[int, ...]) -> list[str]:
    """What the goal (CreateContainer within 1.10x of no plugin) leaves the plugin, from the
    table above, beside the kernel's own cost of the writes, measured now."""
    floors = {n: cgroup_write_floor(n)["median_ms"] if n else 0.0 for n in counts}
    lines = [
        "### The 1.10x budget",
        "",
        "From the table above: *budget* is a tenth of the no-plugin median, *no-op* what the "
        "plugin that changes nothing cost over no plugin (the transport and containerd's NRI "
        "path), *left* the budget minus that, *daemon* what the daemon cost over the no-op: "
        "its decision, the shared containers' writes, the state. *Writes, kernel floor*: N "
        "`cpuset.cpus` writes through open files in a tight loop, nothing else on the way, "
        "measured in this run on private cgroups with one sleeping task each "
        "(`bench_density.cgroup_write_floor`): the least any plugin that moves every shared "
        "container before CreateContainer returns can spend on this machine - what earmarks "
        "move to RunPodSandbox, and what a restart's CreateContainer still pays.",
        "",
        "| containerd (NRI) | running shared | budget | no-op | left | daemon | writes, "
        "kernel floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        plugin, noop, none = (r["create"][side]["median_ms"] for side in ("plugin", "noop", "none"))
        label = f"{CONTAINERD_RELEASES[r['version']]} ({CONTAINERD_NRI[r['version']]})"
        budget = none / 10
        lines.append(
            f"| {label} | {r['running']} | {_ms(budget)} | {_ms(noop - none)} | "
            f"{_ms(budget - (noop - none))} | {_ms(plugin - noop)} | "
            f"{_ms(floors[r['running']])} |"
        )
    return [*lines, ""]


def _nic_read_ahead(versions: list[str], rounds: int) -> list[str]:
    results = [bench_nic_read_ahead(version, rounds) for version in versions]
    lines = [
        "### Pods in a network namespace of their own",
        "",
        "The pods above use the host network, so NIC locality has nothing to read. Here each "
        "round starts a new Guaranteed pod whose network namespace a real CNI run sets up (a "
        "veth `eth0`, and a macvlan `net1` on this machine's NIC, whose device the daemon "
        "traces), and creates its exclusive container; no shared containers. Three private "
        "containerd instances side by side, in turn: the daemon as shipped, which reads the "
        "pod's interfaces when its sandbox starts (*read ahead*), the daemon with "
        "`nic_read_ahead = false`, which reads them at the creation, and no plugin. "
        f"{rounds} rounds after 2 warm-up rounds. *Read ahead used*: the creations whose "
        "`nic-locality` record says the interfaces were read when the pod started (warm-up "
        "included).",
        "",
        "| containerd (NRI) | create: read ahead (median / p99) | create: at creation | "
        "create: no plugin | ratio: read ahead / at creation | RunPodSandbox ratio: read ahead "
        "/ at creation | read ahead used |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["create"]
        label = f"{CONTAINERD_RELEASES[r['version']]} ({CONTAINERD_NRI[r['version']]})"
        used = r["read_ahead_used"]
        lines.append(
            f"| {label} | {_ms(c['ahead']['median_ms'])} / {_ms(c['ahead']['p99_ms'])} | "
            f"{_ms(c['at-create']['median_ms'])} / {_ms(c['at-create']['p99_ms'])} | "
            f"{_ms(c['none']['median_ms'])} / {_ms(c['none']['p99_ms'])} | "
            f"{r['create_ratio']['ahead']:.2f} / {r['create_ratio']['at-create']:.2f} | "
            f"{r['sandbox_ratio']['ahead']:.2f} / {r['sandbox_ratio']['at-create']:.2f} | "
            f"{used['ahead']} / {used['at-create']} |"
        )
    return [*lines, ""]


def section_storm(quick: bool) -> list[str]:
    seconds = 4.0 if quick else 20.0
    versions = sorted(CONTAINERD_RELEASES, key=lambda v: tuple(map(int, v.split("."))))
    results = [bench_update_storm(version, seconds) for version in versions]
    lines = [
        "## Update storm",
        "",
        "Kubelet-like CRI calls racing the daemon's own changes to the same containers "
        "(tests/e2e/storm.py): three threads call UpdateContainerResources in a loop on 4 "
        "running shared containers and on the exclusive container of the moment, one thread "
        "creates, starts, stops and removes exclusive containers and their pods, one takes CPU 1 "
        "offline and back under them; the daemon changes those containers outside its replies "
        "(an exclusive container degraded into the shared pool while its CPU is offline and "
        "restored after it; the shared containers following the pool). Two private containerd "
        "instances of one version, one with the daemon and one with no plugin, the storm on "
        f"each in turn, {seconds:g} s per side in two alternating slices (CPU hotplug is "
        "machine-wide: the daemon also handles the hotplug of the other side's slices). Every "
        "containerd with an NRI before 0.12.1 deadlocks when a plugin's unsolicited "
        "UpdateContainers meets a CRI call; the daemon never sends one (*unsolicited updates*, "
        "counted in containerd's log). *Outside replies*: the daemon's `outside-reply` records, "
        "each a change it wrote to cgroups itself. Calls that failed are races the storm "
        "provokes (a container stopped while it was updated, a CPU offline just then).",
        "",
        "| containerd (NRI) | side | calls (failed) | UpdateContainerResources median / p99 | "
        "CreateContainer median / p99 | longest call | hotplug cycles | outside replies | "
        "unsolicited updates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        label = f"{CONTAINERD_RELEASES[r['version']]} ({CONTAINERD_NRI[r['version']]})"
        for side in ("daemon", "none"):
            per = r["per_method"]
            update = per["UpdateContainerResources"][side]
            create = per.get("CreateContainer", {}).get(side)
            create_ms = f"{_ms(create['median_ms'])} / {_ms(create['p99_ms'])}" if create else "-"
            lines.append(
                f"| {label} | {'daemon' if side == 'daemon' else 'no plugin'} | "
                f"{r['calls'][side] + r['failed'][side]} ({r['failed'][side]}) | "
                f"{_ms(update['median_ms'])} / {_ms(update['p99_ms'])} | {create_ms} | "
                f"{r['longest_ms'][side] / 1e3:.3f} s | {r['hotplug_cycles'][side]} | "
                f"{r['outside_reply_changes'] if side == 'daemon' else '-'} | "
                f"{r['unsolicited_updates'][side]} |"
            )
    hung = [f"{r['version']} {side}: {h}" for r in results for side, h in r["hangs"]]
    lines += ["", f"Calls that hung (over 10 s or cut off): {'; '.join(hung) or 'none'}.", ""]
    return lines


def section_dbus(quick: bool) -> list[str]:
    report = bench_dbus_clients(60 if quick else 400, 20 if quick else 100)
    imports = report["imports"]
    labels = {
        "ours": "ours (`hardware/systemd/`)",
        "jeepney": "jeepney (blocking)",
        "dbus-fast": "dbus-fast (asyncio)",
        "sdbus": "sdbus (libsystemd)",
    }
    lines = [
        "## D-Bus clients",
        "",
        "Setting a systemd scope's `AllowedCPUs`/`AllowedMemoryNodes` (`SetUnitProperties`, the "
        "systemd cgroup driver: docs/cgroups-and-hooks.md §21) with our own client "
        "(nri_cpuplugin/hardware/systemd/) and three libraries, side by side in one "
        "run, samples interleaved round by round (tests/bench/bench_dbus.py). The peer is a "
        "private Debian dbus-daemon with the system bus's reply limit and a FAKE systemd "
        "(tests/fake_systemd.py, jeepney; systemd cannot be PID 1 here) that answers every "
        "call; the FAKE's own time is in every figure alike.",
        "",
        f"Import, as the OCI hook's launcher starts Python (`python -I -S -c 'import X'`, "
        f"{imports['rounds']} rounds): wall time against the same start importing nothing, "
        "and the sum of `-X importtime` self times over the import (median):",
        "",
        "| client | import | samples | median | p99 | ratio to bare start (median / p99) "
        "| importtime |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = {
        "bare": ("bare start", "`pass`"),
        **{
            name: (label, f"`{IMPORTS[name].removeprefix('import ')}`")
            for name, label in labels.items()
        },
        "hook": ("what the hook has loaded already", f"`{HOOK_LOADED.removeprefix('import ')}`"),
        "ours, in the hook": ("ours, after that (against the row above)", "the same + ours"),
    }
    for name, (label, statement) in rows.items():
        s = imports["wall"][name]
        r = imports["ratio"][name]
        lines.append(
            f"| {label} | {statement} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} "
            f"| {r['median']:.2f} / {r['p99']:.2f} | {_ms(imports['importtime_ms'][name])} |"
        )
    lines += [
        "",
        "On a connection, per call (*connect*: connect, authenticate, Hello answered, close - "
        "sdbus completes its handshake only with a first call; *fresh*: connect, authenticate, "
        "Hello, one call answered, close - what the hook pays for one container, where ours "
        "writes the handshake and the call at once; *call*: one call on an open connection; "
        f"*{report['pipelined_calls']} pipelined*: all sent, every answer awaited - what the "
        "daemon pays when a pool change moves that many shared containers). *Client CPU*: the "
        "benchmark process's CPU time per call, the client's own work. *Peer to peer* is our "
        "client on the FAKE's own socket, as systemd's `/run/systemd/private` is reached "
        "(no dbus-daemon in between, no Hello).",
        "",
        f"| client | connect: median / p99 | fresh: median / p99 | client CPU | call: median / "
        f"p99 | client CPU | {report['pipelined_calls']} pipelined: median / p99 | client CPU "
        "per call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sides = {
        "ours": labels["ours"],
        "ours, peer to peer": "ours, peer to peer",
        "jeepney": labels["jeepney"],
        "dbus-fast": labels["dbus-fast"],
        "sdbus": labels["sdbus"] + " (pipelined: its asyncio API)",
    }
    for name, label in sides.items():
        connect = report["connect"].get(name)
        cells = [f"{_ms(connect['median_ms'])} / {_ms(connect['p99_ms'])}" if connect else "-"]
        for kind in ("fresh", "call", "pipelined"):
            s = report[kind].get(name)
            cells += (
                [f"{_ms(s['median_ms'])} / {_ms(s['p99_ms'])}", _ms(s["cpu_per_call_ms"])]
                if s
                else ["-", "-"]
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ours = report["call"]["ours"]["median_ms"]
    wall = {name: s["median_ms"] for name, s in imports["wall"].items()}
    lines += [
        "",
        f"{report['rounds']} rounds of *fresh* and *call*, {max(10, report['rounds'] // 10)} "
        "of the pipelined batch. Ratios of medians, ours against each library: import "
        + ", ".join(
            f"{name} {wall[name] / wall['ours']:.2f}x" for name in ("jeepney", "dbus-fast", "sdbus")
        )
        + " as long as ours; one call "
        + ", ".join(
            f"{name} {report['call'][name]['median_ms'] / ours:.2f}x"
            for name in ("jeepney", "dbus-fast", "sdbus")
        )
        + ".",
        "",
    ]
    return lines


def section_crio(quick: bool) -> list[str]:
    report = bench_crio_exclusive_start(rounds=8 if quick else 30)
    labels = {"none": "no pinning", "hook": "OCI hook (hooks.d)", "daemon": "NRI daemon"}
    lines = [
        "## CRI-O",
        "",
        "### Starting an exclusive container: hook vs daemon vs nothing",
        "",
        "CRI CreateContainer + StartContainer of a Guaranteed 1-CPU container on CRI-O 1.36.3 "
        "(conmon 2.1.6, runc 1.1.5, `vfs` storage, cgroupfs manager), three private instances "
        "in one run: one with nothing, one with the project's hooks.d files in its `hooks_dir` "
        "(NRI off), one with the NRI daemon connected. The operation rotates between them, "
        f"{report['rounds']} measured rounds each after 3 warm-up rounds; the container is "
        "stopped and removed between rounds. With *n* shared (Burstable) containers running "
        "beside it, pinning moves each of them off the new exclusive CPU in the same step: the "
        "hook writes their cgroups itself, and so does the daemon, before its answer (what it "
        "cannot write, it leaves to CRI-O's `runc update`).",
        "",
        "| shared containers | side | median | p99 | vs no pinning (median) |",
        "|---|---|---|---|---|",
    ]
    for n in sorted(k for k in report if isinstance(k, int)):
        base = report[n]["none"]["median_ms"]
        for side in CRIO_SIDES:
            s = report[n][side]
            extra = s["median_ms"] - base
            vs = "-" if side == "none" else f"{extra:+.1f} ms ({s['median_ms'] / base:.2f}x)"
            lines.append(
                f"| {n} | {labels[side]} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} | {vs} |"
            )
    lines += ["", f"The daemon made {report['allocations']} exclusive allocations.", ""]
    return lines


def section_guest(quick: bool) -> list[str]:
    """Pod starts on the QEMU guest node (systemd driver), plugin vs none, and the same on the
    host's cgroupfs (run first, before the guest loads the machine)."""
    counts = (0, 8) if quick else (0, 8, 32, 100)
    host = bench_host_pod_starts("2.3", counts, rounds=4 if quick else 20)
    # Under TCG a pod start takes seconds: the cell with 100 shared containers runs only when
    # the estimate says it ends within 50 minutes (the report says when it was left out).
    guest = bench_guest_pod_starts(counts, rounds=2 if quick else 8, budget_s=3000.0)
    return guest_lines(guest, host)


def section_irqload(quick: bool) -> list[str]:
    report = bench_irq_load(20.0 if quick else 60.0)
    budget_ms = report["budget_s"] * 1e3
    work = report["sides"]["interrupt work"]
    lines = [
        "## Requests under interrupt load",
        "",
        f"The daemon in-process (its NRI adapter called as the stub calls it) on a generated "
        f"48-CPU node with {IRQS} changeable interrupts, each affinity write made to take "
        f"{WRITE_COST * 1e3:g} ms (tests/bench/bench_irqload.py). Pods start one after "
        "another (RunPodSandbox, CreateContainer, StartContainer; Guaranteed and Burstable, "
        f"the oldest removed past 8) for {report['seconds']:g} s per side. *Interrupt work*: "
        "two irq-free pods (every interrupt narrowed for the first, planned again for the "
        f"second a third of the way in), a rescan every {RESCAN:g} s (twice the daemon's "
        "rate; each re-reads every interrupt) after a FAKE irqbalance put a tenth of them "
        f"back on every CPU: {work['writes']} affinity writes "
        f"({work['writes'] * WRITE_COST:.0f} s of them) and {work['rescans']} rescans during "
        "the side. *None*: the same node and pods, not irq-free. Decision latency: from the "
        "handler's call to its answer.",
        "",
        f"Machine: {machine()}.",
        "",
        "| side | request | samples | p50 | p99 | max | budget misses |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in ("interrupt work", "none"):
        result = report["sides"][side]
        for name, s in result["per_request"].items():
            lines.append(
                f"| {side} | {name} | {s['n']} | {_ms(s['median_ms'])} | {_ms(s['p99_ms'])} | "
                f"{_ms(s['max_ms'])} | {result['misses']} |"
            )
    lines += [
        "",
        f"Budget: {budget_ms:g} ms (`nri.request_budget`). Goal: p99 within it, no miss "
        "(*budget misses* counts the side's requests answered without their decision).",
        "",
    ]
    return lines


SECTIONS = (
    "foundation",
    "transport",
    "plugin",
    "hook",
    "operations",
    "hardware",
    "density",
    "storm",
    "crio",
    "dbus",
    "guest",
    "irqload",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `./dev bench` (or `make bench`); every figure below comes from one run.",
        "",
        f"- Run: {started}{' (--quick)' if args.quick else ''}; command: `./dev bench`",
        f"- Machine: {machine()}",
        "",
    ]
    sections = {
        "foundation": section_foundation,
        "transport": section_transport,
        "plugin": section_plugin,
        "hook": section_hook,
        "operations": section_operations,
        "hardware": section_hardware,
        "density": section_density,
        "storm": section_storm,
        "crio": section_crio,
        "dbus": section_dbus,
        "guest": section_guest,
        "irqload": section_irqload,
    }
    for name, section in sections.items():
        if not args.only or name in args.only:
            lines += section(args.quick)
    if args.only and args.output.exists():
        # a partial run replaces its own sections in the existing file and keeps the others
        note = (
            f"Section regenerated {started} with `./dev bench --only {' --only '.join(args.only)}`."
        )
        lines = merge_sections(args.output.read_text(), lines, note)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))


def merge_sections(existing: str, fresh: list[str], note: str) -> list[str]:
    """``existing`` with each ``## `` section of ``fresh`` (after its preamble) put in place of
    the section of the same title, or appended; each replaced section says when it was run."""

    def split(lines: list[str]) -> tuple[list[str], list[list[str]]]:
        preamble: list[str] = []
        parts: list[list[str]] = []
        for line in lines:
            if line.startswith("## "):
                parts.append([line])
            elif parts:
                parts[-1].append(line)
            else:
                preamble.append(line)
        return preamble, parts

    preamble, old = split(existing.split("\n"))
    _, new = split(fresh)
    titles = [part[0] for part in old]
    for part in new:
        part = [part[0], "", note, *part[1:]]
        if part[0] in titles:
            old[titles.index(part[0])] = part
        else:
            old.append(part)
    return preamble + [line for part in old for line in part]


if __name__ == "__main__":
    main()
