"""The NRI front end: runtime events -> engine outcomes -> committed state -> NRI replies.

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

from ..core.cpuset import CPUSet
from ..core.engine import CFS_PERIOD_US, Engine, LiveContainer, Outcome, Target
from ..core.policy import PolicyError, StaticPolicy
from ..core.state import NodeState
from ..core.topology import TopologyError, discover
from ..core.workload import Workload, from_nri, millicores_from_quota, millicores_from_shares
from ..hardware import cgroupfs, hotplug, nic
from ..hardware.liveness import Liveness, pinned_cpus
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings, merge, parse_toml
from ..ops.metrics import Metrics, NoMetrics
from ..storage.store import Expected, StateStore

log = logging.getLogger("nri_cpuplugin")

LIVE_STATES = (1, 2, 3)  # CONTAINER_CREATED, CONTAINER_PAUSED, CONTAINER_RUNNING
# The runtime gives us 2 s per request by default; waiting longer on the lock than this would
# turn a refusal into a timeout, and a timeout starts the container unpinned.
LOCK_TIMEOUT = 1.0
# cgroup v1 evicts the tasks of a cpuset left without CPUs from a workqueue, possibly after we
# repaired it: look again this long after an offline event (bounded; nothing runs when idle).
EVICTION_RECHECKS = (0.1, 0.5, 2.0)
# Containers known only from the state file are checked this many at a time, this often
# (a check reads one or two cgroup files).
SWEEP_INTERVAL, SWEEP_BATCH = 2.0, 32


class CPUPlugin:
    """Handlers for nri.stub.Stub.  ``settings`` are defaults + file; ``flags`` win over both
    the file and the runtime's config string.  Every decision is the engine's
    (core/engine.py); this class turns events into engine calls and outcomes into replies."""

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
        # After the state was lost, until the runtime lists its containers: CPUs that running
        # Guaranteed containers are alone on (liveness.pinned_cpus), never handed out.
        self.pinned = CPUSet()
        self._sweeping = False
        self._swept_to = ""  # the last container id the sweep checked
        # Validate everything now so a bad configuration fails at start, not at first event.
        self._build(merge(settings, self.flags))

    def _build(self, settings: Settings) -> None:
        topology = discover(settings.sysfs)
        policy = StaticPolicy.from_config(
            topology,
            settings.reserved_cpus,
            settings.effective_reserved_count,
            settings.policy_options,
        )
        self.settings = settings
        self.engine = Engine(policy, settings.cfs_quota)
        self.store = StateStore(settings.state_dir, lock_timeout=LOCK_TIMEOUT)
        self.state = None  # loaded by load_state(), under the lock

    @property
    def policy(self) -> StaticPolicy:
        return self.engine.policy

    # --- state ---------------------------------------------------------------------------------

    def load_state(self) -> None:
        """Read the state file; anything unusable is set aside and we start from empty (the
        runtime's Synchronize, or the next events, fill it in).  Never refuses to start."""
        policy = self.policy
        with self.store.locked(timeout=-1):
            result = self.store.load(Expected(policy.name, None, policy.reserved))
            loaded = self.engine.load(result.state, result.problem, result.quarantined)
            if loaded.set_aside:
                self.store.set_aside()
            self.state = result.state  # what is on disk: _commit writes only a change
            self._commit(Outcome(loaded.state))
        self.audit.emit(loaded.events)
        state = self.state
        self.unverified = set(state.assignments) | set(state.sharing)
        if not loaded.trusted:
            self._learn_pinned()
        if loaded.followed is not None and loaded.trusted:
            # Repair the containers we know now (containerd 1.7 sends a launched plugin no
            # Synchronize), and again at Synchronize for those only the runtime knows.
            self._repair_cgroups(sorted(set(state.assignments) | set(state.sharing)))
            self._cgroups_stale = True

    def _commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
        """Commit the outcome's state (the caller holds the lock) before anything is applied.

        A state that cannot be written (a full disk, a read-only directory) is kept in memory
        and written with the next commit that succeeds - what shared containers run on can
        always be derived again - unless ``durable``: an exclusive assignment that a crash
        could forget must not be handed out, so the error goes to the caller."""
        new_state = outcome.state
        if new_state == self.state:
            self.state = new_state
            return outcome
        try:
            timing = self.store.commit(new_state)
        except OSError as err:
            if durable:
                raise
            self.audit.record(
                "state-unsaved",
                f"the state could not be written, kept in memory until it can: {err}",
                audit_mod.WARNING,
                reason=str(err),
            )
        else:
            self.metrics.observe_commit(timing.total_seconds)
        self.state = new_state
        self.metrics.observe_state(new_state, self.policy.topology)
        return outcome

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
        self._start_sweep()
        self.start_hotplug()
        await self.start_metrics()
        self.metrics.set_connected(True)
        self.metrics.observe_state(self.state, self.policy.topology)
        # What the stub learnt of the runtime's NRI (said by NRI >= 0.12, else inferred).
        nri = getattr(getattr(self.stub, "runtime_nri", None), "version", "")
        self.audit.record(
            "config",
            f"configured by {runtime_name} {runtime_version}"
            f"{f' (NRI {nri})' if nri else ''}: reserved {self.policy.reserved}, "
            f"options {','.join(sorted(self.policy.options)) or 'none'}, "
            f"state in {self.settings.state_dir}",
            reserved_cpus=self.policy.reserved,
            shared_cpus=self.state.shared,
            nri_version=nri,
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
            outcome = self._commit(
                self.engine.synchronize(self.state, live, [pod.uid for pod in pods])
            )
        self.unverified.clear()
        self.pinned = CPUSet()  # the runtime's own list replaces what the cgroups suggested
        self.audit.emit(outcome.events)
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
        return [self._update(t) for t in outcome.targets]

    def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        workload = from_nri(pod, container)
        try:
            # Outside the lock: it reads netlink and sysfs, never the state (about 1-3 ms).
            locality = self._nic_locality(pod, workload)
            with self.store.locked():
                outcome = self._create(workload, locality)
        except PolicyError as err:
            self.metrics.pinning_request()
            self.metrics.pinning_error()
            self.audit.emit([self.engine.refused(workload, err)])
            raise
        if outcome.decision is not None and outcome.decision.exclusive:
            self.metrics.pinning_request()
        self.audit.emit(outcome.events)
        mine, *siblings = outcome.targets
        adjust = pb.ContainerAdjustment()
        _fill(adjust.linux.resources.cpu, mine)
        return adjust, [self._update(t) for t in siblings]

    def _create(self, workload: Workload, locality: nic.Locality | None) -> Outcome:
        """Decide and commit (the caller holds the lock).  When there is no room, containers
        known only from the state file may have ended unseen: those holding exclusive CPUs
        are checked, and the request is decided again.  Only then - so a creation never pays
        for checking every container a restart left unverified."""
        preference = locality.preference if locality else None
        note = locality.note if locality else None
        try:
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        except PolicyError as err:
            if err.code != "refused" or not self._recheck_holders():
                raise
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        exclusive = outcome.decision is not None and outcome.decision.exclusive
        try:
            return self._commit(outcome, durable=exclusive)
        except OSError as err:
            raise PolicyError(
                f"exclusive CPUs {outcome.decision.cpus} for {workload.pod_namespace}/"
                f"{workload.pod_name}/{workload.container_name} cannot be made durable: {err}; "
                "free space there (or fix the state directory) and the pod will be retried",
                "not-durable",
            ) from None

    def update_container(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        """Someone (kubelet, an operator) updates resources: keep our cpuset (nri-wire.md §9.2)."""
        outcome = self.engine.update(self.state, container.id)
        return [self._update(t, ignore_failure=False) for t in outcome.targets]

    def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        with self.store.locked():
            outcome = self._commit(self.engine.stop(self.state, container.id))
        self.audit.emit(outcome.events)
        return [self._update(t) for t in outcome.targets if t.container_id != container.id]

    def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        # Normally StopContainer released it already; if that was missed, the pool grows now
        # and the siblings hear about it right after this event.
        with self.store.locked():
            outcome = self._commit(self.engine.stop(self.state, container.id))
        self.audit.emit(outcome.events)
        self._push(outcome.targets)

    def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        with self.store.locked():
            outcome = self._commit(self.engine.remove_pod(self.state, pod.uid))
        self.audit.emit(outcome.events)
        self._push(outcome.targets)

    def update_pod_sandbox(
        self, pod: pb.PodSandbox, overhead: pb.LinuxResources, resources: pb.LinuxResources
    ) -> None:
        """A pod's pod-level resources changed (NRI >= 0.10, kubelet's in-place resize of a pod
        with pod-level resources; docs/nri-wire.md §14).  The reply cannot carry updates, and
        kubelet updates each resized container next (UpdateContainer, where we keep our
        cpusets): here the pod's containers get their current cpusets again, sent right after
        this reply, so nothing the resize did to the pod's cgroups is left in force.

        Hook point: deciding a new exclusive size for a resized pod belongs to the engine
        (core/engine.py); its outcome's targets go out the same way as these."""
        cids = self._containers_of(pod.uid)
        targets = [t for cid in cids for t in self.engine.update(self.state, cid).targets]
        cpu = resources.cpu
        request = millicores_from_shares(cpu.shares.value) if cpu.HasField("shares") else None
        quota = cpu.quota.value if cpu.HasField("quota") else None
        period = cpu.period.value if cpu.HasField("period") else None
        limit = millicores_from_quota(quota, period)
        exclusive = sorted(cid for cid in cids if cid in self.state.assignments)
        self.audit.record(
            "pod-update",
            f"pod {pod.namespace}/{pod.name} resized (CPU request "
            f"{'-' if request is None else f'{request}m'}, limit "
            f"{'none' if limit is None else f'{limit}m'}): cpusets of its {len(targets)} "
            f"containers kept ({len(exclusive)} exclusive)",
            pod_namespace=pod.namespace,
            pod_name=pod.name,
            pod_uid=pod.uid,
            cpu_request_milli=request,
            cpu_limit_milli=limit,
            containers=len(targets),
        )
        self._push(targets)

    def _containers_of(self, pod_uid: str) -> list[str]:
        """The containers we track for a pod: exclusive ones and those in the shared pool."""
        state = self.state
        if state is None or not pod_uid:
            return []
        held = [cid for cid, a in state.assignments.items() if a.pod_uid == pod_uid]
        sharing = [cid for cid, uid in state.sharing.items() if uid == pod_uid]
        return sorted({*held, *sharing})

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
        self._push(outcome.targets)
        emptied = [cid for cid in changed if StaticPolicy.cpuset_for(before, cid) <= went]
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
            target = self.engine.target(state, cid)
            targets.append(hotplug.Target(cid, path, target.cpus, target.mems))
        returned: dict[str, int] = {}
        if targets and layout is not None:
            applied = hotplug.apply(layout, targets, self.proc)
            errors += applied.errors
            returned = applied.returned
        self.audit.emit(hotplug.repair_events(returned, errors))
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
                        self.audit.emit(hotplug.repair_events({cid: moved}, []))

    # --- helpers --------------------------------------------------------------------------------

    def _forget_ended(self, exclusive_only: bool = False, limit: int | None = None) -> Outcome:
        """Release unverified containers whose cgroups show they have ended (see liveness.py):
        those holding exclusive CPUs only, or the next ``limit`` of them in turn (the sweep);
        the caller holds the lock.  Returns what was released (its events are recorded)."""
        state = self.state
        candidates = sorted(self.unverified)
        if exclusive_only:
            candidates = [cid for cid in candidates if cid in state.assignments]
        elif limit is not None:
            # In turn: after the last one checked, wrapping around.
            later = [cid for cid in candidates if cid > self._swept_to]
            candidates = (later + [cid for cid in candidates if cid <= self._swept_to])[:limit]
            if candidates:
                self._swept_to = candidates[-1]
        ended = []
        for cid in candidates:
            if cid not in state.assignments and cid not in state.sharing:
                self.unverified.discard(cid)
            # Alive, or cannot tell: stays unverified (it may still end unseen, later).
            elif self.liveness.alive(state.cgroups.get(cid, "")) is False:
                self.unverified.discard(cid)
                ended.append(cid)
        if not ended:
            return Outcome(state)
        why = "its cgroup is gone or empty, and the runtime could not tell us"
        outcome = self._commit(self.engine.ended(state, ended, why))
        self.audit.emit(outcome.events)
        return outcome

    def _recheck_holders(self) -> bool:
        """Whether CPUs came free: unverified exclusive holders that ended, or containers
        pinned before the state was lost that are gone."""
        freed = bool(self._forget_ended(exclusive_only=True).events)
        if self.pinned:
            before = self.pinned
            self._learn_pinned()
            freed = freed or self.pinned != before
        return freed

    def _learn_pinned(self) -> None:
        """The state is lost (or new): which CPUs are running containers pinned to?  Until the
        runtime says (Synchronize - containerd 1.7 never sends one to a plugin it launched),
        those are kept out of exclusive use, so that no CPU is given twice."""
        pinned = pinned_cpus(self.liveness.root) - self.state.exclusive
        if pinned != self.pinned and (pinned or self.pinned):
            self.audit.record(
                "reconcile",
                f"running containers are pinned to CPUs {pinned or 'none'} that the state does "
                "not name (it was lost): kept out of exclusive use until the runtime lists its "
                "containers",
                audit_mod.WARNING if pinned else audit_mod.INFO,
                cpus=pinned,
                reason="state lost",
            )
        self.pinned = pinned

    def _start_sweep(self) -> None:
        """Check the unverified containers a few at a time on the event loop, so the shared
        pool grows back when some of them ended, without any event paying for all of them."""
        if self._sweeping or not (self.unverified or self.pinned):
            return
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._sweeping = True
        loop.call_later(SWEEP_INTERVAL, self._sweep, loop)

    def _sweep(self, loop: Any) -> None:
        self._sweeping = False
        if self.state is None:
            return
        if self.pinned:  # containers pinned before the state was lost may have ended
            self._learn_pinned()
        if not self.unverified and not self.pinned:
            return
        try:
            with self.store.locked():
                outcome = self._forget_ended(limit=SWEEP_BATCH)
        except Exception as err:  # a busy lock or a full disk: try again later
            log.warning("checking unverified containers failed: %s", err)
        else:
            self._push(outcome.targets)
        if self.unverified or self.pinned:
            self._sweeping = True
            loop.call_later(SWEEP_INTERVAL, self._sweep, loop)

    def _update(self, target: Target, ignore_failure: bool = True) -> pb.ContainerUpdate:
        # ignore_failure: a sibling that exits at this very moment must not fail a creation.
        update = pb.ContainerUpdate(container_id=target.container_id, ignore_failure=ignore_failure)
        _fill(update.linux.resources.cpu, target)
        return update

    def _push(self, targets: Iterable[Target]) -> None:
        """Tell the runtime about cpusets that changed outside of an event's reply."""
        updates = [self._update(t) for t in targets]
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


def _fill(cpu: pb.LinuxCPU, target: Target) -> None:
    cpu.cpus = str(target.cpus)
    if target.mems:
        cpu.mems = str(target.mems)
    if target.quota is not None:
        cpu.quota.value = target.quota
        if target.quota >= 0:
            cpu.period.value = CFS_PERIOD_US


def _cpus(container: pb.Container) -> CPUSet:
    try:
        return CPUSet.parse(container.linux.resources.cpu.cpus)
    except ValueError:
        return CPUSet()
