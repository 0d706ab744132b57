"""Benchmarks through real containerd (2.1.9 unless a benchmark says which) + runc, the test
harness's instances, side by side.

Two private containerd instances run at once, one with a plugin and one without, and the
measured operations alternate between them, so machine noise hits both sides alike.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.daemon import Daemon
from harness.containerd import Containerd
from harness.k8s import ContainerSpec, PodSpec

from .scratch import scratch
from .stats import summary


def _noop_plugin(socket: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("noop_plugin.py")), str(socket)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the no-op plugin did not register")
    return proc


def _ratio(with_plugin: list[float], without: list[float]) -> float:
    return statistics.median(with_plugin) / statistics.median(without)


def bench_create_latency(rounds: int = 60) -> dict:
    """CRI CreateContainer with a no-op NRI plugin connected vs no plugin (containerd 2.1.9)."""
    with ExitStack() as stack:
        plain = stack.enter_context(Containerd("2.1", debug=False))
        hooked = stack.enter_context(Containerd("2.1", debug=False))
        plugin = _noop_plugin(hooked.nri_socket)
        stack.callback(plugin.kill)
        samples: dict[str, list[float]] = {"plugin": [], "none": []}
        pods = {
            "plugin": hooked.cri().run_pod(PodSpec("lat", qos="besteffort")),
            "none": plain.cri().run_pod(PodSpec("lat", qos="besteffort")),
        }
        runtimes = {"plugin": hooked, "none": plain}
        for i in range(rounds + 5):
            order = ("plugin", "none") if i % 2 else ("none", "plugin")
            for side in order:
                cri = runtimes[side].cri()
                start = time.perf_counter()
                cid = cri.create_container(pods[side], ContainerSpec(f"c{i}"))
                elapsed = time.perf_counter() - start
                cri.remove(cid)
                if i >= 5:  # warm-up rounds are not measured
                    samples[side].append(elapsed)
    return {
        "plugin": summary(samples["plugin"]),
        "none": summary(samples["none"]),
        "median_ratio": _ratio(samples["plugin"], samples["none"]),
    }


def bench_exclusive_start_latency(rounds: int = 40, neighbour: bool = True) -> dict:
    """CRI CreateContainer + StartContainer of a Guaranteed 1-CPU container with the CPU plugin
    vs no plugin.  With ``neighbour``, a shared-pool container runs beside it, which the plugin
    moves off the new exclusive CPU in the same step (the daemon writes its cgroup before it
    replies: the price of having no window) - the node without the plugin does nothing of the
    kind."""
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        plain = stack.enter_context(Containerd("2.1", debug=False))
        pinned = stack.enter_context(Containerd("2.1", debug=False))
        daemon = Daemon(pinned.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        runtimes = {"plugin": pinned, "none": plain}
        for runtime in runtimes.values() if neighbour else ():
            runtime.cri().run("neighbour", [ContainerSpec("n", cpu_request_milli=100)])
        pods = {
            side: runtime.cri().run_pod(PodSpec("pinned", qos="guaranteed"))
            for side, runtime in runtimes.items()
        }
        samples: dict[str, list[float]] = {"plugin": [], "none": []}
        for i in range(rounds + 5):
            order = ("plugin", "none") if i % 2 else ("none", "plugin")
            for side in order:
                cri = runtimes[side].cri()
                start = time.perf_counter()
                cid = cri.create_container(pods[side], ContainerSpec.guaranteed(f"g{i}", 1))
                cri.start(cid)
                elapsed = time.perf_counter() - start
                cri.stop(cid, timeout=0)
                cri.remove(cid)
                if i >= 5:
                    samples[side].append(elapsed)
        pinned_count = len(daemon.records("allocate"))
    return {
        "plugin": summary(samples["plugin"]),
        "none": summary(samples["none"]),
        "median_ratio": _ratio(samples["plugin"], samples["none"]),
        "allocations": pinned_count,
    }


AGGRESSOR = "while :; do :; done & while :; do :; done"
RESERVED_CPU = 0
VICTIM_IMAGE = "lab.invalid/victim:1"


def victim_image(workdir: Path) -> Path:
    """The busybox image plus a static C victim that times its own iterations (victim.c):
    busybox cannot read a sub-second clock, and the runtime's log timestamps would add the
    log shim's own scheduling delays to what we measure."""
    from harness import image

    root = workdir / "victim-rootfs"
    shutil.copytree(image.rootfs(), root, symlinks=True)
    subprocess.run(
        ["gcc", "-O2", "-static", "-o", str(root / "bin" / "victim"),
         str(Path(__file__).with_name("victim.c"))],
        check=True,
    )  # fmt: skip
    tar = workdir / "victim.tar"
    tar.write_bytes(image.oci_layout_tar(root, {VICTIM_IMAGE: ["/bin/victim"]}))
    return tar


