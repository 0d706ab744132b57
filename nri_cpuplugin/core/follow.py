"""Following the online CPUs: what a CPU going offline (or coming back) does to the exclusive
assignments.  Pure, like the policy it works for: a state in, a new state and one change per
affected container out (the engine words them for the audit trail).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..base.value import Value
from .allocator import AllocationError
from .cpuset import CPUSet
from .policy import StaticPolicy
from .state import Assignment, NodeState
from .topology import Topology


class HotplugChange(Value):
    """What following the online set did to one exclusive container."""

    container_id: str
    action: str  # "replaced" | "degraded" | "restored" | "preempted"
    cpus: CPUSet  # the CPUs this is about: replacement, CPUs given back, CPUs lost
    held: CPUSet  # what the container holds afterwards
    lost: CPUSet  # what it is still owed afterwards
    reason: str


class Followed(Value):
    state: NodeState
    changes: tuple[HotplugChange, ...]


def follow_online(
    policy: StaticPolicy, state: NodeState, previous: Topology | None = None
) -> Followed:
    """The state made to fit this policy's online CPUs (a policy built on a topology
    discovered after a hotplug event, or at start after changes made while nothing ran).

    1. CPUs that are no longer online leave every assignment and are owed to it.
    2. Owed CPUs that are usable again return to their container (as long as the shared
       pool keeps a CPU).
    3. Containers still owed offline CPUs get free replacements: on their NUMA node(s),
       then their socket(s), then anywhere (never off the NICs' nodes when strict).  A
       replacement settles the debt: the lost CPU joins the shared pool when it returns.
       Without a replacement the container is degraded until the CPU returns.
    4. If the shared pool would be empty, the largest assignment gives a CPU back (owed).

    ``previous`` (the topology before the change) locates offline CPUs, which sysfs no
    longer describes; without it, a container that lost everything is replaced anywhere.
    """
    topo = policy.topology
    # Earmarks are a head start, not a promise: the CPUs follow the containers that hold them,
    # and an earmarked pod's containers are placed like any other's meanwhile.
    state = state.evolve(earmarks={})
    held = dict(state.assignments)  # each step below updates it in place
    usable = policy.assignable | topo.isolated
    newly_lost = _drop_offline(held, topo.online, usable)
    changes = _restore(policy, held, usable)
    changes += _replace(policy, held, newly_lost, previous)
    changes += _preempt(policy, held)
    new_state = state.evolve(assignments=held, fingerprint=topo.fingerprint())
    new_state = new_state.evolve(shared=policy.shared_pool(new_state.exclusive))
    return Followed(new_state, tuple(changes))


def _taken(held: Mapping[str, Assignment]) -> CPUSet:
    return CPUSet().union(*(a.cpus for a in held.values()))


def _drop_offline(held: dict[str, Assignment], online: CPUSet, usable: CPUSet) -> dict[str, CPUSet]:
    """Step 1: offline CPUs leave every assignment and are owed to it.  Returns what each
    container lost now."""
    newly_lost: dict[str, CPUSet] = {}
    for cid in sorted(held):
        a = held[cid]
        gone = a.cpus - online
        # An owed CPU that is online but can no longer be ours (now reserved or isolated by
        # a new configuration) cannot return: treat it as lost now, to be replaced.
        dead = (a.lost & online) - usable
        if gone or dead:
            held[cid] = a.evolve(cpus=a.cpus - gone, lost=(a.lost | gone) - dead)
            newly_lost[cid] = gone | dead
    return newly_lost


def _restore(
    policy: StaticPolicy, held: dict[str, Assignment], usable: CPUSet
) -> list[HotplugChange]:
    """Step 2: owed CPUs usable again return to their container, as long as the shared pool
    keeps a CPU."""
    online = policy.topology.online
    changes = []
    for cid in sorted(held):
        a = held[cid]
        candidates = (a.lost & online & usable) - _taken(held)
        back = CPUSet()
        for cpu in candidates.sorted():
            if policy.shared_pool(_taken(held) | back | {cpu}):
                back |= {cpu}
        if back:
            held[cid] = a = a.evolve(cpus=a.cpus | back, lost=a.lost - back)
            changes.append(
                HotplugChange(cid, "restored", back, a.cpus, a.lost, f"CPU {back} is usable again")
            )
    return changes


def _replace(
    policy: StaticPolicy,
    held: dict[str, Assignment],
    newly_lost: Mapping[str, CPUSet],
    previous: Topology | None,
) -> list[HotplugChange]:
    """Step 3: free replacements for CPUs still owed that are offline or can never return;
    a container that lost CPUs now and gets none is degraded."""
    online = policy.topology.online
    changes = []
    for cid in sorted(held):
        a = held[cid]
        dead = newly_lost.get(cid, CPUSet()) & online  # can never return: replace or forget
        missing = (a.lost - online) | dead
        if not missing:
            continue
        pick, where = _replacement(policy, held, a, missing, previous)
        if pick:
            held[cid] = a = a.evolve(cpus=a.cpus | pick, lost=a.lost - missing)
            reason = f"CPU {missing} went offline; replaced by {pick} ({where})"
            changes.append(HotplugChange(cid, "replaced", pick, a.cpus, a.lost, reason))
        elif cid in newly_lost:
            lost = newly_lost[cid]
            keeps = (
                f"it keeps {a.cpus} until the CPU returns"
                if a.cpus
                else "it runs in the shared pool until the CPU returns"
            )
            reason = f"CPU {lost} went offline and no free CPU can replace it; {keeps}"
            changes.append(HotplugChange(cid, "degraded", lost, a.cpus, a.lost, reason))
    return changes


def _preempt(policy: StaticPolicy, held: dict[str, Assignment]) -> list[HotplugChange]:
    """Step 4: while the shared pool would be empty, the largest assignment gives a CPU back
    (owed to it)."""
    changes = []
    while not policy.shared_pool(_taken(held)):
        victims = [a for a in held.values() if a.cpus & policy.shareable]
        if not victims:
            break
        a = max(victims, key=lambda v: (len(v.cpus), max(v.cpus), v.container_id))
        cpu = CPUSet([max(a.cpus & policy.shareable)])
        held[a.container_id] = a = a.evolve(cpus=a.cpus - cpu, lost=a.lost | cpu)
        reason = f"CPU {cpu} taken back: the shared pool had no CPU left"
        changes.append(HotplugChange(a.container_id, "preempted", cpu, a.cpus, a.lost, reason))
    return changes


def _replacement(
    policy: StaticPolicy,
    held: Mapping[str, Assignment],
    a: Assignment,
    missing: CPUSet,
    previous: Topology | None,
) -> tuple[CPUSet, str]:
    """Free CPUs to replace ``missing`` for ``a``, and where they were found; empty if none."""
    others = [x for x in held.values() if x.container_id != a.container_id]
    busy = CPUSet().union(*(x.cpus | x.lost for x in others)) | a.cpus
    isolated = _was_isolated(a.cpus | missing, policy.topology, previous)
    free = (policy.topology.isolated if isolated else policy.assignable) - busy
    exclusive = _taken(held)
    for label, tier in _replacement_tiers(policy, a, missing, previous):
        candidates = free & tier
        if len(candidates) < len(missing):
            continue
        try:
            pick = policy.allocator.allocate(candidates, len(missing))
        except AllocationError:
            continue
        if policy.shared_pool(exclusive | pick):
            return pick, label
    return CPUSet(), ""


def _was_isolated(cpus: CPUSet, topo: Topology, previous: Topology | None) -> bool:
    """Whether any of ``cpus`` is (or, before the change, was) an isolated CPU."""
    return any(
        info.isolated
        for source in (topo, previous)
        if source is not None
        for cpu in cpus
        if (info := source.by_id.get(cpu)) is not None
    )


def _replacement_tiers(
    policy: StaticPolicy, a: Assignment, missing: CPUSet, previous: Topology | None
) -> list[tuple[str, CPUSet]]:
    """Where replacements for ``missing`` are looked for, closest first: the container's NUMA
    node(s), its socket(s), anywhere; never off its NICs' nodes when their locality is
    strict.  ``previous`` locates the offline CPUs, which sysfs no longer describes."""
    topo = policy.topology
    nodes = topo.numa_of(a.cpus)
    socket_of = topo.group_ids("socket")
    sockets = {socket_of[c] for c in a.cpus if c in socket_of}
    if previous is not None:
        nodes |= previous.numa_of(missing)
        before = previous.group_ids("socket")
        sockets |= {before[c] for c in missing if c in before}
    tiers = [
        ("same NUMA node", policy.node_cpus(nodes)),
        ("same socket", CPUSet().union(*(topo.sockets.get(s, CPUSet()) for s in sockets))),
        ("another socket", topo.online),
    ]
    if a.nic_strict and a.nic_nodes:
        near = policy.node_cpus(a.nic_nodes)
        tiers = [(f"{label}, next to its NICs", cpus & near) for label, cpus in tiers]
    return tiers
