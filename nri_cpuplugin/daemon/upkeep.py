"""What the node does on its own: follows CPU hotplug, sweeps the containers known only from
the state file (daemon/unverified.py), learns which CPUs a lost state's containers are pinned
to, and takes back or owes what a request answered without its decision did late
(daemon/late.py).  Functions of the node (daemon/node.py), which owns everything they change.
Interrupts are daemon/irq_upkeep.py's.  The sweep and the eviction rechecks run as background
work (daemon/background.py), between the runtime's requests; hotplug runs in order with them."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.outcome import Outcome
from ..core.policy import StaticPolicy
from ..hardware.liveness import pinned_cpus
from ..ops import audit as audit_mod
from . import events as ev
from . import irq_upkeep
from .effects import NO_EFFECTS, Deliver, Effects, keep
from .online import engine_for_online_cpus
from .routes import cgroup_target
from .unverified import PINNED_EVERY, SWEEP_BATCH, SWEEP_INTERVAL

log = logging.getLogger("nri_cpuplugin")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .node import Node

# cgroup v1 evicts the tasks of a cpuset left without CPUs from a workqueue, possibly after we
# repaired it: look again this long after an offline event (bounded; nothing runs when idle).
EVICTION_RECHECKS = (0.1, 0.5, 2.0)


def release(node: Node, event: ev.Release, deliver: Deliver = keep) -> Effects:
    state, cid = node.state, event.container_id
    if cid not in state.assignments and cid not in state.sharing:
        return NO_EFFECTS  # nothing to take back
    with node.file.locked(decides=False):
        outcome = node.commit(node.engine.stop(node.state, event.container_id))
    node.audit.emit(outcome.events)
    node.routes.push(outcome.targets, node.state, event.cause)
    return NO_EFFECTS


def restore(node: Node, event: ev.Restore, deliver: Deliver = keep) -> Effects:
    """A resize answered with an error after it was made: the state before it again, and the
    cgroups the resize wrote directly (daemon/containers.py) written back, or owed."""
    if node.state is event.after:  # else other work was committed since: the resize stands
        with node.file.locked(decides=False):
            node.commit(Outcome(event.before))
        state, cid = node.state, event.container_id
        targets = list(node.engine.update(state, cid).targets)
        if event.after.shared != state.shared:
            targets += node.engine.followers(state, exclude=cid)
        node.routes.push(targets, state, "resize answered with an error")
    return NO_EFFECTS


def owe(node: Node, event: ev.Owe, deliver: Deliver = keep) -> Effects:
    node.owed.add(event.container_ids)
    return NO_EFFECTS


def finish_hand_over(node: Node, event: ev.FinishHandOver, deliver: Deliver = keep) -> Effects:
    """systemd units whose hand-over was left unconfirmed (daemon/units.py): what systemd
    refused is owed to the runtime's next reply."""
    node.owed.add(node.writer.finish_units())
    return NO_EFFECTS


def cpus_changed(node: Node, event: ev.CPUsChanged, deliver: Deliver = keep) -> Effects:
    """Kernel uevents: the engine follows the new online set (replacement, degraded,
    return), and cgroups are written directly (cgroup v1 never gives a CPU back by
    itself), CFS quotas included; the runtime hears of it from our next replies.  A failure
    is said loudly: the daemon runs on, and the next start follows the CPUs again."""
    try:
        _follow_online(node, event)
    except Exception as err:
        log.exception("following CPU hotplug failed")
        node.audit.record(
            "hotplug", f"following CPU hotplug failed: {err}", audit_mod.ERR, reason=str(err)
        )
    return NO_EFFECTS


def _follow_online(node: Node, event: ev.CPUsChanged) -> None:
    old = node.engine
    engine = engine_for_online_cpus(node.settings.sysfs, old, event.events, node.audit)
    if engine is None:
        return
    node.engine = engine
    went = old.topology.online - engine.topology.online
    came = engine.topology.online - old.topology.online
    node.returned |= came
    if not node.loaded:
        return  # load_state() repairs against this topology
    before = node.state
    with node.file.locked():
        outcome = node.commit(engine.follow(node.state, old.policy))
    node.audit.emit(outcome.events)
    changed = [t.container_id for t in outcome.targets]
    errors = repair_cgroups(node, changed, came)
    late = time.monotonic() - min(e.received for e in event.events)
    node.audit.record(
        "hotplug-applied",
        f"{len(changed)} containers' cpusets written {late * 1000:.1f} ms after the uevent "
        f"({len(errors)} failed); shared pool {node.state.shared}",
        latency_ms=f"{late * 1000:.2f}",
        containers=len(changed),
        shared_cpus=node.state.shared,
    )
    node.routes.push(outcome.targets, node.state, "CPU hotplug")
    # Unmanaged interrupts left without an online CPU were reset to all of them (exclusive
    # ones included), and some drivers reset their vectors at any hotplug: look again.
    irq_upkeep.keep_free(node, force=True)
    emptied = tuple(c for c in changed if StaticPolicy.cpuset_for(before, c) <= went)
    if went and emptied:
        for delay in EVICTION_RECHECKS:
            node.later(delay, ev.RecheckEvictions(emptied))


