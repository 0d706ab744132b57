"""Earmarks in the daemon: which pods get CPUs set aside when their sandbox starts, and the
answer a creation that takes them all can be given before anything is decided.

A Guaranteed pod's sandbox carries its CPU limit (kubelet sends the sum over its containers,
NRI passes it on as ``pod_resources``).  Its whole CPUs are earmarked then (policy.earmark),
and the shared containers move off them while the pod starts - so the creation of its
exclusive container moves nobody, however many containers the node runs
(docs/architecture.md, "Earmarks").
"""

from __future__ import annotations

from ..core import annotation
from ..core.cpuset import CPUSet
from ..core.engine import Engine
from ..core.state import NodeState
from ..core.workload import (
    GUARANTEED,
    millicores_from_quota,
    millicores_from_shares,
    qos_from_cgroup_parent,
)
from ..nri.pb import nri_pb2 as pb
from .targets import fill_cpu


def pod_cpu_limit(pod: pb.PodSandbox) -> int:
    """The CPU limit of a Guaranteed pod with at least one whole CPU, in millicores, as sent
    for its sandbox; 0 when nothing is to be earmarked for it."""
    linux = pod.linux
    if not linux.cgroup_parent or qos_from_cgroup_parent(linux.cgroup_parent) != GUARANTEED:
        return 0
    cpu = linux.pod_resources.cpu
    limit = millicores_from_quota(
        cpu.quota.value if cpu.HasField("quota") else None,
        cpu.period.value if cpu.HasField("period") else None,
    )
    if limit is None and cpu.HasField("shares"):
        limit = millicores_from_shares(cpu.shares.value)  # kubelet without CFS quota
    return limit if limit and limit >= 1000 else 0


def early_answer(
    engine: Engine,
    state: NodeState,
    pod: pb.PodSandbox,
    container: pb.Container,
    unknown: CPUSet,
) -> pb.ContainerAdjustment | None:
    """The answer for a container that asks for exactly the CPUs earmarked for its pod (a
    whole-CPU request equal to its limit), known before anything is read or locked.  None
    whenever the decision might say anything else: another size, our annotations, a restart
    (its previous CPUs come first), or earmarked CPUs among ``unknown`` ones (returned by a
    hotplug, or pinned by containers the state does not name).  The decision that follows can
    still differ (NIC locality): the caller compares."""
    mark = state.earmarks.get(pod.uid)
    cid = container.id
    if (
        mark is None
        or mark.sandbox_id != pod.id
        or mark.cpus & unknown
        or cid in state.assignments
        or cid in state.sharing
    ):
        return None
    cpu = container.linux.resources.cpu
    if not (cpu.HasField("shares") and cpu.HasField("quota") and cpu.HasField("period")):
        return None
    request = millicores_from_shares(cpu.shares.value)
    limit = millicores_from_quota(cpu.quota.value, cpu.period.value)
    if request != limit or request != 1000 * len(mark.cpus):
        return None
    name = container.name or container.labels.get("io.kubernetes.container.name", "")
    if annotation.read(pod.annotations, name) or annotation.read(container.annotations, name):
        return None
    # A name created in this pod before (it claimed), or remembered from an earlier sandbox
    # of the pod: a restart, whose previous CPUs come first.
    if name in mark.claimants or (pod.uid, name) in state.released:
        return None
    adjust = pb.ContainerAdjustment()
    fill_cpu(adjust.linux.resources.cpu, engine.exclusive_target(cid, mark.cpus))
    return adjust
