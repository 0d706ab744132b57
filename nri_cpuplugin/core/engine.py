"""The engine: every decision of both front ends, written once.

    event ──▶ Engine ──▶ Outcome(state, decision, targets, events)
                              │
    NRI daemon:  commit state, reply with targets as adjustment + container updates
    OCI hook:    commit state, write targets to cgroupfs

An event is a container created, stopped, ended unseen, updated or resized in place; a pod removed;
the runtime's list of live containers (synchronize); the online CPUs changed; the stored state
loaded.  The engine answers with an ``Outcome``: the new state (the caller commits it *before*
applying anything, so a crash can lose an effect but never a decision), the decision for a created
container, the cpuset/mems/quota ``Target`` of every container whose cgroup must change, and the
audit events that explain it (outcome.py).  Rebuilding the state from the runtime's list of what
runs is reconcile.py's.  Pure: it reads no file and touches no cgroup, so every rule is tested with
plain values (tests/unit/test_engine.py).

``StaticPolicy.admit`` is called from this module and reconcile.py only: every placement goes
through the engine.
"""

from __future__ import annotations

from .cpuset import EMPTY, CPUSet
from .eligibility import eligibility
from .events import DEBUG, ERR, INFO, NOTICE, WARNING, AuditEvent, event
from .outcome import CFS_PERIOD_US, UNLIMITED, Loaded, Outcome, Target, in_pool
from .placement import NICPreference
from .policy import Decision, PolicyError, StaticPolicy
from .reconcile import LiveContainer, reconcile
from .state import Earmark, NodeState
from .workload import Workload

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Iterable

    from .follow import Followed
    from .topology import Topology


