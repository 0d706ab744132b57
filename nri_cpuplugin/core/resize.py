"""In-place resize of a placed container (kubelet's UpdateContainerResources): exclusive CPUs
grow around what the container holds and shrink back towards what it started with.

* Grow: every CPU it holds is kept; the new ones come from as close as possible - the free
  threads of its own cores, then its LLC group(s), NUMA node(s), socket(s), then anywhere -
  picked by the allocator within the closest group that has room.
* Shrink: the CPUs added last go first, so a container that grows and shrinks back ends on
  exactly the CPUs it started with; below that, a compact part of its first set is kept.
* Whole CPUs -> fractional (or a limit that no longer equals the request): it leaves its
  exclusive CPUs for the shared pool.  (Shared -> whole CPUs: the engine places it like a new
  container.)
* Growth that cannot be met is refused and nothing changes; the caller says why to kubelet.

Pure, like the policy it extends.
"""

from __future__ import annotations

from .allocator import AllocationError
from .cpuset import CPUSet
from .eligibility import describe, eligibility
from .errors import PolicyError
from .policy import Decision, StaticPolicy
from .state import Assignment, NodeState
from .workload import Workload

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from .topology import Topology


def resize(
    policy: StaticPolicy, state: NodeState, workload: Workload, held: Assignment
) -> tuple[Decision, NodeState]:
    """The decision for an exclusive container (``held``) whose resources changed, and the
    state after it.  (A shared container that becomes eligible is placed like a new one by
    the engine.)"""
    cid = workload.container_id
    count, why, isolated = eligibility(workload)
    before = policy.shared_pool(state.exclusive)
    if held.lost:
        raise PolicyError(
            f"{describe(workload)} cannot be resized while it is degraded by CPU hotplug (it "
            f"holds {held.cpus or 'nothing'} and is owed {held.lost}); retry once its CPUs are "
            "back",
        )
    if count is None:  # exclusive -> shared
        assignments = {k: v for k, v in state.assignments.items() if k != cid}
        new_state = state.evolve(
            assignments=assignments, sharing={**state.sharing, cid: held.pod_uid}
        )
        new_state = new_state.evolve(shared=policy.shared_pool(new_state.exclusive))
        reason = f"{why}: its exclusive CPUs {held.cpus} return to the shared pool"
        return Decision(cid, False, new_state.shared, CPUSet(), before, new_state.shared, reason), (
            new_state
        )
    current = len(held.cpus)
    if count == current:
        return _exclusive(policy, cid, held.cpus, before, before, "resize: same CPUs"), state
    if count > current:
        extra, where = _grow(policy, state, workload, held, count - current, isolated)
        resized = held.evolve(
            cpus=held.cpus | extra,
            initial=held.initial or held.cpus,
            added=held.added + tuple(extra.sorted()),
        )
        reason = f"grown by {extra} ({where})"
    else:
        resized = _shrink(policy, held, count)
        reason = f"shrunk to {resized.cpus}, giving back {held.cpus - resized.cpus}"
    new_state = state.evolve(assignments={**state.assignments, cid: resized})
    new_state = new_state.evolve(shared=policy.shared_pool(new_state.exclusive))
    return _exclusive(policy, cid, resized.cpus, before, new_state.shared, reason), new_state


def _grow(
    policy: StaticPolicy,
    state: NodeState,
    workload: Workload,
    held: Assignment,
    needed: int,
    isolated: bool,
) -> tuple[CPUSet, str]:
    """``needed`` more CPUs for an exclusive container, as close to what it holds as the
    shared pool allows, and where they came from."""
    free = policy.free_exclusive(state, isolated)
    if held.nic_strict and held.nic_nodes:
        free &= policy.node_cpus(held.nic_nodes)
    topo = policy.topology
    siblings = _groups_around(held.cpus, topo, "core", topo.cores) & free
    if len(siblings) >= needed:
        extra = policy.allocator.allocate(siblings, needed)
        if policy.shared_pool(state.exclusive | extra):
            return extra, "threads of its own cores"
    # Its own cores' free threads first, whatever tier the rest comes from.
    first = siblings if len(siblings) < needed else CPUSet()
    for where, tier in _tiers(topo, held.cpus):
        candidates = (free & tier) - first
        if len(candidates) < needed - len(first):
            continue
        try:
            extra = first | policy.allocator.allocate(candidates, needed - len(first))
        except AllocationError:
            continue
        if not policy.shared_pool(state.exclusive | extra):
            break  # no tier can leave the shared pool a CPU if this one cannot
        return extra, f"from {where}" + (f", with {first} of its own cores" if first else "")
    raise PolicyError(
        f"{describe(workload)} asks to grow from {len(held.cpus)} to "
        f"{len(held.cpus) + needed} exclusive CPUs; it holds {held.cpus}, free for exclusive "
        f"use: {free or 'none'} ({len(free)}), and the shared pool must keep a CPU: nothing "
        "changed; free CPUs or lower the request",
    )


def _tiers(topo: Topology, cpus: CPUSet) -> list[tuple[str, CPUSet]]:
    """Where a container holding ``cpus`` grows, closest first.  An LLC group may be smaller
    than a NUMA node (EPYC) or span several (Intel SNC): its part within the container's NUMA
    node comes before both."""
    llc = _groups_around(cpus, topo, "l3", topo.llc_groups)
    numa = _groups_around(cpus, topo, "numa", topo.numa_nodes)
    return [
        ("its LLC group", llc & numa),
        ("its NUMA node", numa),
        ("its LLC group, across NUMA nodes", llc),
        ("its socket", _groups_around(cpus, topo, "socket", topo.sockets)),
        ("another socket", topo.online),
    ]


def _groups_around(cpus: CPUSet, topo: Topology, kind: str, groups: dict[int, CPUSet]) -> CPUSet:
    """Every CPU of the groups of one kind that ``cpus`` (online CPUs) belong to."""
    ids = topo.group_ids(kind)
    return CPUSet().union(*(groups[ids[cpu]] for cpu in cpus))


def _shrink(policy: StaticPolicy, held: Assignment, count: int) -> Assignment:
    initial = held.initial or held.cpus
    if count >= len(initial):
        keep = len(held.added) - (len(held.cpus) - count)
        added = held.added[:keep]
        return held.evolve(cpus=initial | CPUSet(added), added=added)
    # Below its first set: a compact part of it (the allocator's choice within that set).
    cpus = policy.allocator.allocate(initial, count)
    return held.evolve(cpus=cpus, initial=cpus, added=())


def _exclusive(
    policy: StaticPolicy, cid: str, cpus: CPUSet, before: CPUSet, after: CPUSet, reason: str
) -> Decision:
    return Decision(cid, True, cpus, policy.topology.numa_of(cpus), before, after, reason)
