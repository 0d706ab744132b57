"""Keeping the kept-free CPUs of the state out of every interrupt's affinity, as background work
of the node (daemon/background.py): no request waits for it.

After each event whose outcome changed the kept-free CPUs (and at each rescan, after CPU
hotplug) the node queues one ``IrqWork``; an event that changes them again while it runs makes
it plan again from where it is.  Its steps, each short:

1. read /proc, ``SLICE_READS`` interrupts a step, and plan (hardware/interrupts/keeper.py ``Pass``),
   then commit the records of what the writes take **durably**, under the state lock.  When
   that commit fails (a full disk), no affinity is touched and irqbalance is not told: the
   work is retried at the next rescan (``IRQ_RESCAN``, set for it) or change of the kept-free
   CPUs, and whatever a crash leaves on disk still names every CPU taken, so the next run
   gives each back;
2. tell irqbalance (its control socket answers within ``irqbalance.SEND_TIMEOUT``); then
   ``SLICE`` affinity writes at most per step, fewer once a request is queued;
3. when every write is made: the records as they are now (no longer durable-first: a crash
   before them leaves records that name more than is taken, and giving back is idempotent),
   irqbalance, the audit record, the next rescan.

Planning again between steps keeps what was written so far in the state's records
(``Pass.recording``), so nothing taken is forgotten and nothing is given back twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..core import irq
from ..core.cpuset import CPUSet
from ..core.events import WARNING, AuditEvent
from ..core.outcome import Outcome
from ..core.state import IrqRecord
from ..hardware.interrupts import keeper as irq_keeper
from . import events as ev
from .effects import NO_EFFECTS, Deliver, Effects, keep

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .node import Node

# While CPUs are kept free of interrupts, the interrupts are looked at again this often: new
# devices' interrupts start on the default affinity, and irqbalance re-places every interrupt at
# its rescans.  Also how soon records that could not be committed are tried again.
IRQ_RESCAN = 10.0
# Affinity writes per step at most (a write is tens of microseconds; some drivers take
# milliseconds), and interrupts read (25 us each): a step stops sooner when a request is queued.
SLICE = 32
SLICE_READS = 256


def keep_free(node: Node, force: bool = False) -> None:
    """Bring the interrupts in line with the state's kept-free CPUs, in the background, when
    those changed since last planned (``force``: whatever they are - a rescan, hotplug)."""
    free = irq.keep_free(node.state)
    work = node.irq_work
    if work is not None:
        work.stale = work.stale or force or free != work.keep
        return
    if not force and free == node.irq_kept:
        return
    node.irq_work = IrqWork(node)
    node.background.upkeep("irq", node.irq_work.step)


def rescan(node: Node, event: ev.IrqRescan, deliver: Deliver = keep) -> Effects:
    node.irq_rescanning = False
    keep_free(node, force=True)
    return NO_EFFECTS


class IrqWork:
    """One interrupt pass of the node, as steps of background work (see the module text)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.stale = True  # to plan (again) at the next step
        self.keep: CPUSet | None = None  # what the pass under way keeps free
        self.run: irq_keeper.Pass | None = None
        self.told = False  # irqbalance told of the pass's kept-free CPUs

    def step(self) -> bool:
        """One step; False when the work is over."""
        node = self.node
        if self.stale and not self._begin():
            assert self.run is not None
            return self._over(self.run.lift())
        run = self.run
        assert run is not None
        if not run.planned:
            if run.read(SLICE_READS, node.background.waiting):
                return True
            return self._recorded(run)
        if not self.told:
            self.told = True
            run.ban()  # (its control socket: up to irqbalance.SEND_TIMEOUT)
            return True
        if run.write(SLICE, node.background.waiting):
            return True  # (an event between steps may make it plan again)
        return self._over(self._finish(run))

    def _begin(self) -> bool:
        """A new pass from the state as it is; whether anything is to be done."""
        node = self.node
        self.stale, self.told = False, False
        if self.run is not None:  # what the last plan wrote stays recorded
            records = self.run.recording()
            if records != dict(node.state.irqs):
                node.hold(Outcome(node.state.evolve(irqs=records)))
            node.irq_unchangeable |= self.run.refused
        run = irq_keeper.Pass(
            node.irq_roots, node.state, node.policy.topology.online, node.irq_unchangeable
        )
        self.run, self.keep, node.irq_kept = run, run.keep, run.keep
        return run.needed

    def _recorded(self, run: irq_keeper.Pass) -> bool:
        """Planned: what the writes take committed durably; whether there is writing to do
        (else the work is over)."""
        node = self.node
        if run.problem is not None:
            return self._over((run.problem,))
        unrecorded = _record_durably(node, run.recording())
        if unrecorded is not None:
            _rescan_later(node)  # tried again then, or by an event that changes what is kept
            return self._over((unrecorded,))
        return True

    def _over(self, events: Iterable[AuditEvent] = ()) -> bool:
        """The work is over, with ``events`` to say.  A warning the last pass gave too (the
        interrupts cannot be read, a write keeps failing, the disk is full) is said once while
        it lasts, not at every rescan."""
        node = self.node
        node.irq_work = None
        events = tuple(events)
        node.audit.emit(e for e in events if e.message not in node.irq_warned)
        node.irq_warned = frozenset(e.message for e in events if e.priority == WARNING)
        return False

    def _finish(self, run: irq_keeper.Pass) -> tuple[AuditEvent, ...]:
        """Every write made: the records as they are now; what the pass did, to say."""
        node = self.node
        kept = run.finish()
        if dict(kept.records) != dict(node.state.irqs):
            with node.file.locked(decides=False):
                node.commit(Outcome(node.state.evolve(irqs=kept.records)))
        node.irq_unchangeable = kept.unchangeable
        if run.keep:
            _rescan_later(node)
        return kept.events


def _record_durably(node: Node, records: Mapping[int, IrqRecord]) -> AuditEvent | None:
    """Commit the state with ``records`` and wait until it is on disk; when it cannot be,
    what to say (nothing may be narrowed then)."""
    state = node.state
    if dict(records) == dict(state.irqs) and not node.file.unsaved:
        return None
    try:
        with node.file.locked(decides=False):
            node.commit(Outcome(state.evolve(irqs=records)), durable=True)
    except OSError as err:
        return irq_keeper.unrecorded(err, f"in {IRQ_RESCAN:g} s")
    return None


def _rescan_later(node: Node) -> None:
    if not node.irq_rescanning:
        node.irq_rescanning = node.later(IRQ_RESCAN, ev.IrqRescan())
