"""Benchmarks through real containerd (2.1.9 unless a benchmark says which) + runc, the test
harness's instances, side by side.

Two private containerd instances run at once, one with a plugin and one without, and the
measured operations alternate between them, so machine noise hits both sides alike.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from e2e.daemon import Daemon
from harness import host
from harness.containerd import Containerd
from harness.cri import CRIClient
from harness.k8s import ContainerSpec, PodSpec

from .hotplug_guard import OnlineGuard, restore_cpusets
from .scratch import scratch
from .stats import summary


def noop_plugin(socket: Path) -> subprocess.Popen:
    """A plugin that changes nothing, connected to the runtime at ``socket``: the floor."""
    script = str(Path(__file__).with_name("noop_plugin.py"))
    proc = subprocess.Popen(
        [sys.executable, script, str(socket)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the no-op plugin did not register")
    return proc


def _ratio(with_plugin: list[float], without: list[float]) -> float:
    return statistics.median(with_plugin) / statistics.median(without)


def bench_create_latency(rounds: int = 60) -> dict:
    """CRI CreateContainer with a no-op NRI plugin connected vs no plugin (containerd 2.1.9):
    the floor of what any plugin costs here."""
    sides = ("plugin", "none")
    with ExitStack() as stack:
        runtimes = {side: stack.enter_context(Containerd("2.1", debug=False)) for side in sides}
        stack.callback(noop_plugin(runtimes["plugin"].nri_socket).kill)
        samples: dict[str, list[float]] = {side: [] for side in sides}
        pods = {
            side: runtime.cri().run_pod(PodSpec("lat", qos="besteffort"))
            for side, runtime in runtimes.items()
        }
        for i in range(rounds + 5):
            for side in sides[i % 2 :] + sides[: i % 2]:  # who goes first alternates
                cri = runtimes[side].cri()
                start = time.perf_counter()
                cid = cri.create_container(pods[side], ContainerSpec(f"c{i}"))
                elapsed = time.perf_counter() - start
                cri.remove(cid)
                if i >= 5:  # warm-up rounds are not measured
                    samples[side].append(elapsed)
    return {
        **{side: summary(values) for side, values in samples.items()},
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


# The isolation figure's setups, each a victim run next to the same aggressor (but "alone"):
# (a) plugin: a Guaranteed 1-CPU victim on the node with the daemon, which gives it CPU 1 and
#     moves the aggressor (already burning) to the reserved CPU 0;
# (b) bare: the same placement on the node without a plugin, by hand: CRI's cpuset field
#     (runc writes it to each container's cpuset cgroup), victim on CPU 1, aggressor on the
#     rest - the best pinning can do on this machine, whatever tool does it;
# (c) none: no plugin and no pinning, victim and aggressor float over both CPUs;
# and, as a reference, the victim pinned by hand with no aggressor at all.
ISOLATION_SETUPS = ("plugin", "bare", "none", "alone")
VICTIM_CPU = 1  # what the daemon gives the first exclusive container with CPU 0 reserved


@contextmanager
def _system_cpuset(cpu: int) -> Iterator[None]:
    """Run this process, and everything it starts from here on (containerds, shims, the
    plugin), in a cpuset cgroup of its own holding only ``cpu``, as a node's runtime and system
    daemons live on its reserved CPUs (systemd AllowedCPUs / kubelet reservedSystemCPUs).

    A cgroup and not sched_setaffinity: since Linux 6.2 the kernel keeps an affinity asked
    for with sched_setaffinity across fork and cgroup moves (the "user requested" mask), and
    the harness's runc 1.1.5 does not reset it, so every container started below would be
    confined to that CPU too, whatever its own cpuset says.  Moving a process into a cpuset
    cgroup sets no such mask: a container's process takes its own cgroup's CPUs when runc
    moves it there."""
    hierarchies = host.cgroup_hierarchies()
    v1 = "cpuset" in hierarchies
    mount = hierarchies["cpuset" if v1 else "unified"]
    own = mount / host.proc_cgroups(os.getpid())["cpuset" if v1 else "unified"].lstrip("/")
    if not v1 and "cpuset" not in (mount / "cgroup.subtree_control").read_text().split():
        (mount / "cgroup.subtree_control").write_text("+cpuset")
    group = mount / f"nri-bench-system-{secrets.token_hex(4)}"
    group.mkdir()
    try:
        (group / "cpuset.cpus").write_text(str(cpu))
        if v1:  # a v1 cpuset takes no task before it has memory nodes
            (group / "cpuset.mems").write_text((mount / "cpuset.mems").read_text())
        (group / "cgroup.procs").write_text(str(os.getpid()))  # every thread, in v1 too
        try:
            yield
        finally:
            (own / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        # What this process started has been torn down by now; a straggler only delays this.
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def bench_noisy_neighbour(seconds: float = 3.0, rounds: int = 8) -> dict:
    """The victim's iteration times next to a Burstable aggressor burning 2 threads, in the
    setups of ISOLATION_SETUPS, one run of each per round, their order rotating from round
    to round so that the machine's noise hits every setup alike.  During each run, the tasks
    of the node's other containers are sampled from /proc (may they run on the victim's CPU?
    did they last run there?), and the victim counts its own involuntary context switches."""
    runs: dict[str, list[dict]] = {setup: [] for setup in ISOLATION_SETUPS}
    repeated: list[str] = []  # why runs were done again
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        guard = stack.enter_context(OnlineGuard())
        stack.enter_context(_system_cpuset(RESERVED_CPU))
        tar = victim_image(Path(tmp))
        plain = stack.enter_context(Containerd("2.1", debug=False))
        pinned = stack.enter_context(Containerd("2.1", debug=False))
        daemon = Daemon(pinned.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        for runtime in (plain, pinned):
            runtime.import_images(tar)
        nodes = {"plugin": pinned, "bare": plain, "none": plain, "alone": plain}
        for n in range(rounds):
            shift = n % len(ISOLATION_SETUPS)
            for setup in ISOLATION_SETUPS[shift:] + ISOLATION_SETUPS[:shift]:
                cri = nodes[setup].cri()
                runs[setup].append(_undisturbed_run(guard, cri, setup, seconds, n, repeated))
    report: dict = {
        "seconds": seconds,
        "rounds": rounds,
        "repeated": repeated,
        "victim_cpu": VICTIM_CPU,
        "samples": {setup: [x for run in runs[setup] for x in run["iterations"]] for setup in runs},
    }
    for setup, done in runs.items():
        report[setup] = {
            **summary(report["samples"][setup]),
            "nivcsw": sum(run["nivcsw"] for run in done),
            "nvcsw": sum(run["nvcsw"] for run in done),
            "victim_cpus": sorted({run["victim_cpus"] for run in done}),
            "others_cpus": sorted({c for run in done for c in run["watch"].others_cpus}),
            "watch_samples": sum(run["watch"].samples for run in done),
            "allowed": sum(len(run["watch"].allowed["container"]) for run in done),
            "ran": sum(len(run["watch"].ran["container"]) for run in done),
            "sandbox_allowed": sum(len(run["watch"].allowed["sandbox"]) for run in done),
            "sandbox_ran": sum(len(run["watch"].ran["sandbox"]) for run in done),
            "outside_kthreads": sum(len(run["watch"].outside["kernel thread"]) for run in done),
            "outside_processes": sum(len(run["watch"].outside["process"]) for run in done),
        }
    plugin, bare = report["plugin"], report["bare"]
    report["median_ratio"] = plugin["median_ms"] / bare["median_ms"]
    report["p99_ratio"] = plugin["p99_ms"] / bare["p99_ms"]
    return report


def _undisturbed_run(
    guard: OnlineGuard, cri: CRIClient, setup: str, seconds: float, n: int, repeated: list[str]
) -> dict:
    """One run of ``setup`` that no CPU hotplug overlapped (hotplug_guard.py): a run that one
    did overlap, or failed while it happened, is done again; ``repeated`` says why."""
    for attempt in range(4):
        guard.wait_all_online()
        restore_cpusets(cri.top_cgroup)  # the node is empty between runs
        before = guard.changes
        try:
            run = _victim_run(cri, setup, seconds, f"{n}-{attempt}")
        except Exception as e:
            if guard.changes == before:
                raise  # a failure of its own
            repeated.append(f"{setup}: failed during a CPU hotplug ({e})")
            continue
        if guard.changes == before:
            return run
        repeated.append(f"{setup}: CPU hotplug during the run")
    raise RuntimeError(f"CPU hotplug by other work disturbed every run of {setup}: {repeated}")


def _victim_run(cri: CRIClient, setup: str, seconds: float, tag: str) -> dict:
    others = ",".join(str(c) for c in host.online_cpus() if c != VICTIM_CPU)
    by_hand = setup in ("bare", "alone")
    try:
        if setup != "alone":  # already burning when the victim is created
            burn = ContainerSpec(
                "burn", cpu_request_milli=100, memory="16Mi", command=AGGRESSOR,
                cpuset_cpus=others if by_hand else "",
            )  # fmt: skip
            cri.run(f"aggressor-{setup}-{tag}", [burn])
        victim = cri.run(
            f"victim-{setup}-{tag}",
            [ContainerSpec.guaranteed("v", 1, image=VICTIM_IMAGE,
                                      command=["/bin/victim", str(seconds), "2000000"],
                                      cpuset_cpus=str(VICTIM_CPU) if by_hand else "")],
        )  # fmt: skip
        victim_cpus = host.cpus_allowed_list(cri.inspect(victim["v"]).pid)
        watch = _Watch(cri, victim["v"], VICTIM_CPU).begin()
        try:
            cri.wait_state(victim["v"], "CONTAINER_EXITED", timeout=seconds + 30)
        finally:
            watch.end()
        lines = cri.logs(victim["v"])
    finally:
        cri.remove_all()  # every run starts from the same empty node
    counts = [line.split() for line in lines if line.startswith("# nivcsw")]
    if not counts:
        raise RuntimeError(f"the victim ({setup}) printed no context switch counts: {lines[-3:]}")
    _, _, nivcsw, _, nvcsw = counts[-1]
    times = [float(x) / 1e6 for x in lines if not x.startswith("#")]
    return {
        "iterations": times[5:],  # seconds; skip start-up iterations
        "nivcsw": int(nivcsw),
        "nvcsw": int(nvcsw),
        "victim_cpus": victim_cpus,
        "watch": watch,
    }


PF_KTHREAD = 0x00200000  # field 9 of /proc/<tid>/stat: the task is a kernel thread


class _Seen:
    """What one or more samples of :class:`_Watch` found (sets of thread ids)."""

    def __init__(self) -> None:
        kinds = ("container", "sandbox")
        self.allowed: dict[str, set[int]] = {kind: set() for kind in kinds}
        self.ran: dict[str, set[int]] = {kind: set() for kind in kinds}
        self.others_cpus: set[str] = set()  # Cpus_allowed_list of other containers' tasks
        self.outside: dict[str, set[int]] = {"kernel thread": set(), "process": set()}

    def add(self, other: _Seen) -> None:
        for mine, theirs in (
            (self.allowed, other.allowed),
            (self.ran, other.ran),
            (self.outside, other.outside),
        ):
            for kind, tids in theirs.items():
                mine[kind] |= tids
        self.others_cpus |= other.others_cpus


class _Watch(_Seen):
    """Samples, while the victim runs, which tasks could take the victim's CPU from it.

    The node's other tasks (every task in its cgroups but the victim's): which of them the
    kernel allows on ``cpu`` (``Cpus_allowed_list`` of /proc/<tid>/status) and which last ran
    there (field 39 of /proc/<tid>/stat).  Tasks of containers are told from those of pod
    sandboxes (the pause processes the runtime starts for each pod, which sleep until the pod
    ends) by their cgroup's name, the container's id.

    And every other task of the machine: which of them ran on ``cpu`` between two samples
    (last ran there, and its run time in /proc/<tid>/schedstat grew), kernel threads apart.
    This is a lower bound (a task that ran there and then moved is missed), there to say who
    the victim's involuntary context switches come from when no container can.

    A sample counts only if the victim's process was still alive after it: once the victim
    exits, the plugin releases its CPU and the shared containers spread over it again."""

    def __init__(self, cri: CRIClient, victim: str, cpu: int, period: float = 0.2) -> None:
        super().__init__()
        self.root = host.cgroup_dir(cri.top_cgroup, "cpuset")
        self.victim = victim
        self.pid = cri.inspect(victim).pid
        self.started = host.start_time(self.pid)
        self.containers = {c.id for c in cri.containers()}
        self.cpu = cpu
        self.period = period
        self.samples = 0
        self._runtime: dict[int, int] = {}  # outside the node: each task's run time so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def begin(self) -> _Watch:
        self._thread.start()
        return self

    def end(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            sample = _Seen()
            self._outside(self._node(sample), sample)
            if host.is_alive(self.pid, self.started):
                self.samples += 1
                self.add(sample)
            self._stop.wait(self.period)

    def _node(self, sample: _Seen) -> set[int]:
        """One sample of the node's tasks; returns all of them, the victim's included."""
        seen: set[int] = set()
        for directory, _, files in os.walk(self.root):
            if "tasks" not in files:
                continue
            try:
                tids = {int(t) for t in Path(directory, "tasks").read_text().split()}
            except OSError:  # removed meanwhile
                continue
            seen |= tids
            name = os.path.basename(directory)
            if name == self.victim:
                continue
            kind = "container" if name in self.containers else "sandbox"
            for tid in tids:
                try:
                    fields = _stat_fields(Path(f"/proc/{tid}/stat").read_text())
                    allowed = host.cpus_allowed_list(tid)
                except (OSError, LookupError):  # exited meanwhile
                    continue
                if kind == "container":
                    sample.others_cpus.add(allowed)
                if self.cpu in host.parse_cpu_list(allowed):
                    sample.allowed[kind].add(tid)
                if int(fields[39]) == self.cpu:
                    sample.ran[kind].add(tid)
        return seen

    def _outside(self, node: set[int], sample: _Seen) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for name in tids:
                tid = int(name)
                if tid in node:
                    continue
                try:
                    fields = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
                    if int(fields[39]) != self.cpu:
                        self._runtime.pop(tid, None)  # its run time may grow elsewhere
                        continue
                    runtime = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
                if runtime > self._runtime.get(tid, runtime):
                    kind = "kernel thread" if int(fields[9]) & PF_KTHREAD else "process"
                    sample.outside[kind].add(tid)
                self._runtime[tid] = runtime


def _stat_fields(stat: str) -> list[str]:
    """/proc/<tid>/stat split so that ``fields[n]`` is field n as proc(5) numbers them: the
    command name (field 2) may hold spaces and parentheses, so split after its last ')'."""
    pid, _, rest = stat.partition(" (")
    comm, _, tail = rest.rpartition(") ")
    return ["", pid, comm, *tail.split()]


def plot_noisy_neighbour(report: dict, out: Path) -> None:
    """The victim's iteration times per setup, as the fraction of iterations slower than each
    time (log scales both): the tail, where the setups differ, gets the room."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    styles = {
        "plugin": ("tab:blue", "-", "pinned by nri-cpuplugin, aggressor moved off"),
        "bare": ("tab:green", "--", "pinned by hand (cpusets), no plugin"),
        "none": ("tab:red", "-", "no plugin, no pinning"),
        "alone": ("tab:gray", ":", "pinned by hand, no aggressor (reference)"),
    }
    for setup, (color, dash, what) in styles.items():
        values = sorted(v * 1e3 for v in report["samples"][setup])
        if not values:
            continue
        ys = [1 - i / len(values) for i in range(len(values))]
        label = (
            f"{what} (median {report[setup]['median_ms']:.2f} ms, "
            f"p99 {report[setup]['p99_ms']:.2f} ms)"
        )
        ax.step(values, ys, where="post", color=color, linestyle=dash, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(0.01, color="black", linewidth=0.6, alpha=0.5)  # where p99 is read
    ax.set_xlabel("victim iteration time (ms, log scale)")
    ax.set_ylabel("fraction of iterations at least this slow")
    ax.set_title(
        "Guaranteed 1-CPU victim next to a 2-thread Burstable aggressor\n"
        "(2-CPU VM, containerd 2.1.9)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
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
    """The daemon's CreateContainer + StopContainer (daemon/service.py, as ``nri-cpuplugin
    run`` builds it; until each is done, its decision audited) with every decision sent to a
    real systemd-journald (private mount namespace) vs with auditing switched off; two daemons
    on their own state directories, calls alternating."""
    from harness.journald import PrivateJournal

    from nri_cpuplugin.daemon.service import Daemon as CPUDaemon
    from nri_cpuplugin.ops.audit import Audit, JournalSink
    from nri_cpuplugin.ops.config import Settings

    from .bench_nri import realistic_container, realistic_pod

    samples: dict[str, list[float]] = {"journald": [], "off": []}
    with PrivateJournal() as journal, scratch() as tmp:
        daemons = {}
        for side in samples:
            audit = Audit(JournalSink(journal.socket_path))
            settings = Settings(state_dir=f"{tmp}/{side}", reserved_cpu_count=1)
            daemons[side] = CPUDaemon(settings, audit)
        pod = realistic_pod(3)

        async def measure() -> None:
            for side, daemon in daemons.items():
                await daemon.adapter.configure("", "bench", "v0")
                daemon.stop_hotplug()
                daemon.audit.enabled = side == "journald"
            for i in range(rounds):
                for side in ("journald", "off") if i % 2 else ("off", "journald"):
                    daemon = daemons[side]
                    container = realistic_container(pod, i)
                    container.linux.resources.cpu.quota.value = 100000
                    container.linux.resources.cpu.shares.value = 1024
                    start = time.perf_counter()
                    await daemon.adapter.create_container(pod, container)
                    await daemon.adapter.stop_container(pod, container)
                    await daemon.drain()  # what follows the answers: the audit records
                    samples[side].append(time.perf_counter() - start)
                    await daemon.adapter.remove_container(pod, container)

        try:
            asyncio.run(measure())
        finally:
            for daemon in daemons.values():
                daemon.release_claim()
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
