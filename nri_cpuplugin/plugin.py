"""The NRI CPU plugin: runtime events -> policy decisions -> committed state -> cpusets.

Every decision is committed to the state file *before* the reply leaves, so a crash can lose
a reply but never a decision; and every reply that moves CPUs carries the updates for all
shared-pool containers, so there is no instant at which a shared container may run on a CPU
that was just made exclusive (kubelet leaves that window open for up to 10 s).

Two kinds of hardware awareness live here too:

* NIC locality: for an exclusive candidate in a pod with its own network namespace, the NUMA
  nodes of its interfaces (nic.py) steer its CPUs; inspected before the lock, audited.
* CPU hotplug: kernel uevents (hotplug.py) re-discover the topology and let the policy follow
  the online set (replacement, degraded, return); cgroups are repaired directly (cgroup v1
  never gives a CPU back by itself) and the runtime is told through unsolicited
  UpdateContainers, never from inside an NRI event handler.  The state file records the
  online fingerprint: a change while nothing ran is repaired in place at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from . import audit as audit_mod
from . import cgroupfs, hotplug, nic
from .audit import Audit
from .config import Settings, merge, parse_toml
from .cpuset import CPUSet
from .liveness import Liveness
from .metrics import Metrics, NoMetrics
from .nri.pb import nri_pb2 as pb
from .policy import Decision, Followed, PolicyError, StaticPolicy
from .reconcile import LiveContainer, reconcile
from .state import NodeState
from .store import Expected, StateStore
from .topology import TopologyError, discover
from .workload import Workload, from_nri

log = logging.getLogger("nri_cpuplugin")

LIVE_STATES = (1, 2, 3)  # CONTAINER_CREATED, CONTAINER_PAUSED, CONTAINER_RUNNING
# The runtime gives us 2 s per request by default; waiting longer on the lock than this would
# turn a refusal into a timeout, and a timeout starts the container unpinned.
LOCK_TIMEOUT = 1.0
CFS_PERIOD_US = 100_000  # kubelet's period: the quota of a degraded container is count * this
# cgroup v1 evicts the tasks of a cpuset left without CPUs from a workqueue, possibly after we
# repaired it: look again this long after an offline event (bounded; nothing runs when idle).
EVICTION_RECHECKS = (0.1, 0.5, 2.0)


class CPUPlugin:
    """Handlers for nri.stub.Stub.  ``settings`` are defaults + file; ``flags`` win over both
    the file and the runtime's config string."""

    def __init__(self, settings: Settings, audit: Audit, flags: Mapping[str, Any] = ()) -> None:
        self.file_settings = settings
        self.flags = dict(flags)
        self.audit = audit
        self.stub: Any = None  # set by whoever runs the stub; needed for unsolicited updates
        self.state: NodeState | None = None
        self.metrics: Any = NoMetrics()
        self._metrics_server: Any = None
        # Containers known only from the state file, not (yet) confirmed by the runtime.  Until
        # a Synchronize confirms them, they may have ended unseen: their cgroups are checked.
        # Containers created in this session are never in here: before StartContainer they
        # have no cgroup yet, which must not read as "ended".
        self.unverified: set[str] = set()
        self.liveness = Liveness()
        self.hotplug: hotplug.UeventListener | None = None
        self.proc = "/proc"
        # Set when the online set changed since the containers' cgroups were written (found at
        # load): the next Synchronize repairs the cgroups before the runtime applies updates.
        self._cgroups_stale = False
        # Validate everything now so a bad configuration fails at start, not at first event.
        self._build(merge(settings, self.flags))

    def _build(self, settings: Settings) -> None:
        topology = discover(settings.sysfs)
        self.policy = StaticPolicy.from_config(
            topology,
            settings.reserved_cpus,
            settings.effective_reserved_count,
            settings.policy_options,
        )
        self.settings = settings
        self.store = StateStore(settings.state_dir, lock_timeout=LOCK_TIMEOUT)
        self.state = None  # loaded by load_state(), under the lock

    # --- state ---------------------------------------------------------------------------------

    def load_state(self) -> None:
        """Read the state file; anything unusable is set aside and we start from empty (the
        runtime's Synchronize, or the next events, fill it in).  Never refuses to start."""
        policy = self.policy
        repaired: Followed | None = None
        kept = False  # the stored state was used (not set aside)
        with self.store.locked(timeout=-1):
            # Any CPU layout is accepted: a changed online set is repaired in place below.
            result = self.store.load(Expected(policy.name, None, policy.reserved))
            state = result.state
            problem = result.problem
            if state is not None and state.fingerprint != policy.topology.fingerprint():
                stored = state.fingerprint
                repaired = policy.follow_online(state)
                state = repaired.state
                self.audit.record(
                    "state-repair",
                    f"the online CPUs changed while nothing ran ({stored} -> "
                    f"{state.fingerprint}): assignments kept on CPUs still online, "
                    f"{len(repaired.changes)} containers changed",
                    audit_mod.WARNING,
                    reason="online set changed",
                )
            if state is not None:
                problem = policy.check(state)
                if problem is not None:
                    self.store.set_aside()
                    state = None
            if state is None:
                if result.quarantined is not None or problem != result.problem:
                    self.audit.record(
                        "state-rebuild",
                        f"state file set aside, rebuilding from the runtime: {problem}",
                        audit_mod.WARNING,
                        reason=problem,
                    )
                else:
                    self.audit.record("state-new", f"starting with empty state ({problem})")
                state = policy.empty_state()
            else:
                state = policy.normalized(state)
                kept = True
                self.audit.record(
                    "state-loaded",
                    f"state loaded: {len(state.assignments)} exclusive assignments",
                    shared_cpus=state.shared,
                )
            self.store.commit(state)
        self.state = state
        self.unverified = set(state.assignments) | set(state.sharing)
        if repaired is not None and kept:
            self._audit_hotplug(repaired)
            # Repair the containers we know now (containerd 1.7 sends a launched plugin no
            # Synchronize), and again at Synchronize for those only the runtime knows.
            self._repair_cgroups(sorted(set(state.assignments) | set(state.sharing)))
            self._cgroups_stale = True

    def _commit(self, new_state: NodeState) -> None:
        if new_state is not self.state:
            timing = self.store.commit(new_state)
            self.state = new_state
            self.metrics.observe_commit(timing.total_seconds)
            self.metrics.observe_state(new_state, self.policy.topology)

    # --- metrics -------------------------------------------------------------------------------

    async def start_metrics(self) -> None:
        """Serve /metrics if configured (once); safe to call again after reconfiguration.
        Never raises: pinning matters more than being observed, so an address that cannot be
        bound gets one warning and the daemon runs without metrics."""
        listen = self.settings.metrics_listen
        if listen is None or self._metrics_server is not None:
            return
        metrics = Metrics()
        try:
            self._metrics_server = await metrics.serve(listen)
        except (OSError, ValueError) as err:
            # False: tried; not again at every reconnect (one warning, not one per runtime
            # restart).  Restart the daemon once the address is free.
            self._metrics_server = False
            reason = getattr(err, "strerror", None) or str(err)
            self.audit.record(
                "metrics-failed",
                f"cannot serve metrics on {listen}: {reason}; running without metrics",
                audit_mod.WARNING,
                reason=reason,
            )
            return
        self.metrics = metrics
        if self.state is not None:
            self.metrics.observe_state(self.state, self.policy.topology)

    def observe_request(self, method: str, seconds: float) -> None:
        self.metrics.observe_handler(method, seconds)

    # --- NRI handlers --------------------------------------------------------------------------

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        self.audit.common["RUNTIME"] = f"{runtime_name} {runtime_version}".strip()
        overrides = (
            parse_toml(config, "plugin config sent by the runtime") if config.strip() else {}
        )
        settings = merge(self.file_settings, overrides, self.flags)
        if settings != self.settings:
            self._build(settings)
        if self.state is None:
            self.load_state()
        self.start_hotplug()
        await self.start_metrics()
        self.metrics.set_connected(True)
        self.metrics.observe_state(self.state, self.policy.topology)
        self.audit.record(
            "config",
            f"configured by {runtime_name} {runtime_version}: reserved {self.policy.reserved}, "
            f"options {','.join(sorted(self.policy.options)) or 'none'}, "
            f"state in {self.settings.state_dir}",
            reserved_cpus=self.policy.reserved,
            shared_cpus=self.state.shared,
        )
        self.audit.record("connect", f"connected to {runtime_name} {runtime_version}")

    def synchronize(
        self, pods: Iterable[pb.PodSandbox], containers: Iterable[pb.Container]
    ) -> list[pb.ContainerUpdate]:
        pods = list(pods)
        by_id = {pod.id: pod for pod in pods}
        live = []
        for container in containers:
            pod = by_id.get(container.pod_sandbox_id)
            if pod is None or container.state not in LIVE_STATES:
                continue
            live.append(LiveContainer(from_nri(pod, container), _cpus(container)))
        with self.store.locked():
            result = reconcile(self.policy, self.state, live, [pod.uid for pod in pods])
            self._commit(result.state)
        self.unverified.clear()
        for note in result.notes:
            self.audit.record("reconcile", note, reason="synchronize")
        self.audit.record(
            "synchronize",
            f"synchronized {len(live)} live containers: {len(self.state.assignments)} exclusive, "
            f"shared pool {self.state.shared}",
            shared_cpus=self.state.shared,
        )
        if self._cgroups_stale:
            # The CPUs changed while nothing ran: on cgroup v1 the runtime could not apply
            # these updates (ancestors lack the returning CPUs), so write them first.
            self._cgroups_stale = False
            self._repair_cgroups([c.workload.container_id for c in live])
        updates = [self._update_for(c.workload.container_id) for c in live]
        return updates

    def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        workload = from_nri(pod, container)
        before = self.state.shared
        try:
            # Outside the lock: it reads netlink and sysfs, never the state (about 1-3 ms).
            locality = self._nic_locality(pod, workload)
            with self.store.locked():
                self._forget_ended()
                decision, new_state = self.policy.admit(
                    self.state, workload, locality.preference if locality else None
                )
                self._commit(new_state)
        except PolicyError as err:
            self.metrics.pinning_request()
            self.metrics.pinning_error()
            self.audit.record(
                "refuse", str(err), audit_mod.ERR, reason=str(err), **workload.identity()
            )
            raise
        if decision.exclusive:
            self.metrics.pinning_request()
        self._audit_decision(decision, workload)
        if decision.exclusive and locality is not None:
            nic.audit_placement(self.audit, decision, workload, locality)
        adjust = pb.ContainerAdjustment()
        self._fill_cpu(adjust.linux.resources.cpu, decision.cpus, decision.mems, decision.exclusive)
        updates = []
        if decision.shared_after != before:
            updates = self._sibling_updates(exclude=workload.container_id)
        return adjust, updates

    def update_container(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        """Someone (kubelet, an operator) updates resources: keep our cpuset in force."""
        cid = container.id
        if cid not in self.state.assignments and cid not in self.state.sharing:
            return []  # not a container we place
        update = self._update_for(cid)
        update.ignore_failure = False
        return [update]

    def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        before = self.state.shared
        with self.store.locked():
            self._forget_ended()
        self._release(container.id, pod)
        if self.state.shared == before:
            return []
        return self._sibling_updates(exclude=container.id)

    def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        # Normally StopContainer released it already; if that was missed, the pool grows now
        # and the siblings hear about it right after this event.
        decision = self._release(container.id, pod)
        if decision is not None and decision.shared_changed:
            self._push_sibling_updates()

    def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        with self.store.locked():
            before = self.state.shared
            self._commit(self.policy.forget_pod(self.state, pod.uid))
        if self.state.shared != before:
            self._push_sibling_updates()

    def connection_lost(self) -> None:
        self.metrics.set_connected(False)
        self.audit.record("disconnect", "lost the connection to the runtime", audit_mod.WARNING)

    # --- NIC locality ---------------------------------------------------------------------------

    def _nic_locality(self, pod: pb.PodSandbox, workload: Workload) -> nic.Locality | None:
        """Where the pod's NICs are, for exclusive candidates only (nobody else's CPUs are
        chosen, so nobody else pays for the netlink round trips)."""
        if self.policy.eligibility(workload)[0] is None:
            return None
        return nic.locality(
            nic.netns_path(pod.linux.namespaces),
            workload.annotations,
            workload.container_name,
            self.settings.sysfs,
            self.policy.topology,
        )

    # --- CPU hotplug ----------------------------------------------------------------------------

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
        old = self.policy
        try:
            topology = discover(self.settings.sysfs)
            if topology.fingerprint() == old.topology.fingerprint():
                self.audit.record(
                    "hotplug", f"{what}: no change in {self.settings.sysfs}", audit_mod.DEBUG
                )
                return
            policy = StaticPolicy(topology, old.reserved, old.options)
        except (TopologyError, PolicyError) as err:
            self.audit.record(
                "hotplug",
                f"{what}: cannot follow the new topology, keeping the old one: {err}",
                audit_mod.ERR,
                reason=str(err),
            )
            return
        self.policy = policy
        went = old.topology.online - topology.online
        came = topology.online - old.topology.online
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
            followed = policy.follow_online(self.state, previous=old.topology)
            self._commit(followed.state)
        self._audit_hotplug(followed)
        after = self.state
        tracked = set(after.assignments) | set(after.sharing)
        changed = sorted(
            cid for cid in tracked if self._cpuset_of(before, cid) != self._cpuset_of(after, cid)
        )
        errors = self._repair_cgroups(changed, grow=came)
        applied = time.monotonic()
        self.audit.record(
            "hotplug-applied",
            f"{len(changed)} containers' cpusets written {(applied - received) * 1000:.1f} ms "
            f"after the uevent ({len(errors)} failed); shared pool {after.shared}",
            latency_ms=f"{(applied - received) * 1000:.2f}",
            containers=len(changed),
            shared_cpus=after.shared,
        )
        if changed and self.stub is not None:
            self.stub.schedule_update_containers(
                [self._update_for(cid) for cid in changed], self._updates_done
            )
        emptied = [cid for cid in changed if self._cpuset_of(before, cid) <= went]
        if went and emptied:
            self._schedule_eviction_rechecks(emptied)

    def _repair_cgroups(self, cids: Iterable[str], grow: CPUSet | None = None) -> list[str]:
        """Write the cpusets of these containers directly (see hotplug.apply), after giving
        ``grow`` (CPUs that came online; None: every online CPU) back to the ancestors of all
        tracked containers on cgroup v1, where the kernel never restores them."""
        state = self.state
        try:
            layout = cgroupfs.detect(self.liveness.root)
        except cgroupfs.CgroupError as err:
            layout, errors = None, [str(err)]
        else:
            errors = hotplug.grow_ancestors(
                layout,
                sorted(set(state.cgroups.values())),
                self.policy.topology.online if grow is None else grow,
            )
        targets = []
        for cid in cids:
            path = state.cgroups.get(cid)
            if not path:
                continue  # the runtime's update is all we can do
            held = state.assignments.get(cid)
            mems = self.policy.topology.numa_of(held.cpus) if held and held.cpus else None
            targets.append(hotplug.Target(cid, path, self._cpuset_of(state, cid), mems))
        if targets and layout is not None:
            applied = hotplug.apply(layout, targets, self.proc)
            errors += applied.errors
            for cid, moved in applied.returned.items():
                self._audit_returned(cid, moved)
        for error in errors:
            self.audit.record(
                "cgroup-repair", f"cpuset repair failed: {error}", audit_mod.WARNING, reason=error
            )
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
        try:
            layout = cgroupfs.detect(self.liveness.root)
        except cgroupfs.CgroupError:
            return
        if layout.version != cgroupfs.V1:
            return
        with cgroupfs.CgroupFS(layout) as fs:
            for cid in cids:
                path = self.state.cgroups.get(cid)
                if not path:
                    continue
                with contextlib.suppress(cgroupfs.CgroupError):
                    moved = hotplug.return_evicted_tasks(fs, hotplug.cgroup_path(path), self.proc)
                    if moved:
                        self._audit_returned(cid, moved)

    def _audit_returned(self, cid: str, moved: int) -> None:
        self.audit.record(
            "cgroup-repair",
            f"put {moved} processes of container {cid[:12]} back into its cpuset (cgroup v1 "
            "had moved them out when the cpuset lost its last CPU)",
            container_id=cid,
            processes=moved,
        )

    def _audit_hotplug(self, followed: Followed) -> None:
        hotplug.audit_changes(self.audit, followed)

    # --- helpers --------------------------------------------------------------------------------

    def _forget_ended(self) -> None:
        """Release unverified containers whose cgroups show they have ended (see liveness.py);
        the caller holds the lock."""
        state = self.state
        for cid in sorted(self.unverified):
            if cid not in state.assignments and cid not in state.sharing:
                self.unverified.discard(cid)
            elif self.liveness.alive(state.cgroups.get(cid, "")) is False:
                self.unverified.discard(cid)
                decision, state = self.policy.release(state, cid)
                self.audit.record(
                    "reconcile",
                    f"container {cid[:12]} ended while the runtime could not tell us"
                    + (f"; released CPUs {decision.cpus}" if decision else ""),
                    container_id=cid, reason="cgroup gone or empty",
                )  # fmt: skip
        self._commit(state)

    def _release(self, cid: str, pod: pb.PodSandbox) -> Decision | None:
        with self.store.locked():
            decision, new_state = self.policy.release(self.state, cid)
            self._commit(new_state)
        if decision is not None:
            held = decision.cpus
            self.audit.record(
                "release",
                f"released CPUs {held} of container {cid[:12]} (pod {pod.namespace}/{pod.name})",
                container_id=cid,
                pod_uid=pod.uid,
                pod_name=pod.name,
                pod_namespace=pod.namespace,
                cpus=held,
                shared_cpus=decision.shared_after,
            )
            self._audit_resize(decision)
        return decision

    def _fill_cpu(self, cpu: pb.LinuxCPU, cpus: CPUSet, mems: CPUSet, exclusive: bool) -> None:
        cpu.cpus = str(cpus)
        if mems:
            cpu.mems = str(mems)
        if exclusive and self.settings.cfs_quota == "unlimited":
            # No CFS quota on exclusive CPUs (kubelet >= 1.33 does the same): the cpuset already
            # bounds the container, and quota only adds throttling stalls.
            cpu.quota.value = -1

    def _update_for(self, cid: str) -> pb.ContainerUpdate:
        update = pb.ContainerUpdate(container_id=cid, ignore_failure=True)
        held = self.state.assignments.get(cid)
        cpu = update.linux.resources.cpu
        if held is not None and held.cpus:
            self._fill_cpu(cpu, held.cpus, self.policy.topology.numa_of(held.cpus), True)
        else:
            self._fill_cpu(cpu, self.state.shared, CPUSet(), False)
            if held is not None and self.settings.cfs_quota == "unlimited":
                # Degraded to the shared pool: its CPU limit bounds it again meanwhile.
                cpu.quota.value = held.count * CFS_PERIOD_US
                cpu.period.value = CFS_PERIOD_US
        return update

    def _cpuset_of(self, state: NodeState, cid: str) -> CPUSet:
        return StaticPolicy.cpuset_for(state, cid)

    def _sibling_updates(self, exclude: str) -> list[pb.ContainerUpdate]:
        # ignore_failure: a sibling that exits at this very moment must not fail a creation.
        followers = set(self.state.sharing) | {
            cid for cid, held in self.state.assignments.items() if not held.cpus
        }
        return [self._update_for(cid) for cid in sorted(followers) if cid != exclude]

    def _push_sibling_updates(self) -> None:
        updates = self._sibling_updates(exclude="")
        if updates and self.stub is not None:
            self.stub.schedule_update_containers(updates, self._updates_done)

    def _updates_done(self, result: Any) -> None:
        if isinstance(result, BaseException):
            self.audit.record(
                "update-failed",
                f"updating shared containers failed: {result}",
                audit_mod.WARNING,
                reason=str(result),
            )

    def _audit_decision(self, decision: Decision, workload: Workload) -> None:
        if decision.exclusive:
            self.audit.record(
                "allocate",
                f"{workload.pod_namespace}/{workload.pod_name}/{workload.container_name} got "
                f"exclusive CPUs {decision.cpus} (NUMA {decision.mems}): {decision.reason}",
                reason=decision.reason,
                cpus=decision.cpus,
                mems=decision.mems,
                shared_cpus=decision.shared_after,
                **workload.identity(),
            )
        else:
            self.audit.record(
                "share",
                f"{workload.pod_namespace}/{workload.pod_name}/{workload.container_name} runs in "
                f"the shared pool {decision.cpus}: {decision.reason}",
                audit_mod.DEBUG,
                reason=decision.reason,
                cpus=decision.cpus,
                **workload.identity(),
            )
        self._audit_resize(decision)

    def _audit_resize(self, decision: Decision) -> None:
        if decision.shared_changed:
            self.audit.record(
                "shared-resize",
                f"shared pool {decision.shared_before} -> {decision.shared_after} "
                f"({len(self.state.sharing)} containers updated in the same reply)",
                reason=decision.reason,
                shared_cpus=decision.shared_after,
                old_shared_cpus=decision.shared_before,
            )


def _cpus(container: pb.Container) -> CPUSet:
    try:
        return CPUSet.parse(container.linux.resources.cpu.cpus)
    except ValueError:
        return CPUSet()
