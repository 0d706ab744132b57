"""What the node does for the runtime's container events after their creation (that is
daemon/creation.py): start (the state held committed, a container created from an old pool
set right, or - pinning at start - the decision itself), update (the cpuset kept, or an
in-place resize), stop and removal.  Functions of the node (daemon/node.py), which owns
everything they change."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.eligibility import describe
from ..core.outcome import Target
from ..core.policy import PolicyError, StaticPolicy
from ..core.state import NodeState
from ..core.workload import Workload
from ..ops import audit as audit_mod
from . import creation, upkeep
from . import events as ev
from .effects import NO_EFFECTS, Deliver, Effects, keep
from .routes import cgroup_target
from .statefile import BEFORE_ANSWER, STOP

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .node import Node


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
    Returns what takes the decision back.  (Node.query_decides_at_start says when.)"""
    workload = event.workload
    path = workload.cgroup_path
    if not node.writer.can_write(path):
        if node.settings.nri_pin_at == "start":
            why = (
                '[nri] pin_at = "start" writes each container\'s cgroup itself: set pin_at = '
                '"create" (the default) in the plugin\'s configuration'
            )
        else:
            why = (
                "it was created before this daemon started, by a runtime that has not listed "
                "its containers since, and only a write of its own could place it: kubelet "
                "retries it"
            )
        err = PolicyError(
            f"{describe(workload)} has {node.writer.why_not(path)}, but {why}", "config"
        )
        node.audit.emit([node.engine.refused(workload, err)])
        raise err
    # No earmark's answer here: the container's own write below is what it starts with.
    created = ev.CreateContainer(workload, event.pod, event.netns)
    effects = creation.decide_and_answer(node, created, None, keep)
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
