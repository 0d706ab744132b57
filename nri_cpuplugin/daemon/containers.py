"""What the node does for the runtime's container events: creation (decided, the shared
containers moved, answered, committed by the commit rule), start (the state held committed, a
container created from an old pool set right, or - pinning at start - the decision itself),
update (the cpuset kept, or an in-place resize), stop and removal.  Functions of the node
(daemon/node.py), which owns everything they change."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.eligibility import describe, eligibility
from ..core.outcome import Outcome, Target
from ..core.policy import PolicyError, StaticPolicy
from ..core.state import NodeState
from ..core.workload import Workload
from ..hardware import nic
from ..ops import audit as audit_mod
from . import events as ev
from . import upkeep
from .effects import NO_EFFECTS, Deliver, Effects, keep
from .pod_nics import Listing
from .progress import NIC
from .routes import cgroup_target
from .statefile import AT_START, BEFORE_ANSWER, CREATION, STOP

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .node import Node


def create(node: Node, event: ev.CreateContainer, deliver: Deliver = keep) -> Effects:
    """CreateContainer: decide, move the shared containers, answer; then commit (the commit
    rule, daemon/statefile.py) and audit.  A creation answered already from its pod's earmark
    (``event.answered``, or here when the state allows) is decided all the same, and what it
    was decided on otherwise is set right at its start."""
    early = event.answered
    if early is None and (early := node.query_early_answer(event)) is not None:
        deliver(Effects(own=early))  # answered now; decided next, as any creation
    return _create(node, event, early, deliver)


def _create(
    node: Node, event: ev.CreateContainer, early: Target | None, deliver: Deliver
) -> Effects:
    workload = event.workload
    cid = workload.container_id
    node.sandboxes[event.pod.uid] = event.pod.sandbox_id
    # What takes the decision back if the request turns out answered with an error: part of
    # the answer handed over, which is all the late part (daemon/late.py) gets of it.
    tracked = cid in node.state.assignments or cid in node.state.sharing
    undo = None if tracked else ev.Release(cid, "creation answered with an error")
    try:
        # Outside the lock: it reads netlink and sysfs, never the state (about 1-3 ms).
        locality = _nic_locality(node, event)
        with node.file.locked():
            outcome, committed = _decide_creation(node, workload, locality)
            effects, proceed = _answer_creation(node, event, outcome, early, deliver, undo)
            if not committed:
                _settle_creation(node, outcome, proceed)
    except PolicyError as err:
        node.metrics.pinning_request()
        node.metrics.pinning_error()
        node.audit.emit([node.engine.refused(workload, err)])
        raise
    if not (proceed or committed):
        return effects
    if outcome.decision is not None and outcome.decision.exclusive:
        node.metrics.pinning_request()
    node.audit.emit(outcome.events)
    return effects


def _settle_creation(node: Node, outcome: Outcome, proceed: bool) -> None:
    """After the answer (the lock held): the decision is committed by the commit rule - or,
    answered with an error meanwhile, not made, and the shared containers written for it go
    back to the pool as it is."""
    if proceed:
        exclusive = outcome.decision is not None and outcome.decision.exclusive
        if node.commit_point(CREATION, exclusive) == AT_START:
            node.hold(outcome)
        else:
            node.commit(outcome)
    elif len(outcome.targets) > 1:
        back = [node.query_target(t.container_id) for t in outcome.targets[1:]]
        node.routes.push(back, node.state, "creation answered with an error")


def _decide_creation(
    node: Node, workload: Workload, locality: nic.Locality | None
) -> tuple[Outcome, bool]:
    """Decide (the lock held), and commit first where the answer must wait for the
    commit: (outcome, committed).  When there is no room, containers known only from the
    state file may have ended unseen: those holding exclusive CPUs are checked, and the
    request is decided again - only then, so a creation never pays for checking every
    container a restart left unverified."""
    preference = locality.preference if locality else None
    note = locality.note if locality else None
    try:
        outcome = node.engine.create(node.state, workload, preference, note, node.pinned)
    except PolicyError as err:
        if err.code != "refused" or not upkeep.recheck_holders(node):
            raise
        outcome = node.engine.create(node.state, workload, preference, note, node.pinned)
    decision = outcome.decision
    exclusive = decision is not None and decision.exclusive
    if decision is None or node.commit_point(CREATION, exclusive) != BEFORE_ANSWER:
        return outcome, False
    try:
        return node.commit(outcome, durable=True), True
    except OSError as err:
        raise PolicyError(
            f"exclusive CPUs {decision.cpus} for {workload.pod_namespace}/"
            f"{workload.pod_name}/{workload.container_name} cannot be made durable: {err}; "
            "free space there (or fix the state directory) and the pod will be retried",
            "not-durable",
        ) from None


def _answer_creation(
    node: Node,
    event: ev.CreateContainer,
    outcome: Outcome,
    early: Target | None,
    deliver: Deliver,
    undo: ev.Release | None,
) -> tuple[Effects, bool]:
    """Move the shared containers and answer: (the answer, whether the decision stands)."""
    mine, *others = outcome.targets
    if mine.cpus & node.returned:
        # The new container's ancestors lack CPUs that came back online (cgroup v1).
        path = outcome.state.cgroups.get(mine.container_id, "")
        if path:
            node.writer.grow_ancestors([path], mine.cpus)
    state, routes = outcome.state, node.routes
    unwritten = routes.write(others, state)
    carried = (t.container_id for t in outcome.targets)
    owed = routes.owed_targets(carried, node.engine, state)
    updates = routes.for_reply(unwritten + owed, state)
    effects = Effects(own=mine, updates=tuple(updates), undo=undo)
    if early is None:
        return effects, deliver(effects)
    if mine != early or updates:
        # Decided otherwise (NIC locality, say): its StartContainer finds its cgroup on the
        # earmarked CPUs and writes what was decided, before its first instruction; the
        # runtime's stored specs get it with the next reply that can carry updates.
        cid = mine.container_id
        node.owed.add([cid, *(t.container_id for t in updates)])
        node.audit.record(
            "earmark",
            f"container {cid[:12]} was answered with the CPUs earmarked for its pod "
            f"({early.cpus}), but decided on {mine.cpus}: set right when it starts",
            audit_mod.NOTICE,
            container_id=cid,
            cpus=mine.cpus,
            reason="decided otherwise",
        )
    return effects, True


def start(node: Node, event: ev.StartContainer, deliver: Deliver = keep) -> Effects:
    """The runtime has made the container's cgroup from its stored spec; its first
    instruction has not run yet.  A shared container created from a pool that moved since
    (no write could reach it then: it had no cgroup yet) is written now, so it never runs
    on exclusive CPUs; one read for every other container.  A shared container's cgroup
    is made quick to write here, where that costs its own start.  The state its creation
    held is committed.  With ``[nri] pin_at = "start"`` the container is decided here in
    the first place, and its cgroup written (docs/architecture.md, "Pinning at start")."""
    cid = event.workload.container_id
    undo = _create_at_start(node, event) if node.query_decides_at_start(cid) else None
    try:
        _set_right_at_start(node, event)
    except BaseException:
        # Refused (or answered with an error meanwhile): the container does not start, so
        # the CPUs it holds go again - now, not at kubelet's retry - whether just decided or
        # decided at its creation.  (A shared one keeps its record: if the refusal came after
        # the request's budget, the runtime started it on its fallback, and it stays owed.)
        if undo is None and cid in node.state.assignments:
            undo = ev.Release(cid, "start refused")
        if undo is not None:
            upkeep.release(node, undo)
        raise
    return Effects(undo=undo)


def _set_right_at_start(node: Node, event: ev.StartContainer) -> None:
    workload = event.workload
    cid = workload.container_id
    node.commit_held()
    [*targets] = node.engine.update(node.state, cid).targets
    if not targets:
        return
    path = node.state.cgroups.get(cid, "")
    if cid in node.state.sharing:
        node.writer.prepare_shared(cid, path)
    live = node.liveness.cpus(path)
    created = event.stored.cpus if live is None else live
    target = targets[0]
    if node.settings.nri_pin_at == "start":
        if created != target.cpus or target.exclusive:
            _write_at_start(node, event, target)
    elif created != target.cpus:
        # Created with a pool that moved meanwhile (no write could reach it: it had no
        # cgroup yet).  Refused rather than started on another container's CPUs.
        _set_right(node, workload, targets, created, "pool moved during creation", refuse=True)


def after_update(node: Node, event: ev.UpdatedContainer, deliver: Deliver = keep) -> Effects:
    """PostUpdateContainer: the runtime has applied the update, our answer's entry for the
    container among it.  It applies that entry after its NRI call has returned, outside the
    lock that orders the other events (docs/nri-wire.md §11.3): a decision made in between
    (another pod's earmark, an exclusive creation) shrank the pool our answer named, and the
    runtime just put the container back on it.  Set right now, whatever the order was."""
    cid = event.workload.container_id
    if event.stored.cpus:  # (runc's update set them as the systemd driver's unit properties)
        node.writer.runtime_wrote(cid)
    [*targets] = node.engine.update(node.state, cid).targets
    if not targets:
        return NO_EFFECTS
    live = node.liveness.cpus(node.state.cgroups.get(cid, ""))
    applied = event.stored.cpus if live is None else live
    if applied != targets[0].cpus:
        _set_right(node, event.workload, targets, applied, "older answer applied", refuse=False)
    return NO_EFFECTS


def _set_right(
    node: Node, workload: Workload, targets: list[Target], on: CPUSet, why: str, refuse: bool
) -> None:
    """Write a container found on CPUs ``on`` instead of its target, and say which happened:
    moved, or left for the runtime's next reply (owed).  Left on exclusive CPUs, a container
    about to start is refused (``refuse``); one running can only be owed, said loudly."""
    target = targets[0]
    cid = workload.container_id
    name = f"{workload.pod_namespace}/{workload.pod_name}/{workload.container_name}"
    fields = {"container_id": cid, "cpus": target.cpus, "reason": why}
    if not node.routes.write(targets, node.state):
        node.audit.record(
            "share",
            f"{name} was on CPUs {on or 'unknown'} ({why}): moved to {target.cpus}",
            audit_mod.INFO,
            moved="yes",
            **fields,
        )
        return
    held = node.state.assignments.get(cid)
    taken = on & (node.state.exclusive - (held.cpus if held is not None else CPUSet()))
    if taken and refuse:
        err = PolicyError(
            f"{describe(workload)} was created with CPUs {on}, of which {taken} are exclusive "
            f"to others now, and it could not be moved to {target.cpus} "
            f"({node.writer.why_not(node.state.cgroups.get(cid, ''))}): it is not started "
            "now, and kubelet retries it",
            "cgroup-write",
        )
        node.audit.emit([node.engine.refused(workload, err)])
        raise err
    node.owed.add([cid])
    node.audit.record(
        "share",
        f"{name} is on CPUs {on or 'unknown'} ({why}) and could not be moved to {target.cpus}: "
        f"owed to the runtime's next reply"
        + (f"; until then it runs on others' exclusive CPUs {taken}" if taken else ""),
        audit_mod.WARNING if taken else audit_mod.INFO,
        moved="owed",
        **fields,
    )


def _create_at_start(node: Node, event: ev.StartContainer) -> ev.Release | None:
    """Decide the container as a creation (shared containers written, state held for the
    commit that follows); what only the runtime can move is owed to its next reply.
    Returns what takes the decision back."""
    workload = event.workload
    path = workload.cgroup_path
    if not node.writer.can_write(path):
        err = PolicyError(
            f'{describe(workload)} has {node.writer.why_not(path)}, but [nri] pin_at = "start" '
            'writes each container\'s cgroup itself: set pin_at = "create" (the default) in '
            "the plugin's configuration",
            "config",
        )
        node.audit.emit([node.engine.refused(workload, err)])
        raise err
    # No earmark's answer here: the container's own write below is what it starts with.
    effects = _create(node, ev.CreateContainer(workload, event.pod, event.netns), None, keep)
    node.owed.add(t.container_id for t in effects.updates)
    return effects.undo if isinstance(effects.undo, ev.Release) else None


def _write_at_start(node: Node, event: ev.StartContainer, target: Target) -> None:
    """Write the container's own cgroup; refused when it cannot be, rather than started
    on its pod's CPUs."""
    write = cgroup_target(target, node.state)
    errors = node.writer.write_own(write)
    if errors:
        raise PolicyError(
            f"the CPUs {target.cpus} decided for {describe(event.workload)} could not be "
            f"written to its cgroup {write.runtime_path!r} ({'; '.join(errors)}): it is "
            "not started now, and kubelet retries it",
            "cgroup-write",
        )


def update(node: Node, event: ev.UpdateContainer, deliver: Deliver = keep) -> Effects:
    """Someone (kubelet's in-place resize, an operator) updates resources.  A new CPU
    request resizes the container (core/resize.py); anything else keeps our cpuset in
    force.  A growth that cannot be met fails the update: kubelet reports the resize as
    failed and retries.  The runtime applies the entry for the container being updated
    last, in place of the CRI request, after the call has returned (nri-wire §11.3)."""
    cid = event.workload.container_id
    # A container owed stays owed: this reply's entry for it is applied only after the call,
    # so the next reply - one that creates a container on the CPUs it must leave, say, which
    # the runtime applies before it creates that container - must still carry it.
    owed = cid in node.owed
    try:
        if event.resize:
            return _resize(node, event)
        targets = node.engine.update(node.state, cid).targets
        return reply_to_update(
            node, cid, targets, node.routes.owed_targets([cid], node.engine, node.state)
        )
    finally:
        if owed:
            node.owed.add([cid])


def _resize(node: Node, event: ev.UpdateContainer) -> Effects:
    """Decide and commit the resize, write what it changed, answer; ``Restore`` takes it back
    if the request turns out answered with an error."""
    workload = event.workload
    cid = workload.container_id
    before = node.state
    try:
        with node.file.locked():
            outcome = node.engine.resize(node.state, workload)
            exclusive = outcome.decision is not None and outcome.decision.exclusive
            node.commit(outcome, durable=exclusive)
    except (PolicyError, OSError) as err:
        error = err if isinstance(err, PolicyError) else PolicyError(str(err), "not-durable")
        node.audit.emit([node.engine.refused(workload, error)])
        raise error from None
    node.audit.emit(outcome.events)
    changed = outcome.state is not before
    targets, unwritten = list(outcome.targets), False
    if changed:
        targets, unwritten = _write_resized(node, cid, targets, before)
    carried = [cid, *(t.container_id for t in outcome.targets)]
    owed = node.routes.owed_targets(carried, node.engine, node.state)
    effects = reply_to_update(node, cid, targets, owed)
    if unwritten:
        node.owed.add([cid])  # (after this reply's drain)
    return effects.evolve(undo=ev.Restore(cid, before, outcome.state) if changed else None)


def _write_resized(
    node: Node, cid: str, targets: list[Target], before: NodeState
) -> tuple[list[Target], bool]:
    """A resize moves what it changed before its answer, as a creation does: the shared
    containers first, then the container itself.  The runtime applies the answer's own entry
    only after the call has returned, outside the lock that orders the other events
    (docs/nri-wire.md §11.3): a container left on its old cpuset (in ``before``) until then would
    run on CPUs that a decision made meanwhile (another pod's earmark, an exclusive creation)
    hands out as no longer its own.  An exclusive container that grows onto CPUs of shared
    containers the runtime must move waits for them (CPUs are taken away before they are
    given).  Returns what this reply carries - the container's own entry (it replaces the CRI
    request) and what could not be written - and whether the container itself was not
    written: it is owed then, to the next reply that can carry updates (the one that creates
    a container on those CPUs moves it at once)."""
    own = [t for t in targets if t.container_id == cid]
    unwritten = node.routes.write([t for t in targets if t.container_id != cid], node.state)
    if not own:
        return unwritten, False
    target = own[0]
    grows = not target.cpus <= StaticPolicy.cpuset_for(before, cid)
    waits = target.exclusive and bool(unwritten) and grows
    return own + unwritten, waits or bool(node.routes.write(own, node.state))


def reply_to_update(node: Node, cid: str, targets: Iterable[Target], owed: list[Target]) -> Effects:
    own = None
    others = list(owed)
    for target in targets:
        if target.container_id == cid:
            own = target
        else:
            others.append(target)
    routes = node.routes
    own = routes.for_reply([own], node.state)[0] if own is not None else None
    return Effects(own=own, updates=tuple(routes.for_reply(others, node.state)))


def stop(node: Node, event: ev.StopContainer, deliver: Deliver = keep) -> Effects:
    """The container's CPUs go back to the shared pool.  Once the runtime lists its
    containers, the answer goes first, and the shared containers' writes and the commit
    follow it: a shared container given its CPUs a moment later runs nowhere it must not,
    and a crash before the commit is repaired from the runtime's list, which shows the
    container stopped.  Before that: commit, write, answer."""
    cid = event.workload.container_id
    with node.file.locked():
        outcome = node.engine.stop(node.state, cid)
        others = [t for t in outcome.targets if t.container_id != cid]
        carried = [cid, *(t.container_id for t in others)]
        routes, state = node.routes, outcome.state
        if node.commit_point(STOP) == BEFORE_ANSWER:
            node.commit(outcome)
            unwritten = routes.write(others, state)
            owed = routes.owed_targets(carried, node.engine, state)
            effects = Effects(updates=tuple(routes.for_reply(unwritten + owed, state)))
        else:
            node.hold(outcome)
            direct = [t for t in others if routes.writable(t, state)]
            runtime = [t for t in others if not routes.writable(t, state)]
            owed = routes.owed_targets(carried, node.engine, state)
            effects = Effects(updates=tuple(routes.for_reply(runtime + owed, state)))
            deliver(effects)
            # Not written after all: the next reply that can carry them does.
            node.owed.add(t.container_id for t in routes.write(direct, state))
            node.commit(outcome)
    node.audit.emit(outcome.events)
    return effects


def remove(node: Node, event: ev.RemoveContainer, deliver: Deliver = keep) -> Effects:
    """Normally StopContainer released it already; if that was missed, the pool grows now
    and the shared containers are written (or owed)."""
    cid = event.workload.container_id
    node.writer.forget(cid)
    with node.file.locked():
        outcome = node.commit(node.engine.stop(node.state, cid))
    node.audit.emit(outcome.events)
    node.routes.push(outcome.targets, node.state, "container removed")
    return NO_EFFECTS


def _nic_locality(node: Node, event: ev.CreateContainer) -> nic.Locality | None:
    """Where the pod's NICs are, for exclusive candidates only (nobody else's CPUs are
    chosen): from the read made when the pod started (daemon/pod_nics.py), if any."""
    workload = event.workload
    if eligibility(workload)[0] is None:
        return None
    with node.progress.phase(NIC):
        read_ahead = node.pod_nics.lister_for(event.pod.sandbox_id, event.netns)
        used: list[str] = []
        lister = None
        if read_ahead is not None:
            read = read_ahead

            def lister(path: str) -> Listing:
                listing = read(path)
                used.append(path)  # (not when the read failed, or locality is off)
                return listing

        locality = nic.locality(
            event.netns,
            workload.annotations,
            workload.container_name,
            node.settings.sysfs,
            node.policy.topology,
            lister,
        )
    if not used:
        return locality
    return locality.evolve(note=f"{locality.note} (interfaces read when the pod started)")
