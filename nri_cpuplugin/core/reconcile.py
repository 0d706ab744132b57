"""Rebuilding the state from the runtime's truth: what runs (``LiveContainer``) and what the
state file remembers in, a consistent state and one note per change out (``reconcile``).
Pure, like the engine that calls it (``Engine.synchronize``).
"""

from __future__ import annotations

from ..base.value import Value
from .cpuset import CPUSet
from .eligibility import eligibility
from .errors import PolicyError
from .policy import StaticPolicy
from .state import NodeState
from .workload import Workload

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Iterable


class LiveContainer(Value):
    workload: Workload
    cpus: CPUSet  # what it runs on now (empty when unknown)


class Reconciled(Value):
    state: NodeState
    notes: tuple[str, ...]  # one line per change, for the audit trail


def reconcile(
    policy: StaticPolicy,
    state: NodeState,
    live: Iterable[LiveContainer],
    live_pods: Iterable[str],
) -> Reconciled:
    """Rebuild the state from the runtime's truth plus what the state file remembers.

    Used when the runtime lists everything it runs (NRI Synchronize) and whenever the stored state
    could not be trusted.  Pure: live containers and a state in, a consistent state and a list of
    what changed out.  The rules, in order:

    1. An assignment whose container is no longer live is dropped (it stopped while we were away).
    2. What stopped containers are remembered by is kept only for pods that still exist.
    3. A live container that keeps its assignment keeps its CPUs.
    4. An eligible live container without one (created while we were away, or the state file was
       lost) keeps the CPUs it already runs on when they are exactly its request and free -
       nothing moves under a running workload - or else is placed like a new container.
    5. Everything else runs in the shared pool.
    """
    live = list(live)
    notes: list[str] = []
    state = _forget_gone(policy, state, live, set(live_pods), notes)
    state = _place_eligible(policy, state, live, notes)
    sharing = {
        c.workload.container_id: c.workload.pod_uid
        for c in live
        if c.workload.container_id not in state.assignments
    }
    cgroups = {
        c.workload.container_id: c.workload.cgroup_path for c in live if c.workload.cgroup_path
    }
    state = state.evolve(sharing=sharing, cgroups=cgroups)
    return Reconciled(policy.normalized(state), tuple(notes))


def _forget_gone(
    policy: StaticPolicy,
    state: NodeState,
    live: list[LiveContainer],
    live_pods: set[str],
    notes: list[str],
) -> NodeState:
    """reconcile's rules 1-3: assignments of containers no longer live dropped, stopped
    containers' CPUs and earmarks remembered only for pods that still exist, the rest kept;
    nothing shares until the live containers say so."""
    live_ids = {c.workload.container_id for c in live}
    pods = live_pods | {c.workload.pod_uid for c in live}
    kept = {}
    for cid, assignment in state.assignments.items():
        if cid in live_ids:
            kept[cid] = assignment
        else:
            notes.append(f"dropped {assignment.cpus} of container {cid[:12]} (no longer running)")
    released = {key: r for key, r in state.released.items() if key[0] in pods}
    earmarks = {uid: e for uid, e in state.earmarks.items() if uid in pods}
    for uid in state.earmarks.keys() - earmarks.keys():
        notes.append(f"dropped CPUs {state.earmarks[uid].cpus} earmarked for gone pod {uid}")
    state = state.evolve(assignments=kept, released=released, sharing={}, earmarks=earmarks)
    return state.evolve(shared=policy.shared_pool(state.exclusive))


def _place_eligible(
    policy: StaticPolicy, state: NodeState, live: list[LiveContainer], notes: list[str]
) -> NodeState:
    """reconcile's rule 4.  Adopt first, so that containers already on their own CPUs are not
    displaced by newcomers placed anew; then place the rest in a stable order."""
    waiting = []
    for container in sorted(live, key=lambda c: c.workload.container_id):
        workload = container.workload
        if workload.container_id in state.assignments:
            continue
        try:
            count = eligibility(workload)[0]
        except PolicyError as err:
            notes.append(f"container {workload.container_id[:12]} shares: {err}")
            continue
        if count is None:
            continue
        adopted = policy.adopt(state, workload, container.cpus)
        if adopted is not None:
            state = adopted
            notes.append(f"adopted {container.cpus} already used by {_name_of(workload)}")
        else:
            waiting.append(workload)
    for workload in waiting:
        try:
            decision, state = policy.admit(state, workload)
        except PolicyError as err:
            notes.append(f"{_name_of(workload)} left in the shared pool: {err}")
            continue
        notes.append(f"placed {_name_of(workload)} on {decision.cpus}")
    return state


def _name_of(workload: Workload) -> str:
    return f"container {workload.container_name!r} ({workload.container_id[:12]})"