class Engine:
    """The decisions of one policy (one topology, reserved set and option list)."""

    def __init__(self, policy: StaticPolicy, cfs_quota: str = "unlimited") -> None:
        self.policy = policy
        self.topology = policy.topology
        # "unlimited": exclusive CPUs carry no CFS quota (kubelet >= 1.33 does the same): the
        # cpuset already bounds the container, and quota only adds throttling stalls.
        self.lift_quota = cfs_quota == "unlimited"

    def following(self, topology: Topology) -> Engine:
        """This engine's policy (reserved CPUs, options, quota rule) on another topology: the
        CPUs online after a hotplug."""
        policy = self.policy
        engine = Engine(
            StaticPolicy(topology, policy.reserved, policy.options, policy.irq_free_all)
        )
        engine.lift_quota = self.lift_quota
        return engine

    # --- targets ------------------------------------------------------------------------------

    def target(self, state: NodeState, cid: str) -> Target:
        """The cgroup settings of a tracked container under ``state``."""
        held = state.assignments.get(cid)
        if held is not None and held.cpus:
            return self.exclusive_target(cid, held.cpus)
        if held is not None:
            # Degraded to the shared pool (hotplug took every CPU it held): its CPU limit
            # bounds it again meanwhile.
            quota = held.count * CFS_PERIOD_US if self.lift_quota else None
            return Target(cid, state.shared, None, quota, mems_from_parent=True)
        return Target(cid, state.shared)

    def exclusive_target(self, cid: str, cpus: CPUSet) -> Target:
        """The cgroup settings of a container that holds ``cpus`` exclusively."""
        quota = UNLIMITED if self.lift_quota else None
        return Target(cid, cpus, self.topology.numa_of(cpus), quota, True)

    def followers(self, state: NodeState, exclude: str = "") -> tuple[Target, ...]:
        """Targets of every container that runs in the shared pool (shared ones, and degraded
        exclusive ones that hold nothing), for when the pool changed."""
        held = state.assignments
        ids = set(state.sharing) | {c for c, a in held.items() if not a.cpus}
        ids.discard(exclude)
        shared = state.shared
        return tuple(
            self.target(state, cid) if cid in held else in_pool(cid, shared) for cid in sorted(ids)
        )

    def _moved(self, before: NodeState, after: NodeState, exclude: str = "") -> tuple[Target, ...]:
        if before.shared == after.shared:
            return ()
        return self.followers(after, exclude)

    # --- the stored state ---------------------------------------------------------------------

    def load(
        self,
        stored: NodeState | None,
        problem: str | None,
        quarantined: str | None,
        announce: bool = True,
    ) -> Loaded:
        """What to run on, given what the store returned.  Any CPU layout is accepted: a changed
        online set is followed in place, never a reason to set the file aside.  ``announce``
        adds the informational state-new/state-loaded events (the daemon, not every hook)."""
        policy = self.policy
        events: list[AuditEvent] = []
        followed = None
        state = stored
        if state is not None and state.fingerprint != self.topology.fingerprint():
            from .follow import follow_online  # only when the CPUs changed: rare

            followed = follow_online(policy, state)
            events.append(
                event(
                    "state-repair",
                    f"the online CPUs changed since the last commit ({state.fingerprint} -> "
                    f"{followed.state.fingerprint}): assignments kept on CPUs still online, "
                    f"{len(followed.changes)} containers changed",
                    WARNING,
                    reason="online set changed",
                )
            )
            events += self.hotplug_events(followed)
            state = followed.state
        set_aside = False
        original = problem
        if state is not None:
            problem = policy.check(state)
            set_aside = problem is not None
        if state is None or set_aside:
            if quarantined is not None or problem != original:
                events = [
                    event(
                        "state-rebuild",
                        f"state file set aside, rebuilding from the runtime: {problem}",
                        WARNING,
                        reason=problem,
                    )
                ]
            elif announce:
                events = [event("state-new", f"starting with empty state ({problem})")]
            return Loaded(policy.empty_state(), False, set_aside, None, tuple(events))
        state = policy.normalized(state)
        if announce:
            events.append(
                event(
                    "state-loaded",
                    f"state loaded: {len(state.assignments)} exclusive assignments",
                    shared_cpus=state.shared,
                )
            )
        return Loaded(state, True, False, followed, tuple(events))

    # --- containers ---------------------------------------------------------------------------

    def create(
        self,
        state: NodeState,
        workload: Workload,
        nic: NICPreference | None = None,
        nic_note: str | None = None,
        unavailable: CPUSet = EMPTY,
    ) -> Outcome:
        """A container is being created: exclusive CPUs or the shared pool.  Raises
        PolicyError (see ``refused``) when its request cannot be met; nothing changes then.
        ``unavailable``: CPUs running containers are pinned to although the state does not
        name them (it was lost, and the runtime has not listed its containers yet)."""
        decision, new_state = self.policy.admit(state, workload, nic, unavailable)
        cid = workload.container_id
        targets = (self.target(new_state, cid), *self._moved(state, new_state, exclude=cid))
        who = _who(workload)
        if decision.exclusive:
            events = [
                event(
                    "allocate",
                    f"{who} got exclusive CPUs {decision.cpus} (NUMA {decision.mems}): "
                    f"{decision.reason}",
                    reason=decision.reason,
                    cpus=decision.cpus,
                    mems=decision.mems,
                    shared_cpus=decision.shared_after,
                    **workload.identity(),
                )
            ]
            if nic_note is not None:
                events.append(_nic_event(decision, workload, nic, nic_note))
        else:
            events = [
                event(
                    "share",
                    f"{who} runs in the shared pool {decision.cpus}: {decision.reason}",
                    DEBUG,
                    reason=decision.reason,
                    cpus=decision.cpus,
                    **workload.identity(),
                )
            ]
        events += self._resized(state, new_state, decision.reason)
        return Outcome(new_state, decision, targets, tuple(events))

    def refused(self, workload: Workload, err: PolicyError) -> AuditEvent:
        """The audit event of a creation refused with ``err``."""
        return event("refuse", str(err), ERR, reason=str(err), code=err.code, **workload.identity())

    def stop(self, state: NodeState, cid: str) -> Outcome:
        """The runtime says the container stopped: its CPUs return to the shared pool (and are
        remembered for its restart)."""
        held = state.assignments.get(cid)
        decision, new_state = self.policy.release(state, cid)
        if decision is None or held is None:
            return Outcome(new_state)
        events = [
            event(
                "release",
                f"released CPUs {held.cpus} of container {cid[:12]} "
                f"(pod {held.pod_namespace}/{held.pod_name})",
                container_id=cid,
                pod_uid=held.pod_uid,
                pod_name=held.pod_name,
                pod_namespace=held.pod_namespace,
                cpus=held.cpus,
                shared_cpus=new_state.shared,
            ),
            *self._resized(state, new_state, "released"),
        ]
        return Outcome(new_state, decision, self._moved(state, new_state), tuple(events))

    def ended(self, state: NodeState, cids: Iterable[str], why: str) -> Outcome:
        """Containers found ended without the runtime saying so (their cgroup is gone or
        empty): released like a stop."""
        before = state
        events = []
        for cid in sorted(cids):
            decision, state = self.policy.release(state, cid)
            freed = f"; released CPUs {decision.cpus}" if decision is not None else ""
            events.append(
                event(
                    "release",
                    f"container {cid[:12]} no longer runs ({why}){freed}",
                    container_id=cid,
                    cpus=decision.cpus if decision is not None else None,
                    reason="ended",
                )
            )
        events += self._resized(before, state, "ended")
        return Outcome(state, None, self._moved(before, state), tuple(events))

    def update(self, state: NodeState, cid: str) -> Outcome:
        """Someone updates a container's resources: our cpuset stays in force."""
        if cid not in state.assignments and cid not in state.sharing:
            return Outcome(state)  # not a container we place
        return Outcome(state, None, (self.target(state, cid),))

    def resize(self, state: NodeState, workload: Workload) -> Outcome:
        """A container's resources changed in place (kubelet's in-place resize): exclusive
        CPUs grow or shrink around what it holds (core/resize.py), a container crosses between
        shared and exclusive, and the shared pool and its followers move in the same outcome.
        Raises PolicyError when growth cannot be met; nothing changes then."""
        cid = workload.container_id
        held = state.assignments.get(cid)
        if held is None:
            if cid not in state.sharing:
                return Outcome(state)  # not a container we place
            if eligibility(workload)[0] is None:
                return self.update(state, cid)
            decision, new_state = self.policy.admit(state, workload)  # shared -> exclusive
        else:
            from .resize import resize  # only when resources change: rare

            decision, new_state = resize(self.policy, state, workload, held)
            if new_state is state:
                return self.update(state, cid)
        target = self.target(new_state, cid)
        if held is not None and held.cpus and not target.exclusive:  # exclusive -> shared
            target = target.evolve(mems_from_parent=True)
        targets = (target, *self._moved(state, new_state, exclude=cid))
        events = [
            event(
                "resize",
                f"{_who(workload)} resized: "
                + (
                    f"exclusive CPUs {decision.cpus} (NUMA {decision.mems})"
                    if decision.exclusive
                    else f"runs in the shared pool {decision.cpus}"
                )
                + f": {decision.reason}",
                reason=decision.reason,
                cpus=decision.cpus,
                mems=decision.mems,
                old_cpus=held.cpus if held is not None else state.shared,
                **workload.identity(),
            ),
            *self._resized(state, new_state, "resize"),
        ]
        return Outcome(new_state, decision, targets, tuple(events))

    def earmark(
        self, state: NodeState, pod_uid: str, wanted: Earmark, unavailable: CPUSet = EMPTY
    ) -> Outcome:
        """A Guaranteed pod's sandbox started: CPUs earmarked for its exclusive containers
        (policy.earmark), and the shared containers moved off them."""
        new_state = self.policy.earmark(state, pod_uid, wanted, unavailable)
        if new_state is state:
            return Outcome(state)
        cpus = new_state.earmarks[pod_uid].cpus
        events = [
            event(
                "earmark",
                f"pod {wanted.pod_namespace}/{wanted.pod_name} started with a CPU limit of "
                f"{wanted.limit_milli}m: CPUs {cpus} earmarked for its exclusive containers",
                reason="pod started",
                cpus=cpus,
                shared_cpus=new_state.shared,
                pod_uid=pod_uid,
                pod_name=wanted.pod_name,
                pod_namespace=wanted.pod_namespace,
            ),
            *self._resized(state, new_state, "pod earmarked"),
        ]
        return Outcome(new_state, None, self._moved(state, new_state), tuple(events))

    def remove_pod(self, state: NodeState, pod_uid: str) -> Outcome:
        """The pod is gone: what its containers held or are remembered by is dropped."""
        new_state = self.policy.forget_pod(state, pod_uid)
        events = self._resized(state, new_state, "pod removed")
        return Outcome(new_state, None, self._moved(state, new_state), tuple(events))

    def synchronize(
        self, state: NodeState, live: Iterable[LiveContainer], live_pods: Iterable[str]
    ) -> Outcome:
        """The runtime's (or the cgroups') list of what runs: the state made to match it (see
        ``reconcile``), and the target of every live container."""
        live = list(live)
        result = reconcile(self.policy, state, live, live_pods)
        new_state = result.state
        events = [event("reconcile", note, reason="synchronize") for note in result.notes]
        targets = tuple(self.target(new_state, c.workload.container_id) for c in live)
        return Outcome(new_state, None, targets, tuple(events))

    # --- hardware -----------------------------------------------------------------------------

    def follow(self, state: NodeState, previous: StaticPolicy) -> Outcome:
        """The online CPUs changed (this engine's policy has the new topology; ``previous`` the
        old one): every assignment follows, and every container whose cpuset changed gets a
        target."""
        from .follow import follow_online

        followed = follow_online(self.policy, state, previous=previous.topology)
        after = followed.state
        tracked = set(after.assignments) | set(after.sharing)
        targets = tuple(
            self.target(after, cid)
            for cid in sorted(tracked)
            if StaticPolicy.cpuset_for(state, cid) != StaticPolicy.cpuset_for(after, cid)
        )
        return Outcome(after, None, targets, self.hotplug_events(followed))

    def hotplug_events(self, followed: Followed) -> tuple[AuditEvent, ...]:
        """One event per container that following the online set changed."""
        events = []
        for change in followed.changes:
            action, priority = _CHANGE_ACTIONS[change.action]
            held = followed.state.assignments.get(change.container_id)
            who = (
                f"{held.pod_namespace}/{held.pod_name}/{held.container_name}"
                if held is not None
                else change.container_id[:12]
            )
            events.append(
                event(
                    action,
                    f"{who}: {change.reason}; holds {change.held or 'nothing (shared pool)'}"
                    + (f", owed {change.lost}" if change.lost else ""),
                    priority,
                    container_id=change.container_id,
                    cpus=change.cpus,
                    held_cpus=change.held,
                    lost_cpus=change.lost,
                    reason=change.reason,
                    pod_name=held.pod_name if held else None,
                    pod_namespace=held.pod_namespace if held else None,
                )
            )
        return tuple(events)

    # --- wording ------------------------------------------------------------------------------

    def _resized(self, before: NodeState, after: NodeState, reason: str) -> list[AuditEvent]:
        if before.shared == after.shared:
            return []
        return [
            event(
                "shared-resize",
                f"shared pool {before.shared} -> {after.shared} ({len(after.sharing)} shared "
                "containers follow it)",
                reason=reason,
                shared_cpus=after.shared,
                old_shared_cpus=before.shared,
            )
        ]


_CHANGE_ACTIONS = {
    "replaced": ("cpu-replaced", NOTICE),
    "degraded": ("degraded", WARNING),
    "preempted": ("degraded", WARNING),
    "restored": ("cpu-restored", NOTICE),
}


def _who(workload: Workload) -> str:
    return f"{workload.pod_namespace}/{workload.pod_name}/{workload.container_name}"


def _nic_event(
    decision: Decision, workload: Workload, nic: NICPreference | None, note: str
) -> AuditEvent:
    """Where the pod's NICs are and whether the exclusive CPUs chosen are next to them."""
    nodes = nic.nodes if nic is not None else CPUSet()
    if nodes:
        verdict = "honoured" if decision.mems <= nodes else "not honoured: too few free CPUs there"
        message = f"placement on NUMA {decision.mems} {verdict}"
    else:
        verdict, message = "no preference", "nothing to honour"
    return event(
        "nic-locality",
        f"{_who(workload)}: {note}; {message}",
        INFO if (nic is not None and nic.nics) or nodes else DEBUG,
        nic_numa=nodes,
        nics="; ".join(nic.nics) if nic is not None else "",
        honoured=verdict.split(":")[0],
        cpus=decision.cpus,
        mems=decision.mems,
        **workload.identity(),
    )
