"""How the NRI daemon's targets reach the containers (a part of CPUPlugin, kept apart for
size): written to their cgroups directly where it can, carried in a reply where it must, and
owed to the runtime's next reply when no reply is there to carry them - never sent unsolicited
(docs/architecture.md, "Shared containers on dense nodes" and "Changes outside event
replies")."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.engine import CFS_PERIOD_US, Target
from ..hardware import cgroupfs, cpusets
from ..hardware.liveness import cgroup_path
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ..hardware.cpuset_files import OpenCpusets


class TargetWriter:
    """Mixed into CPUPlugin, whose state, engine, liveness and audit it uses (declared here
    for the reader; CPUPlugin defines them)."""

    state: Any
    engine: Any
    liveness: Any
    audit: Any
    _owed: set[str]
    _unbalanced: set[str]
    _cpusets: OpenCpusets

    def _update(self, target: Target, ignore_failure: bool = True) -> pb.ContainerUpdate:
        # ignore_failure: a sibling that exits at this very moment must not fail a creation.
        # The runtime writes this cgroup now: what we last wrote there no longer says what is.
        self._cpusets.written_elsewhere(target.container_id)
        if target.mems_from_parent and not target.mems:
            target = target.evolve(mems=self._parent_mems(target.container_id))
        update = pb.ContainerUpdate(container_id=target.container_id, ignore_failure=ignore_failure)
        fill_cpu(update.linux.resources.cpu, target)
        return update

    def _parent_mems(self, cid: str) -> CPUSet | None:
        """The memory nodes of the container's parent cgroup (its pod's), for the runtime to
        give back to it - or, when its cgroup is unknown, the root cpuset's (kubelet restricts
        no pod's nodes without its memory manager).  None, which leaves them as they are, when
        neither can be read."""
        layout = self.liveness.layout()
        if layout is None:
            return None
        path = self.state.cgroups.get(cid, "")
        try:
            with cgroupfs.CgroupFS(layout) as fs:
                if path:
                    return cgroupfs.parent_mems(fs, cgroup_path(path)) or None
                name = "cpuset.mems.effective" if layout.version == cgroupfs.V2 else "cpuset.mems"
                return CPUSet.parse(fs.read("cpuset", "/", name)) or None
        except (cgroupfs.CgroupError, ValueError):
            return None

    def _grow_pod_cgroup(self, target: Target, state: Any = None) -> None:
        """Give the new container's ancestors (its pod's cgroup above all) the CPUs it gets.
        cgroup v1 gives a CPU that comes back online to no cpuset, and a pod cgroup made while
        it was offline lacks it for good: the runtime could then never start a container of
        that pod on it (EACCES writing the container's cpuset).  Only for CPUs that came back
        (``returned``), so creations pay nothing otherwise; a no-op on cgroup v2."""
        path = (self.state if state is None else state).cgroups.get(target.container_id, "")
        if not path:
            return
        layout = self.liveness.layout()
        if layout is None:
            return
        errors = cpusets.grow_ancestors(layout, [path], target.cpus)
        self.audit.emit(cpusets.repair_events({}, errors))

    def _write_followers(self, targets: Iterable[Target]) -> list[Target]:
        """Move the shared pool's followers by writing their cgroups directly (cpuset, and the
        CFS quota of degraded or restored containers): one file write per container, where
        each update in a reply costs the runtime one ``runc update``, run one after another,
        holding up every other pod start.  Returns the targets the runtime must apply after
        all (see ``_split_followers``, and the writes that failed).

        The runtime's stored spec of a container written here lags behind until our reply to
        its next event, or the next Synchronize, carries its cpuset: docs/architecture.md,
        "Shared containers on dense nodes"."""
        direct, runtime = self._split_followers(targets)
        return runtime + self._write_direct(direct)

    def _split_followers(self, targets: Iterable[Target]) -> tuple[list[Target], list[Target]]:
        """(written here, applied by the runtime): the runtime applies those without a cgroup
        path, under the systemd cgroup driver (systemd re-applies a unit's AllowedCPUs on
        daemon-reload, so its runtime must know), or when no cgroupfs is found."""
        direct, runtime = [], []
        for target in targets:
            path = self.state.cgroups.get(target.container_id, "")
            (direct if is_cgroupfs_path(path) else runtime).append(target)
        if direct and self.liveness.layout() is None:
            return [], runtime + direct
        return direct, runtime

    def _write_direct(self, direct: list[Target]) -> list[Target]:
        """Write ``direct`` (from ``_split_followers``); returns those whose write failed."""
        if not direct:
            return []
        layout = self.liveness.layout()
        if layout is None:
            return direct
        # Most of them (a creation on a dense node: every shared container) go through the
        # files kept open since they started; the others through cpusets.move.
        # (A target with memory nodes or a quota to set goes through cpusets.move whole.)
        left = set(
            self._cpusets.write_kept(
                (t.container_id, t.cpus)
                for t in direct
                if t.mems is None and t.quota is None and not t.mems_from_parent
            )
        )
        writes = [
            self._cgroup_target(t)
            for t in direct
            if t.container_id in left
            or t.mems is not None
            or t.quota is not None
            or t.mems_from_parent
        ]
        failed = set(cpusets.move(layout, writes, self._unbalanced, self._cpusets).failed)
        return [t for t in direct if t.container_id in failed]

    def _cgroup_target(self, target: Target) -> cpusets.Target:
        """``target`` as hardware/cpusets.py writes it, at the container's cgroup."""
        return cpusets.Target(
            target.container_id,
            self.state.cgroups.get(target.container_id, ""),
            target.cpus,
            target.mems,
            target.quota,
            target.mems_from_parent,
        )

    def _prepare_shared(self, cid: str) -> None:
        """Make a shared container's cgroup quick to write when an exclusive container comes
        (cgroup v1; once per container): no scheduler domain of its own any more
        (hardware/cpusets.stop_balancing), and its ``cpuset.cpus`` kept open
        (hardware/cpuset_files.py)."""
        path = self.state.cgroups.get(cid, "")
        layout = self.liveness.layout()
        if layout is None or not is_cgroupfs_path(path):
            return
        if cid not in self._unbalanced or cid not in self._cpusets:
            with cgroupfs.CgroupFS(layout) as fs:
                cpusets.stop_balancing(fs, [(cid, path)], self._unbalanced)
                self._cpusets.open(fs, cid, cgroup_path(path))

    def _forget_cgroups(self, cid: str) -> None:
        """Drop what ``_prepare_shared`` holds for a container that is gone."""
        self._unbalanced.discard(cid)
        self._cpusets.forget(cid)

    def _push(self, targets: Iterable[Target], cause: str) -> None:
        """Apply targets that changed outside any event's reply (CPU hotplug, a removal, a
        background check, a pod resize): written directly (see _write_followers); what cannot
        be is owed to the runtime and carried by the next reply that can carry updates
        (CreateContainer, UpdateContainer, StopContainer, Synchronize).

        Never an unsolicited UpdateContainers.  The runtime serves it holding NRI's adaptation
        lock while it waits for its own NRI lock; each CRI event takes the same two locks in
        the other order.  Any CRI call entering NRI at that moment - UpdateContainerResources,
        StopPodSandbox, anything - deadlocks containerd for good, on every release before NRI
        0.12.1 (docs/architecture.md, "Changes outside event replies")."""
        targets = list(targets)
        if not targets:
            return
        owed = {t.container_id for t in self._write_followers(targets)}
        self._owed |= owed
        written = [t.container_id for t in targets if t.container_id not in owed]
        self.audit.record(
            "outside-reply",
            f"{len(targets)} containers changed outside an event reply ({cause}): "
            f"{len(written)} written directly"
            + (f", {len(owed)} left for the runtime's next event" if owed else ""),
            audit_mod.INFO,
            cause=cause,
            container_ids=",".join(t.container_id for t in targets),
            written=len(written),
            owed=len(owed),
        )

    def _carry_owed(self, carried: Iterable[str], state: Any = None) -> list[pb.ContainerUpdate]:
        """The owed updates (see _push) for a reply, as of ``state`` (default: the committed
        one); ``carried``
        names the containers this reply already deals with (or must not list).  Each goes out
        once: a container that ended meanwhile only makes the runtime log a failure."""
        if not self._owed:
            return []
        owed, self._owed = self._owed - set(carried), set()
        return [
            self._update(t)
            for cid in sorted(owed)
            for t in self.engine.update(self.state if state is None else state, cid).targets
        ]


def is_cgroupfs_path(path: str) -> bool:
    """A cgroupsPath of the cgroupfs driver (the systemd driver's is slice:prefix:name)."""
    return bool(path) and (path.startswith("/") or path.count(":") != 2)


def fill_cpu(cpu: pb.LinuxCPU, target: Target) -> None:
    cpu.cpus = str(target.cpus)
    if target.mems:
        cpu.mems = str(target.mems)
    if target.quota is not None:
        cpu.quota.value = target.quota
        if target.quota >= 0:
            cpu.period.value = CFS_PERIOD_US


def spec_agrees(container: pb.Container, target: Target) -> bool:
    """Whether the runtime's stored spec of the container already says what ``target`` does."""
    cpu = container.linux.resources.cpu
    if cpus_of(container) != target.cpus:
        return False
    if target.mems is not None and cpu.mems.strip() != str(target.mems):
        return False
    return target.quota is None or (cpu.HasField("quota") and cpu.quota.value == target.quota)


def cpus_of(container: pb.Container) -> CPUSet:
    try:
        return CPUSet.parse(container.linux.resources.cpu.cpus)
    except ValueError:
        return CPUSet()
