"""What the daemon's node is told: one value per thing that happened, free of protobuf.

The NRI adapter (daemon/adapter.py) makes these from the runtime's messages; the daemon's own
sources (CPU hotplug, the sweep of containers known only from the state file) make the rest;
the deadline (daemon/deadline.py) makes the events that undo or owe what a request answered
without its decision did late.  The node (daemon/node.py) turns each into effects.
"""

from __future__ import annotations

from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.outcome import Target
from ..core.state import NodeState
from ..core.workload import Workload
from ..hardware.hotplug import CPUEvent


class Pod(Value):
    """A pod sandbox as the runtime names it."""

    uid: str
    sandbox_id: str
    name: str = ""
    namespace: str = ""
    cgroup_parent: str = ""  # a path (cgroupfs driver) or a slice name (systemd driver)

    def describe(self) -> str:
        return f"pod {self.namespace}/{self.name}"


class Stored(Value):
    """What the runtime's stored spec of a container says of its CPUs (what a reply last
    carried, or what it was created with)."""

    cpus: CPUSet
    mems: str = ""
    quota: int | None = None

    def agrees(self, target: Target) -> bool:
        """Whether applying the spec again would leave the container on ``target``."""
        if self.cpus != target.cpus:
            return False
        if target.mems is not None and self.mems != str(target.mems):
            return False
        return target.quota is None or self.quota == target.quota


class Live(Value):
    """A container the runtime lists as live."""

    workload: Workload
    sandbox_id: str
    stored: Stored


# --- the runtime's events ------------------------------------------------------------------------


class Configure(Value):
    """The runtime's configuration string for the plugin (TOML; may be empty)."""

    config: str


class Synchronize(Value):
    pods: tuple[Pod, ...]
    live: tuple[Live, ...]


class CreateContainer(Value):
    workload: Workload
    pod: Pod
    netns: str | None = None  # the pod's network namespace (None: the host's)
    # Set when the request was answered already with the CPUs earmarked for the pod
    # (Deadline answers an idle worker's creation so): the decision compares with it.
    answered: Target | None = None


class StartContainer(Value):
    workload: Workload
    pod: Pod
    stored: Stored
    netns: str | None = None  # as for CreateContainer: pinning at start decides here
    # Set by the deadline when the request comes: whether it was the container's decision
    # then (pinning at start, not placed yet) - by the time its budget runs out, the node
    # may hold the decision already, and the fallback must still be an error.
    decides: bool = False


class UpdateContainer(Value):
    workload: Workload  # with the requested resources
    resize: bool  # a new CPU request (kubelet's in-place resize); else the cpuset is kept


class UpdatedContainer(Value):
    """PostUpdateContainer: the runtime has applied an update (ours among it)."""

    workload: Workload
    stored: Stored


class StopContainer(Value):
    workload: Workload


class RemoveContainer(Value):
    workload: Workload


class RunPodSandbox(Value):
    pod: Pod
    earmark_milli: int  # the CPU limit to earmark whole CPUs for (0: none)


class RemovePodSandbox(Value):
    pod: Pod


class UpdatePodSandbox(Value):
    pod: Pod
    request_milli: int | None
    limit_milli: int | None


# --- the daemon's own ----------------------------------------------------------------------------


class CPUsChanged(Value):
    """Kernel uevents: CPUs went offline or came online."""

    events: tuple[CPUEvent, ...]


class SweepRound(Value):
    """Check a few containers known only from the state file (daemon/unverified.py)."""


class RecheckEvictions(Value):
    """cgroup v1 evicts tasks of a cpuset left without CPUs from a workqueue, possibly after
    it was repaired: look again."""

    container_ids: tuple[str, ...]


class Disconnected(Value):
    """The runtime's connection ended: its next one lists its containers again."""


class IrqRescan(Value):
    """Look at the interrupts again (new ones, ones irqbalance moved) while CPUs are kept free
    of them."""


class FinishHandOver(Value):
    """Finish the hand-over of systemd units left unconfirmed (calls pending, or lost with a
    connection systemd closed): daemon/units.py, ``finish``."""


class CommitHeld(Value):
    """Commit the state held in memory, if the file lags behind it (before the daemon exits)."""


# --- late work: a request answered without its decision ------------------------------------------


class Release(Value):
    """Take back what was decided for a container the runtime is not creating after all (its
    request was answered with an error)."""

    container_id: str
    cause: str


class Restore(Value):
    """Take back a resize answered with an error: the state before it, unless other work was
    committed since (``after`` is no longer the state)."""

    container_id: str
    before: NodeState
    after: NodeState


class Owe(Value):
    """Targets a reply would have carried, owed to the runtime's next reply instead."""

    container_ids: tuple[str, ...]
