"""Keeping the CPUs of containers that asked for it free of device interrupts: read what /proc
shows, plan (core/irq.py), record, write, tell irqbalance - the same steps for both front ends.

The records of what is taken are committed durably before any affinity is narrowed (the front
end's commit of ``Pass.recording``: when it fails, nothing is written), and again once the
writes are made: a crash in between leaves records that the next run finds and completes,
never a CPU taken that nobody gives back.  ``keep_free`` does it all in one go (the OCI hook);
``Pass`` in steps (the daemon, between the runtime's requests: daemon/irq_upkeep.py).
Interrupts the kernel refuses to move (managed ones) are left alone, counted, and not tried
again.  A read-only /proc/irq (a container's) ends the pass at its first write: nothing is
taken, and the warning says where the plugin must run instead.
"""

from __future__ import annotations

import os
from collections import deque

from ...base.value import Value
from ...core import irq as plan_irq
from ...core.cpuset import CPUSet
from ...core.events import DEBUG, INFO, WARNING, AuditEvent, event
from ...core.state import IrqRecord, NodeState
from . import affinity, irqbalance

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping


class Roots(Value):
    """Where the interrupts and irqbalance are: beside the sysfs the daemon was given (``/sys``
    -> ``/proc``, ``/run``), so a generated sysfs tree (tests) never touches the host's."""

    sysfs: str
    proc: str
    run: str

    @classmethod
    def beside(cls, sysfs: str, proc: str | None = None) -> Roots:
        top = os.path.dirname(os.path.normpath(sysfs)) or "/"
        proc = os.path.join(top, "proc") if proc is None else proc
        return cls(sysfs, proc, os.path.join(os.path.dirname(proc) or "/", "run"))


class Kept(Value):
    records: Mapping[int, IrqRecord]
    unchangeable: frozenset[tuple[int, str]]
    events: tuple[AuditEvent, ...]


class Pass:
    """One bringing-in-line of the interrupts with a state's kept-free CPUs, in steps that can
    be spread over time (the daemon writes a few at a time between the runtime's requests):

    1. ``read``: what /proc shows (all of it, or a slice at a time), then the plan
       (core/irq.py); ``problem`` says why not when /proc cannot be read;
    2. the caller commits ``recording()`` - durably: no affinity is narrowed before what it
       takes is on disk - then ``ban``s irqbalance from the kept-free CPUs;
    3. ``write`` as many times as it takes;
    4. ``finish``: the records once the writes are made, irqbalance let back when nothing is
       kept free, what was done as audit events.

    Stopped between writes, ``recording()`` is still exact: the next pass (or the next run,
    after a crash) takes it from there."""

    def __init__(
        self,
        roots: Roots,
        state: NodeState,
        online: CPUSet,
        unchangeable: frozenset[tuple[int, str]],
    ) -> None:
        self.roots = roots
        self.keep = plan_irq.keep_free(state)
        self.before = state.irqs
        self.online = online
        self.shared = state.shared
        self.unchangeable = unchangeable
        self.plan = plan_irq.IrqPlan((), state.irqs, 0, 0)
        self.planned = False
        self.problem: AuditEvent | None = None
        self._reading: Iterator[plan_irq.Irq] | None = None
        self._found: list[plan_irq.Irq] = []
        self.pending: deque[tuple[int, CPUSet]] = deque()
        self.names: dict[int, str] = {}
        self.refused: set[tuple[int, str]] = set()
        self.unwritten: list[int] = []  # not written: /proc/irq is read-only
        self.read_only: str | None = None  # why, once seen
        self.failed: list[str] = []
        self.notes: list[str | None] = []

    @property
    def needed(self) -> bool:
        """Whether anything is kept free, or left to give back."""
        return bool(self.keep or self.before)

    def read(self, limit: int = 0, enough: Callable[[], bool] = lambda: False) -> bool:
        """Read up to ``limit`` interrupts (0: all), fewer when ``enough()`` says so after one;
        once all are read, plan.  Whether more are left to read."""
        if self._reading is None:
            self._reading = affinity.reading(self.roots.proc)
        count = 0
        try:
            for one in self._reading:
                self._found.append(one)
                count += 1
                if count == limit or enough():
                    return True
        except affinity.IrqError as err:
            self.problem = _event(f"cannot read interrupts: {err}", WARNING)
            return False
        found = sorted(self._found, key=lambda i: i.number)
        self.names = {i.number: i.names for i in found}
        self.plan = plan_irq.plan(
            found, self.keep, self.online, self.shared, self.before, self.unchangeable
        )
        self.pending = deque(self.plan.writes)
        self.planned = True
        return False

    def recording(self) -> dict[int, IrqRecord]:
        """What the state must record while the writes not made yet are pending."""
        refused = (n for n, _ in self.refused)
        pending = (n for n, _ in self.pending)
        return plan_irq.while_writing(self.before, self.plan, pending, refused, self.unwritten)

    def ban(self) -> None:
        if self.keep:
            self.notes.append(_ban(self.roots, self.keep))

    def lift(self) -> tuple[AuditEvent, ...]:
        """Nothing to keep free or give back, but a ban sent while a plan narrowed nothing (or
        before a restart) is lifted still."""
        return _lift_ban(self.roots)

    def write(self, limit: int, enough: Callable[[], bool] = lambda: False) -> bool:
        """Up to ``limit`` writes, fewer when ``enough()`` says so after one; whether more
        are left."""
        for _ in range(limit):
            if not self.pending:
                break
            number, cpus = self.pending.popleft()
            try:
                affinity.write(self.roots.proc, number, cpus)
            except affinity.Refused:
                self.refused.add((number, self.names.get(number, "")))
            except affinity.ReadOnly as err:
                self.read_only = str(err)
                self.unwritten += [number, *(n for n, _ in self.pending)]
                self.pending.clear()
            except affinity.IrqError as err:
                self.failed.append(str(err))
            if enough():
                break
        return bool(self.pending)

    def finish(self) -> Kept:
        """The records once every write is made, and what the pass did."""
        records = self.recording()
        if not self.keep:
            self.notes.append(_ban(self.roots, self.keep))
        refused = frozenset(self.refused)
        events: tuple[AuditEvent, ...]
        if self.read_only is not None:
            events = (_unmoved(self.keep, self.read_only, len(self.unwritten), self.notes),)
        else:
            events = _events(self.keep, self.plan, refused, self.failed, self.notes)
        return Kept(records, self.unchangeable | refused, events)