def bench_noisy_neighbour(seconds: float = 8.0, rounds: int = 2) -> dict:
    """A latency-sensitive Guaranteed 1-CPU victim (fixed compute loop timing its own
    iterations) with and without a Burstable aggressor burning 2 threads, on a node with the
    CPU plugin and on one without.  Phases alternate between the two nodes (and repeat), so
    both see the same machine noise."""
    results: dict[str, dict[str, list[float]]] = {
        side: {"alone": [], "aggressor": []} for side in ("plugin", "none")
    }
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        # As on a production node, the runtime and system daemons live on the reserved CPU
        # (systemd CPUAffinity / kubelet reservedSystemCPUs): this process and everything it
        # starts (both containerds, their shims, the plugin) inherit this affinity.
        # Containers get their cpusets from their cgroups regardless.
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {RESERVED_CPU})
        stack.callback(os.sched_setaffinity, 0, previous)
        tar = victim_image(Path(tmp))
        plain = stack.enter_context(Containerd("2.1", debug=False))
        pinned = stack.enter_context(Containerd("2.1", debug=False))
        daemon = Daemon(pinned.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        runtimes = {"plugin": pinned, "none": plain}
        for runtime in runtimes.values():
            runtime.import_images(tar)
        for n in range(rounds):
            for phase in ("alone", "aggressor"):
                for side in ("plugin", "none") if n % 2 == 0 else ("none", "plugin"):
                    results[side][phase] += _victim_run(runtimes[side].cri(), phase, seconds, n)
    report: dict = {"samples": results, "seconds": seconds, "rounds": rounds}
    for side, phases in results.items():
        alone, noisy = summary(phases["alone"]), summary(phases["aggressor"])
        report[side] = {
            "alone": alone,
            "aggressor": noisy,
            "p99_ratio": noisy["p99_ms"] / alone["p99_ms"],
            "median_ratio": noisy["median_ms"] / alone["median_ms"],
        }
    return report


def _victim_run(cri, phase: str, seconds: float, n: int) -> list[float]:
    aggressor = None
    if phase == "aggressor":  # already burning when the victim starts
        aggressor = cri.run(
            f"aggressor-{n}",
            [ContainerSpec("burn", cpu_request_milli=100, memory="16Mi", command=AGGRESSOR)],
        )
    victim = cri.run(
        f"victim-{phase}-{n}",
        [ContainerSpec.guaranteed("v", 1, image=VICTIM_IMAGE,
                                  command=["/bin/victim", str(seconds), "2000000"])],
    )  # fmt: skip
    cri.wait_state(victim["v"], "CONTAINER_EXITED", timeout=seconds + 30)
    if aggressor is not None:
        cri.stop(aggressor["burn"], timeout=0)
    lines = cri.logs(victim["v"])
    return [float(x) / 1e6 for x in lines[5:]]  # seconds; skip start-up iterations


def plot_noisy_neighbour(report: dict, out: Path) -> None:
    """Latency distributions of the victim's iterations (CDF), four curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    styles = {
        ("plugin", "alone"): ("tab:blue", "-"),
        ("plugin", "aggressor"): ("tab:blue", "--"),
        ("none", "alone"): ("tab:red", "-"),
        ("none", "aggressor"): ("tab:red", "--"),
    }
    for (side, phase), (color, dash) in styles.items():
        values = sorted(v * 1e3 for v in report["samples"][side][phase])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        label = (
            f"{'with nri-cpuplugin' if side == 'plugin' else 'no plugin'}, "
            f"{'alone' if phase == 'alone' else 'next to a 2-thread aggressor'} "
            f"(p99 {report[side][phase]['p99_ms']:.1f} ms)"
        )
        ax.plot(values, ys, color=color, linestyle=dash, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("victim iteration time (ms, log scale)")
    ax.set_ylabel("fraction of iterations")
    ax.set_title("Guaranteed 1-CPU victim on a 2-CPU node (containerd 2.1.9)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def bench_daemon_footprint(cycles: int = 200, idle_seconds: float = 10.0) -> dict:
    """RSS of the daemon across create/stop cycles, and its wake-ups while idle."""
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        runtime = stack.enter_context(Containerd("2.1", debug=False))
        daemon = Daemon(runtime.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        cri = runtime.cri()
        cri.run("neighbour", [ContainerSpec("n", cpu_request_milli=100)])
        pod = cri.run_pod(PodSpec("cycle", qos="guaranteed"))
        rss = {}
        for i in range(1, cycles + 1):  # one container restarting, as a crash loop would
            cid = cri.create_container(pod, ContainerSpec.guaranteed("g", 1))
            cri.start(cid)
            cri.stop(cid, timeout=0)
            cri.remove(cid)
            if i in (1, cycles // 4, cycles // 2, 3 * cycles // 4, cycles):
                rss[i] = _rss_kib(daemon.proc.pid)
        before = _context_switches(daemon.proc.pid)
        time.sleep(idle_seconds)
        after = _context_switches(daemon.proc.pid)
    return {
        "cycles": cycles,
        "rss_mib": {k: v / 1024 for k, v in rss.items()},
        "growth_mib_after_first_quarter": (rss[cycles] - rss[cycles // 4]) / 1024,
        "idle_seconds": idle_seconds,
        "idle_wakeups": after - before,
    }


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of every thread: each wake-up adds one."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if "ctxt_switches" in line:
                total += int(line.split()[1])
    return total


def bench_audit_cost(rounds: int = 400) -> dict:
    """The plugin's CreateContainer + StopContainer handlers with every decision sent to a real
    systemd-journald (private mount namespace) vs with auditing switched off; two plugins on
    their own state directories, calls alternating."""
    from harness.journald import PrivateJournal

    from nri_cpuplugin.daemon.plugin import CPUPlugin
    from nri_cpuplugin.ops.audit import Audit, JournalSink
    from nri_cpuplugin.ops.config import Settings

    from .bench_nri import realistic_container, realistic_pod

    samples: dict[str, list[float]] = {"journald": [], "off": []}
    with PrivateJournal() as journal, scratch() as tmp:
        plugins = {}
        for side in samples:
            audit = Audit(JournalSink(journal.socket_path))
            plugin = CPUPlugin(Settings(state_dir=f"{tmp}/{side}", reserved_cpu_count=1), audit)
            asyncio.run(plugin.configure("", "bench", "v0"))
            audit.enabled = side == "journald"
            plugins[side] = plugin
        pod = realistic_pod(3)
        for i in range(rounds):
            for side in ("journald", "off") if i % 2 else ("off", "journald"):
                container = realistic_container(pod, i)
                container.linux.resources.cpu.quota.value = 100000
                container.linux.resources.cpu.shares.value = 1024
                start = time.perf_counter()
                plugins[side].create_container(pod, container)
                plugins[side].stop_container(pod, container)
                samples[side].append(time.perf_counter() - start)
                plugins[side].remove_container(pod, container)
        entries = len(journal.entries("ACTION=allocate"))
    return {
        "journald": summary(samples["journald"]),
        "off": summary(samples["off"]),
        "median_ratio": _ratio(samples["journald"], samples["off"]),
        "allocate_entries": entries,
    }


def bench_cold_start(containers: int = 200, pods: int = 20) -> dict:
    """Time from starting ``nri-cpuplugin run`` to synchronized with the runtime, when
    containerd 2.1.9 already runs ``containers`` containers in ``pods`` pods."""
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        runtime = stack.enter_context(Containerd("2.1", debug=False))
        cri = runtime.cri()
        per_pod = containers // pods
        for p in range(pods):
            qos = "guaranteed" if p == 0 else "burstable"
            specs = [
                ContainerSpec.guaranteed("pinned", 1)
                if qos == "guaranteed" and c == 0
                else ContainerSpec(f"c{c}", cpu_request_milli=10, memory="8Mi")
                for c in range(per_pod)
            ]
            cri.run(PodSpec.for_containers(f"pod{p}", specs, qos=qos), specs)
        started = time.perf_counter()
        daemon = Daemon(runtime.nri_socket, Path(tmp) / "state").start(wait=False)
        stack.callback(daemon.stop)
        daemon.wait_synchronized(timeout=60)
        elapsed = time.perf_counter() - started
        [sync] = daemon.new_records("synchronize")
    return {"containers": containers, "pods": pods, "seconds": elapsed, "message": sync["MESSAGE"]}
