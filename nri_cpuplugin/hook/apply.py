"""The hook's cgroup writes: every live container's cpuset (and quota) brought in line with the
committed state, as one transaction."""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..core.engine import Engine
from ..core.outcome import CFS_PERIOD_US, Target
from ..core.state import NodeState
from ..core.workload import Workload
from ..hardware import cgroup_writes
from ..hardware.cgroup_writes import Transaction
from ..hardware.cgroupfs import CgroupError, CgroupFS
from .records import Record

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping


def apply_targets(
    fs: CgroupFS,
    engine: Engine,
    state: NodeState,
    targets: Mapping[str, Record],
    requested: Mapping[str, CPUSet],
    current: Workload | None,
    fault: Callable[[str], None],
    was_exclusive: Collection[str] = (),
) -> tuple[list[str], list[tuple[Record, Target]]]:
    """Bring every live container's cgroups in line with ``state``: CPUs taken away first,
    then CPUs given, the new container last.  One transaction: all or nothing.  Returns
    one line per cgroup written, and what was written where (for systemd: hook/units.py).
    ``was_exclusive``: containers that held exclusive CPUs before this run; those now shared
    get their parent's memory nodes back."""
    plan = _plan(engine, state, targets, requested, was_exclusive)
    current_id = current.container_id if current is not None else None
    others = [p for p in plan if p[1].container_id != current_id]
    mine = [p for p in plan if p[1].container_id == current_id]
    # CPUs are taken away before they are given, so no CPU is ever in more places than
    # it already was.
    others.sort(
        key=lambda p: (
            not (requested.get(p[1].container_id, CPUSet()) - p[1].cpus),
            p[1].container_id,
        )
    )
    tx = Transaction(fs)
    written = _write(tx, others, current_id)
    fault("shared-written")
    written += _write(tx, mine, current_id)
    if current is not None:
        fault("container-written")
    return written, plan


def _plan(
    engine: Engine,
    state: NodeState,
    targets: Mapping[str, Record],
    requested: Mapping[str, CPUSet],
    was_exclusive: Collection[str],
) -> list[tuple[Record, Target]]:
    """The containers whose cgroups must be written, and with what."""
    plan: list[tuple[Record, Target]] = []
    for cid, record in targets.items():
        if cid not in state.assignments and cid not in state.sharing:
            continue
        target = engine.target(state, cid)
        if cid in was_exclusive and not target.exclusive:
            target = target.evolve(mems_from_parent=True)
        # Shared containers already on the pool, the usual case, need no write.
        if (
            target.exclusive
            or target.quota is not None
            or target.mems_from_parent
            or requested.get(cid) != target.cpus
        ):
            plan.append((record, target))
    return plan


def _write(tx: Transaction, plan: list[tuple[Record, Target]], current_id: str | None) -> list[str]:
    """Write ``plan`` in order; on a failure every write of ``tx`` is undone (CgroupError)."""
    written: list[str] = []
    for record, target in plan:
        cid = target.container_id
        try:
            if _place(tx, record, target):
                written.append(f"{cid[:12]}={target.cpus}")
        except CgroupError as err:
            # A sibling exiting right now must not fail this container (as the NRI
            # path's ignore_failure); the next run finds it stale.
            if cid != current_id and not _still_running(tx.fs, record):
                continue
            undone = len(tx.done)
            failed = tx.rollback()
            message = f"{err}; rolled back {undone} earlier cgroup writes"
            if failed:
                message += f", {len(failed)} of which failed: {'; '.join(failed)}"
            raise CgroupError(message) from None
    return written


def _place(tx: Transaction, record: Record, target: Target) -> bool:
    """Write the cpuset, and the CFS quota when the target sets one."""
    changed = cgroup_writes.set_cpuset(
        tx, record.cgroups.cpuset, target.cpus, target.mems, target.mems_from_parent
    )
    quota = target.quota
    if quota is not None and record.cgroups.cpu is not None:
        if quota < 0:
            changed |= cgroup_writes.lift_quota(tx, record.cgroups.cpu)
        else:
            changed |= cgroup_writes.limit_quota(tx, record.cgroups.cpu, quota, CFS_PERIOD_US)
    return changed


def _still_running(fs: CgroupFS, record: Record) -> bool:
    try:
        return fs.populated(record.cgroups.cpuset)
    except CgroupError:
        return False
