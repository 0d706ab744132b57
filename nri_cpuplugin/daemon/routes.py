"""Where each target goes: to the container's cgroup directly (the writer), into a reply (the
runtime applies it), or owed to the runtime's next reply that can carry it.

Each target the runtime applies costs it a ``runc update``, run one after another while other
pods wait; a direct write is one file write.  So whatever the writer can write, it writes, and
only the rest reaches a reply (docs/architecture.md, "Shared containers on dense nodes").
What changes outside any reply and cannot be written is owed (daemon/owed.py): never sent in
an unsolicited UpdateContainers, which deadlocks containerd before NRI 0.12.1
(docs/architecture.md, "Changes outside event replies").
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.engine import Engine
from ..core.outcome import Target
from ..core.state import NodeState
from ..hardware import cpusets
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from .owed import Owed
from .progress import CGROUPS, Progress
from .writer import CgroupWriter


class Routes:
    def __init__(self, writer: CgroupWriter, owed: Owed, audit: Audit, progress: Progress):
        self.writer = writer
        self.owed = owed
        self.audit = audit
        self.progress = progress

    def write(self, targets: Iterable[Target], state: NodeState) -> list[Target]:
        """Write targets directly; returns those the runtime must apply after all."""
        targets = list(targets)
        if not targets:
            return []
        with self.progress.phase(CGROUPS):
            failed = set(self.writer.write(cgroup_target(t, state) for t in targets))
        return [t for t in targets if t.container_id in failed]

    def writable(self, target: Target, state: NodeState) -> bool:
        return self.writer.can_write(state.cgroups.get(target.container_id, ""))

    def push(self, targets: Iterable[Target], state: NodeState, cause: str) -> None:
        """Apply targets that changed outside any reply: written, or owed."""
        targets = list(targets)
        if not targets:
            return
        owed = {t.container_id for t in self.write(targets, state)}
        self.owed.add(owed)
        written = [t.container_id for t in targets if t.container_id not in owed]
        self.audit.record(
            "outside-reply",
            f"{len(targets)} containers changed outside an event reply ({cause}): "
            f"{len(written)} written directly"
            + (f", {len(owed)} left for the runtime's next event" if owed else ""),
            audit_mod.INFO,
            cause=cause,
            container_ids=",".join(t.container_id for t in targets),
            written=len(written),
            owed=len(owed),
        )

    def owed_targets(
        self, carried: Iterable[str], engine: Engine, state: NodeState
    ) -> list[Target]:
        """What is owed, for the reply being made (each goes out once); ``carried``: the
        containers that reply deals with already, or must not list."""
        carried = set(carried)
        # What systemd refused after an earlier write had returned is owed like the rest, but
        # never dropped as carried: the reply may carry nothing for it (it was written, and a
        # unit asked of systemd again is no longer refused: daemon/units.py).  One this reply
        # deals with stays owed to the next.
        refused = set(self.writer.take_refused())
        self.owed.add(refused - carried)
        ids = self.owed.drain(carried)
        self.owed.add(refused & carried)
        return [t for cid in ids for t in engine.update(state, cid).targets]

    def for_reply(self, targets: Iterable[Target], state: NodeState) -> list[Target]:
        """Targets as a reply carries them (daemon/writer.py, ``for_runtime``)."""
        return [self.writer.for_runtime(t, state.cgroups.get(t.container_id, "")) for t in targets]


def cgroup_target(target: Target, state: NodeState) -> cpusets.Target:
    """``target`` as the writer writes it, at the container's cgroup."""
    return cpusets.Target(
        target.container_id,
        state.cgroups.get(target.container_id, ""),
        target.cpus,
        target.mems,
        target.quota,
        target.mems_from_parent,
    )
