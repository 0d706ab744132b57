"""The NRI front end: runtime events -> engine outcomes -> committed state -> NRI replies.

A decision is committed to the state file before the reply leaves, so a crash can lose a
reply but never a decision - except where the runtime gives every decision back after a crash
(a creation or a stop, once the runtime lists its containers at each connection: see
daemon/persistence.py).
Every event that moves CPUs moves all shared-pool containers before its reply leaves (written
directly, or as updates in the reply), so there is no instant at which a shared container may
run on a CPU that was just made exclusive (kubelet leaves that window open for up to 10 s).

The runtime is never sent an unsolicited UpdateContainers: on every containerd with an NRI
before 0.12.1 it can deadlock the runtime for good (docs/architecture.md, "Changes outside
event replies").  What changes outside an event is written directly, and what cannot be is
carried by the next reply that can carry updates (``_push``, ``_carry_owed``).

Two kinds of hardware awareness live here too:

* NIC locality: for an exclusive candidate in a pod with its own network namespace, the NUMA
  nodes of its interfaces (nic.py) steer its CPUs; read when its pod started
  (daemon/pod_nics.py) or else before the lock, audited.
* CPU hotplug: kernel uevents (hotplug.py) re-discover the topology and let the policy follow
  the online set (replacement, degraded, return); cgroups are written directly (cgroup v1
  never gives a CPU back by itself), cpusets and CFS quotas alike.  The state file records
  the online fingerprint: a change while nothing ran is repaired in place at the next start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.cpuset import CPUSet
from ..core.engine import Engine, LiveContainer, Outcome
from ..core.policy import PolicyError, StaticPolicy
from ..core.state import Earmark, NodeState
from ..core.topology import discover
from ..core.workload import (
    GUARANTEED,
    Workload,
    from_nri,
    millicores_from_quota,
    millicores_from_shares,
    qos_from_cgroup_parent,
)
from ..hardware import hotplug, nic
from ..hardware.cpuset_files import OpenCpusets
from ..hardware.liveness import Liveness
from ..nri.handlers import EVENT_BITS
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings, merge, parse_toml
from ..ops.metrics import Metrics, NoMetrics
from ..storage.store import StateStore
from . import earmarks
from .hotplug_events import HotplugEvents
from .persistence import StateKeeping
from .pod_nics import Listing, PodNICs
from .starts import Starts
from .targets import TargetWriter, cpus_of, fill_cpu, spec_agrees
from .unverified import UnverifiedContainers

log = logging.getLogger("nri_cpuplugin")

LIVE_STATES = (1, 2, 3)  # CONTAINER_CREATED, CONTAINER_PAUSED, CONTAINER_RUNNING
# The runtime gives us 2 s per request by default; waiting longer on the lock than this would
# turn a refusal into a timeout, and a timeout starts the container unpinned.  (The daemon's
# DeadlinePlugin waits on its worker thread instead, and answers in time: daemon/deadline.py.)
LOCK_TIMEOUT = 1.0


class CPUPlugin(StateKeeping, HotplugEvents, UnverifiedContainers, Starts, TargetWriter):
    """Handlers for nri.stub.Stub.  ``settings`` are defaults + file; ``flags`` win over both
    the file and the runtime's config string.  Every decision is the engine's
    (core/engine.py); this class turns events into engine calls and outcomes into replies."""

    def __init__(self, settings: Settings, audit: Audit, flags: Mapping[str, Any] = ()) -> None:
        self.file_settings = settings
        self.flags = dict(flags)
        self.audit = audit
        self.stub: Any = None  # set by whoever runs the stub
        self.state: NodeState | None = None
        self.metrics: Any = NoMetrics()
        self._metrics_server: Any = None
        # Containers known only from the state file, not (yet) confirmed by the runtime.  Until
        # a Synchronize confirms them, they may have ended unseen: their cgroups are checked.
        # Containers created in this session are never in here: before StartContainer they
        # have no cgroup yet, which must not read as "ended".
        self.unverified: set[str] = set()
        self.hotplug: hotplug.UeventListener | None = None
        self.proc = "/proc"
        # Set when the online set changed since the containers' cgroups were written (found at
        # load): the next Synchronize repairs the cgroups before the runtime applies updates.
        self._cgroups_stale = False
        # After the state was lost, until the runtime lists its containers: CPUs that running
        # Guaranteed containers look pinned to (liveness.pinned_cpus), never handed out.
        self.pinned = CPUSet()
        # Containers whose target the runtime must apply itself (no direct write possible)
        # after a change outside any event: carried by the next reply that can (see _push).
        self._owed: set[str] = set()
        self._unsaved = False  # see StateKeeping
        # Shared containers whose cgroup asks for no scheduler domain of its own any more,
        # which halves the cost of each write (hardware/cpusets.stop_balancing), and whose
        # cpuset.cpus is kept open (hardware/cpuset_files.py): see _prepare_shared.
        self._unbalanced: set[str] = set()
        self._cpusets = OpenCpusets()
        # The interfaces of Guaranteed pods' namespaces, read as each pod starts.
        self.pod_nics = PodNICs()
        # Pod uid -> the sandbox its newest container was created in.  kubelet recreates a
        # pod's sandbox under the same uid and removes the old one later (garbage collection):
        # that removal must not take the CPUs of the new sandbox's containers.
        self._latest_sandbox: dict[str, str] = {}
        # Whether the runtime listed its containers on this connection (Synchronize), as it
        # then does at every connection: an exclusive assignment a crash kept from the state
        # file comes back from that list, so it may be committed after the answer (_hold).
        self.runtime_lists = False
        # CPUs that came back online while we ran (all online CPUs after a change while we
        # were down): cgroup v1 gave them to no cgroup made while they were offline.
        self.returned = CPUSet()
        self._sweeping = False
        self._sweeps = 0
        self._swept_to = ""  # the last container id the sweep checked
        # The claim on the state directory that makes an OCI hook on this node stand aside
        # (storage/owner.py): (state directory, open descriptor holding the flock).
        self._claim: tuple[str, int] | None = None
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
        # cgroupfs is mounted below sysfs: a generated sysfs tree (tests) has none of the
        # host's cgroups, so nothing is read from or written to them.
        self.liveness = Liveness(os.path.join(settings.sysfs, "fs", "cgroup"))
        self.store = StateStore(settings.state_dir, lock_timeout=LOCK_TIMEOUT)
        self.state = None  # loaded by load_state(), under the lock

    @property
    def policy(self) -> StaticPolicy:
        return self.engine.policy

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

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> int | None:
        self.audit.common["RUNTIME"] = f"{runtime_name} {runtime_version}".strip()
        self._apply_config(config)
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
        unwanted = 0
        if not (self.settings.nic_read_ahead or self.settings.earmark_pods):
            # Without the read-ahead and earmarks, RunPodSandbox would only cost each pod a
            # round trip.
            unwanted |= EVENT_BITS["run_pod_sandbox"]
        if self.settings.nri_pin_at == "start":
            # Decided at StartContainer: any consultation at creation costs the runtime's
            # CreateContainer its own NRI round trip (docs/architecture.md, "Pinning at start").
            unwanted |= EVENT_BITS["create_container"]
        if not unwanted or self.stub is None:
            return None  # every handler's event
        return self.stub.handled_events & ~unwanted

    def _apply_config(self, config: str) -> None:
        """Settings from the runtime's config string (rebuilt when they changed), and the
        state loaded.  Apart from configure() so that it can run where the state is owned."""
        overrides = (
            parse_toml(config, "plugin config sent by the runtime") if config.strip() else {}
        )
        settings = merge(self.file_settings, overrides, self.flags)
        if settings != self.settings:
            self._build(settings)
        if self.state is None:
            self.load_state()

    def synchronize(
        self, pods: Iterable[pb.PodSandbox], containers: Iterable[pb.Container]
    ) -> list[pb.ContainerUpdate]:
        pods = list(pods)
        by_id = {pod.id: pod for pod in pods}
        live = []
        specs: dict[str, pb.Container] = {}
        latest: dict[str, str] = {}
        for container in containers:
            pod = by_id.get(container.pod_sandbox_id)
            if pod is None or container.state not in LIVE_STATES:
                continue
            live.append(LiveContainer(from_nri(pod, container), cpus_of(container)))
            specs[container.id] = container
            latest[pod.uid] = pod.id
        with self.store.locked():
            outcome = self._commit(
                self.engine.synchronize(self.state, live, [pod.uid for pod in pods])
            )
        self.unverified.clear()
        self.runtime_lists = True
        self._unbalanced &= specs.keys()
        self._cpusets.keep_only(specs)
        self.pod_nics.keep_only(pod.id for pod in pods)
        self._latest_sandbox = latest
        self._warn_unserved_driver(specs.values())
        owed, self._owed = self._owed, set()  # carried by this reply (below)
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
        # The reply carries only what the runtime's stored specs do not say already (each
        # update costs the runtime one `runc update`, run one after another): on a dense node,
        # the shared containers moved by direct writes while they ran.  The others are written
        # directly where they can be, in case a crash came between a commit and our writes;
        # where they cannot, the runtime applied that spec itself - unless it is owed.
        lagging = []
        agreeing = []
        for target in outcome.targets:
            cid = target.container_id
            agrees = cid not in owed and spec_agrees(specs[cid], target)
            (agreeing if agrees else lagging).append(target)
        self._write_followers(agreeing)
        return [self._update(t) for t in lagging]

    def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        """Decide, move the siblings, answer; then audit.  The shared siblings'
        cgroups are written before the answer (kept-open files, a few microseconds each), so
        the window is closed when the runtime returns; the answer carries the decision and the
        siblings the runtime must move itself.  The decision is audited after it.  An
        exclusive assignment is committed before the answer unless the runtime lists its
        containers at every connection (Synchronize), which restores one that a crash kept
        from the state file (engine.reconcile adopts it): then the container's StartContainer
        commits it (``_hold``).  Without that list, a shared one is committed right after the
        answer."""
        return self._decide_creation(pod, container, self._answer)

    def _decide_creation(
        self, pod: pb.PodSandbox, container: pb.Container, answer: Callable[[object], bool]
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        """create_container's work, ``answer`` handing its reply over (see ``_answer``)."""
        workload = from_nri(pod, container)
        self._latest_sandbox[pod.uid] = pod.id
        try:
            # Outside the lock: it reads netlink and sysfs, never the state (about 1-3 ms).
            locality = self._nic_locality(pod, workload)
            with self.store.locked():
                outcome, committed = self._create(workload, locality)
                mine, *siblings = outcome.targets
                # As decided, not yet committed: the state the answer speaks for.
                if mine.cpus & self.returned:
                    self._grow_pod_cgroup(mine, outcome.state)
                adjust = pb.ContainerAdjustment()
                fill_cpu(adjust.linux.resources.cpu, mine)
                # The container being created must not be listed: the runtime refuses that.
                updates = [self._update(t) for t in self._write_followers(siblings)]
                updates += self._carry_owed(
                    (t.container_id for t in outcome.targets), outcome.state
                )
                # False: answered with an error meanwhile; what was committed already is
                # audited, and released again by the late part (daemon/deadline.py).
                proceed = answer((adjust, updates))
                if proceed and not committed:
                    (self._hold if self.runtime_lists else self._commit)(outcome)
                elif not (proceed or committed) and siblings:
                    # Written for a decision that is not made after all: the pool as it is.
                    back = [self.engine.target(self.state, t.container_id) for t in siblings]
                    self._push(back, "creation answered with an error")
        except PolicyError as err:
            self.metrics.pinning_request()
            self.metrics.pinning_error()
            self.audit.emit([self.engine.refused(workload, err)])
            raise
        if not (proceed or committed):
            return adjust, updates
        if outcome.decision is not None and outcome.decision.exclusive:
            self.metrics.pinning_request()
        self.audit.emit(outcome.events)
        return adjust, updates

    def _answer(self, reply: object) -> bool:
        """Hand the reply to the runtime before the rest of the creation is done; False when
        the request was answered with an error meanwhile, and nothing more may be done.  Here
        (no worker) the reply goes when the handler returns."""
        return True

    def _create(self, workload: Workload, locality: nic.Locality | None) -> tuple[Outcome, bool]:
        """Decide (the caller holds the lock), and commit first where the answer must wait
        for the commit: (outcome, committed).  When there is no room, containers known only
        from the state file may have ended unseen: those holding exclusive CPUs are checked,
        and the request is decided again.  Only then - so a creation never pays for checking
        every container a restart left unverified."""
        preference = locality.preference if locality else None
        note = locality.note if locality else None
        try:
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        except PolicyError as err:
            if err.code != "refused" or not self._recheck_holders():
                raise
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        exclusive = outcome.decision is not None and outcome.decision.exclusive
        if not exclusive or self.runtime_lists:
            return outcome, False
        try:
            return self._commit(outcome, durable=True), True
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
        """Someone (kubelet's in-place resize, an operator) updates resources.  A new CPU
        request resizes the container (core/resize.py); anything else keeps our cpuset in
        force.  A growth that cannot be met fails the update: kubelet reports the resize as
        failed and retries."""
        # No shares, or 0 (CRI's "leave as it is"): not a change of the CPU request.
        if not resources.cpu.shares.value:
            outcome = self.engine.update(self.state, container.id)
            # The owed updates of other containers first: the runtime applies the entry for
            # the container being updated last, in place of the CRI request (nri-wire §11.3).
            owed = self._carry_owed([container.id])
            return owed + [self._update(t, ignore_failure=False) for t in outcome.targets]
        updated = pb.Container()
        updated.CopyFrom(container)
        updated.linux.resources.CopyFrom(resources)
        workload = from_nri(pod, updated)
        try:
            with self.store.locked():
                outcome = self.engine.resize(self.state, workload)
                exclusive = outcome.decision is not None and outcome.decision.exclusive
                self._commit(outcome, durable=exclusive)
        except (PolicyError, OSError) as err:
            error = err if isinstance(err, PolicyError) else PolicyError(str(err), "not-durable")
            self.audit.emit([self.engine.refused(workload, error)])
            raise error from None
        self.audit.emit(outcome.events)
        owed = self._carry_owed([container.id, *(t.container_id for t in outcome.targets)])
        return owed + [
            self._update(t, ignore_failure=t.container_id != container.id) for t in outcome.targets
        ]

    def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        """The container's CPUs go back to the shared pool.  Once the runtime lists its
        containers, the answer goes first, and the shared containers' writes and the commit
        follow it: a shared container given its CPUs a moment later runs nowhere it must not,
        and a crash before the commit is repaired from the runtime's list, which shows the
        container stopped.  Before that, commit, write, answer."""
        with self.store.locked():
            outcome = self.engine.stop(self.state, container.id)
            followers = [t for t in outcome.targets if t.container_id != container.id]
            cids = [container.id, *(t.container_id for t in followers)]
            if not self.runtime_lists:
                self._commit(outcome)
                updates = [self._update(t) for t in self._write_followers(followers)]
                updates += self._carry_owed(cids)
            else:
                self._hold(outcome)
                direct, runtime = self._split_followers(followers)
                updates = [self._update(t) for t in runtime] + self._carry_owed(cids)
                self._answer(updates)
                # Not written after all: the next reply that can carry them does.
                self._owed |= {t.container_id for t in self._write_direct(direct)}
                self._commit(outcome)
        self.audit.emit(outcome.events)
        return updates

    def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        # Normally StopContainer released it already; if that was missed, the pool grows now
        # and the siblings hear about it right after this event.
        self._forget_cgroups(container.id)
        with self.store.locked():
            outcome = self._commit(self.engine.stop(self.state, container.id))
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "container removed")

    def run_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        """A pod started, its network set up: if it is Guaranteed, CPUs are earmarked for its
        exclusive containers (``_earmark``) and its interfaces are read for their NIC
        locality."""
        self._read_nics_ahead(pod)
        limit = self._earmark_limit(pod)
        if limit:
            self._earmark(pod, limit)

    def _earmark_limit(self, pod: pb.PodSandbox) -> int:
        return earmarks.pod_cpu_limit(pod) if self.settings.earmark_pods else 0

    def _earmark(self, pod: pb.PodSandbox, limit: int) -> None:
        """CPUs set aside for the pod's exclusive containers, and the shared containers moved
        off them now (written directly, or owed to the next reply that can carry updates):
        the creation of an exclusive container that takes them moves nobody, whatever the
        number of containers on the node (docs/architecture.md, "Earmarks")."""
        wanted = Earmark(CPUSet(), pod.id, limit, pod_name=pod.name, pod_namespace=pod.namespace)
        with self.store.locked():
            decided = self.engine.earmark(self.state, pod.uid, wanted, self.pinned)
            outcome = self._commit(decided)
        if outcome.events:
            self._latest_sandbox[pod.uid] = pod.id
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "pod earmarked")

    def _read_nics_ahead(self, pod: pb.PodSandbox) -> None:
        """A Guaranteed pod (it may hold exclusive containers: which ones, its creations say)
        has its interfaces read now, in the background, for their NIC locality
        (daemon/pod_nics.py).  On the event loop: it only starts the read."""
        netns = nic.netns_path(pod.linux.namespaces)
        parent = pod.linux.cgroup_parent
        if not self.settings.nic_read_ahead or netns is None or not parent:
            return
        if qos_from_cgroup_parent(parent) != GUARANTEED:
            return
        try:
            if nic.request(pod.annotations, "").mode == "off":  # pod-wide
                return
        except PolicyError:
            return  # its creations refuse the annotation, with the reason
        self.pod_nics.read_ahead(pod.id, netns)

    def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        self.pod_nics.forget(pod.id)
        if self._latest_sandbox.setdefault(pod.uid, pod.id) != pod.id:
            self.audit.record(
                "reconcile",
                f"an earlier sandbox {pod.id[:12]} of pod {pod.namespace}/{pod.name} was "
                "removed: the containers of its newer sandbox keep what they hold",
                audit_mod.INFO,
                reason="earlier sandbox removed",
            )
            return
        del self._latest_sandbox[pod.uid]
        with self.store.locked():
            outcome = self._commit(self.engine.remove_pod(self.state, pod.uid))
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "pod removed")

    def update_pod_sandbox(
        self, pod: pb.PodSandbox, overhead: pb.LinuxResources, resources: pb.LinuxResources
    ) -> None:
        """A pod's pod-level resources changed (NRI >= 0.10, kubelet's in-place resize of a pod
        with pod-level resources; docs/nri-wire.md §14).  The reply cannot carry updates, and
        kubelet updates each resized container next (UpdateContainer, where we keep our
        cpusets): here the pod's containers get their current cpusets (and quotas) again,
        written directly (see _push), so nothing the resize did to their cgroups is left in
        force.

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
        self._push(targets, "pod resized")

    def _containers_of(self, pod_uid: str) -> list[str]:
        """The containers we track for a pod: exclusive ones and those in the shared pool."""
        state = self.state
        if state is None or not pod_uid:
            return []
        held = [cid for cid, a in state.assignments.items() if a.pod_uid == pod_uid]
        sharing = [cid for cid, uid in state.sharing.items() if uid == pod_uid]
        return sorted({*held, *sharing})

    def connection_lost(self) -> None:
        self.runtime_lists = False
        self.metrics.set_connected(False)
        self.audit.record("disconnect", "lost the connection to the runtime", audit_mod.WARNING)

    # --- NIC locality ---------------------------------------------------------------------------

    def _nic_locality(self, pod: pb.PodSandbox, workload: Workload) -> nic.Locality | None:
        """Where the pod's NICs are, for exclusive candidates only (nobody else's CPUs are
        chosen): from the read made when the pod started (daemon/pod_nics.py), if any."""
        if self.policy.eligibility(workload)[0] is None:
            return None
        netns = nic.netns_path(pod.linux.namespaces)
        read_ahead = self.pod_nics.lister_for(pod.id, netns)
        used = []

        def lister(path: str) -> Listing:
            listing = read_ahead(path)
            used.append(path)  # (not when the read failed, or locality is off)
            return listing

        locality = nic.locality(
            netns,
            workload.annotations,
            workload.container_name,
            self.settings.sysfs,
            self.policy.topology,
            lister if read_ahead is not None else None,
        )
        if not used:
            return locality
        return locality.evolve(note=f"{locality.note} (interfaces read when the pod started)")
