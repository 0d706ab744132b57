"""``./dev demo --guest``: the plugin on a production-shaped node - the test harness's QEMU guest
(tests/harness/guest.py): systemd as PID 1, cgroup v2, 8 CPUs as 2 sockets x 2 cores x 2
threads on 2 NUMA nodes, containerd 2.3.4 with runc's systemd cgroup driver, and the daemon as
packaging/ installs it (``nri-cpuplugin.service``, one CPU reserved).

Shows the topology the guest kernel reports and the daemon sees, a 4-CPU Guaranteed pod born
on 2 whole cores of one NUMA node with that node's memory, a second Guaranteed pod on the
other socket, a Burstable pod's CPUs shrinking as they start and growing back as they stop,
and ``nri-cpuplugin status``.  :func:`walk` is the demo's part once the node runs; the guest
tests run it too (tests/guest/test_pinning.py), so the demo cannot silently rot.

The guest runs under emulation when the host has no usable KVM (about 10x slower: a boot takes
about a minute, a pod start 10 s).  Leaving - at the end, on a failure, on Ctrl-C or SIGTERM -
powers the guest off, which ends every pod and the daemon with it (its disk is a throwaway
overlay), and stops QEMU by pid if it does not go.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from harness import guest_runtimes, guest_vm
from harness.guest import Guest, GuestError
from harness.guest_node import GuestNode
from harness.guest_runtimes import GuestRuntime
from harness.host import parse_cpu_list

RUNTIME = "containerd-2.3"
STEPS = "demo.in_guest"
BOLD, DIM, RESET = "\033[1m", "\033[2m", "\033[0m"


class Narrator:
    """Progress lines with the time since the demo began (the guest is slow: say why we wait)."""

    def __init__(self, write: Callable[[str], None] = print) -> None:
        self.write = write
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.write(f"\n{BOLD}== {text}{RESET}  {DIM}[{self.elapsed()}]{RESET}")

    def line(self, text: str) -> None:
        self.write(f"   {text}")

    def block(self, text: str) -> None:
        for line in text.rstrip().splitlines():
            self.line(line)

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.0f} s"


def walk(guest: Guest, runtime: GuestRuntime, say: Narrator) -> dict[str, Any]:
    """The demo on a node whose runtime and daemon run: pods started, shown and removed.
    Returns what was seen, for tests."""
    facts: dict[str, Any] = {"topology": _show_topology(guest, say)}
    address = runtime.cri_socket
    say.step("a Burstable pod 'web' (100m CPU), on the shared pool")
    web = _call(guest, "start_pod", say, address=address, name="web", milli=100)
    watch = {"web": web["cid"]}
    _show(say, web["views"], ["web"])
    facts["web_alone"] = web["views"]["web"]

    say.step("a Guaranteed pod 'db' with 4 CPUs: 2 whole cores of one NUMA node, its memory")
    db = _call(guest, "start_pod", say, address=address, name="db", cpus=4, watch=watch)
    say.line(f"db's very first lines (before anything could move it): {_first(db)}")
    _show(say, db["views"], ["db", "web"])
    facts["db"] = db
    watch["db"] = db["cid"]

    say.step("a second Guaranteed pod 'cache' with 2 CPUs: one whole core on the other socket")
    cache = _call(guest, "start_pod", say, address=address, name="cache", cpus=2, watch=watch)
    say.line(f"cache's very first lines: {_first(cache)}")
    _show(say, cache["views"], ["cache", "db", "web"])
    facts["cache"] = cache

    say.step("nri-cpuplugin status (in the guest)")
    status = guest.run(
        ["/usr/bin/python3", "-m", "nri_cpuplugin.cli", "status"],
        env=guest.python_env(),
        timeout=120,
    )
    say.block(status.stdout or status.describe())
    facts["status"] = {"rc": status.rc, "text": status.stdout}

    say.step("stop 'cache', then 'db': web grows back")
    facts["web_after"] = [
        _stop(guest, say, address, pod, {"web": web["cid"]})["web"] for pod in (cache, db)
    ]
    _stop(guest, say, address, web, {})
    return facts


def _stop(
    guest: Guest, say: Narrator, address: str, pod: dict[str, Any], watch: dict[str, str]
) -> dict[str, dict[str, str]]:
    """The pod stopped and removed; the containers of ``watch`` shown once they have its
    CPUs back."""
    done = _call(
        guest,
        "stop_pod",
        say,
        address=address,
        pod_id=pod["pod_id"],
        cid=pod["cid"],
        slice=pod["slice"],
        watch=watch,
        grows=parse_cpu_list(pod["first_lines"]["Cpus_allowed_list"]),
    )
    views: dict[str, dict[str, str]] = done["views"]
    if watch:
        say.line(f"removed in {done['stop_seconds']} s")
        _show(say, views, list(watch))
    return views


def _show_topology(guest: Guest, say: Narrator) -> dict[str, Any]:
    say.step("the guest's CPUs as its kernel reports them (lscpu, sysfs)")
    topology = guest.kernel_topology()
    say.line(topology.summary())
    say.step("... and as the daemon sees them: nri-cpuplugin topology (in the guest)")
    seen = guest.check(
        ["/usr/bin/python3", "-m", "nri_cpuplugin.cli", "topology"],
        env=guest.python_env(),
        timeout=120,
    )
    say.block(seen)
    return {
        "sockets": {str(cpu): s for cpu, s in topology.socket_of.items()},
        "numa_nodes": {str(n): cpus for n, cpus in topology.node_cpus.items()},
        "siblings": sorted(set(topology.thread_siblings.values())),
        "daemon_view": seen,
    }


def _call(guest: Guest, step: str, say: Narrator, **kwargs: Any) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = guest.call(f"{STEPS}:{step}", timeout=600, **kwargs)
    say.line(f"{DIM}({step} took {time.monotonic() - started:.0f} s in the guest){RESET}")
    return result


def _first(pod: dict[str, Any]) -> str:
    lines = pod["first_lines"]
    return f"Cpus_allowed_list {lines['Cpus_allowed_list'].strip()}, " + (
        f"Mems_allowed_list {lines['Mems_allowed_list'].strip()}"
    )


def _show(say: Narrator, views: dict[str, dict[str, str]], labels: list[str]) -> None:
    """Each container as its first process (``/proc/<pid>/status``) and systemd (its scope's
    properties) have it: a scope whose cpuset the daemon took over from systemd holds none."""
    for label in labels:
        v = views[label]
        held = v["allowed_cpus"].strip() or "(none: the cgroup files hold it)"
        say.line(
            f"{label:<6} Cpus_allowed_list {v['cpus_allowed_list']:<7} "
            f"Mems_allowed_list {v['mems_allowed_list']:<4} | "
            f"AllowedCPUs={held:<7} AllowedMemoryNodes={v['allowed_memory_nodes']}"
        )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    say = Narrator()
    signal.signal(signal.SIGTERM, _terminate)  # a kill powers the guest off too
    say.step("the guest node's lab: runtimes and images (cached under the lab after the first run)")
    if stale := guest_vm.reap_stale():
        raise SystemExit("leftovers of an earlier guest could not be removed:\n" + "\n".join(stale))
    guest_runtimes.prepare()
    say.step(
        "booting the guest: QEMU, systemd, cgroup v2 (built first if not cached; a boot takes "
        "about a minute under emulation)"
    )
    try:
        with Guest.boot(log=say.line) as guest:
            node = GuestNode(guest)
            say.step("containerd 2.3.4 (runc, systemd cgroup driver) and nri-cpuplugin.service")
            runtime = node.use(RUNTIME)
            node.start_daemon()
            say.line(f"{runtime.unit} and nri-cpuplugin.service active ({say.elapsed()})")
            walk(guest, runtime, say)
            say.step("powering the guest off (its pods and daemon go with it)")
    except KeyboardInterrupt:
        say.step("interrupted: the guest was powered off")
        raise SystemExit(130) from None
    except GuestError as e:
        say.step("failed: the guest was powered off")
        raise SystemExit(str(e)) from None
    say.line(f"done in {say.elapsed()}; nothing left behind")
