"""Concurrent pod starts: kubelet starts the pods it is given in parallel (one goroutine per
pod), so a node that just got 16 pods sees 16 RunPodSandbox + CreateContainer + StartContainer
sequences at once.  With the plugin, every one of those CreateContainers goes through the
daemon, and the exclusive one also moves the shared containers started so far off its CPU.

Two private containerd instances of one version side by side, one with ``nri-cpuplugin run``
and one with no plugin; each round starts the same 16 pods on one of them (the order of the
two alternates), timing the whole burst, then removes them all before the next round.
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from e2e.daemon import Daemon
from harness import host
from harness.containerd import Containerd
from harness.cri import CRIClient, RunningPod
from harness.k8s import ContainerSpec

from .bench_e2e import RESERVED_CPU
from .hotplug_guard import OnlineGuard, restore_cpusets
from .stats import summary


def bench_concurrent_pod_starts(version: str, rounds: int, pods: int = 16, warmup: int = 1) -> dict:
    """Wall time of starting ``pods`` pods at once (1 Guaranteed 1-CPU, the rest Burstable)
    through CRI, with the plugin vs no plugin, rounds alternating between the two nodes."""
    walls: dict[str, list[float]] = {"plugin": [], "none": []}
    misplaced = checked = disturbed = 0  # checked: plugin rounds whose placement was read
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        guard = stack.enter_context(OnlineGuard())
        plain = stack.enter_context(Containerd(version, debug=False))
        pinned = stack.enter_context(Containerd(version, debug=False))
        daemon = Daemon(pinned.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        runtimes = {"plugin": pinned, "none": plain}
        i = 0
        while min(len(w) for w in walls.values()) < rounds:
            if i >= 3 * (rounds + warmup):
                raise RuntimeError(f"CPU hotplug by other work disturbed {disturbed} rounds")
            for side in ("plugin", "none") if i % 2 else ("none", "plugin"):
                cri = runtimes[side].cri()
                guard.wait_all_online()
                restore_cpusets(cri.top_cgroup)  # the node is empty between rounds
                before = guard.changes
                try:
                    elapsed, started = _start_pods(cri, pods, f"r{i}")
                    wrong = _misplaced(cri, started) if side == "plugin" else 0
                except Exception as e:
                    if guard.changes == before:  # a failure of its own
                        raise RuntimeError(f"round {i} on the node with {side}: {e}") from e
                    cri.remove_all()
                    disturbed += 1
                    continue
                _remove_pods(cri, started)
                if guard.changes != before:  # a round hotplug_guard.py says to repeat
                    disturbed += 1
                    continue
                misplaced += wrong
                checked += side == "plugin"
                # The first rounds fill caches (image, binaries) on both sides.
                if i >= warmup and len(walls[side]) < rounds:
                    walls[side].append(elapsed)
            i += 1
        allocations = len(daemon.records("allocate"))
    plugin, none = summary(walls["plugin"]), summary(walls["none"])
    return {
        "version": version,
        "pods": pods,
        "rounds": rounds,
        "plugin": plugin,
        "none": none,
        # Of the medians the table shows (nearest rank: the middle round with an odd count).
        "median_ratio": plugin["median_ms"] / none["median_ms"],
        "max_ratio": plugin["max_ms"] / none["max_ms"],
        "misplaced": misplaced,
        "checked": checked,
        "disturbed": disturbed,
        "allocations": allocations,
    }


def _pod_specs(pods: int, tag: str) -> list[tuple[str, list[ContainerSpec]]]:
    exclusive = (f"{tag}-exclusive", [ContainerSpec.guaranteed("x", 1)])
    shared = [
        (f"{tag}-shared{k}", [ContainerSpec("s", cpu_request_milli=100, memory="16Mi")])
        for k in range(1, pods)
    ]
    return [exclusive, *shared]


def _start_pods(cri: CRIClient, pods: int, tag: str) -> tuple[float, list[RunningPod]]:
    """Every pod in its own thread (as kubelet's pod workers), released together, so the
    exclusive pod lands anywhere in the burst; the wall time runs from the release until the
    last StartContainer returned."""
    specs = _pod_specs(pods, tag)
    started: list[RunningPod | None] = [None] * len(specs)
    errors: list[BaseException] = []
    gate = threading.Barrier(len(specs) + 1)

    def one(k: int) -> None:
        name, containers = specs[k]
        gate.wait()
        try:
            started[k] = cri.run(name, containers)  # RunPodSandbox, CreateContainer, Start
        except BaseException as e:  # reported below, after every thread is done
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(specs))]
    for t in threads:
        t.start()
    gate.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return elapsed, [p for p in started if p is not None]


def _misplaced(cri: CRIClient, started: list[RunningPod]) -> int:
    """Containers whose processes the kernel lets run where the plugin says they must not,
    once every start returned: the exclusive one on the reserved CPU, a shared one on the
    exclusive CPU."""
    allowed = {
        name: set(host.parse_cpu_list(host.cpus_allowed_list(cri.inspect(cid).pid)))
        for pod in started
        for name, cid in ((f"{pod.id}/{n}", c) for n, c in pod.containers.items())
    }
    exclusive = next(cpus for name, cpus in allowed.items() if name.endswith("/x"))
    shared = [cpus for name, cpus in allowed.items() if not name.endswith("/x")]
    return (RESERVED_CPU in exclusive) + sum(bool(cpus & exclusive) for cpus in shared)


def _remove_pods(cri: CRIClient, started: list[RunningPod]) -> None:
    """StopPodSandbox (kills the containers) + RemovePodSandbox, in parallel to save time."""

    def remove(pod: RunningPod) -> None:
        cri.stop_pod(pod.id)
        cri.remove_pod(pod.id)

    with ThreadPoolExecutor(len(started) or 1) as pool:
        list(pool.map(remove, started))
