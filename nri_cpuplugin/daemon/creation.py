"""What the node does for CreateContainer: the container decided (its NICs read first, for
exclusive candidates), the shared containers moved, the answer handed over, then the decision
committed by the commit rule (daemon/statefile.py) and audited.  Functions of the node
(daemon/node.py), which owns everything they change; the container's later events are
daemon/containers.py's."""

from __future__ import annotations

from ..core.outcome import Outcome, Target
from ..core.policy import PolicyError
from ..core.workload import Workload
from ..hardware import nic
from ..hardware.netns_links import list_links
from ..hardware.nic_guard import candidate_locality
from ..ops import audit as audit_mod
from . import events as ev
from . import upkeep
from .effects import Deliver, Effects, keep
from .pod_nics import Listing
from .progress import NIC
from .statefile import AT_START, BEFORE_ANSWER, CREATION

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
    return decide_and_answer(node, event, early, deliver)


def decide_and_answer(
    node: Node, event: ev.CreateContainer, early: Target | None, deliver: Deliver
) -> Effects:
    """Decide, move the shared containers and answer (``deliver``, unless ``early`` was
    answered already), then commit; what the answer handed over (``Effects``)."""
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


def _nic_locality(node: Node, event: ev.CreateContainer) -> nic.Locality | None:
    """Where the pod's NICs are, for exclusive candidates only (hardware/nic_guard.py): from
    the read made when the pod started (daemon/pod_nics.py), if any."""
    used: list[str] = []

    def lister(netns: str | None) -> Listing:
        # Asked for only when locality reads the interfaces: a read still running is waited
        # for by candidates alone.
        read = node.pod_nics.lister_for(event.pod.sandbox_id, netns)
        if read is None:
            return list_links(netns)
        listing = read(netns)
        used.append(netns or "")  # (not when the read failed)
        return listing

    with node.progress.phase(NIC):
        locality = candidate_locality(
            event.workload, event.netns, node.settings.sysfs, node.policy.topology, lister
        )
    if locality is None or not used:
        return locality
    return locality.evolve(note=f"{locality.note} (interfaces read when the pod started)")