def repair_cgroups(node: Node, cids: Iterable[str], grow: CPUSet | None) -> list[str]:
    """Write these containers' cpusets (and CFS quotas) directly, after giving ``grow``
    (CPUs that came online; None: every online CPU) back to the ancestors of every tracked
    container on cgroup v1, where the kernel never restores them."""
    state = node.state
    targets = [
        cgroup_target(node.engine.target(state, cid), state)
        for cid in cids
        if state.cgroups.get(cid)  # else the runtime's update is all we can do
    ]
    return node.writer.repair(
        targets,
        state.cgroups.values(),
        node.policy.topology.online if grow is None else grow,
    )


def recheck_evictions(node: Node, event: ev.RecheckEvictions, deliver: Deliver = keep) -> Effects:
    cgroups = node.state.cgroups
    node.writer.return_evicted(
        (cid, cgroups[cid]) for cid in event.container_ids if cgroups.get(cid)
    )
    return NO_EFFECTS


def start_sweep(node: Node) -> None:
    """Check the unverified containers a few at a time, and the pods whose removal the
    runtime may not relay, so the shared pool grows back when some of them ended, without any
    event paying for all of them."""
    if not node.sweeping and (node.unverified or node.pinned or node.unrelayed_pods):
        node.sweeping = node.later(SWEEP_INTERVAL, ev.SweepRound())


def sweep(node: Node, event: ev.SweepRound, deliver: Deliver = keep) -> Effects:
    """One round of the sweep; the next is scheduled while there is more to check."""
    node.sweeping = False
    sweep_round(node)  # a round that fails ends the chain; the next Configure begins a new one
    start_sweep(node)
    return NO_EFFECTS


def sweep_round(node: Node) -> None:
    if not node.loaded:
        return
    # Containers pinned before the state was lost may have ended.  The scan walks every pod
    # cgroup (tens of milliseconds on a large node, which events wait for): not every sweep.
    node.unverified.sweeps += 1
    if node.pinned and node.unverified.sweeps % PINNED_EVERY == 0:
        learn_pinned(node)
    forget_gone_pods(node)
    if not node.unverified:
        return
    try:
        with node.file.locked():
            outcome = forget_ended(node, limit=SWEEP_BATCH)
    except Exception as err:  # a lock that cannot be had, a check that failed: the next round
        log.warning("checking unverified containers failed: %s", err)
        return
    node.routes.push(outcome.targets, node.state, "ended unseen")


def forget_gone_pods(node: Node) -> None:
    """Earmarked pods whose removal the runtime may not relay (``Node.unrelayed_pods``): one
    whose cgroup is gone was removed, and its earmark goes back to the shared pool."""
    for uid, parent in list(node.unrelayed_pods.items()):
        if uid not in node.state.earmarks:
            del node.unrelayed_pods[uid]  # claimed, or gone some other way
        elif node.liveness.pod_gone(parent):
            del node.unrelayed_pods[uid]
            cpus = node.state.earmarks[uid].cpus
            with node.file.locked():
                outcome = node.commit(node.engine.remove_pod(node.state, uid))
            node.audit.record(
                "reconcile",
                f"pod {uid} was removed without the runtime saying so (its cgroup {parent} is "
                f"gone): CPUs {cpus} earmarked for it go back to the shared pool",
                audit_mod.NOTICE,
                pod_uid=uid,
                cpus=cpus,
                reason="pod removed unseen",
            )
            node.audit.emit(outcome.events)
            node.routes.push(outcome.targets, node.state, "pod removed unseen")


def forget_ended(node: Node, exclusive_only: bool = False, limit: int = 0) -> Outcome:
    """Release unverified containers whose cgroups show they have ended (the lock held)."""
    ended = node.unverified.ended(node.state, node.liveness, exclusive_only, limit)
    if not ended:
        return Outcome(node.state)
    why = "its cgroup is gone or empty, and the runtime could not tell us"
    outcome = node.commit(node.engine.ended(node.state, ended, why))
    node.audit.emit(outcome.events)
    return outcome


def recheck_holders(node: Node) -> bool:
    """Whether CPUs came free: unverified exclusive holders that ended, or containers
    pinned before the state was lost that are gone."""
    freed = bool(forget_ended(node, exclusive_only=True).events)
    if node.pinned:
        before = node.pinned
        learn_pinned(node)
        freed = freed or node.pinned != before
    return freed


def learn_pinned(node: Node) -> None:
    """The state is lost (or new): which CPUs are running containers pinned to?  Until the
    runtime says (Synchronize - containerd 1.7 never sends one to a plugin it launched),
    those are kept out of exclusive use, so that no CPU is given twice."""
    pinned = pinned_cpus(node.liveness.root) - node.state.exclusive
    if pinned != node.pinned and (pinned or node.pinned):
        node.audit.record(
            "reconcile",
            f"running containers are pinned to CPUs {pinned or 'none'} that the state does "
            "not name (it was lost): kept out of exclusive use until the runtime lists its "
            "containers",
            audit_mod.WARNING if pinned else audit_mod.INFO,
            cpus=pinned,
            reason="state lost",
        )
    node.pinned = pinned
