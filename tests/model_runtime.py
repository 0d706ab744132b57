"""A model of the node around the daemon, for tests/unit/test_model_races.py: containerd (the
runtime, with its NRI ordering), kubelet (pods, their cgroups, retries), systemd and the kernel
(CPU hotplug), driving the production daemon (daemon/service.py ``Daemon``) through its NRI
adapter, as the stub would, on an asyncio loop.

Every class here is a FAKE standing at one of the daemon's edges:

* ``Host``: the process the daemon runs in - its event loop, its timers (``Node.later``: here
  they fire when the test says), no kernel uevents (the test submits ``CPUsChanged`` as the
  hotplug source does), a kill -9 and a restart on the same state directory;
* ``Machine``: the sysfs tree (online CPUs swapped in place on hotplug) and the cgroup v1 tree
  (tests/fake_cgroup_v1.py);
* ``FakeSystemd`` / ``FakeUnits``: systemd's view of the systemd driver's scopes (each one's
  AllowedCPUs, put back into its cgroup at every ``daemon-reload``) and the daemon's ``Units``
  (daemon/writer.py) talking to it;
* ``Runtime``: containerd.  It calls the adapter's handlers in the order containerd does and
  applies the replies as it does (docs/nri-wire.md §9-§11): a creation's updates before the
  container exists, its adjustment into the stored spec, the cgroup made from the stored spec
  at the start, an UpdateContainer reply's other entries at once and its own entry later
  (``apply_own``, then PostUpdateContainer, §11.3), updates of unknown containers skipped,
  Stop/RemovePodSandbox never relayed for pods created before its own restart.

It decides nothing the daemon decides and predicts none of its answers: the test checks what
the daemon's answers and writes lead to.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fake_cgroup_v1 import FakeCgroupV1
from model_stall import Stall
from proc_gen import proc_tree
from sysfs_gen import MachineSpec, write_sysfs
from topologies import scratch_dir

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.core.workload import CONTAINER_TYPE
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.daemon.units import SystemdUnits
from nri_cpuplugin.hardware import cpusets, hotplug
from nri_cpuplugin.hardware.liveness import cgroup_path, pod_cgroup_path
from nri_cpuplugin.nri.handlers import EVENT_BITS, event_mask
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings

# 1 socket, 6 cores, 2 threads: CPUs 0-11, a core's threads N and N+6; 0 and 6 reserved.
MACHINE = MachineSpec(sockets=1, cores_per_socket=6, threads_per_core=2, name="model-12")
IRQS = {24: "0-11", 25: "0-11", 26: "5"}  # the machine's device interrupts, at boot
IRQ_FREE = "irq-free.nri-cpuplugin.io"
CREATED, RUNNING, STOPPED = 1, 3, 4  # NRI ContainerState
PERIOD = 100_000


# --- the daemon's process ------------------------------------------------------------------------


class NoUevents:
    """FAKE hotplug listener: nothing comes from the kernel; the test submits the events."""

    def close(self) -> None:
        pass


class Subscription:
    """What the stub tells the adapter at Configure: the events its handlers imply."""

    def __init__(self, adapter: object) -> None:
        self.handled_events = event_mask(adapter)


class Records(list):
    """Audit records, as the journal would get them; each observer sees each record as it is
    made (on the daemon's worker thread, right after what it reports)."""

    def __init__(self) -> None:
        super().__init__()
        self.observers: list = []

    def __call__(self, record: dict) -> None:
        self.append(record)
        for observe in self.observers:
            observe(record)

    def of(self, action: str) -> list[dict]:
        return [r for r in self if r["ACTION"] == action]


class Host:
    """FAKE process around the daemon: ``Daemon`` as ``nri-cpuplugin run`` builds it, its
    event loop, its timers held until ``fire_timers``, and kill -9."""

    def __init__(
        self, settings: Settings, records: Records, units: Any, proc: str, stall: Stall
    ) -> None:
        self.settings = settings
        self.records = records
        self.units = units
        self.proc = proc
        self.stall = stall  # the disk and the state lock, and the budgets' clock
        self.loop = asyncio.new_event_loop()
        self.timers: list[object] = []
        self.events = 0  # the adapter's subscription, once configured
        self._over = threading.Event()  # what killed daemons' worker threads wait for
        self.daemon = self._make()

    def _make(self) -> Daemon:
        # (a factory makes the units of each daemon: a restarted one starts with none known)
        units = self.units() if callable(self.units) else self.units
        daemon = Daemon(self.settings, Audit(self.records), units=units)
        daemon.hotplug = NoUevents()  # type: ignore[assignment]
        daemon.stub = Subscription(daemon.adapter)
        daemon.node.later = self._later
        daemon.node.writer.proc = self.proc
        self.stall.install(daemon.worker)
        return daemon

    def _later(self, delay: float, event: object) -> bool:
        self.timers.append(event)
        return True

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def call(self, method: str, *args: Any) -> tuple[Any, PolicyError | None]:
        """One request as the stub serves it: (the reply, None), or (None, the error the stub
        answers with).  What the worker has queued is done first, unless it is stuck
        (tests/model_stall.py)."""
        self.run(self.stall.settle(self.daemon.worker))
        try:
            return self.run(getattr(self.daemon.adapter, method)(*args)), None
        except PolicyError as err:
            return None, err

    def connect(self, pods: list, containers: list, lists: bool = True) -> list:
        """Configure and Synchronize, as the runtime does for a plugin that registers; no
        Synchronize (``lists=False``) as containerd 1.7 for a plugin it launched again."""
        adapter = self.daemon.adapter
        mask = self.run(adapter.configure("", "containerd", "v2.1.9"))
        self.events = mask if mask is not None else event_mask(adapter)
        self.daemon.node.writer.proc = self.proc
        if not lists:
            return []
        updates, err = self.call("synchronize", pods, containers)
        assert err is None, f"Synchronize refused: {err}"
        return updates

    def subscribed(self, method: str) -> bool:
        return bool(self.events & EVENT_BITS[method])

    def disconnected(self) -> None:
        async def lost() -> None:
            self.daemon.adapter.connection_lost()

        self.run(lost())

    def submit(self, event: object) -> None:
        async def submit() -> None:
            self.daemon.deadline.submit(event)

        self.run(submit())

    def quiesce(self) -> None:
        """Wait until every job queued so far has run (late work, background events); not
        while something stalls."""
        assert not self.stall.what, "the worker cannot settle in a stall"
        self.run(self.stall.settle(self.daemon.worker))

    def fire_timers(self) -> list[object]:
        """The timers that were set, due now (their events submitted, in order)."""
        events, self.timers = self.timers, []
        for event in events:
            self.submit(event)
        return events

    def kill(self) -> None:
        """kill -9: the worker thread runs nothing more (it waits for what never comes until
        the test ends), kept files close, the claim goes (as the kernel would do all three);
        nothing is drained."""
        daemon = self.daemon

        async def stop() -> None:
            daemon.worker.submit("exit", self._over.wait, awaited=False)

        self.run(stop())
        daemon.node.writer.keep_only(set())
        daemon.release_claim()

    def restart(self) -> None:
        self.kill()
        self.timers = []
        self.daemon = self._make()

    def close(self) -> None:
        self.kill()
        self.loop.close()
        self._over.set()  # the killed daemons' worker threads idle from here on


# --- the machine ---------------------------------------------------------------------------------


# The generated trees by offline CPUs, for every Machine of this process: nothing writes to a
# tree once generated (the cgroups are below ``fs``, beside it), and each costs ~30 ms to
# write - about a tenth of a schedule when made anew for each.
_TREES: dict[frozenset[int], Path] = {}
_TREES_DIR: list[Path] = []


def _tree(offline: frozenset[int]) -> Path:
    tree = _TREES.get(offline)
    if tree is None:
        if not _TREES_DIR:
            _TREES_DIR.append(Path(tempfile.mkdtemp(prefix="nri-model-trees-", dir=scratch_dir())))
            atexit.register(shutil.rmtree, _TREES_DIR[0], True)
        tree = _TREES_DIR[0] / f"tree-{len(_TREES)}"
        write_sysfs(MachineSpec(**{**MACHINE.__dict__, "offline": offline}), tree)
        _TREES[offline] = tree
    return tree


class Machine:
    """FAKE hardware: a generated sysfs tree whose online CPUs change in place (``devices`` is
    swapped atomically), with the FAKE cgroup v1 tree below it at ``fs/cgroup``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sysfs = base / "sysfs"
        self.sysfs.mkdir(parents=True)
        self.offline: frozenset[int] = frozenset()
        self._link()
        (self.sysfs / "fs").mkdir()
        self.cgroups = FakeCgroupV1(self.sysfs / "fs" / "cgroup", MACHINE.online)
        # FAKE /proc: no processes (no v1 eviction to repair); three device interrupts, one
        # of them on CPU 5 alone (given the shared pool when 5 is kept free)
        self.proc = proc_tree(base / "proc", IRQS, default="fff", cpus=len(MACHINE.online))
        # Each interrupt's affinity as the kernel last set it (at boot, or at a hotplug that left
        # it no online CPU): what it has when nobody took CPUs from it.
        self.irq_set = {number: CPUSet.parse(cpus) for number, cpus in IRQS.items()}

    @property
    def online(self) -> CPUSet:
        return MACHINE.online - CPUSet(self.offline)

    def _irqs_offline(self) -> None:
        """The kernel's part of a CPU going offline: an interrupt left with no online CPU is
        given every online one."""
        for number in IRQS:
            path = self.proc / "irq" / str(number) / "smp_affinity_list"
            if not CPUSet.parse(path.read_text().strip()) & self.online:
                path.write_text(f"{self.online}\n")
                self.irq_set[number] = self.online

    def _link(self) -> None:
        link = self.sysfs / "devices.new"
        os.symlink(_tree(self.offline) / "devices", link)
        os.replace(link, self.sysfs / "devices")

    def set_online(self, cpu: int, online: bool) -> hotplug.CPUEvent:
        """The kernel takes a CPU offline or brings it back: sysfs, the cpusets, the uevent."""
        self.offline = self.offline - {cpu} if online else self.offline | {cpu}
        self._link()
        if online:
            self.cgroups.online_again(cpu)
        else:
            self.cgroups.offline(cpu)
            self._irqs_offline()
        return hotplug.CPUEvent("online" if online else "offline", cpu, time.monotonic())


# --- systemd --------------------------------------------------------------------------------------


class FakeSystemd:
    """FAKE systemd: the AllowedCPUs of each systemd-driver scope (cgroup path -> CPUs), as runc
    and the daemon set them; systemd applies a property to the cgroup when it is set, and every
    unit's again at each daemon-reload."""

    def __init__(self, cgroups: FakeCgroupV1) -> None:
        self.cgroups = cgroups
        self.allowed: dict[str, CPUSet] = {}
        self.refusing: set[str] = set()  # container ids whose scopes refuse changes (a fault)

    def set_allowed(self, path: str, cpus: CPUSet) -> None:
        self.allowed[path] = cpus
        self.cgroups.write("systemd", path, cpus=cpus)

    def created(self, path: str, cpus: CPUSet | None) -> None:
        """runc made the container's scope, with the spec's cpuset (or none)."""
        if cpus:
            self.allowed[path] = cpus

    def keep(self, path: str, cpus: CPUSet) -> None:
        """runc update: the scope's AllowedCPUs set (runc writes the files after)."""
        self.allowed[path] = cpus

    def forget(self, path: str) -> None:
        self.allowed.pop(path, None)

    def daemon_reload(self) -> list[str]:
        """Every unit's AllowedCPUs written into its cgroup again: the paths it changed."""
        changed = []
        for path, cpus in sorted(self.allowed.items()):
            before = self.cgroups.cpus(path)
            if before is not None and before != cpus & self.cgroups.online:
                self.cgroups.write("systemd", path, cpus=cpus)
                changed.append(path)
        return changed


class FakeUnits:
    """The daemon's ``Units`` (daemon/writer.py) on FAKE systemd, in place of the D-Bus client
    (daemon/units.py): a unit whose scope does not exist (yet), or that refuses, is not set;
    one that is, is released after (systemd holds no cpuset for it any more)."""

    def __init__(self, systemd: FakeSystemd) -> None:
        self.systemd = systemd

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Each unit's cpuset set, then released (daemon/units.py: handed over to the files)."""
        failed = []
        for target in targets:
            path = cgroup_path(target.runtime_path)
            if (
                not target.cpus
                or target.container_id in self.systemd.refusing
                or not self.systemd.cgroups.exists(path)
            ):
                failed.append(target.container_id)
                continue
            self.systemd.set_allowed(path, target.cpus)
            self.systemd.forget(path)
        return failed

    def take_refused(self) -> list[str]:
        return []  # FAKE systemd answers every call at once

    def finish(self) -> list[str]:
        return []  # (nothing is ever left unconfirmed)

    def forget(self, container_id: str) -> None:
        pass  # (asks every time: what is bare is FAKE systemd's to know)

    def keep_only(self, container_ids: set[str]) -> None:
        pass


# --- kubelet's pods -------------------------------------------------------------------------------


class Ctr:
    """One container of a pod's spec and the runtime's instance of it (``id`` changes with
    each attempt: kubelet retries a refused creation, restarts a stopped container)."""

    def __init__(self, pod: Pod, name: str, milli: int, limit: int | None, kind: str = "app",
                 sidecar: bool = False) -> None:  # fmt: skip
        self.pod = pod
        self.name = name
        self.milli = milli
        self.limit = limit
        self.kind = kind
        self.sidecar = sidecar
        self.attempt = 0
        self.id = ""
        self.phase = "planned"  # created, running, exited (start refused), stopped, completed
        self.msg = pb.Container()  # the runtime's stored spec
        self.pending: pb.LinuxResources | None = None  # an update's own entry, not applied yet
        self.relayed = False  # in the runtime's NRI state (its stop and removal are relayed)

    def __repr__(self) -> str:
        return f"{self.pod.name}/{self.name}#{self.attempt}"

    @property
    def path(self) -> str:
        """Its cgroup, below the hierarchy's root."""
        return cgroup_path(self.msg.linux.cgroups_path)

    def cpu(self) -> pb.LinuxCPU:
        return self.msg.linux.resources.cpu


class Pod:
    def __init__(self, name: str, qos: str, driver: str) -> None:
        self.name = name
        self.uid = f"u{name}"
        self.qos = qos
        self.driver = driver
        self.containers: list[Ctr] = []
        self.phase = "planned"  # running, removed
        self.attempt = 0
        self.old = False  # created before the runtime's last restart
        self.annotations: dict[str, str] = {}

    def __repr__(self) -> str:
        return self.name

    def add(self, name: str, milli: int, limit: int | None = None, **kind: Any) -> Pod:
        self.containers.append(Ctr(self, name, milli, limit, **kind))
        return self

    @property
    def limit_milli(self) -> int:
        """kubelet's pod limit: the app containers and sidecars together, or an init container
        when it is larger."""
        running = sum(c.limit or 0 for c in self.containers if c.kind == "app" or c.sidecar)
        inits = [c.limit or 0 for c in self.containers if c.kind == "init" and not c.sidecar]
        return max([running, *inits])

    @property
    def sandbox_id(self) -> str:
        return f"sb-{self.name}-{self.attempt}"

    @property
    def cgroup_parent(self) -> str:
        qos = "" if self.qos == "guaranteed" else self.qos
        if self.driver == "systemd":
            return f"kubepods-{qos + '-' if qos else ''}pod{self.uid}.slice"
        return f"/kubepods/{qos + '/' if qos else ''}pod{self.uid}"

    @property
    def path(self) -> str:
        return pod_cgroup_path(self.cgroup_parent)

    def runtime_path(self, cid: str) -> str:
        if self.driver == "systemd":
            return f"{self.cgroup_parent}:cri-containerd:{cid}"
        return f"{self.cgroup_parent}/{cid}"

    def sandbox(self) -> pb.PodSandbox:
        sandbox = pb.PodSandbox(id=self.sandbox_id, name=self.name, uid=self.uid, namespace="ns")
        sandbox.annotations.update(self.annotations)
        sandbox.linux.cgroup_parent = self.cgroup_parent
        if self.qos == "guaranteed":
            cpu = sandbox.linux.pod_resources.cpu
            cpu.shares.value = max(2, self.limit_milli * 1024 // 1000)
            cpu.period.value, cpu.quota.value = PERIOD, self.limit_milli * PERIOD // 1000
        return sandbox


def cri_cpu(cpu: pb.LinuxCPU, milli: int, limit: int | None) -> None:
    """kubelet's CPU values for a request and limit (docs/cgroups-and-hooks.md §8)."""
    cpu.shares.value = max(2, milli * 1024 // 1000)
    cpu.period.value = PERIOD
    if limit:
        cpu.quota.value = limit * PERIOD // 1000


def merge_cpu(into: pb.LinuxCPU, cpu: pb.LinuxCPU) -> None:
    """Set, non-zero fields replace the stored ones (docs/nri-wire.md §11.2)."""
    if cpu.cpus:
        into.cpus = cpu.cpus
    if cpu.mems:
        into.mems = cpu.mems
    for field in ("shares", "quota", "period"):
        if cpu.HasField(field) and getattr(cpu, field).value:
            getattr(into, field).value = getattr(cpu, field).value


def cpus_of(cpu: pb.LinuxCPU) -> CPUSet | None:
    return CPUSet.parse(cpu.cpus) if cpu.cpus else None


# --- containerd -----------------------------------------------------------------------------------


class Runtime:
    """FAKE containerd (see the module text).  Each method is one thing the runtime does; it
    returns a line saying what happened, for the test's log."""

    def __init__(
        self, host: Host, machine: Machine, systemd: FakeSystemd, lists: bool = True
    ) -> None:
        self.host = host
        self.lists = lists  # Synchronize at each connection (not: containerd 1.7, launched)
        self.machine = machine
        self.cgroups = machine.cgroups
        self.systemd = systemd
        self.pods: list[Pod] = []
        self.by_id: dict[str, Ctr] = {}
        self.refused: list[tuple[str, str]] = []  # (container id, request) answered with errors

    # --- what the runtime lists ---------------------------------------------------------------

    def live(self) -> list[Ctr]:
        """Containers the runtime has (created or running)."""
        return [c for c in self.by_id.values() if c.phase in ("created", "running")]

    def running(self) -> list[Ctr]:
        return [c for c in self.by_id.values() if c.phase == "running"]

    def listing(self) -> tuple[list[pb.PodSandbox], list[pb.Container]]:
        pods = [p.sandbox() for p in self.pods if p.phase == "running"]
        return pods, [c.msg for c in self.by_id.values()]

    # --- replies ------------------------------------------------------------------------------

    def apply(self, updates: Iterable[pb.ContainerUpdate]) -> None:
        """Updates of other containers: one after another, unknown ones skipped (§11.2)."""
        for update in updates:
            ctr = self.by_id.get(update.container_id)
            if ctr is None or ctr.phase not in ("created", "running"):
                continue
            cpu = update.linux.resources.cpu
            merge_cpu(ctr.cpu(), cpu)
            if ctr.phase == "running":
                self.write(ctr, cpu)

    def write(self, ctr: Ctr, cpu: pb.LinuxCPU) -> None:
        """runc update: the systemd driver sets the scope's AllowedCPUs, then the files."""
        cpus = cpus_of(cpu)
        quota = cpu.quota.value if cpu.HasField("quota") and cpu.quota.value else None
        if ctr.pod.driver == "systemd" and cpus:
            self.systemd.keep(ctr.path, cpus)
        self.cgroups.write("runtime", ctr.path, cpus=cpus, mems=cpu.mems or None, quota=quota)

    # --- pods ---------------------------------------------------------------------------------

    def run_pod(self, pod: Pod) -> str:
        pod.attempt += 1
        if not self.cgroups.exists(pod.path):
            self.cgroups.mk(pod.path)  # kubelet makes it before RunPodSandbox
        pod.phase, pod.old = "running", False
        if self.host.subscribed("run_pod_sandbox"):
            _, err = self.host.call("run_pod_sandbox", pod.sandbox())
            if err is not None:
                pod.phase = "planned"  # kubelet retries the sandbox
                return f"RunPodSandbox {pod} refused: {err}"
        return f"RunPodSandbox {pod}"

    def remove_pod(self, pod: Pod) -> str:
        for ctr in pod.containers:
            if ctr.phase in ("created", "running"):
                self._stop(ctr)
            if ctr.phase in ("stopped", "exited", "completed"):
                self._remove(ctr)
            ctr.phase = "removed"
        self.cgroups.remove(pod.path)  # kubelet, once its containers are gone
        relayed = pod.phase == "running" and not pod.old
        if relayed and self.host.subscribed("remove_pod_sandbox"):
            self.host.call("remove_pod_sandbox", pod.sandbox())
        pod.phase = "removed"
        return f"removed pod {pod}" + ("" if relayed else " (not relayed)")

    # --- containers ---------------------------------------------------------------------------

    def create(self, ctr: Ctr, answered: Callable[[Ctr], object] | None = None) -> str:
        """CreateContainer: the reply's updates applied, its adjustment merged into the new
        container's spec, the container stored (``answered`` is called before that, if given:
        updates of other replies meanwhile skip the container, which the runtime does not know
        yet)."""
        pod = ctr.pod
        ctr.attempt += 1
        ctr.id = f"{pod.name}-{ctr.name}-{ctr.attempt}-".ljust(64, "0")
        msg = pb.Container(id=ctr.id, pod_sandbox_id=pod.sandbox_id, name=ctr.name, state=CREATED)
        if ctr.kind == "init":
            msg.annotations[CONTAINER_TYPE] = "init"
        cri_cpu(msg.linux.resources.cpu, ctr.milli, ctr.limit)
        msg.linux.cgroups_path = pod.runtime_path(ctr.id)
        ctr.msg = msg
        if self.host.subscribed("create_container"):
            reply, err = self.host.call("create_container", pod.sandbox(), msg)
            if err is not None:
                self.refused.append((ctr.id, "CreateContainer"))
                # Rolled back: the runtime tells the plugins it stopped and removed it.
                updates, _ = self.host.call("stop_container", pod.sandbox(), msg)
                self.apply(updates or [])
                self.host.call("remove_container", pod.sandbox(), msg)
                return f"CreateContainer {ctr} refused: {err}"
            adjust, updates = reply
            self.apply(updates)  # before the new container exists
            merge_cpu(msg.linux.resources.cpu, adjust.linux.resources.cpu)
        if answered is not None:
            answered(ctr)
        ctr.phase, ctr.relayed = "created", True
        self.by_id[ctr.id] = ctr
        return f"CreateContainer {ctr} -> {msg.linux.resources.cpu.cpus or '-'}"

    def start(self, ctr: Ctr, made: Callable[[Ctr], object] | None = None) -> str:
        """The task is made (its cgroup from the stored spec; then ``made`` is called, if
        given), StartContainer relayed; a refusal deletes the task again."""
        cpu = ctr.cpu()
        cpus = cpus_of(cpu)
        quota = cpu.quota.value if cpu.HasField("quota") and cpu.quota.value else -1
        self.cgroups.mk(ctr.path, cpus=cpus, mems=cpu.mems or None, procs="4242", quota=quota,
                        shares=cpu.shares.value)  # fmt: skip
        if ctr.pod.driver == "systemd":
            self.systemd.created(ctr.path, cpus)
        if made is not None:
            made(ctr)
        if self.host.subscribed("start_container"):
            _, err = self.host.call("start_container", ctr.pod.sandbox(), ctr.msg)
            if err is not None:
                self.refused.append((ctr.id, "StartContainer"))
                self._drop_cgroup(ctr)
                ctr.phase = "exited"
                ctr.msg.state = STOPPED
                return f"StartContainer {ctr} refused: {err}"
        ctr.phase = "running"
        ctr.msg.state = RUNNING
        return f"StartContainer {ctr} on {self.cgroups.cpus(ctr.path)}"

    def stop(self, ctr: Ctr, phase: str = "stopped") -> str:
        self._stop(ctr)
        ctr.phase = phase
        return f"StopContainer {ctr}" + ("" if ctr.relayed else " (not relayed)")

    def _stop(self, ctr: Ctr) -> None:
        ctr.pending = None  # an update in flight fails with its task
        self._drop_cgroup(ctr)
        ctr.msg.state = STOPPED
        if ctr.relayed and self.host.subscribed("stop_container"):
            updates, _ = self.host.call("stop_container", ctr.pod.sandbox(), ctr.msg)
            self.apply(updates or [])

    def _drop_cgroup(self, ctr: Ctr) -> None:
        self.cgroups.remove(ctr.path)
        self.systemd.forget(ctr.path)

    def _remove(self, ctr: Ctr) -> None:
        if ctr.relayed and self.host.subscribed("remove_container"):
            self.host.call("remove_container", ctr.pod.sandbox(), ctr.msg)
        self.by_id.pop(ctr.id, None)
        ctr.relayed = False

    def renew(self, ctr: Ctr) -> str:
        """kubelet removes an exited or stopped container and makes a new one (the next
        attempt's CreateContainer comes as its own step)."""
        was = repr(ctr)
        if ctr.phase == "exited" and ctr.relayed and self.host.subscribed("stop_container"):
            updates, _ = self.host.call("stop_container", ctr.pod.sandbox(), ctr.msg)
            self.apply(updates or [])
        self._remove(ctr)
        ctr.phase = "planned"
        return f"removed {was} for a new attempt"

    def update(self, ctr: Ctr, resources: pb.LinuxResources) -> str:
        """CRI UpdateContainerResources: the reply's other entries applied now, its own entry
        (or the request) kept for ``apply_own``."""
        reply, err = self.host.call("update_container", ctr.pod.sandbox(), ctr.msg, resources)
        if err is not None:
            self.refused.append((ctr.id, "UpdateContainer"))
            return f"UpdateContainer {ctr} refused: {err}"
        own = [u for u in reply if u.container_id == ctr.id]
        self.apply(u for u in reply if u.container_id != ctr.id)
        wanted = pb.LinuxResources()
        wanted.CopyFrom(resources)
        if own:
            merge_cpu(wanted.cpu, own[-1].linux.resources.cpu)
        ctr.pending = wanted
        return f"UpdateContainer {ctr} -> {wanted.cpu.cpus or 'as requested'} (applied later)"

    def apply_own(self, ctr: Ctr, post: bool = True) -> str:
        """The runtime applies the update's own entry, outside its NRI lock, then relays
        PostUpdateContainer (§11.3; ``post=False``: not yet, see ``post_update``)."""
        wanted, ctr.pending = ctr.pending, None
        assert wanted is not None
        merge_cpu(ctr.cpu(), wanted.cpu)
        self.write(ctr, wanted.cpu)
        applied = self.cgroups.cpus(ctr.path)
        if post:
            self.post_update(ctr)
        return f"applied {ctr}'s update ({applied})" + ("; PostUpdateContainer" if post else "")

    def post_update(self, ctr: Ctr) -> None:
        if self.host.subscribed("post_update_container"):
            self.host.call("post_update_container", ctr.pod.sandbox(), ctr.msg)

    # --- restarts -----------------------------------------------------------------------------

    def reconnect(self) -> str:
        """The plugin (re)registers: Configure, Synchronize, the reply applied (no
        Synchronize when the runtime does not list: ``lists``)."""
        if not self.lists:
            self.host.connect([], [], lists=False)
            return "no Synchronize"
        pods, containers = self.listing()
        self.apply(self.host.connect(pods, containers))
        return f"Synchronize {len(pods)} pods, {len(containers)} containers"

    def restart(self) -> str:
        """containerd restarts: CRI calls in flight fail, the plugin reconnects; its NRI state
        holds the containers it lists, and no pod: their Stop/RemovePodSandbox never come.
        Not ``lists``: containerd 1.7 with the plugin it launched, killed and launched again."""
        for ctr in self.by_id.values():
            ctr.pending = None
        self.host.disconnected()
        for pod in self.pods:
            pod.old = pod.old or pod.phase == "running"
        for ctr in self.by_id.values():
            ctr.relayed = ctr.phase in ("created", "running")
        if not self.lists:
            self.host.restart()
            return "runtime restarted, the plugin launched again; " + self.reconnect()
        return "runtime restarted; " + self.reconnect()

    # --- kubelet: a pod's next step ------------------------------------------------------------

    def next_step(self, pod: Pod) -> tuple[str, Ctr | None] | None:
        if pod.phase == "planned":
            return "run", None
        if pod.phase != "running":
            return None
        for ctr in pod.containers:
            if ctr.phase == "planned":
                return "create", ctr
            if ctr.phase == "created":
                return "start", ctr
            if ctr.phase in ("exited", "stopped"):
                return "renew", ctr
            if ctr.phase == "running" and ctr.kind == "init" and not ctr.sidecar:
                return "complete", ctr
        return None

    def advance(self, pod: Pod) -> str:
        step = self.next_step(pod)
        assert step is not None
        what, ctr = step
        if what == "run":
            return self.run_pod(pod)
        assert ctr is not None
        if what == "create":
            return self.create(ctr)
        if what == "start":
            return self.start(ctr)
        if what == "renew":
            return self.renew(ctr)
        return self.stop(ctr, "completed")


def resize_request(milli: int, limit: int | None) -> pb.LinuxResources:
    """CRI UpdateContainerResources of an in-place resize, as containerd wraps it: every CPU
    field, zero or not (docs/nri-wire.md §9.2)."""
    resources = pb.LinuxResources()
    cri_cpu(resources.cpu, milli, limit)
    resources.cpu.quota.value = (limit or 0) * PERIOD // 1000
    return resources


def cpuset_request(cpus: CPUSet) -> pb.LinuxResources:
    """An update that changes no CPU request: an operator widening the cpuset (no shares)."""
    resources = pb.LinuxResources()
    resources.cpu.cpus = str(cpus)
    return resources


def cpu_event(machine: Machine, cpu: int, online: bool) -> ev.CPUsChanged:
    return ev.CPUsChanged((machine.set_online(cpu, online),))


class ModelNode:
    """The whole FAKE node in one: machine, systemd, the daemon's process and containerd.
    ``driver``: "cgroupfs" or "systemd"; ``units``: the daemon reaches systemd (FakeUnits),
    "dbus": through its real ``SystemdUnits`` on FAKE D-Bus (tests/model_dbus.py), or not
    (the runtime applies the systemd driver's cpusets from the replies).  ``lists``: the
    runtime sends Synchronize at each connection (not: containerd 1.7 and a plugin it
    launched)."""

    def __init__(self, base: Path, driver: str = "cgroupfs", units: bool | str = False,
                 pin_at: str = "create", budget: float = 1.5, records: Records | None = None,
                 lists: bool = True) -> None:  # fmt: skip
        self.driver = driver
        self.machine = Machine(Path(base))
        self.cgroups = self.machine.cgroups
        self.systemd = FakeSystemd(self.cgroups)
        if units == "dbus":
            from model_dbus import DBusSystemd  # (it builds on FakeSystemd, above)

            self.systemd = DBusSystemd(self.cgroups, Path(base) / "host")
        self.records = Records() if records is None else records
        self.stall = Stall()
        self.settings = Settings(
            sysfs=str(self.machine.sysfs),
            state_dir=str(Path(base) / "state"),
            reserved_cpu_count=2,
            nri_request_budget=budget,
            nri_pin_at=pin_at,
            nic_read_ahead=False,
            systemd_bus="off",
        )
        units_: Any = FakeUnits(self.systemd) if units else None
        if units == "dbus":
            units_ = self.dbus_units
        self.host = Host(self.settings, self.records, units_, str(self.machine.proc), self.stall)
        self.runtime = Runtime(self.host, self.machine, self.systemd, lists)
        self.runtime.reconnect()

    def dbus_units(self) -> SystemdUnits:
        """The daemon's own units (daemon/units.py) on FAKE D-Bus; its follow-ups are timers."""
        from model_dbus import DBusSystemd, ModelClient

        assert isinstance(self.systemd, DBusSystemd)
        units = SystemdUnits(Audit(self.records), "/nonexistent", str(self.systemd.root))
        units.client = ModelClient(self.systemd)  # type: ignore[assignment]
        units.wake = lambda delay: self.host._later(delay, ev.FinishHandOver())
        return units

    @property
    def state(self) -> Any:
        return self.host.daemon.node.state

    def pod(self, name: str, qos: str = "guaranteed") -> Pod:
        pod = Pod(name, qos, self.driver)
        self.runtime.pods.append(pod)
        return pod

    def up(self, pod: Pod) -> list[str]:
        """Every step of the pod's start, in order; what happened."""
        lines: list[str] = []
        while self.runtime.next_step(pod) is not None and len(lines) < 20:
            lines.append(self.runtime.advance(pod))
            self.host.quiesce()
        return lines

    def on(self, ctr: Ctr) -> CPUSet | None:
        """What the container's cgroup runs on."""
        return self.cgroups.cpus(ctr.path)

    def close(self) -> None:
        self.stall.end()
        self.host.close()
        self.stall.close()
