"""Where an eligible container's exclusive CPUs come from: its sources in order of preference,
narrowed to its NICs' NUMA nodes when it has any, and the first that has room.

NIC locality (hardware/nic.py finds the NUMA nodes of a pod's network interfaces) is a
preference among the CPUs a container is entitled to: its exclusive CPUs come from those nodes
whenever they have enough free CPUs.  "Strict" (asked by annotation) turns the preference into a
condition.  Which CPUs are free is the policy's to say (policy.py); this module only chooses.
"""

from __future__ import annotations

from ..base.value import Value
from .allocator import AllocationError, Allocator
from .cpuset import CPUSet
from .eligibility import describe
from .errors import PolicyError
from .state import NodeState
from .workload import Workload

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    # Where a container's CPUs may come from: (exact: this set or nothing, CPUs, why).
    Source = tuple[bool, CPUSet, str]


class NICPreference(Value):
    """Where a container's network interfaces are attached (built by hardware/nic.py)."""

    nodes: CPUSet  # NUMA nodes of the NICs; empty means no preference
    strict: bool = False  # fail the creation rather than place the CPUs elsewhere
    nics: tuple[str, ...] = ()  # one description per NIC, for the audit trail and status


def choose(
    allocator: Allocator,
    state: NodeState,
    workload: Workload,
    count: int,
    isolated: bool,
    free: CPUSet,
    unavailable: CPUSet,
    nic: NICPreference | None = None,
    near: CPUSet | None = None,
) -> tuple[CPUSet, str]:
    """``count`` CPUs for an eligible container and why these: the first of its sources
    (``sources``) that has room, near its NICs (``near``: their nodes' CPUs) when it has any.
    ``free``: what a new exclusive assignment may take, ``unavailable`` already left out."""
    free, options = sources(state, workload, count, isolated, free, unavailable)
    nearby = (nic, near) if nic is not None and nic.nodes and near is not None else None
    if nearby is not None:
        options = near_nics(options, *nearby)
    chosen, last_error = first_fit(allocator, options, free, count)
    if chosen is not None:
        return chosen
    if nearby is not None and nearby[0].strict:
        raise no_room_near_nics(workload, count, isolated, free, *nearby)
    pool = "isolated CPUs" if isolated else "CPUs"
    reason = last_error or f"cannot allocate {count} CPUs: only {len(free)} available"
    raise PolicyError(
        f"{describe(workload)} asks for {count} exclusive {pool}; free for exclusive use: "
        f"{free or 'none'} ({len(free)}): {reason}"
    )


def first_fit(
    allocator: Allocator, options: list[Source], free: CPUSet, count: int
) -> tuple[tuple[CPUSet, str] | None, AllocationError | None]:
    """The CPUs of the first source with room and why; else None and the last
    allocator error."""
    last_error: AllocationError | None = None
    for exact, cpus, why in options:
        if exact:
            if cpus <= free:
                return (cpus, why), None
            continue
        if len(cpus) < count and cpus is not free:
            continue  # too small to try; the whole free pool is always tried (its error)
        try:
            return (allocator.allocate(cpus, count), why), None
        except AllocationError as err:
            last_error = err
    return None, last_error


def sources(
    state: NodeState,
    workload: Workload,
    count: int,
    isolated: bool,
    free: CPUSet,
    unavailable: CPUSet,
) -> tuple[CPUSet, list[Source]]:
    """The free CPUs, and where a container's CPUs come from in order of preference: its
    previous CPUs (a restart), its pod's earmark, its pod's finished init containers'
    CPUs, then any free CPUs.  A source is (exact: the set itself or nothing, CPUs, why)."""
    mark = state.earmarks.get(workload.pod_uid)
    marked = mark.cpus - unavailable if mark is not None and not isolated else CPUSet()
    free |= marked  # the pod's own
    previous = state.released.get((workload.pod_uid, workload.container_name))
    reusable = free & CPUSet().union(
        *(
            r.cpus
            for (uid, _), r in state.released.items()
            if uid == workload.pod_uid and r.kind == "init"
        )
    )
    options: list[Source] = []
    if previous is not None and len(previous.cpus) == count:
        options.append((True, previous.cpus, "restarted container got its previous CPUs back"))
    if len(marked) >= count:
        options.append((False, marked, "earmarked for its pod when the pod started"))
    if workload.kind != "init":
        options.append((False, reusable, "reused finished init containers' CPUs"))
    options.append((False, free, "allocated by topology"))
    return free, options


def near_nics(options: list[Source], nic: NICPreference, near: CPUSet) -> list[Source]:
    """The sources narrowed to the NICs' NUMA nodes (``near``: their CPUs): instead of the
    others when locality is strict, before them otherwise."""
    where = f"next to its NICs on NUMA {nic.nodes}"
    local = [
        (exact, cpus if exact else cpus & near, f"{why}, {where}")
        for exact, cpus, why in options
        if not exact or cpus <= near
    ]
    return local if nic.strict else local + options


def no_room_near_nics(
    workload: Workload,
    count: int,
    isolated: bool,
    free: CPUSet,
    nic: NICPreference,
    near: CPUSet,
) -> PolicyError:
    pool = "isolated CPUs" if isolated else "CPUs"
    near_free = free & near
    return PolicyError(
        f"{describe(workload)} asks for {count} exclusive {pool} on NUMA {nic.nodes}, "
        f"where its NICs are ({'; '.join(nic.nics) or 'named by annotation'}), and NIC "
        f"locality is strict: free there: {near_free or 'none'} ({len(near_free)}); free "
        f"elsewhere: {(free - near_free) or 'none'}; relax the locality annotation or "
        "free CPUs on that node"
    )
