"""The static policy: who gets exclusive CPUs, from which pool, and what everyone else shares.

Pools (every online CPU is in exactly one role):

* reserved  - for system daemons; never handed out exclusively.  With ``strict-cpu-reservation``
  they also leave the shared pool, as in kubelet.
* isolated  - ``isolcpus``; never shared.  An eligible container gets them only when it asks by
  annotation.
* exclusive - held by one container each.
* shared    - the rest: every non-exclusive container runs here.  It is never allowed to become
  empty.

Who is entitled to exclusive CPUs (a Guaranteed container with an integer CPU request; what
annotations may change) is eligibility.py's; where an entitled container's CPUs come from (a
restart's previous CPUs, its pod's earmark, near its NICs) is placement.py's.  This module
keeps the pools and the state's books: admit, earmark, release, forget.

CPU hotplug (``follow.py``): a CPU that goes offline leaves every pool; an exclusive
container that held it gets a free replacement (same NUMA node, then same socket, then any) or
is *degraded* - it keeps what is left, or runs in the shared pool when nothing is, and the CPU
is owed to it: it returns to that container when it comes back online.

The policy is pure: every method takes a NodeState and returns a new one, so the caller commits
state before any effect is applied.
"""

from __future__ import annotations

from ..base.value import Value
from . import placement
from .allocator import STRICT_CPU_RESERVATION, AllocationError, Allocator, reserve_by_count
from .cpuset import EMPTY, CPUSet
from .eligibility import describe, eligibility, wants_irq_free
from .errors import PolicyError
from .placement import NICPreference
from .state import Assignment, Earmark, NodeState, Released
from .topology import Topology
from .workload import Workload

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

POLICY_NAME = "static"
# Remembered stops (for restarts and init containers' CPUs): far more than the containers of a
# dense node's pods restarting at once, small enough that every commit stays cheap.
MAX_RELEASED = 512


class Decision(Value):
    container_id: str
    exclusive: bool
    cpus: CPUSet  # the container's cpuset: its exclusive CPUs, or the shared pool
    mems: CPUSet  # NUMA nodes of exclusive CPUs; empty for shared containers (left as is)
    shared_before: CPUSet
    shared_after: CPUSet
    reason: str


