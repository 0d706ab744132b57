"""Exclusive CPUs kept free of device interrupts: which CPUs, and what to write where.

A container that opted in (its pod's ``irq-free.nri-cpuplugin.io: "true"``, CRI-O's
``irq-load-balancing.crio.io: "disable"``, or ``[irq] keep_off_exclusive`` node-wide) has its
exclusive CPUs taken out of every interrupt's affinity the kernel lets us change, and out of
the default affinity of interrupts yet to come, for as long as it holds them.  What was taken
is recorded (``NodeState.irqs``) before anything is written, and given back - only that, and
only where still online - when no container needs those CPUs kept free: changes others made
meanwhile (irqbalance's) stay.

Pure: the front ends read /proc/irq (hardware/interrupts/affinity.py), plan here, commit the
records, then write.  Every step can run again after a crash and comes to the same masks.
"""

from __future__ import annotations

from ..base.value import Value
from .cpuset import CPUSet
from .state import IrqRecord, NodeState

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

DEFAULT = -1  # the default affinity of new interrupts, as a record number


class Irq(Value):
    """One interrupt as /proc shows it: its requested affinity and its handlers' names."""

    number: int
    requested: CPUSet
    names: str


class IrqPlan(Value):
    writes: tuple[tuple[int, CPUSet], ...]  # (interrupt, new affinity), DEFAULT included
    records: Mapping[int, IrqRecord]  # what the state records once the writes are made
    narrowed: int  # interrupts whose affinity loses kept-free CPUs
    restored: int  # interrupts given CPUs back


def keep_free(state: NodeState) -> CPUSet:
    """The CPUs to keep free of interrupts: those of the containers that asked for it."""
    cpus: set[int] = set()
    for held in state.assignments.values():
        if held.irq_free:
            cpus |= held.cpus
    return CPUSet(cpus)


def plan(
    irqs: Iterable[Irq],
    keep: CPUSet,
    online: CPUSet,
    fallback: CPUSet,
    records: Mapping[int, IrqRecord],
    unchangeable: frozenset[tuple[int, str]] = frozenset(),
) -> IrqPlan:
    """The writes that bring each interrupt's affinity to what it was without us, less
    ``keep``; never a set without an online CPU (``fallback``, the shared pool, when nothing
    else is left).  ``unchangeable``: (number, names) the kernel refused before (managed
    interrupts): left alone.  Records of interrupts that are gone are dropped."""
    writes = []
    kept: dict[int, IrqRecord] = {}
    narrowed = restored = 0
    for irq in irqs:
        if (irq.number, irq.names) in unchangeable:
            continue
        record = records.get(irq.number)
        taken = record.taken if record is not None and record.names == irq.names else CPUSet()
        back = (taken - keep) & online
        want = (irq.requested | back) - keep
        if not want & online:
            want = (fallback & online) - keep
        # Still ours: what is kept free, and what cannot be given back while it is offline.
        still = (taken & keep) | (irq.requested & keep) | (taken - keep - online)
        if want & online and want != irq.requested:
            writes.append((irq.number, want))
            narrowed += bool(irq.requested & keep)
            restored += bool(back - irq.requested)
        if still and want & online:
            kept[irq.number] = IrqRecord(irq.names, still)
    return IrqPlan(tuple(writes), kept, narrowed, restored)


def while_writing(
    before: Mapping[int, IrqRecord],
    plan: IrqPlan,
    pending: Iterable[int],
    refused: Iterable[int] = (),
    unwritten: Iterable[int] = (),
) -> dict[int, IrqRecord]:
    """What the records must say while the writes to ``pending`` interrupts are not all made
    (a crash leaves each of them written or not): for each, what was taken before its write
    and what is after it; for the rest, the plan's (``refused``: written in vain, the kernel
    manages them: nothing taken; ``unwritten``: not written, /proc/irq being read-only: what
    was taken before still is).  Committed before the first write, it lets the next run
    give back exactly what was taken, wherever the writes stopped."""
    records = dict(plan.records)
    for number in refused:
        records.pop(number, None)
    for number in unwritten:
        if (old := before.get(number)) is None:
            records.pop(number, None)
        else:
            records[number] = old
    for number in pending:
        old, new = before.get(number), records.get(number)
        if old is None:
            continue
        if new is None:
            records[number] = old
        elif new.names == old.names:
            records[number] = IrqRecord(new.names, old.taken | new.taken)
    return records
