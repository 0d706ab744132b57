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
    online = topo.online
    usable = policy.assignable | topo.isolated
    # Earmarks are a head start, not a promise: the CPUs follow the containers that hold them,
    # and an earmarked pod's containers are placed like any other's meanwhile.
    state = state.evolve(earmarks={})
    held = dict(state.assignments)
    changes: list[HotplugChange] = []
    newly_lost: dict[str, CPUSet] = {}

    def taken() -> CPUSet:
        return CPUSet().union(*(a.cpus for a in held.values()))

    for cid in sorted(held):  # 1.
        a = held[cid]
        gone = a.cpus - online
        # An owed CPU that is online but can no longer be ours (now reserved or isolated by
        # a new configuration) cannot return: treat it as lost now, to be replaced.
        dead = (a.lost & online) - usable
        if gone or dead:
            held[cid] = a.evolve(cpus=a.cpus - gone, lost=(a.lost | gone) - dead)
            newly_lost[cid] = gone | dead
    for cid in sorted(held):  # 2.
        a = held[cid]
        candidates = (a.lost & online & usable) - taken()
        back = CPUSet()
        for cpu in candidates.sorted():
            if policy.shared_pool(taken() | back | {cpu}):
                back |= {cpu}
        if back:
            held[cid] = a = a.evolve(cpus=a.cpus | back, lost=a.lost - back)
            changes.append(
                HotplugChange(cid, "restored", back, a.cpus, a.lost, f"CPU {back} is usable again")
            )
    for cid in sorted(held):  # 3.
        a = held[cid]
        dead = newly_lost.get(cid, CPUSet()) & online  # can never return: replace or forget
        missing = (a.lost - online) | dead
        if not missing:
            continue
        pick, where = _replacement(policy, held, a, missing, previous)
        if pick:
            held[cid] = a = a.evolve(cpus=a.cpus | pick, lost=a.lost - missing)
            changes.append(
                HotplugChange(
                    cid,
                    "replaced",
                    pick,
                    a.cpus,
                    a.lost,
                    f"CPU {missing} went offline; replaced by {pick} ({where})",
                )
            )
        elif cid in newly_lost:
            changes.append(
                HotplugChange(
                    cid,
                    "degraded",
                    newly_lost[cid],
                    a.cpus,
                    a.lost,
                    f"CPU {newly_lost[cid]} went offline and no free CPU can replace it"
                    + (
                        "; it runs in the shared pool until the CPU returns"
                        if not a.cpus
                        else f"; it keeps {a.cpus} until the CPU returns"
                    ),
                )
            )
    while not policy.shared_pool(taken()):  # 4.
        victims = [a for a in held.values() if a.cpus & policy.shareable]
        if not victims:
            break
        a = max(victims, key=lambda v: (len(v.cpus), max(v.cpus), v.container_id))
        cpu = CPUSet([max(a.cpus & policy.shareable)])
        held[a.container_id] = a = a.evolve(cpus=a.cpus - cpu, lost=a.lost | cpu)
        changes.append(
            HotplugChange(
                a.container_id,
                "preempted",
                cpu,
                a.cpus,
                a.lost,
                f"CPU {cpu} taken back: the shared pool had no CPU left",
            )
        )
    new_state = state.evolve(assignments=held, fingerprint=topo.fingerprint())
    new_state = new_state.evolve(shared=policy.shared_pool(new_state.exclusive))
    return Followed(new_state, tuple(changes))


def _replacement(
    policy: StaticPolicy,
    held: Mapping[str, Assignment],
    a: Assignment,
    missing: CPUSet,
    previous: Topology | None,
) -> tuple[CPUSet, str]:
    """Free CPUs to replace ``missing`` for ``a``, and where they were found; empty if none."""
    topo = policy.topology
    others = [x for x in held.values() if x.container_id != a.container_id]
    busy = CPUSet().union(*(x.cpus | x.lost for x in others)) | a.cpus
    isolated = any(
        info.isolated
        for source in (topo, previous)
        if source is not None
        for cpu in a.cpus | missing
        if (info := source.by_id.get(cpu)) is not None
    )
    free = (topo.isolated if isolated else policy.assignable) - busy
    nodes = topo.numa_of(a.cpus) | (previous.numa_of(missing) if previous else CPUSet())
    sockets = {topo.by_id[c].socket for c in a.cpus} | {
        previous.by_id[c].socket for c in missing if previous is not None and c in previous.online
    }
    tiers = [
        ("same NUMA node", policy.node_cpus(nodes)),
        ("same socket", CPUSet().union(*(topo.sockets.get(s, CPUSet()) for s in sockets))),
        ("another socket", topo.online),
    ]
    if a.nic_strict and a.nic_nodes:
        near = policy.node_cpus(a.nic_nodes)
        tiers = [(f"{label}, next to its NICs", cpus & near) for label, cpus in tiers]
    exclusive = CPUSet().union(*(x.cpus for x in held.values()))
    for label, tier in tiers:
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