class StaticPolicy:
    name = POLICY_NAME

    def __init__(
        self,
        topology: Topology,
        reserved: CPUSet,
        options: Iterable[str] = (),
        irq_free_all: bool = False,
    ) -> None:
        self.topology = topology
        # [irq] keep_off_exclusive: every exclusive container's CPUs kept free of interrupts.
        self.irq_free_all = irq_free_all
        self.allocator = Allocator(topology, options)
        self.options = self.allocator.options
        self.strict = STRICT_CPU_RESERVATION in self.options
        if not reserved:
            raise PolicyError(
                "no reserved CPUs: set reserved_cpus (a list) or reserved_cpu_count (at least 1)",
                "config",
            )
        unknown = reserved - topology.all_cpus
        if unknown:
            raise PolicyError(
                f"reserved CPUs {unknown} are not CPUs of this machine (present: "
                f"{topology.all_cpus})",
                "config",
            )
        if not topology.all_cpus - reserved:
            # Judged on every CPU of the machine, not on the online ones: while a CPU is
            # offline (hotplug) a configuration that leaves it unreserved is still a good one.
            raise PolicyError(
                f"reserved CPUs {reserved} are every CPU of this machine (online "
                f"{topology.online or 'none'}, isolated {topology.isolated or 'none'}): no CPU "
                "is left to give a Guaranteed container exclusively, so every one would be "
                "refused; reserve fewer CPUs (reserved_cpus or reserved_cpu_count)",
                "config",
            )
        # Reserved CPUs may be offline (hotplug): they simply reserve nothing until they return.
        self.reserved = reserved
        # CPUs any shared container may run on, before exclusive assignments are removed.
        base = topology.online - topology.isolated
        self.shareable = base - reserved if self.strict else base
        # CPUs that may be handed out exclusively (isolated ones only on request).
        self.assignable = base - reserved
        if not self.shareable:
            raise PolicyError(
                f"no CPU left for the shared pool: online {topology.online}, reserved {reserved}, "
                f"isolated {topology.isolated}"
                + (f" and {STRICT_CPU_RESERVATION} is on" if self.strict else ""),
                "config",
            )

    @classmethod
    def from_config(
        cls,
        topology: Topology,
        reserved_cpus: CPUSet | None = None,
        reserved_count: int | None = None,
        options: Iterable[str] = (),
        irq_free_all: bool = False,
    ) -> StaticPolicy:
        """Reserved CPUs as an explicit list (wins) or a count taken as kubelet takes it."""
        if reserved_cpus is None:
            if reserved_count is None:
                raise PolicyError("set reserved_cpus (a list) or reserved_cpu_count", "config")
            try:
                reserved_cpus = reserve_by_count(topology, reserved_count)
            except AllocationError as err:
                hint = ": lower reserved_cpu_count" if reserved_count > 0 else ""
                raise PolicyError(f"{err}{hint}", "config") from None
        return cls(topology, reserved_cpus, options, irq_free_all)

    # --- pools ------------------------------------------------------------------------------

    def empty_state(self) -> NodeState:
        return NodeState(
            policy=self.name,
            fingerprint=self.topology.fingerprint(),
            reserved=self.reserved,
            shared=self.shareable,
        )

    def shared_pool(self, exclusive: CPUSet) -> CPUSet:
        return self.shareable - exclusive

    @staticmethod
    def cpuset_for(state: NodeState, container_id: str) -> CPUSet:
        """The CPUs a tracked container must run on: its exclusive CPUs, or the shared pool
        (shared containers, and degraded ones that lost every CPU they held)."""
        held = state.assignments.get(container_id)
        return held.cpus if held is not None and held.cpus else state.shared

    def free_exclusive(self, state: NodeState, isolated: bool = False) -> CPUSet:
        """CPUs that a new exclusive assignment may take: not held, and not owed to a degraded
        container (an online CPU it lost stays its own until it can be given back)."""
        pool = self.topology.isolated if isolated else self.assignable
        return pool - state.exclusive - _owed(state.assignments)

    def check(self, state: NodeState) -> str | None:
        """Why a loaded state cannot serve this policy on this machine, or None if it can.

        Offline CPUs are not a reason: ``follow_online`` repairs those in place."""
        usable = self.assignable | self.topology.isolated
        for cid, assignment in state.assignments.items():
            stray = (assignment.cpus & self.topology.online) - usable
            if stray:
                return f"container {cid} holds CPUs {stray} that are no longer assignable"
        if not self.shared_pool(state.exclusive):
            return "the assignments leave the shared pool empty"
        return None

    def normalized(self, state: NodeState) -> NodeState:
        """The same assignments with the shared pool recomputed for the current options (and
        without earmarks on CPUs these options no longer let containers hold)."""
        earmarks = {uid: e for uid, e in state.earmarks.items() if e.cpus <= self.assignable}
        if len(earmarks) != len(state.earmarks):
            state = state.evolve(earmarks=earmarks)
        return state.evolve(shared=self.shared_pool(state.exclusive))

    # --- decisions --------------------------------------------------------------------------

    def admit(
        self,
        state: NodeState,
        workload: Workload,
        nic: NICPreference | None = None,
        unavailable: CPUSet = EMPTY,
    ) -> tuple[Decision, NodeState]:
        """Decide a new container's cpuset; raise PolicyError when its request cannot be met.
        ``unavailable``: CPUs not to hand out although the state does not say they are held
        (running containers are pinned there and the state that named them was lost).
        ``nic`` steers exclusive CPUs towards the NUMA nodes of the pod's NICs."""
        before = self.shared_pool(state.exclusive)
        held = state.assignments.get(workload.container_id)
        if held is not None:  # a repeated event: answer as before
            decision = self._exclusive(
                workload.container_id, held.cpus, before, before, "already assigned"
            )
            return decision, state
        state = self._supersede(state, workload)
        shared = self.shared_pool(state.exclusive)
        count, why, isolated = eligibility(workload)
        state = _track_cgroup(state, workload)
        if count is None:
            state = state.evolve(sharing={**state.sharing, workload.container_id: workload.pod_uid})
            state = self._claim(state, workload)
            decision = Decision(
                workload.container_id, False, state.shared, CPUSet(), before, state.shared, why
            )
            return decision, state
        free = self.free_exclusive(state, isolated) - unavailable
        near = self.node_cpus(nic.nodes) if nic is not None and nic.nodes else None
        cpus, how = placement.choose(
            self.allocator, state, workload, count, isolated, free, unavailable, nic, near
        )
        if not self.shared_pool(state.exclusive | cpus):
            raise PolicyError(
                f"{describe(workload)} asks for {count} exclusive CPUs: granting {cpus} would "
                f"leave the shared pool empty (shared now: {shared}); lower the request or "
                "reserve fewer CPUs"
            )
        new_state = self._claim(self._assign(state, workload, cpus, nic), workload)
        decision = self._exclusive(
            workload.container_id, cpus, before, new_state.shared, f"{why}; {how}"
        )
        return decision, new_state

    # --- earmarks ----------------------------------------------------------------------------

    def earmark(
        self, state: NodeState, pod_uid: str, wanted: Earmark, unavailable: CPUSet = EMPTY
    ) -> NodeState:
        """A Guaranteed pod's sandbox started with a CPU limit of ``wanted.limit_milli`` (the
        sum over its containers; ``wanted`` is its earmark without CPUs): set aside as many
        whole free CPUs as its containers could ask for between them, chosen by topology as
        one request, so that creating its exclusive containers takes them without moving any
        other container.  Fewer when fewer are free (the shared pool keeps a CPU); none for a
        pod already known (a recreated sandbox: its containers' restarts go by what they held)
        or with less than a whole CPU."""
        count = wanted.limit_milli // 1000
        known = pod_uid in state.earmarks or any(
            a.pod_uid == pod_uid for a in state.assignments.values()
        )
        if count < 1 or not pod_uid or known:
            return state
        free = self.free_exclusive(state) - unavailable
        count = min(count, len(self.shared_pool(state.exclusive)) - 1)
        while count > 0:
            try:
                cpus = self.allocator.allocate(free, count)
            except AllocationError:
                count -= 1
                continue
            new_state = state.evolve(earmarks={**state.earmarks, pod_uid: wanted.evolve(cpus=cpus)})
            return new_state.evolve(shared=self.shared_pool(new_state.exclusive))
        return state

    def _claim(self, state: NodeState, workload: Workload) -> NodeState:
        """A container of an earmarked pod was created: its CPU limit is claimed, and the
        earmark keeps no more whole CPUs than the pod's containers could still ask for (the
        rest returns to the shared pool).  A restart (a name that claimed already) claims
        nothing more.  An init container's claim waits for the pod's first app container:
        kubelet's pod limit is the larger of an init container's and the app containers' sum,
        and counts an init container in that sum only when it runs on beside them (a sidecar,
        a restartable init container: kubelet annotates both kinds "init")."""
        mark = state.earmarks.get(workload.pod_uid)
        name = workload.container_name
        if mark is None or name in mark.claimants:
            return state
        used = workload.cpu_limit_milli or workload.cpu_request_milli
        earmarks = dict(state.earmarks)
        if workload.kind == "init":
            deferred = (*mark.deferred, (workload.container_id, name, used))
            earmarks[workload.pod_uid] = mark.evolve(deferred=deferred)
            return state.evolve(earmarks=earmarks)
        running = state.assignments.keys() | state.sharing.keys()
        sidecars = [(n, milli) for cid, n, milli in mark.deferred if cid in running]
        claimed = mark.claimed_milli + used + sum(milli for _, milli in sidecars)
        claimants = (*mark.claimants, *(n for n, _ in sidecars), name)
        keep = max(0, (mark.limit_milli - claimed) // 1000)
        cpus = self._trimmed(mark.cpus, keep)
        if cpus:
            earmarks[workload.pod_uid] = mark.evolve(
                cpus=cpus, claimed_milli=claimed, claimants=claimants, deferred=()
            )
        else:
            del earmarks[workload.pod_uid]
        new_state = state.evolve(earmarks=earmarks)
        return new_state.evolve(shared=self.shared_pool(new_state.exclusive))

    def _trimmed(self, earmarked: CPUSet, keep: int) -> CPUSet:
        """The ``keep`` CPUs of an earmark that stay earmarked, chosen from it by topology as
        a request of that size would be (whole cores; ids alone would split them: a core's
        threads are N and N+24 on a 48-thread part): as many as can be chosen so."""
        for count in range(min(keep, len(earmarked)), 0, -1):
            try:
                return self.allocator.allocate(earmarked, count)
            except AllocationError:
                continue
        return CPUSet()

    def _assign(
        self, state: NodeState, workload: Workload, cpus: CPUSet, nic: NICPreference | None = None
    ) -> NodeState:
        assignment = Assignment(
            container_id=workload.container_id,
            cpus=cpus,
            pod_uid=workload.pod_uid,
            container_name=workload.container_name,
            pod_name=workload.pod_name,
            pod_namespace=workload.pod_namespace,
            kind=workload.kind,
            nic_nodes=nic.nodes if nic is not None else CPUSet(),
            nics=nic.nics if nic is not None else (),
            nic_strict=bool(nic is not None and nic.strict and nic.nodes),
            irq_free=wants_irq_free(workload, self.irq_free_all),
        )
        sharing = {k: v for k, v in state.sharing.items() if k != workload.container_id}
        new_state = state.evolve(
            assignments={**state.assignments, workload.container_id: assignment}, sharing=sharing
        )
        mark = state.earmarks.get(workload.pod_uid)
        if mark is not None and mark.cpus & cpus:
            earmarks = dict(state.earmarks)
            if mark.cpus - cpus:
                earmarks[workload.pod_uid] = mark.evolve(cpus=mark.cpus - cpus)
            else:
                del earmarks[workload.pod_uid]
            new_state = new_state.evolve(earmarks=earmarks)
        return new_state.evolve(shared=self.shared_pool(new_state.exclusive))

    def _supersede(self, state: NodeState, workload: Workload) -> NodeState:
        """Kubernetes runs one container per (pod, name) at a time.  An assignment still held
        under that key by another id belongs to a creation that failed after we answered, or
        to a container whose stop we missed: it is dead, so release it (its CPUs then serve
        the new container first, as a restart)."""
        if not workload.pod_uid:
            return state
        for cid, held in state.assignments.items():
            if (held.pod_uid, held.container_name) == (workload.pod_uid, workload.container_name):
                return self.release(state, cid)[1]
        return state

    def adopt(self, state: NodeState, workload: Workload, cpus: CPUSet) -> NodeState | None:
        """Record CPUs an eligible container already runs on (found live after a restart), if
        they are exactly its request and still free; None if it must be placed anew."""
        count, _, isolated = eligibility(workload)
        if count is None or len(cpus) != count or not cpus <= self.free_exclusive(state, isolated):
            return None
        return self._assign(state, workload, cpus)

    def node_cpus(self, nodes: Iterable[int]) -> CPUSet:
        numa = self.topology.numa_nodes
        return CPUSet().union(*(numa.get(node, CPUSet()) for node in nodes))

    def release(self, state: NodeState, container_id: str) -> tuple[Decision | None, NodeState]:
        """A container stopped: its CPUs go back to the shared pool and are remembered for its
        restart.  Returns None for containers that held no exclusive CPUs."""
        held = state.assignments.get(container_id)
        if container_id in state.cgroups:
            state = state.evolve(cgroups=_without(state.cgroups, container_id))
        if held is None:
            if container_id in state.sharing:
                state = state.evolve(sharing=_without(state.sharing, container_id))
            return None, state
        before = self.shared_pool(state.exclusive)
        assignments = {k: v for k, v in state.assignments.items() if k != container_id}
        released = {
            **state.released,
            (held.pod_uid, held.container_name): Released(held.cpus, held.kind),
        }
        exclusive = CPUSet().union(*(a.cpus for a in assignments.values()))
        released = _bounded(released, exclusive)
        new_state = state.evolve(assignments=assignments, released=released)
        after = self.shared_pool(new_state.exclusive)
        new_state = new_state.evolve(shared=after)
        return self._exclusive(container_id, held.cpus, before, after, "released"), new_state

    def forget_pod(self, state: NodeState, pod_uid: str) -> NodeState:
        """The pod is gone: drop its assignments and what its containers are remembered by."""
        assignments = {k: v for k, v in state.assignments.items() if v.pod_uid != pod_uid}
        released = {k: v for k, v in state.released.items() if k[0] != pod_uid}
        sharing = {k: v for k, v in state.sharing.items() if v != pod_uid}
        gone = (set(state.sharing) - set(sharing)) | (set(state.assignments) - set(assignments))
        cgroups = {k: v for k, v in state.cgroups.items() if k not in gone}
        earmarks = {k: v for k, v in state.earmarks.items() if k != pod_uid}
        new_state = state.evolve(
            assignments=assignments,
            released=released,
            sharing=sharing,
            cgroups=cgroups,
            earmarks=earmarks,
        )
        return new_state.evolve(shared=self.shared_pool(new_state.exclusive))

    def _exclusive(
        self, cid: str, cpus: CPUSet, before: CPUSet, after: CPUSet, reason: str
    ) -> Decision:
        return Decision(cid, True, cpus, self.topology.numa_of(cpus), before, after, reason)


def _bounded(released: dict, exclusive: CPUSet) -> dict:
    """At most MAX_RELEASED remembered stops.  A missed RemovePodSandbox would otherwise keep its
    pod's entries forever, and every commit would carry them.  Entries whose CPUs another
    container holds go first (their restart could not get them back anyway), then the rest in
    a stable order."""
    if len(released) <= MAX_RELEASED:
        return released
    order = sorted(released, key=lambda key: (not (released[key].cpus & exclusive), key))
    for key in order[: len(released) - MAX_RELEASED]:
        del released[key]
    return released


def _owed(assignments: Mapping[str, Assignment]) -> CPUSet:
    return CPUSet().union(*(a.lost for a in assignments.values()))


def _without(mapping: Mapping[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in mapping.items() if k != key}


def _track_cgroup(state: NodeState, workload: Workload) -> NodeState:
    if not workload.cgroup_path:
        return state
    return state.evolve(cgroups={**state.cgroups, workload.container_id: workload.cgroup_path})