def keep_free(
    roots: Roots,
    state: NodeState,
    online: CPUSet,
    unchangeable: frozenset[tuple[int, str]],
    record: Callable[[Mapping[int, IrqRecord]], None],
    retried: str,
) -> Kept:
    """Bring every changeable interrupt in line with ``state`` (core/irq.py) in one go;
    ``record`` commits the interrupt records of the state, durably, and raises OSError when
    it cannot.  When the records cannot be committed before the writes, nothing is written
    and the pass says so (``retried``: when it is tried again)."""
    run = Pass(roots, state, online, unchangeable)
    if not run.needed:
        return Kept(state.irqs, unchangeable, run.lift())
    run.read()
    if run.problem is not None:
        return Kept(state.irqs, unchangeable, (run.problem,))
    try:
        record(run.recording())  # what a crash during the writes must not lose
    except OSError as err:
        return Kept(state.irqs, unchangeable, (unrecorded(err, retried),))
    run.ban()
    while run.write(len(run.pending) or 1):
        pass
    kept = run.finish()
    record(kept.records)
    return kept


def _ban(roots: Roots, keep: CPUSet) -> str | None:
    return irqbalance.ban(
        keep,
        roots.sysfs,
        roots.proc,
        os.path.join(roots.run, "nri-cpuplugin", "irqbalance.env"),
        os.path.join(roots.run, "irqbalance"),
    )


def _lift_ban(roots: Roots) -> tuple[AuditEvent, ...]:
    if not irqbalance.banning(os.path.join(roots.run, "nri-cpuplugin", "irqbalance.env")):
        return ()
    why = _ban(roots, CPUSet())
    return (_event(f"irqbalance's ban could not be lifted: {why}", WARNING),) if why else ()


def _events(
    keep: CPUSet,
    plan: plan_irq.IrqPlan,
    refused: frozenset[tuple[int, str]],
    failed: list[str],
    notes: list[str | None],
) -> tuple[AuditEvent, ...]:
    if not (plan.writes or refused or failed or any(notes)):
        return ()
    message = (
        f"interrupts kept off CPUs {keep or 'none'}: {plan.narrowed} narrowed, "
        f"{plan.restored} given CPUs back"
        + (f", {len(refused)} managed by the kernel left alone" if refused else "")
        + (f", {len(failed)} failed ({'; '.join(failed[:3])})" if failed else "")
        + "".join(f"; {note}" for note in notes if note)
    )
    priority = WARNING if failed else INFO if plan.writes else DEBUG
    return (
        _event(
            message,
            priority,
            cpus=keep,
            narrowed=plan.narrowed,
            restored=plan.restored,
            managed=len(refused),
            failed=len(failed),
        ),
    )


def _unmoved(keep: CPUSet, why: str, count: int, notes: list[str | None]) -> AuditEvent:
    message = f"interrupts not kept off CPUs {keep or 'none'}: {why}" + "".join(
        f"; {note}" for note in notes if note
    )
    return _event(message, WARNING, cpus=keep, narrowed=0, restored=0, managed=0, failed=count)


def unrecorded(err: OSError, retried: str) -> AuditEvent:
    """What to say when the records a pass needs could not be committed durably: nothing was
    narrowed (both front ends; ``retried`` says when it is tried again)."""
    return _event(
        "interrupts left as they are: what narrowing them takes could not be recorded "
        f"durably first ({err}); tried again {retried}",
        WARNING,
        reason=str(err),
    )


def _event(message: str, priority: int, **fields: object) -> AuditEvent:
    return event("irq", message, priority, **fields)
