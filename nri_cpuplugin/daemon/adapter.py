"""The NRI adapter: the handlers nri.stub.Stub calls, and the one place in the daemon that
touches protobuf.  Each runtime message becomes an event (daemon/events.py), handled within
its budget (daemon/deadline.py); the node's effects (daemon/effects.py) become the reply.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ..core.cpuset import CPUSet
from ..core.outcome import CFS_PERIOD_US, UNLIMITED, Target
from ..core.policy import PolicyError
from ..core.workload import (
    GUARANTEED,
    from_nri,
    millicores_from_quota,
    millicores_from_shares,
    qos_from_cgroup_parent,
)
from ..hardware import nic
from ..hardware.nic_guard import netns_path
from ..nri.handlers import EVENT_BITS
from ..nri.pb import nri_pb2 as pb
from . import events as ev
from .deadline import Deadline
from .effects import Effects
from .node import Node
from .pod_nics import PodNICs

LIVE_STATES = (1, 2, 3)  # CONTAINER_CREATED, CONTAINER_PAUSED, CONTAINER_RUNNING


class Lifecycle(Protocol):
    """What the daemon does as the runtime connects and goes (daemon/service.py)."""

    async def connected(self, runtime: str, version: str) -> None: ...

    def disconnected(self) -> None: ...


class NRIAdapter:
    def __init__(
        self, deadline: Deadline, node: Node, pod_nics: PodNICs, lifecycle: Lifecycle
    ) -> None:
        self.deadline = deadline
        self.node = node
        self.pod_nics = pod_nics
        self.lifecycle = lifecycle
        self.stub: object = None  # set by whoever runs the stub

    # --- the connection ---------------------------------------------------------------------------

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> int | None:
        await self.deadline.configure(ev.Configure(config))
        await self.lifecycle.connected(runtime_name, runtime_version)
        settings = self.node.settings
        unwanted = 0
        if not (settings.nic_read_ahead or settings.earmark_pods):
            # Without the read-ahead and earmarks, RunPodSandbox would only cost each pod a
            # round trip.
            unwanted |= EVENT_BITS["run_pod_sandbox"]
        if settings.nri_pin_at == "start":
            # Decided at StartContainer: any consultation at creation costs the runtime's
            # CreateContainer its own NRI round trip (docs/architecture.md, "Pinning at start").
            unwanted |= EVENT_BITS["create_container"]
        handled: int | None = getattr(self.stub, "handled_events", None)
        if not unwanted or handled is None:
            return None  # every handler's event
        return handled & ~unwanted

    async def synchronize(
        self, pods: Iterable[pb.PodSandbox], containers: Iterable[pb.Container]
    ) -> list[pb.ContainerUpdate]:
        pods = list(pods)
        by_id = {pod.id: pod for pod in pods}
        live = tuple(
            ev.Live(from_nri(by_id[c.pod_sandbox_id], c), c.pod_sandbox_id, stored(c))
            for c in containers
            if c.pod_sandbox_id in by_id and c.state in LIVE_STATES
        )
        effects = await self.deadline.handle(ev.Synchronize(tuple(map(pod_of, pods)), live))
        return updates_of(effects)

    def connection_lost(self) -> None:
        self.lifecycle.disconnected()

    # --- containers -------------------------------------------------------------------------------

    async def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        event = ev.CreateContainer(from_nri(pod, container), pod_of(pod), netns_of(pod))
        effects = await self.deadline.handle(event)
        adjust = pb.ContainerAdjustment()
        if effects.own is not None:
            fill_cpu(adjust.linux.resources.cpu, effects.own, created=True)
        return adjust, updates_of(effects)

    async def start_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        event = ev.StartContainer(
            from_nri(pod, container), pod_of(pod), stored(container), netns_of(pod)
        )
        await self.deadline.handle(event)

    async def update_container(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        updated = pb.Container()
        updated.CopyFrom(container)
        updated.linux.resources.CopyFrom(resources)
        # No shares, or 0 (CRI's "leave as it is"): not a change of the CPU request.
        resize = bool(resources.cpu.shares.value)
        effects = await self.deadline.handle(ev.UpdateContainer(from_nri(pod, updated), resize))
        updates = updates_of(effects)
        if effects.own is not None:
            # Last, and a failure fails the update: it is the container the CRI call is about.
            updates.append(update_of(effects.own, ignore_failure=False))
        return updates

    async def post_update_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        event = ev.UpdatedContainer(from_nri(pod, container), stored(container))
        await self.deadline.handle(event)

    async def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        effects = await self.deadline.handle(ev.StopContainer(from_nri(pod, container)))
        return updates_of(effects)

    async def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        await self.deadline.handle(ev.RemoveContainer(from_nri(pod, container)))

    # --- pods -------------------------------------------------------------------------------------

    async def run_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        """A pod started, its network set up: a Guaranteed pod's interfaces are read now, in the
        background, for its containers' NIC locality (daemon/pod_nics.py), and its whole CPUs
        are earmarked for its exclusive containers."""
        settings = self.node.settings
        if settings.nic_read_ahead:
            self._read_nics_ahead(pod)
        limit = pod_cpu_limit(pod) if settings.earmark_pods else 0
        if limit:
            await self.deadline.handle(ev.RunPodSandbox(pod_of(pod), limit))

    def _read_nics_ahead(self, pod: pb.PodSandbox) -> None:
        """Only starts the read (on the event loop): a Guaranteed pod in a network namespace of
        its own may hold exclusive containers, which ones its creations say."""
        netns = netns_of(pod)
        parent = pod.linux.cgroup_parent
        if netns is None or not parent or qos_from_cgroup_parent(parent) != GUARANTEED:
            return
        try:
            if nic.request(pod.annotations, "").mode == "off":  # pod-wide
                return
        except PolicyError:
            return  # its creations refuse the annotation, with the reason
        self.pod_nics.read_ahead(pod.id, netns)

    async def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        await self.deadline.handle(ev.RemovePodSandbox(pod_of(pod)))

    async def update_pod_sandbox(
        self, pod: pb.PodSandbox, overhead: pb.LinuxResources, resources: pb.LinuxResources
    ) -> None:
        cpu = resources.cpu
        request = millicores_from_shares(cpu.shares.value) if cpu.HasField("shares") else None
        quota = cpu.quota.value if cpu.HasField("quota") else None
        period = cpu.period.value if cpu.HasField("period") else None
        limit = millicores_from_quota(quota, period)
        await self.deadline.handle(ev.UpdatePodSandbox(pod_of(pod), request, limit))


# --- protobuf in --------------------------------------------------------------------------------


def pod_of(pod: pb.PodSandbox) -> ev.Pod:
    return ev.Pod(pod.uid, pod.id, pod.name, pod.namespace, pod.linux.cgroup_parent)


def netns_of(pod: pb.PodSandbox) -> str | None:
    return netns_path(pod.linux.namespaces)


def stored(container: pb.Container) -> ev.Stored:
    cpu = container.linux.resources.cpu
    quota = cpu.quota.value if cpu.HasField("quota") else None
    if quota == NO_QUOTA_AT_CREATE:
        quota = UNLIMITED  # the spec of a container created without a quota
    return ev.Stored(cpus_of(container), cpu.mems.strip(), quota)


def cpus_of(container: pb.Container) -> CPUSet:
    try:
        return CPUSet.parse(container.linux.resources.cpu.cpus)
    except ValueError:
        return CPUSet()


def pod_cpu_limit(pod: pb.PodSandbox) -> int:
    """The CPU limit of a Guaranteed pod with at least one whole CPU, in millicores, as sent
    for its sandbox (kubelet sends the sum over its containers; NRI passes it on as
    ``pod_resources``); 0 when nothing is to be earmarked for it."""
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


# --- protobuf out -------------------------------------------------------------------------------


# A cgroup the runtime creates has no CFS quota until one is written, and quota 0 is what
# every runtime reads as "write none" (kubelet sends it for containers without a CPU limit).
# -1 asks the runtime to lift a quota, which some cannot do right: crun before 1.22 on the
# systemd driver turns it into 1 ms per 100 ms (1 % of a CPU: the container's own start then
# takes seconds; containers/crun#1794), crun before 1.8.4 fails it on cgroup v1.  So a new
# container is told 0, a running one -1.
NO_QUOTA_AT_CREATE = 0


def fill_cpu(cpu: pb.LinuxCPU, target: Target, created: bool = False) -> None:
    """``target`` as the runtime's resources; ``created``: for a container not created yet."""
    cpu.cpus = str(target.cpus)
    if target.mems:
        cpu.mems = str(target.mems)
    if target.quota is not None:
        lifted = target.quota == UNLIMITED
        cpu.quota.value = NO_QUOTA_AT_CREATE if lifted and created else target.quota
        if not lifted:
            cpu.period.value = CFS_PERIOD_US


def update_of(target: Target, ignore_failure: bool = True) -> pb.ContainerUpdate:
    # ignore_failure: another container that exits at this very moment must not fail the
    # request this reply answers.
    update = pb.ContainerUpdate(container_id=target.container_id, ignore_failure=ignore_failure)
    fill_cpu(update.linux.resources.cpu, target)
    return update


def updates_of(effects: Effects) -> list[pb.ContainerUpdate]:
    return [update_of(target) for target in effects.updates]
