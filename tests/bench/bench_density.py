"""Dense nodes: what creating an exclusive container costs while N shared containers run.

Four private containerd instances of one version side by side: two with ``nri-cpuplugin run``
(deciding at CreateContainer, the default, and with ``[nri] pin_at = "start"``), one with a
plugin that changes nothing (the floor of any plugin) and one with no plugin, each running the
same N Burstable containers; a Guaranteed 1-CPU container is created (and started) on each in
turn.  With the plugin, every shared container must leave the new exclusive CPU before
CreateContainer returns, and the container must run on it from its first instruction.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.daemon import Daemon
from harness import host
from harness.containerd import Containerd
from harness.k8s import ContainerSpec, PodSpec

from .bench_e2e import _ratio, noop_plugin
from .stats import summary


def bench_dense_create(version: str, running: int, rounds: int) -> dict:
    """A Guaranteed pod with a 1-CPU container started beside ``running`` shared containers,
    as kubelet starts it (RunPodSandbox with the pod's resources, CreateContainer,
    StartContainer), its container stopped (which gives the CPU back to them) and created
    again in the same pod (a restart), then the pod removed: with the plugin deciding at
    creation, with it pinning at start, with a no-op plugin and with no plugin, in turn (who
    goes first rotates)."""
    sides = ("plugin", "start", "noop", "none")
    pinned_sides = ("plugin", "start")
    timed = ("sandbox", "create", "start", "stop", "recreate")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        runtimes = {side: stack.enter_context(Containerd(version, debug=False)) for side in sides}
        daemon = Daemon(runtimes["plugin"].nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        config = Path(tmp) / "pin-at-start.toml"
        config.write_text('[nri]\npin_at = "start"\n')
        at_start = Daemon(runtimes["start"].nri_socket, Path(tmp) / "state-start", config=config)
        stack.callback(at_start.start().stop)
        stack.callback(noop_plugin(runtimes["noop"].nri_socket).kill)
        shared_pids: dict[str, list[int]] = {side: [] for side in pinned_sides}
        shared_ids: list[str] = []
        for side, runtime in runtimes.items():
            cri = runtime.cri()
            for i in range(running):
                pod = cri.run(f"shared{i}", [ContainerSpec(f"s{i}", cpu_request_milli=100)])
                if side in pinned_sides:
                    shared_pids[side].append(cri.inspect(pod[f"s{i}"]).pid)
                if side == "plugin":
                    shared_ids.append(pod[f"s{i}"])
        times: dict[str, dict[str, list[float]]] = {
            what: {side: [] for side in sides} for what in timed
        }
        window_open = dict.fromkeys(pinned_sides, 0)
        misplaced = dict.fromkeys(pinned_sides, 0)
        for i in range(rounds + 2):
            order = sides[i % len(sides) :] + sides[: i % len(sides)]
            spec = ContainerSpec.guaranteed(f"g{i}", 1)
            pods = {}
            for side in order:
                cri = runtimes[side].cri()
                marks = [time.perf_counter()]
                pods[side] = pod = cri.run_pod(PodSpec.for_containers(f"pinned{i}", [spec]))
                marks.append(time.perf_counter())
                cid = cri.create_container(pod, spec)
                marks.append(time.perf_counter())
                if side in pinned_sides:  # the window: every shared container off CPU 1 already
                    window_open[side] += sum(
                        host.cpus_allowed_list(p) != "0" for p in shared_pids[side]
                    )
                cri.start(cid)
                marks.append(time.perf_counter())
                if side in pinned_sides:
                    misplaced[side] += host.cpus_allowed_list(cri.inspect(cid).pid) != "1"
                cri.stop(cid, timeout=0)
                marks.append(time.perf_counter())
                cri.remove(cid)
                if i >= 2:  # the first rounds warm caches on both sides
                    times["sandbox"][side].append(marks[1] - marks[0])
                    times["create"][side].append(marks[2] - marks[1])
                    times["start"][side].append(marks[3] - marks[1])
                    times["stop"][side].append(marks[4] - marks[3])
            # The restart, once every side stopped its container (kubelet restarts after a
            # back-off; here the others' turns are the pause).
            for side in order:
                cri = runtimes[side].cri()
                began = time.perf_counter()
                cid = cri.create_container(pods[side], spec)
                if i >= 2:
                    times["recreate"][side].append(time.perf_counter() - began)
                cri.start(cid)
                cri.stop(cid, timeout=0)
                cri.remove(cid)
                cri.stop_pod(pods[side])
                cri.remove_pod(pods[side])
        converge = _convergence(runtimes["plugin"], daemon, shared_ids)
    ratios = {what: _ratio(times[what]["plugin"], times[what]["none"]) for what in timed}
    at_start_ratios = {what: _ratio(times[what]["start"], times[what]["none"]) for what in timed}
    return {
        "version": version,
        "running": running,
        "create": {side: summary(v) for side, v in times["create"].items()},
        "create_start": {side: summary(v) for side, v in times["start"].items()},
        "recreate": {side: summary(v) for side, v in times["recreate"].items()},
        "create_ratio": ratios["create"],
        "create_start_ratio": ratios["start"],
        "stop_ratio": ratios["stop"],
        "sandbox_ratio": ratios["sandbox"],
        "recreate_ratio": ratios["recreate"],
        "noop_create_ratio": _ratio(times["create"]["noop"], times["create"]["none"]),
        "window_open": window_open["plugin"],
        "misplaced": misplaced["plugin"],
        "converge_s": converge,
        "at_start": {
            "create_ratio": at_start_ratios["create"],
            "create_start_ratio": at_start_ratios["start"],
            "sandbox_ratio": at_start_ratios["sandbox"],
            "stop_ratio": at_start_ratios["stop"],
            "recreate_ratio": at_start_ratios["recreate"],
            "window_open": window_open["start"],
            "misplaced": misplaced["start"],
        },
    }


def cgroup_write_floor(count: int, rounds: int = 31) -> dict:
    """The kernel's cost of moving ``count`` shared containers off a CPU (cgroup v1), with
    nothing else on the way: ``count`` private container cgroups, one sleeping task each, made
    as the daemon prepares shared containers (no scheduler domain of their own, ``cpuset.cpus``
    kept open), then every file written with the pool minus the last CPU and back, in a tight
    loop.  Returns the median and p99 of one such pass (the shrink, what a creation waits
    for), in ms.  Everything made is removed again, also on failure."""
    cpus = host.online_cpus()
    everything = f"{cpus[0]}-{cpus[-1]}"
    pool = ",".join(map(str, cpus[:-1]))
    top = host.cgroup_dir(f"/nri-bench-floor-{secrets.token_hex(3)}")
    made: list[Path] = []
    tasks: list[subprocess.Popen] = []
    files: list[int] = []
    try:
        for directory in [top] + [top / f"pod{i}" for i in range(count)]:
            directory.mkdir()
            made.append(directory)
            (directory / "cpuset.mems").write_text((top.parent / "cpuset.mems").read_text())
            (directory / "cpuset.cpus").write_text(everything)
        for i in range(count):
            leaf = top / f"pod{i}" / "ctr"
            leaf.mkdir()
            made.append(leaf)
            (leaf / "cpuset.mems").write_text((top.parent / "cpuset.mems").read_text())
            (leaf / "cpuset.cpus").write_text(everything)
            (leaf / "cpuset.sched_load_balance").write_text("0")
            tasks.append(subprocess.Popen(["sleep", "3600"]))
            (leaf / "cgroup.procs").write_text(str(tasks[-1].pid))
            files.append(os.open(leaf / "cpuset.cpus", os.O_WRONLY | os.O_CLOEXEC))
        shrink, grow = f"{pool}\n".encode(), f"{everything}\n".encode()
        passes = []
        for _ in range(rounds):
            began = time.perf_counter()
            for fd in files:
                os.pwrite(fd, shrink, 0)
            passes.append(time.perf_counter() - began)
            for fd in files:
                os.pwrite(fd, grow, 0)
        return summary(passes)
    finally:
        for fd in files:
            os.close(fd)
        for task in tasks:
            task.kill()
            task.wait()
        for directory in reversed(made):
            for _ in range(100):  # a killed task leaves its cgroup a moment later
                with contextlib.suppress(OSError):
                    directory.rmdir()
                    break
                time.sleep(0.01)
            else:
                directory.rmdir()  # still busy after a second: say why


def _convergence(runtime: Containerd, daemon: Daemon, shared: list[str]) -> float:
    """Seconds from a daemon restart until the runtime's stored spec of every shared container
    moved by direct writes (an exclusive container runs) names the shared pool again: the
    Synchronize reply carries those containers, one `runc update` each."""
    cri = runtime.cri()
    spec = ContainerSpec.guaranteed("converge", 1)
    pod = cri.run_pod(PodSpec.for_containers("converge", [spec]))
    cid = cri.create_container(pod, spec)
    cri.start(cid)
    daemon.stop()
    began = time.perf_counter()
    daemon.start(wait=False)
    deadline = began + 120
    pending = list(shared)
    while pending:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(pending)} stored specs still lag after 120 s")
        pending = [c for c in pending if cri.inspect(c).spec["linux"]["resources"]["cpu"]
                   ["cpus"] != "0"]  # fmt: skip
        if pending:
            time.sleep(0.01)
    took = time.perf_counter() - began
    cri.stop(cid, timeout=0)
    cri.remove(cid)
    return took


def plot_density(results: list[dict], out: Path) -> None:
    """Median CreateContainer latency against running shared containers, per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    versions = sorted({r["version"] for r in results})
    colors = dict(zip(versions, ("tab:blue", "tab:green", "tab:purple"), strict=False))
    for version in versions:
        rows = sorted((r for r in results if r["version"] == version), key=lambda r: r["running"])
        xs = [r["running"] for r in rows]
        for what, side, dash, how in (
            ("create", "plugin", "-", "with nri-cpuplugin, new pod"),
            ("create", "start", "-.", 'with nri-cpuplugin, pin_at = "start", new pod'),
            ("recreate", "plugin", ":", "with nri-cpuplugin, restart in its pod"),
            ("create", "none", "--", "no plugin"),
        ):
            ys = [r[what][side]["median_ms"] for r in rows]
            label = f"containerd {version}, {how}"
            ax.plot(xs, ys, color=colors[version], linestyle=dash, marker="o", label=label)
    ax.set_xlabel("running shared containers")
    ax.set_ylabel("CreateContainer of an exclusive container, median (ms)")
    ax.set_title("Exclusive container creation on a dense node (2-CPU VM)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
