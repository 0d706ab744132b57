"""What an event does when it ends after its request was answered without it: it agrees with
the answer (daemon/deadline.py).  An answer with an error means the runtime's operation did
not happen: the decision the node made for it is taken back by the event the node named
(``Effects.undo``: a release, a restore).  A fallback stands: what the reply would have
carried is owed to the runtime's next reply - never sent unsolicited.  Each ends with one
``deadline-late`` record saying what became of it."""

from __future__ import annotations

import time

from ..core.eligibility import describe
from ..core.state import NodeState
from ..ops import audit as audit_mod
from . import events as ev
from .effects import Effects
from .node import Node
from .progress import Abandoned
from .worker import ERROR, Job


def finish_late(node: Node, job: Job) -> None:
    event = job.args[0]
    if job.error is not None:
        done = "nothing was changed"
        if isinstance(event, (ev.CreateContainer, ev.StartContainer)):
            done = "nothing was assigned"
        what = done if isinstance(job.error, Abandoned) else f"it was refused: {job.error}"
    elif job.answer == ERROR:
        what = _take_back(node, event, job.result)
    else:
        what = _let_stand(node, event, job.result, job.answered)
    late = time.monotonic() - job.answered_at
    # Answered by the stub's guard rather than by the deadline: named here, off the fast path.
    subject = job.subject if job.subject != job.name else subject_of(event)
    node.audit.record(
        "deadline-late",
        f"{job.name} of {subject} ended {late:.2f} s after it was answered with "
        f"{'an error' if job.answer == ERROR else 'a fallback'}: {what}",
        audit_mod.NOTICE,
        event=job.name,
        late_seconds=f"{late:.3f}",
    )


def _take_back(node: Node, event: object, effects: Effects) -> str:
    """The operation failed: its decision goes, what its reply carried for others is owed."""
    resize = isinstance(event, ev.UpdateContainer)
    node.handle(effects.owed_when_unsent(own_too=resize))
    undo = effects.undo
    if isinstance(undo, ev.Restore):
        if node.state is not undo.after:
            # Other work was committed since (put off behind it by the stub's guard): going
            # back would undo that too.  The resize stands; kubelet's retry finds it made.
            return f"committed, {len(effects.updates) + 1} cpusets owed to the runtime"
        node.handle(undo)
        return f"its resize was undone: it keeps {_held(undo.before, undo.container_id)}"
    if isinstance(undo, ev.Release):
        state = node.state
        cid = undo.container_id
        if cid not in state.assignments and cid not in state.sharing:
            return "nothing to undo"
        held = state.assignments.get(cid)
        node.handle(undo)
        if held is not None:
            return f"its exclusive CPUs {held.cpus} were released again"
        return "its record was dropped again"
    return "nothing to undo"


def _let_stand(node: Node, event: object, effects: Effects, answered: Effects) -> str:
    """A fallback stands: the reply the event made is owed instead."""
    own = effects.own
    # A creation answered with the pool as it was: when the pool moved meanwhile (an earlier
    # late job), its StartContainer checks its cgroup, and the next reply carries its cpuset.
    moved = own is not None and answered.own is not None and own.cpus != answered.own.cpus
    owe = effects.owed_when_unsent(own_too=moved)
    node.handle(owe)
    if isinstance(event, ev.CreateContainer) and own is not None:
        return f"recorded in the shared pool {own.cpus}"
    owed = len(owe.container_ids)
    return "committed" + (f", {owed} cpusets owed to the runtime" if owed else "")


def _held(state: NodeState, cid: str) -> str:
    held = state.assignments.get(cid)
    return f"its exclusive CPUs {held.cpus}" if held is not None else "the shared pool"


def subject_of(event: object) -> str:
    """What a request was about, as the audit trail names it."""
    workload = getattr(event, "workload", None)
    if workload is not None:
        return describe(workload)
    if isinstance(event, ev.Synchronize):
        return f"the runtime's {len(event.live)} containers"
    pod = getattr(event, "pod", None)
    return pod.describe() if pod is not None else type(event).__name__
