"""What the engine answers (engine.py): an ``Outcome`` - the new state, the decision for a
created container, a ``Target`` for every container whose cgroup must change, and the audit
events that explain it - and ``Loaded``, the stored state made usable.  Plain values, shared by
both front ends and by what applies them (hardware/cpusets.py, hook/apply.py, daemon/).
"""

from __future__ import annotations

from ..base.value import Value
from .cpuset import CPUSet
from .events import AuditEvent
from .policy import Decision
from .state import NodeState

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from .follow import Followed

CFS_PERIOD_US = 100_000  # kubelet's CFS period: a degraded container's quota is count * this
UNLIMITED = -1  # a CFS quota of -1 lifts the limit


class Target(Value):
    """What one container's cgroup must say."""

    container_id: str
    cpus: CPUSet
    mems: CPUSet | None = None  # NUMA nodes of exclusive CPUs; None: left as it is
    quota: int | None = None  # CFS quota (us per CFS_PERIOD_US); UNLIMITED; None: left alone
    exclusive: bool = False
    # Held exclusive CPUs until now: its memory nodes (``mems``, the NUMA nodes of those CPUs)
    # go back to its parent cgroup's, which are what a shared container is created with.
    mems_from_parent: bool = False


def in_pool(cid: str, shared: CPUSet) -> Target:
    """``Target(cid, shared)``, built without the generic constructor's checks: a creation on
    a dense node makes one per shared container (about a third of its decision at 100)."""
    target = object.__new__(Target)
    target.__dict__.update(Target._defaults, container_id=cid, cpus=shared)
    return target


class Outcome(Value):
    state: NodeState
    decision: Decision | None = None
    targets: tuple[Target, ...] = ()
    events: tuple[AuditEvent, ...] = ()

    def then(self, later: Outcome) -> Outcome:
        """This outcome followed by ``later`` (computed on this one's state): later targets win."""
        targets = {t.container_id: t for t in self.targets}
        targets.update((t.container_id, t) for t in later.targets)
        return Outcome(
            later.state,
            later.decision or self.decision,
            tuple(targets.values()),
            self.events + later.events,
        )


class Loaded(Value):
    """The stored state made usable: followed to the online CPUs, checked, normalised."""

    state: NodeState
    trusted: bool  # the stored state was used (False: an empty state to rebuild on)
    set_aside: bool  # the stored file must be moved aside: this policy cannot honour it
    followed: Followed | None  # the online CPUs changed since it was committed
    events: tuple[AuditEvent, ...]
