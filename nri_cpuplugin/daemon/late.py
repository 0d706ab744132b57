"""What a daemon job does when it ends after its request was answered without it (a part of
DeadlinePlugin kept apart for size; daemon/deadline.py): it agrees with the answer.  An
exclusive decision answered with an error is undone, a resize answered with an error is
undone, and everything else stands, with what its reply would have carried owed to the
runtime's next reply - never sent unsolicited."""

from __future__ import annotations

import time

from ..core.engine import Outcome
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod
from .worker import ERROR, Abandoned, Job

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class LateWork:
    """Mixed into DeadlinePlugin, whose state, store, engine and audit it uses (declared here
    for the reader; CPUPlugin defines them)."""

    state: Any
    store: Any
    engine: Any
    audit: Any
    _owed: set[str]
    _commit: Any
    _push: Any

    def _create_late(self, job: Job) -> None:
        """A creation that ended after its request was answered without it."""
        container = job.args[1]
        cid = container.id
        state = self.state
        if job.error is not None:
            what = (
                "nothing was assigned"
                if isinstance(job.error, Abandoned)
                else f"it was refused: {job.error}"
            )
        elif job.answer == ERROR:
            if job.result is not None:
                # The reply was not sent: what it carried for other containers (owed
                # updates among them) goes with the next reply that can carry it.
                self._owed |= {update.container_id for update in job.result[1]} - {cid}
            before = job.before
            # A repeated creation of a tracked container must not release what it held.
            tracked = before is not None and (cid in before.assignments or cid in before.sharing)
            if tracked or (cid not in state.assignments and cid not in state.sharing):
                what = "nothing to undo"
            else:
                # The runtime is not creating it: what was committed for it goes again.
                held = state.assignments.get(cid)
                with self.store.locked():
                    outcome = self._commit(self.engine.stop(self.state, cid))
                self.audit.emit(outcome.events)
                self._push(outcome.targets, "creation answered with an error")
                what = (
                    f"its exclusive CPUs {held.cpus} were released again"
                    if held is not None
                    else "its record was dropped again"
                )
        else:
            adjust, updates = job.result
            cpu = adjust.linux.resources.cpu
            if cpu.cpus != job.answered_cpus:
                # The pool moved while it waited (an earlier late job): its StartContainer
                # checks its cgroup, and the next reply that can carry its cpuset does.
                self._owed.add(cid)
            self._owed |= {update.container_id for update in updates}
            what = f"recorded in the shared pool {cpu.cpus}"
        self._late_record(job, what)

    def _start_late(self, job: Job) -> None:
        """A StartContainer that decided its container after it was answered without it: an
        error answer undoes the decision as for a creation, anything else stands."""
        (self._create_late if job.answer == ERROR else self._replay_late)(job)

    def _update_late(self, job: Job) -> None:
        """An update that ended after it was answered without it.  A resize answered with an
        error that was committed all the same (the budget ran out during the commit) is
        undone: the runtime did not apply it, and the CPUs it freed or took must not be given
        to anyone else meanwhile.  Kubelet retries it."""
        before = job.before
        # Nothing to undo - or other work was committed since (its late part was put off
        # behind it: the stub's guard, daemon/worker.py), which going back to ``before`` would
        # undo too: the resize stands then, its reply is owed, and kubelet's retry finds it made.
        nothing = before is None or before is self.state or job.after is not self.state
        if job.answer != ERROR or job.error is not None or nothing:
            self._replay_late(job)
            return
        with self.store.locked():
            self._commit(Outcome(before))
        # The reply was not sent: what it carried goes with the next one that can carry it.
        self._owed |= {update.container_id for update in job.result}
        container = job.args[1]
        held = before.assignments.get(container.id)
        kept = f"its exclusive CPUs {held.cpus}" if held is not None else "the shared pool"
        self._late_record(job, f"its resize was undone: it keeps {kept}")

    def _replay_late(self, job: Job) -> None:
        """Any other request that ended after it was answered without it: what its reply
        would have carried is owed to the runtime's next reply that can carry it (never an
        unsolicited update: docs/architecture.md, "Changes outside event replies")."""
        if job.error is not None:
            what = (
                "nothing was changed"
                if isinstance(job.error, Abandoned)
                else f"it failed: {job.error}"
            )
        else:
            owed = {u.container_id for u in job.result} if isinstance(job.result, list) else set()
            self._owed |= owed
            what = "committed" + (f", {len(owed)} cpusets owed to the runtime" if owed else "")
        self._late_record(job, what)

    def _late_record(self, job: Job, what: str) -> None:
        late = time.monotonic() - job.answered_at
        subject = job.subject
        if subject == job.name and len(job.args) > 1 and isinstance(job.args[1], pb.Container):
            # Answered by the stub's guard, not by us: named here, off the fast path.
            pod, container = job.args[:2]
            subject = subject_of(pod, container)
        self.audit.record(
            "deadline-late",
            f"{job.name} of {subject} ended {late:.2f} s after it was answered with "
            f"{'an error' if job.answer == ERROR else 'a fallback'}: {what}",
            audit_mod.NOTICE,
            event=job.name,
            late_seconds=f"{late:.3f}",
        )


def subject_of(pod: pb.PodSandbox, container: pb.Container) -> str:
    return f"container {container.name!r} of pod {pod.namespace}/{pod.name}"
