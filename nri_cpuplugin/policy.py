"""The static policy: who gets exclusive CPUs, from which pool, and what everyone else shares.

Pools (every online CPU is in exactly one role):

* reserved  - for system daemons; never handed out exclusively.  With ``strict-cpu-reservation``
  they also leave the shared pool, as in kubelet.
* isolated  - ``isolcpus``; never shared.  An eligible container gets them only when it asks by
  annotation.
* exclusive - held by one container each.
* shared    - the rest: every non-exclusive container runs here.  It is never allowed to become
  empty.

Eligibility follows kubelet: a Guaranteed container with an integer CPU request.  Annotations
(set by any pod author, so untrusted) can opt a container *out*, or steer an eligible one to
isolated CPUs; they never grant CPUs to a container that is not entitled to them.

The policy is pure: every method takes a NodeState and returns a new one, so the caller commits
state before any effect is applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .allocator import STRICT_CPU_RESERVATION, AllocationError, Allocator, reserve_by_count
from .cpuset import CPUSet
from .state import Assignment, NodeState, Released
from .topology import Topology
from .workload import GUARANTEED, Workload

POLICY_NAME = "static"

# "false" opts a container out of exclusive CPUs.  Pod-wide, or per container with the suffix
# "/container.<name>", which wins over the pod-wide value.
EXCLUSIVE_ANNOTATION = "exclusive-cpus.nri-cpuplugin.io"
# "true" asks that an eligible container's exclusive CPUs come from the isolated CPUs.
ISOLATED_ANNOTATION = "isolated-cpus.nri-cpuplugin.io"


class PolicyError(Exception):
    """A request that cannot be met; the message is shown to whoever created the container."""


@dataclass(frozen=True)
class Decision:
    container_id: str
    exclusive: bool
    cpus: CPUSet  # the container's cpuset: its exclusive CPUs, or the shared pool
    mems: CPUSet  # NUMA nodes of exclusive CPUs; empty for shared containers (left as is)
    shared_before: CPUSet
    shared_after: CPUSet
    reason: str

    @property
    def shared_changed(self) -> bool:
        return self.shared_before != self.shared_after


class StaticPolicy:
    name = POLICY_NAME

    def __init__(self, topology: Topology, reserved: CPUSet, options: Iterable[str] = ()) -> None:
        self.topology = topology
        self.allocator = Allocator(topology, options)
        self.options = self.allocator.options
        self.strict = STRICT_CPU_RESERVATION in self.options
        if not reserved:
            raise PolicyError(
                "no reserved CPUs: set reserved_cpus (a list) or reserved_cpu_count (at least 1)"
            )
        unknown = reserved - topology.online
        if unknown:
            raise PolicyError(f"reserved CPUs {unknown} are not online (online: {topology.online})")
        self.reserved = reserved
        # CPUs any shared container may run on, before exclusive assignments are removed.
        base = topology.online - topology.isolated
        self._shareable = base - reserved if self.strict else base
        # CPUs that may be handed out exclusively (isolated ones only on request).
        self._assignable = base - reserved
        if not self._shareable:
            raise PolicyError(
                f"no CPU left for the shared pool: online {topology.online}, reserved {reserved}, "
                f"isolated {topology.isolated}"
                + (f" and {STRICT_CPU_RESERVATION} is on" if self.strict else "")
            )

    @classmethod
    def from_config(
        cls,
        topology: Topology,
        reserved_cpus: CPUSet | None = None,
        reserved_count: int | None = None,
        options: Iterable[str] = (),
    ) -> StaticPolicy:
        """Reserved CPUs as an explicit list (wins) or a count taken as kubelet takes it."""
        if reserved_cpus is None:
            if reserved_count is None:
                raise PolicyError("set reserved_cpus (a list) or reserved_cpu_count")
            try:
                reserved_cpus = reserve_by_count(topology, reserved_count)
            except AllocationError as err:
                raise PolicyError(str(err)) from None
        return cls(topology, reserved_cpus, options)

    # --- pools ------------------------------------------------------------------------------

    def empty_state(self) -> NodeState:
        return NodeState(
            policy=self.name,
            fingerprint=self.topology.fingerprint(),
            reserved=self.reserved,
            shared=self._shareable,
        )

    def shared_pool(self, exclusive: CPUSet) -> CPUSet:
        return self._shareable - exclusive

    def free_exclusive(self, state: NodeState, isolated: bool = False) -> CPUSet:
        """CPUs that a new exclusive assignment may take."""
        pool = self.topology.isolated if isolated else self._assignable
        return pool - state.exclusive

    def check(self, state: NodeState) -> str | None:
        """Why a loaded state cannot serve this policy on this machine, or None if it can."""
        for cid, assignment in state.assignments.items():
            stray = assignment.cpus - (self._assignable | self.topology.isolated)
            if stray:
                return f"container {cid} holds CPUs {stray} that are no longer assignable"
        if not self.shared_pool(state.exclusive):
            return "the assignments leave the shared pool empty"
        return None

    def normalized(self, state: NodeState) -> NodeState:
        """The same assignments with the shared pool recomputed for the current options."""
        return state.evolve(shared=self.shared_pool(state.exclusive))

    # --- decisions --------------------------------------------------------------------------

    def admit(self, state: NodeState, workload: Workload) -> tuple[Decision, NodeState]:
        """Decide a new container's cpuset; raise PolicyError when its request cannot be met."""
        before = self.shared_pool(state.exclusive)
        held = state.assignments.get(workload.container_id)
        if held is not None:  # a repeated event: answer as before
            decision = self._exclusive(
                workload.container_id, held.cpus, before, before, "already assigned"
            )
            return decision, state
        state = self._supersede(state, workload)
        shared = self.shared_pool(state.exclusive)
        count, why, isolated = self.eligibility(workload)
        state = _track_cgroup(state, workload)
        if count is None:
            state = state.evolve(sharing={**state.sharing, workload.container_id: workload.pod_uid})
            decision = Decision(workload.container_id, False, shared, CPUSet(), before, shared, why)
            return decision, state
        cpus, how = self._choose(state, workload, count, isolated)
        if not self.shared_pool(state.exclusive | cpus):
            raise PolicyError(
                f"{_describe(workload)} asks for {count} exclusive CPUs: granting {cpus} would "
                f"leave the shared pool empty (shared now: {shared}); lower the request or "
                "reserve fewer CPUs"
            )
        new_state = self._assign(state, workload, cpus)
        decision = self._exclusive(
            workload.container_id, cpus, before, new_state.shared, f"{why}; {how}"
        )
        return decision, new_state

    def _assign(self, state: NodeState, workload: Workload, cpus: CPUSet) -> NodeState:
        assignment = Assignment(
            container_id=workload.container_id,
            cpus=cpus,
            pod_uid=workload.pod_uid,
            container_name=workload.container_name,
            pod_name=workload.pod_name,
            pod_namespace=workload.pod_namespace,
            kind=workload.kind,
        )
        sharing = {k: v for k, v in state.sharing.items() if k != workload.container_id}
        new_state = state.evolve(
            assignments={**state.assignments, workload.container_id: assignment}, sharing=sharing
        )
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
        count, _, isolated = self.eligibility(workload)
        if count is None or len(cpus) != count or not cpus <= self.free_exclusive(state, isolated):
            return None
        return self._assign(state, workload, cpus)

    def eligibility(self, workload: Workload) -> tuple[int | None, str, bool]:
        """(exclusive CPU count or None, why, from isolated CPUs?)."""
        opt_out = _annotation_flag(workload, EXCLUSIVE_ANNOTATION)
        wants_isolated = _annotation_flag(workload, ISOLATED_ANNOTATION) is True
        if workload.qos != GUARANTEED:
            return None, f"{workload.qos} QoS shares", False
        count = workload.integer_cpus
        if count is None:
            return (
                None,
                f"guaranteed with {workload.cpu_request_milli}m (not whole CPUs) shares",
                False,
            )
        if opt_out is False:
            return None, f"opted out by {EXCLUSIVE_ANNOTATION}", False
        return count, f"guaranteed with {count} whole CPUs", wants_isolated

    def _choose(
        self, state: NodeState, workload: Workload, count: int, isolated: bool
    ) -> tuple[CPUSet, str]:
        free = self.free_exclusive(state, isolated)
        previous = state.released.get((workload.pod_uid, workload.container_name))
        if previous is not None and len(previous.cpus) == count and previous.cpus <= free:
            return previous.cpus, "restarted container got its previous CPUs back"
        reusable = free & CPUSet().union(
            *(
                r.cpus
                for (uid, _), r in state.released.items()
                if uid == workload.pod_uid and r.kind == "init"
            )
        )
        try:
            if workload.kind != "init" and len(reusable) >= count:
                return self.allocator.allocate(
                    reusable, count
                ), "reused finished init containers' CPUs"
            return self.allocator.allocate(free, count), "allocated by topology"
        except AllocationError as err:
            pool = "isolated CPUs" if isolated else "CPUs"
            raise PolicyError(
                f"{_describe(workload)} asks for {count} exclusive {pool}; free for exclusive use: "
                f"{free or 'none'} ({len(free)}): {err}"
            ) from None

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
        new_state = state.evolve(
            assignments=assignments, released=released, sharing=sharing, cgroups=cgroups
        )
        return new_state.evolve(shared=self.shared_pool(new_state.exclusive))

    def _exclusive(
        self, cid: str, cpus: CPUSet, before: CPUSet, after: CPUSet, reason: str
    ) -> Decision:
        return Decision(cid, True, cpus, self.topology.numa_of(cpus), before, after, reason)


def _without(mapping: Mapping[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in mapping.items() if k != key}


def _track_cgroup(state: NodeState, workload: Workload) -> NodeState:
    if not workload.cgroup_path:
        return state
    return state.evolve(cgroups={**state.cgroups, workload.container_id: workload.cgroup_path})


def _describe(workload: Workload) -> str:
    pod = f"{workload.pod_namespace}/{workload.pod_name}" if workload.pod_name else workload.pod_uid
    return f"container {workload.container_name!r} of pod {pod}"


def _annotation_flag(workload: Workload, key: str) -> bool | None:
    """The container-specific value wins over the pod-wide one; anything but true/false is an
    error the pod author must see rather than a silent guess."""
    annotations: Mapping[str, str] = workload.annotations
    for name in (f"{key}/container.{workload.container_name}", key):
        if name in annotations:
            value = annotations[name].strip().lower()
            if value in ("true", "false"):
                return value == "true"
            raise PolicyError(
                f"annotation {name}={annotations[name]!r} on {_describe(workload)}: "
                "expected 'true' or 'false'"
            )
    return None
