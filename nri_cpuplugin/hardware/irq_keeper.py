"""Keeping the CPUs of containers that asked for it free of device interrupts: read what /proc
shows, plan (core/irq.py), record, write, tell irqbalance - the same steps for both front ends.

The records of what is taken are committed before any affinity is narrowed (``record``, the
front end's commit), and again once the writes are made: a crash in between leaves records
that the next run finds and completes, never a CPU taken that nobody gives back.  Interrupts
the kernel refuses to move (managed ones) are left alone, counted, and not tried again.
"""

from __future__ import annotations

import os

from ..base.value import Value
from ..core import irq as plan_irq
from ..core.cpuset import CPUSet
from ..core.events import DEBUG, INFO, WARNING, AuditEvent, event
from ..core.state import IrqRecord, NodeState
from . import irq, irqbalance

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


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


def keep_free(
    roots: Roots,
    state: NodeState,
    online: CPUSet,
    unchangeable: frozenset[tuple[int, str]],
    record: Callable[[Mapping[int, IrqRecord]], None],
) -> Kept:
    """Bring every changeable interrupt in line with ``state`` (core/irq.py); ``record``
    commits the interrupt records of the state."""
    keep = plan_irq.keep_free(state)
    if not keep and not state.irqs:
        # Nothing to give back, but a ban sent while a plan narrowed nothing (or before a
        # restart) is lifted still.
        return Kept(state.irqs, unchangeable, _lift_ban(roots))
    try:
        found = irq.interrupts(roots.proc)
    except irq.IrqError as err:
        return Kept(state.irqs, unchangeable, (_event(f"cannot read interrupts: {err}", WARNING),))
    plan = plan_irq.plan(found, keep, online, state.shared, state.irqs, unchangeable)
    record({**state.irqs, **plan.records})  # what a crash during the writes must not lose
    notes = []
    if keep:
        notes.append(_ban(roots, keep))
    refused, failed = _write(roots, plan, found)
    records = {n: r for n, r in plan.records.items() if (n, r.names) not in refused}
    record(records)
    if not keep:
        notes.append(_ban(roots, keep))
    unchangeable = unchangeable | refused
    return Kept(records, unchangeable, _events(keep, plan, refused, failed, notes))


def _write(
    roots: Roots, plan: plan_irq.IrqPlan, found: list[plan_irq.Irq]
) -> tuple[frozenset[tuple[int, str]], list[str]]:
    names = {i.number: i.names for i in found}
    refused: set[tuple[int, str]] = set()
    failed = []
    for number, cpus in plan.writes:
        try:
            irq.write(roots.proc, number, cpus)
        except irq.Refused:
            refused.add((number, names.get(number, "")))
        except irq.IrqError as err:
            failed.append(str(err))
    return frozenset(refused), failed


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


def _event(message: str, priority: int, **fields: object) -> AuditEvent:
    return event("irq", message, priority, **fields)
