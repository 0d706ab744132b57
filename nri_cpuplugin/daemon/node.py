"""The node as the daemon sees it: one object that owns the state, the engine, the state file
and the cgroups' liveness, and turns each event (daemon/events.py) into effects.

    event ──▶ Node.handle ──▶ engine ──▶ writer (direct cgroup writes) ──▶ Effects (the reply)
                                 │
                                 └──▶ commit: before the reply, after it, or at the start

Every decision is the engine's (core/engine.py); the node adds what only the daemon knows:
which containers the runtime has listed, what is owed to the runtime (daemon/owed.py), which
sandbox of a pod is the newest, which CPUs came back online, NIC locality.

**When a commit happens**: one rule, daemon/statefile.py ``commit_point``.

**What moves with a decision**: every event that moves CPUs moves every shared container
before its reply leaves - written directly by the writer (daemon/writer.py), or carried in the
reply - so there is no instant at which a shared container may run on a CPU just made
exclusive.  What changes outside a reply (a removal, CPU hotplug, the sweep) is written, or
owed to the next reply that can carry it: never an unsolicited UpdateContainers, which
deadlocks containerd (docs/architecture.md, "Changes outside event replies").

What each event does is in the handler modules beside it, by subject: daemon/creation.py,
daemon/containers.py, daemon/pods.py, daemon/upkeep.py (``HANDLERS``); they change nothing the node
does not own. The node runs on one thread at a time (the daemon's worker, daemon/deadline.py);
methods named ``query_*`` only read and may be called from the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.cpuset import CPUSet
from ..core.eligibility import eligibility
from ..core.outcome import Outcome, Target
from ..core.policy import PolicyError, StaticPolicy
from ..core.state import NodeState
from ..core.topology import discover
from ..core.workload import Workload
from ..hardware.interrupts.keeper import Roots
from ..hardware.liveness import Liveness
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings, merge, parse_toml
from ..ops.metrics import NoMetrics
from ..storage.loading import load_state
from ..storage.store import StateStore
from . import containers, creation, earmarks, irq_upkeep, pods, upkeep
from . import events as ev
from .background import Background, Inline
from .effects import NO_EFFECTS, Deliver, Effects, keep
from .owed import Owed
from .pod_nics import PodNICs
from .progress import NoProgress, Progress
from .routes import Routes
from .statefile import StateFile, commit_point
from .unverified import Unverified
from .writer import CgroupWriter, Units

# Later: submit an event to the node after a delay (timers live on the event loop); False when
# it cannot be (no event loop runs).
Later = Callable[[float, object], bool]


def _never(delay: float, event: object) -> bool:
    return False


class Node:
    def __init__(
        self,
        settings: Settings,
        audit: Audit,
        flags: Mapping[str, Any] | None = None,
        *,
        progress: Progress | None = None,
        units: Units | None = None,
        pod_nics: PodNICs | None = None,
        later: Later = _never,
        background: Background | None = None,
        metrics: Any = None,
    ) -> None:
        self.file_settings = settings
        self.flags = dict(flags or {})
        self.audit = audit
        self.metrics: Any = NoMetrics() if metrics is None else metrics
        self.progress = progress or NoProgress()
        # (Not ``pod_nics or``: an empty one is false, and the adapter fills the one given.)
        self.pod_nics = pod_nics if pod_nics is not None else PodNICs()
        self.later = later
        # Where its upkeep runs: between the runtime's requests (the daemon's worker).
        self.background = background or Inline()
        self._units = units
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
        self.cgroups_stale = False
        # Whether the runtime listed its containers on this connection (it then does at every
        # connection): see the commit rule in the module text.
        self.runtime_lists = False
        # Pod uid -> the sandbox its newest container was created in.  kubelet recreates a
        # pod's sandbox under the same uid and removes the old one later (garbage collection):
        # that removal must not take the CPUs of the new sandbox's containers.
        self.sandboxes: dict[str, str] = {}
        # Earmarked pods the runtime listed at Synchronize -> their cgroup parent: containerd
        # keeps no NRI state for the sandboxes it found at its own start and relays no
        # Stop/RemovePodSandbox for them, so the sweep watches their cgroups instead.
        self.unrelayed_pods: dict[str, str] = {}
        self.sweeping = False
        # Interrupts: the kept-free CPUs last applied (None: not yet), the interrupts the kernel
        # refused to move (managed ones), whether a rescan is scheduled (daemon/irq_upkeep.py).
        self.irq_kept: CPUSet | None = None
        self.irq_unchangeable: frozenset[tuple[int, str]] = frozenset()
        self.irq_rescanning = False
        self.irq_work: irq_upkeep.IrqWork | None = None  # queued or under way
        self.irq_warned: frozenset[str] = frozenset()  # the last pass's warnings (irq_upkeep.py)
        self.file = StateFile(settings.state_dir, self.progress)
        self._build(merge(settings, self.flags))  # a bad configuration fails now

    def _build(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = settings.engine(discover(settings.sysfs))
        # cgroupfs is mounted below sysfs: a generated sysfs tree (tests) has none of the
        # host's cgroups, so nothing is read from or written to them.
        self.liveness = Liveness(f"{settings.sysfs}/fs/cgroup")
        self.writer = CgroupWriter(self.liveness, self.audit, self._units)
        self.irq_roots = Roots.beside(settings.sysfs)
        self.routes = Routes(self.writer, self.owed, self.audit, self.progress)
        self.file.retarget(settings.state_dir)
        # Loaded by load_state(), under the lock; until then nothing is decided.
        self.state = self.policy.empty_state()
        self.loaded = False

    @property
    def policy(self) -> StaticPolicy:
        return self.engine.policy

    @property
    def store(self) -> StateStore:
        return self.file.store

    def handle(self, event: object, deliver: Deliver = keep) -> Effects:
        """Turn one event into effects (see the module text).  Raises PolicyError when the
        request must fail (the runtime then fails the operation, kubelet retries it)."""
        effects = HANDLERS[type(event)](self, event, deliver)
        if self.loaded:
            # After the event's answer and commit, in the background: its CPUs kept free of
            # interrupts, or given back, as its outcome says (nothing to do, and one set
            # comparison, most times).
            irq_upkeep.keep_free(self)
        return effects

    # --- queries (from the event loop too) -------------------------------------------------------

    def query_target(self, container_id: str) -> Target:
        return self.engine.target(self.state, container_id)

    def query_early_answer(self, event: ev.CreateContainer) -> Target | None:
        """The pod's earmark as the creation's answer, when that is what it will be decided
        on and the answer need carry nothing else (daemon/earmarks.py)."""
        if self.owed or not self.runtime_lists or not self.loaded:
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
            return eligibility(workload)[0] is not None
        except PolicyError:
            return True

    def query_kept(self, container_id: str) -> Effects:
        """An update's answer that keeps the container's cpuset, as its event would."""
        targets = self.engine.update(self.state, container_id).targets
        return containers.reply_to_update(self, container_id, targets, [])

    def query_decides_at_start(self, container_id: str) -> bool:
        """Whether this StartContainer is the container's decision: a container not placed
        yet (one listed by Synchronize was placed then), when pinning at start - or created
        before this daemon's start by a runtime that never lists its containers (containerd
        1.7 and a plugin it launched again): its creation's decision, made by the daemon
        before, was set aside by the sweep, since a container not started has no cgroup."""
        state = self.state
        return (
            (self.settings.nri_pin_at == "start" or not self.runtime_lists)
            and container_id not in state.assignments
            and container_id not in state.sharing
        )

    # --- the state file ---------------------------------------------------------------------------

    def configure(self, event: ev.Configure, deliver: Deliver = keep) -> Effects:
        """Settings from the runtime's config string (rebuilt when they changed); the state
        loaded if it is not yet."""
        config = event.config
        overrides = (
            parse_toml(config, "plugin config sent by the runtime") if config.strip() else {}
        )
        settings = merge(self.file_settings, overrides, self.flags)
        if settings != self.settings:
            self._build(settings)
        if not self.loaded:
            self.load_state()
        upkeep.start_sweep(self)
        return NO_EFFECTS

    def load_state(self) -> None:
        """Read the state file; anything unusable is set aside and we start from empty (the
        runtime's Synchronize, or the next events, fill it in).  Never refuses to start."""
        self.file.claim()
        with self.file.locked():
            stored, loaded = load_state(self.store, self.engine)
            if loaded.set_aside:
                self.store.set_aside()
            if loaded.state == stored:  # nothing changed: nothing written (a full disk)
                self.state = loaded.state
            else:
                self.commit(Outcome(loaded.state))
        self.loaded = True
        self.audit.emit(loaded.events)
        state = self.state
        self.unverified = Unverified(set(state.assignments) | set(state.sharing))
        if not loaded.trusted:
            upkeep.learn_pinned(self)
        if loaded.followed is not None and loaded.trusted:
            # Repair the containers we know now (containerd 1.7 sends a launched plugin no
            # Synchronize), and again at Synchronize for those only the runtime knows.
            upkeep.repair_cgroups(self, sorted(set(state.assignments) | set(state.sharing)), None)
            self.cgroups_stale = True
            self.returned = self.policy.topology.online

    def release_claim(self) -> None:
        self.file.release_claim()

    def commit_point(self, kind: str, exclusive: bool = False) -> str:
        """When a creation's or a stop's decision is written (daemon/statefile.py)."""
        return commit_point(kind, exclusive, self.runtime_lists)

    def commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
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
        self.take(new_state)
        return outcome

    def hold(self, outcome: Outcome) -> None:
        """Take the outcome's state without writing it yet (``AT_START``/``AFTER_ANSWER``)."""
        if outcome.state is not self.state:
            self.take(outcome.state)
            self.file.unsaved = True

    def take(self, state: NodeState) -> None:
        self.state = state
        self.metrics.observe_state(state, self.policy.topology)

    def commit_held(self, event: object = None, deliver: Deliver = keep) -> Effects:
        """Commit the state held in memory, if the file lags behind it."""
        if self.file.unsaved:
            with self.file.locked():
                self.commit(Outcome(self.state))
        return NO_EFFECTS

    def disconnected(self, event: ev.Disconnected, deliver: Deliver = keep) -> Effects:
        self.runtime_lists = False
        return NO_EFFECTS


# The handlers live beside the node, by subject; each uses the node's public parts only.

HANDLERS: dict[type, Callable[[Node, Any, Deliver], Effects]] = {
    ev.Configure: Node.configure,
    ev.Disconnected: Node.disconnected,
    ev.CommitHeld: Node.commit_held,
    ev.Synchronize: pods.synchronize,
    ev.RunPodSandbox: pods.run_pod,
    ev.RemovePodSandbox: pods.remove_pod,
    ev.UpdatePodSandbox: pods.update_pod,
    ev.CreateContainer: creation.create,
    ev.StartContainer: containers.start,
    ev.UpdateContainer: containers.update,
    ev.UpdatedContainer: containers.after_update,
    ev.StopContainer: containers.stop,
    ev.RemoveContainer: containers.remove,
    ev.CPUsChanged: upkeep.cpus_changed,
    ev.RecheckEvictions: upkeep.recheck_evictions,
    ev.SweepRound: upkeep.sweep,
    ev.Release: upkeep.release,
    ev.Restore: upkeep.restore,
    ev.Owe: upkeep.owe,
    ev.IrqRescan: irq_upkeep.rescan,
    ev.FinishHandOver: upkeep.finish_hand_over,
}
