"""What the node does for the runtime's pod events and its list of what runs: Synchronize
(the state made to match, what the runtime's stored specs lack carried in the reply), a pod
started (its whole CPUs earmarked, daemon/earmarks.py), removed, or resized.  Functions of the
node (daemon/node.py), which owns everything they change."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.cpuset import CPUSet
from ..core.outcome import Target
from ..core.reconcile import LiveContainer
from ..core.state import Earmark
from ..ops import audit as audit_mod
from . import events as ev
from . import upkeep
from .effects import NO_EFFECTS, Deliver, Effects, keep

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .node import Node


def synchronize(node: Node, event: ev.Synchronize, deliver: Deliver = keep) -> Effects:
    live = [LiveContainer(c.workload, c.stored.cpus) for c in event.live]
    stored = {c.workload.container_id: c for c in event.live}
    with node.file.locked():
        outcome = node.commit(
            node.engine.synchronize(node.state, live, [pod.uid for pod in event.pods])
        )
    node.unverified.clear()
    node.runtime_lists = True
    node.writer.keep_only(set(stored))
    node.pod_nics.keep_only(pod.sandbox_id for pod in event.pods)
    node.sandboxes = {c.workload.pod_uid: c.sandbox_id for c in event.live}
    node.unrelayed_pods = {
        pod.uid: pod.cgroup_parent
        for pod in event.pods
        if pod.uid in node.state.earmarks and pod.cgroup_parent
    }
    upkeep.start_sweep(node)
    _warn_unserved_driver(node, [c.workload.cgroup_path for c in event.live])
    owed = set(node.owed.drain())  # carried by this reply (below)
    node.pinned = CPUSet()  # the runtime's own list replaces what the cgroups suggested
    node.audit.emit(outcome.events)
    node.audit.record(
        "synchronize",
        f"synchronized {len(live)} live containers: {len(node.state.assignments)} exclusive, "
        f"shared pool {node.state.shared}",
        shared_cpus=node.state.shared,
    )
    if node.cgroups_stale:
        # The CPUs changed while nothing ran: on cgroup v1 the runtime could not apply
        # these updates (ancestors lack the returning CPUs), so write them first.
        node.cgroups_stale = False
        upkeep.repair_cgroups(node, [c.workload.container_id for c in live], None)
    # The reply carries only what the runtime's stored specs do not say already (each
    # update costs the runtime one `runc update`, run one after another): on a dense node,
    # the shared containers moved by direct writes while they ran.  The others are written
    # directly where they can be, in case a crash came between a commit and our writes;
    # where they cannot, the runtime applied that spec itself - unless it is owed.
    lagging: list[Target] = []
    agreeing: list[Target] = []
    for target in outcome.targets:
        cid = target.container_id
        agrees = cid not in owed and stored[cid].stored.agrees(target)
        (agreeing if agrees else lagging).append(target)
    node.routes.write(agreeing, node.state)
    return Effects(updates=tuple(node.routes.for_reply(lagging, node.state)))


def _warn_unserved_driver(node: Node, paths: Iterable[str]) -> None:
    """Pinning at start writes each container's cgroup itself: on a node whose containers
    this daemon cannot write, every start would be refused - said once per connection,
    before the first refusal."""
    if node.settings.nri_pin_at != "start":
        return
    unserved = [path for path in paths if not node.writer.can_write(path)]
    if unserved:
        node.audit.record(
            "config",
            f'[nri] pin_at = "start" writes each container\'s cgroup, but '
            f"{len(unserved)} of the runtime's containers have cgroups it cannot write "
            f"(like {unserved[0]!r}): new containers like them will be refused at their "
            'start; set pin_at = "create" (the default)',
            audit_mod.ERR,
            reason="pin_at start cannot write",
        )


def run_pod(node: Node, event: ev.RunPodSandbox, deliver: Deliver = keep) -> Effects:
    """A Guaranteed pod started: CPUs set aside for its exclusive containers, and the
    shared containers moved off them now, so the creation of an exclusive container that
    takes them moves nobody (docs/architecture.md, "Earmarks")."""
    pod = event.pod
    wanted = Earmark(
        CPUSet(), pod.sandbox_id, event.earmark_milli, pod_name=pod.name,
        pod_namespace=pod.namespace,
    )  # fmt: skip
    with node.file.locked():
        outcome = node.commit(node.engine.earmark(node.state, pod.uid, wanted, node.pinned))
    if outcome.events:
        node.sandboxes[pod.uid] = pod.sandbox_id
    node.audit.emit(outcome.events)
    node.routes.push(outcome.targets, node.state, "pod earmarked")
    return NO_EFFECTS


def remove_pod(node: Node, event: ev.RemovePodSandbox, deliver: Deliver = keep) -> Effects:
    pod = event.pod
    node.pod_nics.forget(pod.sandbox_id)
    node.unrelayed_pods.pop(pod.uid, None)
    if node.sandboxes.setdefault(pod.uid, pod.sandbox_id) != pod.sandbox_id:
        node.audit.record(
            "reconcile",
            f"an earlier sandbox {pod.sandbox_id[:12]} of {pod.describe()} was removed: "
            "the containers of its newer sandbox keep what they hold",
            audit_mod.INFO,
            reason="earlier sandbox removed",
        )
        return NO_EFFECTS
    del node.sandboxes[pod.uid]
    with node.file.locked():
        outcome = node.commit(node.engine.remove_pod(node.state, pod.uid))
    node.audit.emit(outcome.events)
    node.routes.push(outcome.targets, node.state, "pod removed")
    return NO_EFFECTS


def update_pod(node: Node, event: ev.UpdatePodSandbox, deliver: Deliver = keep) -> Effects:
    """A pod's pod-level resources changed (NRI >= 0.10, kubelet's in-place resize of a
    pod with pod-level resources).  The reply cannot carry updates, and kubelet updates
    each resized container next (UpdateContainer, where we keep our cpusets): here the
    pod's containers get their cpusets (and quotas) again, written directly, so nothing
    the resize did to their cgroups is left in force."""
    pod = event.pod
    cids = _containers_of(node, pod.uid)
    targets = [t for cid in cids for t in node.engine.update(node.state, cid).targets]
    request, limit = event.request_milli, event.limit_milli
    exclusive = [cid for cid in cids if cid in node.state.assignments]
    node.audit.record(
        "pod-update",
        f"{pod.describe()} resized (CPU request "
        f"{'-' if request is None else f'{request}m'}, limit "
        f"{'none' if limit is None else f'{limit}m'}): cpusets of its {len(targets)} "
        f"containers kept ({len(exclusive)} exclusive)",
        pod_namespace=pod.namespace,
        pod_name=pod.name,
        pod_uid=pod.uid,
        cpu_request_milli=request,
        cpu_limit_milli=limit,
        containers=len(targets),
    )
    node.routes.push(targets, node.state, "pod resized")
    return NO_EFFECTS


def _containers_of(node: Node, pod_uid: str) -> list[str]:
    """The containers we track for a pod: exclusive ones and those in the shared pool."""
    state = node.state
    if not pod_uid:
        return []
    held = [cid for cid, a in state.assignments.items() if a.pod_uid == pod_uid]
    sharing = [cid for cid, uid in state.sharing.items() if uid == pod_uid]
    return sorted({*held, *sharing})
