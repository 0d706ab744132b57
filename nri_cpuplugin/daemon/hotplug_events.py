"""The NRI daemon's CPU hotplug handling (a part of CPUPlugin, kept apart for size): kernel
uevents re-discover the topology, the engine follows the new online set, and cgroups are
repaired directly (cgroup v1 never gives a CPU back by itself), CFS quotas of degraded and
restored containers included.  The runtime learns of the changes from our next replies, never
from an unsolicited UpdateContainers (CPUPlugin._push says why)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.engine import Engine
from ..core.policy import PolicyError, StaticPolicy
from ..core.topology import TopologyError, discover
from ..hardware import cgroupfs, cpusets, hotplug
from ..ops import audit as audit_mod

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("nri_cpuplugin")

# cgroup v1 evicts the tasks of a cpuset left without CPUs from a workqueue, possibly after we
# repaired it: look again this long after an offline event (bounded; nothing runs when idle).
EVICTION_RECHECKS = (0.1, 0.5, 2.0)


class HotplugEvents:
    """Mixed into CPUPlugin, whose state, engine, store and audit it uses (declared here for
    the reader; CPUPlugin defines them, and ``_commit`` and ``_push``)."""

    _commit: Any
    _push: Any
    _cpusets: Any

    hotplug: Any
    returned: Any
    engine: Any
    state: Any
    store: Any
    audit: Any
    settings: Any
    liveness: Any
    proc: str

    def start_hotplug(self) -> None:
        """Listen to the kernel's CPU online/offline uevents on the running loop (once)."""
        if self.hotplug is not None:
            return
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        listener = hotplug.UeventListener(self.cpu_events)
        try:
            listener.start(loop)
        except (OSError, ImportError) as err:
            self.audit.record(
                "hotplug",
                f"cannot listen to CPU hotplug uevents ({err}); CPUs going offline or online "
                "are only noticed at the next start",
                audit_mod.WARNING,
                reason=str(err),
            )
            return
        self.hotplug = listener

    def stop_hotplug(self) -> None:
        if self.hotplug is not None:
            self.hotplug.close()
            self.hotplug = None

    def cpu_events(self, events: list[hotplug.CPUEvent]) -> None:
        """Kernel uevents arrived (from the loop's reader, never inside an NRI handler)."""
        try:
            self._follow_online(events)
        except Exception as err:  # the daemon must outlive a bug here; say it loudly
            log.exception("following CPU hotplug failed")
            self.audit.record(
                "hotplug", f"following CPU hotplug failed: {err}", audit_mod.ERR, reason=str(err)
            )

    def _follow_online(self, events: list[hotplug.CPUEvent]) -> None:
        received = min(e.received for e in events)
        what = ", ".join(f"CPU {e.cpu} {e.action}" if e.cpu >= 0 else e.action for e in events)
        old = self.engine
        try:
            topology = discover(self.settings.sysfs)
            if topology.fingerprint() == old.topology.fingerprint():
                self.audit.record(
                    "hotplug", f"{what}: no change in {self.settings.sysfs}", audit_mod.DEBUG
                )
                return
            engine = Engine(
                StaticPolicy(topology, old.policy.reserved, old.policy.options),
                self.settings.cfs_quota,
            )
        except (TopologyError, PolicyError) as err:
            self.audit.record(
                "hotplug",
                f"{what}: cannot follow the new topology, keeping the old one: {err}",
                audit_mod.ERR,
                reason=str(err),
            )
            return
        self.engine = engine
        went = old.topology.online - topology.online
        came = topology.online - old.topology.online
        self.returned |= came  # see CPUPlugin._grow_pod_cgroup
        self.audit.record(
            "hotplug",
            f"{what}: online CPUs {old.topology.online} -> {topology.online}",
            audit_mod.NOTICE,
            cpus_offline=went,
            cpus_online=came,
        )
        if self.state is None:
            return  # not loaded yet: load_state() repairs against this topology
        before = self.state
        with self.store.locked():
            outcome = self._commit(engine.follow(self.state, old.policy))
        self.audit.emit(outcome.events)
        changed = [t.container_id for t in outcome.targets]
        errors = self._repair_cgroups(changed, grow=came)
        applied = time.monotonic()
        self.audit.record(
            "hotplug-applied",
            f"{len(changed)} containers' cpusets written {(applied - received) * 1000:.1f} ms "
            f"after the uevent ({len(errors)} failed); shared pool {self.state.shared}",
            latency_ms=f"{(applied - received) * 1000:.2f}",
            containers=len(changed),
            shared_cpus=self.state.shared,
        )
        self._push(outcome.targets, "CPU hotplug")
        emptied = [cid for cid in changed if StaticPolicy.cpuset_for(before, cid) <= went]
        if went and emptied:
            self._schedule_eviction_rechecks(emptied)

    def _repair_cgroups(self, cids: Iterable[str], grow: CPUSet | None = None) -> list[str]:
        """Write the cpusets (and CFS quotas) of these containers directly (see
        cpusets.apply), after giving ``grow`` (CPUs that came online; None: every online CPU)
        back to the ancestors of all tracked containers on cgroup v1, where the kernel never
        restores them."""
        state = self.state
        self._cpusets.written_elsewhere()
        try:
            layout = cgroupfs.detect(self.liveness.root)
        except cgroupfs.CgroupError as err:
            layout, errors = None, [str(err)]
        else:
            errors = cpusets.grow_ancestors(
                layout,
                sorted(set(state.cgroups.values())),
                self.policy.topology.online if grow is None else grow,
            )
        targets = []
        for cid in cids:
            path = state.cgroups.get(cid)
            if not path:
                continue  # the runtime's update is all we can do
            target = self.engine.target(state, cid)
            targets.append(
                cpusets.Target(
                    cid, path, target.cpus, target.mems, target.quota, target.mems_from_parent
                )
            )
        returned: dict[str, int] = {}
        if targets and layout is not None:
            applied = cpusets.apply(layout, targets, self.proc)
            errors += applied.errors
            returned = applied.returned
        self.audit.emit(cpusets.repair_events(returned, errors))
        return errors

    def _schedule_eviction_rechecks(self, cids: list[str]) -> None:
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for delay in EVICTION_RECHECKS:
            loop.call_later(delay, self._recheck_evictions, cids)

    def _recheck_evictions(self, cids: list[str]) -> None:
        layout = self.liveness.layout()
        if layout is None or layout.version != cgroupfs.V1:
            return
        with cgroupfs.CgroupFS(layout) as fs:
            for cid in cids:
                path = self.state.cgroups.get(cid)
                if not path:
                    continue
                with contextlib.suppress(cgroupfs.CgroupError):
                    moved = cpusets.return_evicted_tasks(fs, cpusets.cgroup_path(path), self.proc)
                    if moved:
                        self.audit.emit(cpusets.repair_events({cid: moved}, []))
