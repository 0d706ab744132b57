"""The answer a creation that takes all of its pod's earmark can be given before anything is
decided.

A Guaranteed pod's sandbox carries its CPU limit (kubelet sends the sum over its containers,
NRI passes it on as ``pod_resources``).  Its whole CPUs are earmarked then (policy.earmark),
and the shared containers move off them while the pod starts - so the creation of its
exclusive container moves nobody, however many containers the node runs
(docs/architecture.md, "Earmarks").
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..core.engine import Engine
from ..core.outcome import Target
from ..core.state import NodeState
from ..core.workload import Workload


def early_answer(
    engine: Engine, state: NodeState, workload: Workload, sandbox_id: str, unknown: CPUSet
) -> Target | None:
    """The target of a container that asks for exactly the CPUs earmarked for its pod (a
    whole-CPU request equal to its limit), known before anything is read or locked.  None
    whenever the decision might say anything else: another size, our annotations, a restart
    (its previous CPUs come first), or earmarked CPUs among ``unknown`` ones (returned by a
    hotplug, or pinned by containers the state does not name).  The decision that follows can
    still differ (NIC locality): the caller compares."""
    mark = state.earmarks.get(workload.pod_uid)
    cid = workload.container_id
    if (
        mark is None
        or mark.sandbox_id != sandbox_id
        or mark.cpus & unknown
        or cid in state.assignments
        or cid in state.sharing
    ):
        return None
    wanted = 1000 * len(mark.cpus)
    if workload.cpu_request_milli != wanted or workload.cpu_limit_milli != wanted:
        return None
    if workload.annotations:
        return None
    # A name created in this pod before (it claimed), or remembered from an earlier sandbox
    # of the pod: a restart, whose previous CPUs come first.
    name = workload.container_name
    if name in mark.claimants or (workload.pod_uid, name) in state.released:
        return None
    return engine.exclusive_target(cid, mark.cpus)
