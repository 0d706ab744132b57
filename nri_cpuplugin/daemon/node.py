"""The node as the daemon sees it: one object that owns the state, the engine, the state file
and the cgroups' liveness, and turns each event (daemon/events.py) into effects.

    event ──▶ Node.handle ──▶ engine ──▶ writer (direct cgroup writes) ──▶ Effects (the reply)
                                 │
                                 └──▶ commit: before the reply, after it, or at the start

Every decision is the engine's (core/engine.py); the node adds what only the daemon knows:
which containers the runtime has listed, what is owed to the runtime (daemon/owed.py), which
sandbox of a pod is the newest, which CPUs came back online, NIC locality.

**When a commit happens** (``_commit_point``, the one rule): a decision is committed before
its answer leaves, so a crash can lose an answer but never a decision - except where the
runtime gives every such decision back after a crash.  Once the runtime lists its containers
at each connection (Synchronize), a creation's state is held in memory and committed by the
container's StartContainer, before its first instruction, and a stop's right after its
answer: a crash in between loses nothing the runtime would not list again.  Before that, an
exclusive decision must be durable before its answer, and a shared creation is committed
right after its answer.

**What moves with a decision**: every event that moves CPUs moves every shared container
before its reply leaves - written directly by the writer (daemon/writer.py), or carried in the
reply - so there is no instant at which a shared container may run on a CPU just made
exclusive.  What changes outside a reply (a removal, CPU hotplug, the sweep) is written, or
owed to the next reply that can carry it: never an unsolicited UpdateContainers, which
deadlocks containerd (docs/architecture.md, "Changes outside event replies").

The node runs on one thread at a time (the daemon's worker, daemon/deadline.py); methods named
``query_*`` only read and may be called from the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.cpuset import CPUSet
from ..core.engine import Engine, LiveContainer, Outcome, Target
from ..core.policy import PolicyError, StaticPolicy, describe
from ..core.state import Earmark, NodeState
from ..core.topology import TopologyError, discover
from ..core.workload import Workload
from ..hardware import cpusets, nic
from ..hardware.liveness import Liveness, pinned_cpus
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings, merge, parse_toml
from ..ops.metrics import NoMetrics
from ..storage.store import Expected
from . import earmarks
from . import events as ev
from .effects import NO_EFFECTS, Effects
from .owed import Owed
from .pod_nics import Listing, PodNICs
from .progress import CGROUPS, NIC, NoProgress, Progress
from .statefile import StateFile
from .unverified import PINNED_EVERY, SWEEP_BATCH, SWEEP_INTERVAL, Unverified
from .writer import CgroupWriter, Units

# cgroup v1 evicts the tasks of a cpuset left without CPUs from a workqueue, possibly after we
# repaired it: look again this long after an offline event (bounded; nothing runs when idle).
EVICTION_RECHECKS = (0.1, 0.5, 2.0)

# Which events the commit rule tells apart, and when their decision is written to the state
# file (see the module text).
CREATION, STOP = "creation", "stop"
BEFORE_ANSWER = "before-answer"
AFTER_ANSWER = "after-answer"
AT_START = "at-start"

# Deliver: hands a reply to the runtime before the rest of the work is done; False when the
# request was answered with an error meanwhile (nothing more may be decided for it).
Deliver = Callable[[Effects], bool]
# Later: submit an event to the node after a delay (timers live on the event loop); False when
# it cannot be (no event loop runs).
Later = Callable[[float, object], bool]


def _keep(effects: Effects) -> bool:
    return True  # not run by the worker: the reply goes when handle() returns


def _never(delay: float, event: object) -> bool:
    return False


class Node:
    def __init__(
        self,
        settings: Settings,
        audit: Audit,
        flags: Mapping[str, Any] = (),
        *,
        progress: Progress | None = None,
        units: Units | None = None,
        pod_nics: PodNICs | None = None,
        later: Later = _never,
    ) -> None:
        self.file_settings = settings
        self.flags = dict(flags)
        self.audit = audit
        self.metrics: Any = NoMetrics()
        self.progress = progress or NoProgress()
        self.pod_nics = pod_nics or PodNICs()
        self.later = later
        self._units = units
        self.state: NodeState | None = None
        self.owed = Owed()
        self.unverified = Unverified()
        # After the state was lost, until the runtime lists its containers: CPUs that running
        # Guaranteed containers look pinned to (liveness.pinned_cpus), never handed out.
        self.pinned = CPUSet()
        # CPUs that came back online while we ran (all online CPUs after a change while we
        # were down): cgroup v1 gave them to no cgroup made while they were offline.
        self.returned = CPUSet()
        # Set when the online set changed since the containers' cgroups were written (found at
        # load): the next Synchronize repairs the cgroups before the runtime applies updates.
        self._cgroups_stale = False
        # Whether the runtime listed its containers on this connection (it then does at every
        # connection): see the commit rule in the module text.
        self.runtime_lists = False
        # Pod uid -> the sandbox its newest container was created in.  kubelet recreates a
        # pod's sandbox under the same uid and removes the old one later (garbage collection):
        # that removal must not take the CPUs of the new sandbox's containers.
        self._sandboxes: dict[str, str] = {}
        self._sweeping = False
        self.file: StateFile | None = None
        self._build(merge(settings, self.flags))  # a bad configuration fails now

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
        self.liveness = Liveness(f"{settings.sysfs}/fs/cgroup")
        self.writer = CgroupWriter(self.liveness, self.audit, self._units)
        if self.file is None:
            self.file = StateFile(settings.state_dir, self.progress)
        else:
            self.file.retarget(settings.state_dir)
        self.state = None  # loaded by load_state(), under the lock

    @property
    def policy(self) -> StaticPolicy:
        return self.engine.policy

    @property
    def store(self) -> Any:
        return self.file.store

    def handle(self, event: object, deliver: Deliver = _keep) -> Effects:
        """Turn one event into effects (see the module text).  Raises PolicyError when the
        request must fail (the runtime then fails the operation, kubelet retries it)."""
        return HANDLERS[type(event)](self, event, deliver)

    # --- queries (from the event loop too) -------------------------------------------------------

    def query_target(self, container_id: str) -> Target:
        return self.engine.target(self.state, container_id)

    def query_early_answer(self, event: ev.CreateContainer) -> Target | None:
        """The pod's earmark as the creation's answer, when that is what it will be decided
        on and the answer need carry nothing else (daemon/earmarks.py)."""
        if self.owed or not self.runtime_lists or self.state is None:
            # The reply must carry the owed updates; without the runtime's lists at each
            # connection the decision must be durable before the answer.
            return None
        return earmarks.early_answer(
            self.engine,
            self.state,
            event.workload,
            event.pod.sandbox_id,
            self.returned | self.pinned,
        )

    def query_eligible(self, workload: Workload) -> bool:
        """An exclusive candidate; so is one its annotations make the policy refuse (no answer
        but an error is right for it)."""
        try:
            return self.policy.eligibility(workload)[0] is not None
        except PolicyError:
            return True

    def query_kept(self, container_id: str) -> Effects:
        """An update's answer that keeps the container's cpuset, as its event would."""
        targets = self.engine.update(self.state, container_id).targets
        return self._update_effects(container_id, targets, [])

    def query_decides_at_start(self, container_id: str) -> bool:
        """Whether this StartContainer is the container's decision: pinning at start, and a
        container not placed yet (one listed by Synchronize was placed then)."""
        state = self.state
        return (
            self.settings.nri_pin_at == "start"
            and state is not None
            and container_id not in state.assignments
            and container_id not in state.sharing
        )

    # --- the state file ---------------------------------------------------------------------------

    def configure(self, event: ev.Configure, deliver: Deliver = _keep) -> Effects:
        """Settings from the runtime's config string (rebuilt when they changed); the state
        loaded if it is not yet."""
        config = event.config
        overrides = (
            parse_toml(config, "plugin config sent by the runtime") if config.strip() else {}
        )
        settings = merge(self.file_settings, overrides, self.flags)
        if settings != self.settings:
            self._build(settings)
        if self.state is None:
            self.load_state()
        self._start_sweep()
        return NO_EFFECTS

    def load_state(self) -> None:
        """Read the state file; anything unusable is set aside and we start from empty (the
        runtime's Synchronize, or the next events, fill it in).  Never refuses to start."""
        self.file.claim()
        policy = self.policy
        with self.file.locked():
            result = self.store.load(Expected(policy.name, None, policy.reserved))
            loaded = self.engine.load(result.state, result.problem, result.quarantined)
            if loaded.set_aside:
                self.store.set_aside()
            if loaded.state == result.state:  # nothing changed: nothing written (a full disk)
                self.state = loaded.state
            else:
                self._commit(Outcome(loaded.state))
        self.audit.emit(loaded.events)
        state = self.state
        self.unverified = Unverified(set(state.assignments) | set(state.sharing))
        if not loaded.trusted:
            self._learn_pinned()
        if loaded.followed is not None and loaded.trusted:
            # Repair the containers we know now (containerd 1.7 sends a launched plugin no
            # Synchronize), and again at Synchronize for those only the runtime knows.
            self._repair_cgroups(sorted(set(state.assignments) | set(state.sharing)), None)
            self._cgroups_stale = True
            self.returned = self.policy.topology.online

    def release_claim(self) -> None:
        self.file.release_claim()

    def _commit_point(self, kind: str, exclusive: bool = False) -> str:
        """The rule of the module text: when a creation's or a stop's decision is written to
        the state file (every other event's: before its answer)."""
        if self.runtime_lists:
            return AT_START if kind == CREATION else AFTER_ANSWER
        return AFTER_ANSWER if kind == CREATION and not exclusive else BEFORE_ANSWER

    def _commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
        """Write the outcome's state (the lock held) before anything of it is applied.

        A state that cannot be written (a full disk, a read-only directory) is kept in memory
        and written with the next commit that succeeds - what shared containers run on can
        always be derived again - unless ``durable``: an exclusive assignment that a crash
        could forget must not be handed out, so the error goes to the caller."""
        new_state = outcome.state
        # The engine returns the very state it was given when nothing changed.
        if new_state is self.state and not self.file.unsaved:
            return outcome
        if durable:
            self.progress.check()  # past this point the decision stands; it is undone instead
        try:
            timing = self.file.write(new_state)
        except OSError as err:
            if durable:
                raise
            self.file.unsaved = True
            self.audit.record(
                "state-unsaved",
                f"the state could not be written, kept in memory until it can: {err}",
                audit_mod.WARNING,
                reason=str(err),
            )
        else:
            self.file.unsaved = False
            self.metrics.observe_commit(timing.total_seconds)
        self._take(new_state)
        return outcome

    def _hold(self, outcome: Outcome) -> None:
        """Take the outcome's state without writing it yet (``AT_START``/``AFTER_ANSWER``)."""
        if outcome.state is not self.state:
            self._take(outcome.state)
            self.file.unsaved = True

    def _take(self, state: NodeState) -> None:
        self.state = state
        self.metrics.observe_state(state, self.policy.topology)

    def commit_held(self, event: object = None, deliver: Deliver = _keep) -> Effects:
        """Commit the state held in memory, if the file lags behind it."""
        if self.file.unsaved:
            with self.file.locked():
                self._commit(Outcome(self.state))
        return NO_EFFECTS

    # --- what the runtime lists -----------------------------------------------------------------

    def synchronize(self, event: ev.Synchronize, deliver: Deliver = _keep) -> Effects:
        live = [LiveContainer(c.workload, c.stored.cpus) for c in event.live]
        stored = {c.workload.container_id: c for c in event.live}
        with self.file.locked():
            outcome = self._commit(
                self.engine.synchronize(self.state, live, [pod.uid for pod in event.pods])
            )
        self.unverified.clear()
        self.runtime_lists = True
        self.writer.keep_only(set(stored))
        self.pod_nics.keep_only(pod.sandbox_id for pod in event.pods)
        self._sandboxes = {c.workload.pod_uid: c.sandbox_id for c in event.live}
        self._warn_unserved_driver(c.workload.cgroup_path for c in event.live)
        owed = set(self.owed.drain())  # carried by this reply (below)
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
            self._repair_cgroups([c.workload.container_id for c in live], None)
        # The reply carries only what the runtime's stored specs do not say already (each
        # update costs the runtime one `runc update`, run one after another): on a dense node,
        # the shared containers moved by direct writes while they ran.  The others are written
        # directly where they can be, in case a crash came between a commit and our writes;
        # where they cannot, the runtime applied that spec itself - unless it is owed.
        lagging, agreeing = [], []
        for target in outcome.targets:
            cid = target.container_id
            agrees = cid not in owed and stored[cid].stored.agrees(target)
            (agreeing if agrees else lagging).append(target)
        self._write(agreeing)
        return Effects(updates=self._for_runtime(lagging))

    def _warn_unserved_driver(self, paths: Iterable[str]) -> None:
        """Pinning at start writes each container's cgroup itself: on a node whose containers
        this daemon cannot write, every start would be refused - said once per connection,
        before the first refusal."""
        if self.settings.nri_pin_at != "start":
            return
        unserved = [path for path in paths if not self.writer.can_write(path)]
        if unserved:
            self.audit.record(
                "config",
                f'[nri] pin_at = "start" writes each container\'s cgroup, but '
                f"{len(unserved)} of the runtime's containers have cgroups it cannot write "
                f"(like {unserved[0]!r}): new containers like them will be refused at their "
                'start; set pin_at = "create" (the default)',
                audit_mod.ERR,
                reason="pin_at start cannot write",
            )

    # --- containers -------------------------------------------------------------------------------

    def create(self, event: ev.CreateContainer, deliver: Deliver = _keep) -> Effects:
        """Decide, move the shared containers, answer; then commit (``_commit_point``) and
        audit.  A creation answered already from its pod's earmark (``event.answered``, or
        here when the state allows) is decided all the same, and what it was decided on
        otherwise is set right at its start."""
        early = event.answered
        if early is None and (early := self.query_early_answer(event)) is not None:
            deliver(Effects(own=early))  # answered now; decided next, as any creation
        workload = event.workload
        self._sandboxes[event.pod.uid] = event.pod.sandbox_id
        before = self.state
        try:
            # Outside the lock: it reads netlink and sysfs, never the state (about 1-3 ms).
            locality = self._nic_locality(event)
            with self.file.locked():
                outcome, committed = self._decide_creation(workload, locality)
                effects, proceed = self._answer_creation(event, outcome, early, deliver)
                if proceed and not committed:
                    exclusive = outcome.decision is not None and outcome.decision.exclusive
                    if self._commit_point(CREATION, exclusive) == AT_START:
                        self._hold(outcome)
                    else:
                        self._commit(outcome)
                elif not (proceed or committed) and len(outcome.targets) > 1:
                    # Written for a decision that is not made after all: the pool as it is.
                    back = [self.query_target(t.container_id) for t in outcome.targets[1:]]
                    self._push(back, "creation answered with an error")
        except PolicyError as err:
            self.metrics.pinning_request()
            self.metrics.pinning_error()
            self.audit.emit([self.engine.refused(workload, err)])
            raise
        if not (proceed or committed):
            return effects
        if outcome.decision is not None and outcome.decision.exclusive:
            self.metrics.pinning_request()
        self.audit.emit(outcome.events)
        cid = workload.container_id
        tracked = before is not None and (cid in before.assignments or cid in before.sharing)
        undo = None if tracked else ev.Release(cid, "creation answered with an error")
        return effects.evolve(undo=undo)

    def _decide_creation(
        self, workload: Workload, locality: nic.Locality | None
    ) -> tuple[Outcome, bool]:
        """Decide (the lock held), and commit first where the answer must wait for the
        commit: (outcome, committed).  When there is no room, containers known only from the
        state file may have ended unseen: those holding exclusive CPUs are checked, and the
        request is decided again - only then, so a creation never pays for checking every
        container a restart left unverified."""
        preference = locality.preference if locality else None
        note = locality.note if locality else None
        try:
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        except PolicyError as err:
            if err.code != "refused" or not self._recheck_holders():
                raise
            outcome = self.engine.create(self.state, workload, preference, note, self.pinned)
        exclusive = outcome.decision is not None and outcome.decision.exclusive
        if self._commit_point(CREATION, exclusive) != BEFORE_ANSWER:
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

    def _answer_creation(
        self, event: ev.CreateContainer, outcome: Outcome, early: Target | None, deliver: Deliver
    ) -> tuple[Effects, bool]:
        """Move the shared containers and answer: (the answer, whether the decision stands)."""
        mine, *others = outcome.targets
        if mine.cpus & self.returned:
            # The new container's ancestors lack CPUs that came back online (cgroup v1).
            path = outcome.state.cgroups.get(mine.container_id, "")
            if path:
                self.writer.grow_ancestors([path], mine.cpus)
        unwritten = self._write(others, outcome.state)
        owed = self.owed.drain(t.container_id for t in outcome.targets)
        updates = self._for_runtime(unwritten + self._targets(owed, outcome.state), outcome.state)
        effects = Effects(own=mine, updates=tuple(updates))
        if early is None:
            return effects, deliver(effects)
        if mine != early or updates:
            # Decided otherwise (NIC locality, say): its StartContainer finds its cgroup on the
            # earmarked CPUs and writes what was decided, before its first instruction; the
            # runtime's stored specs get it with the next reply that can carry updates.
            cid = mine.container_id
            self.owed.add([cid, *(t.container_id for t in updates)])
            self.audit.record(
                "earmark",
                f"container {cid[:12]} was answered with the CPUs earmarked for its pod "
                f"({early.cpus}), but decided on {mine.cpus}: set right when it starts",
                audit_mod.NOTICE,
                container_id=cid,
                cpus=mine.cpus,
                reason="decided otherwise",
            )
        return effects, True

    def start(self, event: ev.StartContainer, deliver: Deliver = _keep) -> Effects:
        """The runtime has made the container's cgroup from its stored spec; its first
        instruction has not run yet.  A shared container created from a pool that moved since
        (no write could reach it then: it had no cgroup yet) is written now, so it never runs
        on exclusive CPUs; one read for every other container.  A shared container's cgroup
        is made quick to write here, where that costs its own start.  The state its creation
        held is committed.  With ``[nri] pin_at = "start"`` the container is decided here in
        the first place, and its cgroup written (docs/architecture.md, "Pinning at start")."""
        cid = event.workload.container_id
        undo = self._create_at_start(event) if self.query_decides_at_start(cid) else None
        try:
            self._set_right_at_start(event)
        except BaseException:
            # Refused (or answered with an error meanwhile): the container does not start, so
            # what was just decided for it goes again - now, not at kubelet's retry.
            if undo is not None:
                self.release(undo)
            raise
        return Effects(undo=undo)

    def _set_right_at_start(self, event: ev.StartContainer) -> None:
        workload = event.workload
        cid = workload.container_id
        self.commit_held()
        [*targets] = self.engine.update(self.state, cid).targets
        if not targets:
            return
        path = self.state.cgroups.get(cid, "")
        if cid in self.state.sharing:
            self.writer.prepare_shared(cid, path)
        live = self.liveness.cpus(path)
        created = event.stored.cpus if live is None else live
        target = targets[0]
        if self.settings.nri_pin_at == "start":
            if created != target.cpus or target.exclusive:
                self._write_at_start(event, target)
        elif created != target.cpus:
            self.audit.record(
                "share",
                f"{event.pod.namespace}/{event.pod.name}/{workload.container_name} was created "
                f"with CPUs {created or 'unknown'}; the shared pool moved meanwhile: starting "
                f"it on {target.cpus}",
                audit_mod.INFO,
                container_id=cid,
                cpus=target.cpus,
                reason="pool moved during creation",
            )
            self.owed.add(t.container_id for t in self._write(targets))

    def _create_at_start(self, event: ev.StartContainer) -> ev.Release | None:
        """Decide the container as a creation (shared containers written, state held for the
        commit that follows); what only the runtime can move is owed to its next reply.
        Returns what takes the decision back."""
        workload = event.workload
        path = workload.cgroup_path
        if not self.writer.can_write(path):
            which = f"the cgroup {path!r}, which this daemon cannot write" if path else "no cgroup"
            err = PolicyError(
                f'{describe(workload)} has {which}, but [nri] pin_at = "start" writes each '
                'container\'s cgroup itself: set pin_at = "create" (the default) in the '
                "plugin's configuration",
                "config",
            )
            self.audit.emit([self.engine.refused(workload, err)])
            raise err
        creation = ev.CreateContainer(workload, event.pod, event.netns)
        effects = self.create(creation)
        self.owed.add(t.container_id for t in effects.updates)
        return effects.undo

    def _write_at_start(self, event: ev.StartContainer, target: Target) -> None:
        """Write the container's own cgroup; refused when it cannot be, rather than started
        on its pod's CPUs."""
        write = self._cgroup_target(target, self.state)
        errors = self.writer.write_own(write)
        if errors:
            raise PolicyError(
                f"the CPUs {target.cpus} decided for {describe(event.workload)} could not be "
                f"written to its cgroup {write.runtime_path!r} ({'; '.join(errors)}): it is "
                "not started now, and kubelet retries it",
                "cgroup-write",
            )

    def update(self, event: ev.UpdateContainer, deliver: Deliver = _keep) -> Effects:
        """Someone (kubelet's in-place resize, an operator) updates resources.  A new CPU
        request resizes the container (core/resize.py); anything else keeps our cpuset in
        force.  A growth that cannot be met fails the update: kubelet reports the resize as
        failed and retries.  The runtime applies the entry for the container being updated
        last, in place of the CRI request (nri-wire §11.3)."""
        workload = event.workload
        cid = workload.container_id
        if not event.resize:
            targets = self.engine.update(self.state, cid).targets
            owed = self._targets(self.owed.drain([cid]), self.state)
            return self._update_effects(cid, targets, owed)
        before = self.state
        try:
            with self.file.locked():
                outcome = self.engine.resize(self.state, workload)
                exclusive = outcome.decision is not None and outcome.decision.exclusive
                self._commit(outcome, durable=exclusive)
        except (PolicyError, OSError) as err:
            error = err if isinstance(err, PolicyError) else PolicyError(str(err), "not-durable")
            self.audit.emit([self.engine.refused(workload, error)])
            raise error from None
        self.audit.emit(outcome.events)
        carried = [cid, *(t.container_id for t in outcome.targets)]
        owed = self._targets(self.owed.drain(carried), self.state)
        effects = self._update_effects(cid, outcome.targets, owed)
        changed = outcome.state is not before
        return effects.evolve(undo=ev.Restore(cid, before, outcome.state) if changed else None)

    def _update_effects(self, cid: str, targets: Iterable[Target], owed: list[Target]) -> Effects:
        own = None
        others = list(owed)
        for target in targets:
            if target.container_id == cid:
                own = target
            else:
                others.append(target)
        resolved = self._for_runtime([own] if own is not None else [], self.state)
        return Effects(
            own=resolved[0] if resolved else None, updates=tuple(self._for_runtime(others))
        )

    def stop(self, event: ev.StopContainer, deliver: Deliver = _keep) -> Effects:
        """The container's CPUs go back to the shared pool.  Once the runtime lists its
        containers, the answer goes first, and the shared containers' writes and the commit
        follow it: a shared container given its CPUs a moment later runs nowhere it must not,
        and a crash before the commit is repaired from the runtime's list, which shows the
        container stopped.  Before that: commit, write, answer."""
        cid = event.workload.container_id
        with self.file.locked():
            outcome = self.engine.stop(self.state, cid)
            others = [t for t in outcome.targets if t.container_id != cid]
            carried = [cid, *(t.container_id for t in others)]
            if self._commit_point(STOP) == BEFORE_ANSWER:
                self._commit(outcome)
                unwritten = self._write(others)
                owed = self._targets(self.owed.drain(carried), self.state)
                effects = Effects(updates=tuple(self._for_runtime(unwritten + owed)))
            else:
                self._hold(outcome)
                direct = [t for t in others if self._writable(t)]
                runtime = [t for t in others if not self._writable(t)]
                owed = self._targets(self.owed.drain(carried), self.state)
                effects = Effects(updates=tuple(self._for_runtime(runtime + owed)))
                deliver(effects)
                # Not written after all: the next reply that can carry them does.
                self.owed.add(t.container_id for t in self._write(direct))
                self._commit(outcome)
        self.audit.emit(outcome.events)
        return effects

    def remove(self, event: ev.RemoveContainer, deliver: Deliver = _keep) -> Effects:
        """Normally StopContainer released it already; if that was missed, the pool grows now
        and the shared containers are written (or owed)."""
        cid = event.workload.container_id
        self.writer.forget(cid)
        with self.file.locked():
            outcome = self._commit(self.engine.stop(self.state, cid))
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "container removed")
        return NO_EFFECTS

    # --- pods ---------------------------------------------------------------------------------

    def run_pod(self, event: ev.RunPodSandbox, deliver: Deliver = _keep) -> Effects:
        """A Guaranteed pod started: CPUs set aside for its exclusive containers, and the
        shared containers moved off them now, so the creation of an exclusive container that
        takes them moves nobody (docs/architecture.md, "Earmarks")."""
        pod = event.pod
        wanted = Earmark(
            CPUSet(), pod.sandbox_id, event.earmark_milli, pod_name=pod.name,
            pod_namespace=pod.namespace,
        )  # fmt: skip
        with self.file.locked():
            outcome = self._commit(self.engine.earmark(self.state, pod.uid, wanted, self.pinned))
        if outcome.events:
            self._sandboxes[pod.uid] = pod.sandbox_id
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "pod earmarked")
        return NO_EFFECTS

    def remove_pod(self, event: ev.RemovePodSandbox, deliver: Deliver = _keep) -> Effects:
        pod = event.pod
        self.pod_nics.forget(pod.sandbox_id)
        if self._sandboxes.setdefault(pod.uid, pod.sandbox_id) != pod.sandbox_id:
            self.audit.record(
                "reconcile",
                f"an earlier sandbox {pod.sandbox_id[:12]} of {pod.describe()} was removed: "
                "the containers of its newer sandbox keep what they hold",
                audit_mod.INFO,
                reason="earlier sandbox removed",
            )
            return NO_EFFECTS
        del self._sandboxes[pod.uid]
        with self.file.locked():
            outcome = self._commit(self.engine.remove_pod(self.state, pod.uid))
        self.audit.emit(outcome.events)
        self._push(outcome.targets, "pod removed")
        return NO_EFFECTS

    def update_pod(self, event: ev.UpdatePodSandbox, deliver: Deliver = _keep) -> Effects:
        """A pod's pod-level resources changed (NRI >= 0.10, kubelet's in-place resize of a
        pod with pod-level resources).  The reply cannot carry updates, and kubelet updates
        each resized container next (UpdateContainer, where we keep our cpusets): here the
        pod's containers get their cpusets (and quotas) again, written directly, so nothing
        the resize did to their cgroups is left in force."""
        pod = event.pod
        cids = self._containers_of(pod.uid)
        targets = [t for cid in cids for t in self.engine.update(self.state, cid).targets]
        request, limit = event.request_milli, event.limit_milli
        exclusive = [cid for cid in cids if cid in self.state.assignments]
        self.audit.record(
            "pod-update",
            f"{pod.describe()} resized (CPU request "
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
        return NO_EFFECTS

    def _containers_of(self, pod_uid: str) -> list[str]:
        """The containers we track for a pod: exclusive ones and those in the shared pool."""
        state = self.state
        if state is None or not pod_uid:
            return []
        held = [cid for cid, a in state.assignments.items() if a.pod_uid == pod_uid]
        sharing = [cid for cid, uid in state.sharing.items() if uid == pod_uid]
        return sorted({*held, *sharing})

    def disconnected(self, event: ev.Disconnected, deliver: Deliver = _keep) -> Effects:
        self.runtime_lists = False
        return NO_EFFECTS

    # --- late work: what a request answered without its decision leaves -------------------------

    def release(self, event: ev.Release, deliver: Deliver = _keep) -> Effects:
        state, cid = self.state, event.container_id
        if cid not in state.assignments and cid not in state.sharing:
            return NO_EFFECTS  # nothing to take back
        with self.file.locked(decides=False):
            outcome = self._commit(self.engine.stop(self.state, event.container_id))
        self.audit.emit(outcome.events)
        self._push(outcome.targets, event.cause)
        return NO_EFFECTS

    def restore(self, event: ev.Restore, deliver: Deliver = _keep) -> Effects:
        if self.state is event.after:  # else other work was committed since: the resize stands
            with self.file.locked(decides=False):
                self._commit(Outcome(event.before))
        return NO_EFFECTS

    def owe(self, event: ev.Owe, deliver: Deliver = _keep) -> Effects:
        self.owed.add(event.container_ids)
        return NO_EFFECTS

    # --- CPU hotplug ------------------------------------------------------------------------------

    def cpus_changed(self, event: ev.CPUsChanged, deliver: Deliver = _keep) -> Effects:
        """Kernel uevents: the topology is discovered again, the engine follows the new online
        set (replacement, degraded, return), and cgroups are written directly (cgroup v1
        never gives a CPU back by itself), CFS quotas included."""
        received = min(e.received for e in event.events)
        what = ", ".join(
            f"CPU {e.cpu} {e.action}" if e.cpu >= 0 else e.action for e in event.events
        )
        old = self.engine
        try:
            topology = discover(self.settings.sysfs)
            if topology.fingerprint() == old.topology.fingerprint():
                self.audit.record(
                    "hotplug", f"{what}: no change in {self.settings.sysfs}", audit_mod.DEBUG
                )
                return NO_EFFECTS
            policy = StaticPolicy(topology, old.policy.reserved, old.policy.options)
        except (TopologyError, PolicyError) as err:
            self.audit.record(
                "hotplug",
                f"{what}: cannot follow the new topology, keeping the old one: {err}",
                audit_mod.ERR,
                reason=str(err),
            )
            return NO_EFFECTS
        self.engine = Engine(policy, self.settings.cfs_quota)
        went = old.topology.online - topology.online
        came = topology.online - old.topology.online
        self.returned |= came
        self.audit.record(
            "hotplug",
            f"{what}: online CPUs {old.topology.online} -> {topology.online}",
            audit_mod.NOTICE,
            cpus_offline=went,
            cpus_online=came,
        )
        if self.state is None:
            return NO_EFFECTS  # not loaded yet: load_state() repairs against this topology
        before = self.state
        with self.file.locked():
            outcome = self._commit(self.engine.follow(self.state, old.policy))
        self.audit.emit(outcome.events)
        changed = [t.container_id for t in outcome.targets]
        errors = self._repair_cgroups(changed, came)
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
        emptied = tuple(c for c in changed if StaticPolicy.cpuset_for(before, c) <= went)
        if went and emptied:
            for delay in EVICTION_RECHECKS:
                self.later(delay, ev.RecheckEvictions(emptied))
        return NO_EFFECTS

    def _repair_cgroups(self, cids: Iterable[str], grow: CPUSet | None) -> list[str]:
        """Write these containers' cpusets (and CFS quotas) directly, after giving ``grow``
        (CPUs that came online; None: every online CPU) back to the ancestors of every tracked
        container on cgroup v1, where the kernel never restores them."""
        state = self.state
        targets = [
            self._cgroup_target(self.engine.target(state, cid), state)
            for cid in cids
            if state.cgroups.get(cid)  # else the runtime's update is all we can do
        ]
        return self.writer.repair(
            targets,
            state.cgroups.values(),
            self.policy.topology.online if grow is None else grow,
        )

    def recheck_evictions(self, event: ev.RecheckEvictions, deliver: Deliver = _keep) -> Effects:
        cgroups = self.state.cgroups
        self.writer.return_evicted(
            (cid, cgroups[cid]) for cid in event.container_ids if cgroups.get(cid)
        )
        return NO_EFFECTS

    # --- containers known only from the state file ------------------------------------------------

    def _start_sweep(self) -> None:
        """Check the unverified containers a few at a time, so the shared pool grows back when
        some of them ended, without any event paying for all of them."""
        if not self._sweeping and (self.unverified or self.pinned):
            self._sweeping = self.later(SWEEP_INTERVAL, ev.SweepRound())

    def sweep(self, event: ev.SweepRound, deliver: Deliver = _keep) -> Effects:
        """One round of the sweep; the next is scheduled while there is more to check."""
        self._sweeping = False
        try:
            self._sweep_round()
        finally:  # a round that failed ends the chain; the next Configure begins a new one
            self._start_sweep()
        return NO_EFFECTS

    def _sweep_round(self) -> None:
        if self.state is None:
            return
        # Containers pinned before the state was lost may have ended.  The scan walks every pod
        # cgroup (tens of milliseconds on a large node, which events wait for): not every sweep.
        self.unverified.sweeps += 1
        if self.pinned and self.unverified.sweeps % PINNED_EVERY == 0:
            self._learn_pinned()
        if not self.unverified:
            return
        with self.file.locked():
            outcome = self._forget_ended(limit=SWEEP_BATCH)
        self._push(outcome.targets, "ended unseen")

    def _forget_ended(self, exclusive_only: bool = False, limit: int = 0) -> Outcome:
        """Release unverified containers whose cgroups show they have ended (the lock held)."""
        ended = self.unverified.ended(self.state, self.liveness, exclusive_only, limit)
        if not ended:
            return Outcome(self.state)
        why = "its cgroup is gone or empty, and the runtime could not tell us"
        outcome = self._commit(self.engine.ended(self.state, ended, why))
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

    # --- applying targets ----------------------------------------------------------------------

    def _cgroup_target(self, target: Target, state: NodeState) -> cpusets.Target:
        """``target`` as the writer writes it, at the container's cgroup."""
        return cpusets.Target(
            target.container_id,
            state.cgroups.get(target.container_id, ""),
            target.cpus,
            target.mems,
            target.quota,
            target.mems_from_parent,
        )

    def _writable(self, target: Target) -> bool:
        return self.writer.can_write(self.state.cgroups.get(target.container_id, ""))

    def _write(self, targets: Iterable[Target], state: NodeState | None = None) -> list[Target]:
        """Write targets directly; returns those the runtime must apply after all."""
        targets = list(targets)
        if not targets:
            return []
        state = self.state if state is None else state
        with self.progress.phase(CGROUPS):
            failed = set(self.writer.write(self._cgroup_target(t, state) for t in targets))
        return [t for t in targets if t.container_id in failed]

    def _push(self, targets: Iterable[Target], cause: str) -> None:
        """Apply targets that changed outside any event's reply: written directly; what
        cannot be is owed to the runtime's next reply that can carry updates (never an
        unsolicited UpdateContainers, see the module text)."""
        targets = list(targets)
        if not targets:
            return
        owed = {t.container_id for t in self._write(targets)}
        self.owed.add(owed)
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

    def _targets(self, container_ids: Iterable[str], state: NodeState) -> list[Target]:
        """The current targets of these containers (owed ones: each goes out once; one no
        longer tracked has none)."""
        return [t for cid in container_ids for t in self.engine.update(state, cid).targets]

    def _for_runtime(
        self, targets: Iterable[Target], state: NodeState | None = None
    ) -> list[Target]:
        state = self.state if state is None else state
        return [self.writer.for_runtime(t, state.cgroups.get(t.container_id, "")) for t in targets]

    # --- NIC locality ---------------------------------------------------------------------------

    def _nic_locality(self, event: ev.CreateContainer) -> nic.Locality | None:
        """Where the pod's NICs are, for exclusive candidates only (nobody else's CPUs are
        chosen): from the read made when the pod started (daemon/pod_nics.py), if any."""
        workload = event.workload
        if self.policy.eligibility(workload)[0] is None:
            return None
        with self.progress.phase(NIC):
            read_ahead = self.pod_nics.lister_for(event.pod.sandbox_id, event.netns)
            used = []

            def lister(path: str) -> Listing:
                listing = read_ahead(path)
                used.append(path)  # (not when the read failed, or locality is off)
                return listing

            locality = nic.locality(
                event.netns,
                workload.annotations,
                workload.container_name,
                self.settings.sysfs,
                self.policy.topology,
                lister if read_ahead is not None else None,
            )
        if not used:
            return locality
        return locality.evolve(note=f"{locality.note} (interfaces read when the pod started)")


HANDLERS: dict[type, Callable[[Node, Any, Deliver], Effects]] = {
    ev.Configure: Node.configure,
    ev.Synchronize: Node.synchronize,
    ev.CreateContainer: Node.create,
    ev.StartContainer: Node.start,
    ev.UpdateContainer: Node.update,
    ev.StopContainer: Node.stop,
    ev.RemoveContainer: Node.remove,
    ev.RunPodSandbox: Node.run_pod,
    ev.RemovePodSandbox: Node.remove_pod,
    ev.UpdatePodSandbox: Node.update_pod,
    ev.CPUsChanged: Node.cpus_changed,
    ev.SweepRound: Node.sweep,
    ev.RecheckEvictions: Node.recheck_evictions,
    ev.CommitHeld: Node.commit_held,
    ev.Disconnected: Node.disconnected,
    ev.Release: Node.release,
    ev.Restore: Node.restore,
    ev.Owe: Node.owe,
}
