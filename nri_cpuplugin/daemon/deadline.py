"""Deadline discipline: every NRI request is answered within its budget, decided or not.

The runtime waits ``plugin_request_timeout`` (2 s by default, containerd and CRI-O alike) for
each answer.  A request left unanswered past it makes the runtime drop the plugin, and the
containers created meanwhile start unpinned.  Four of the node's waits can outlast it, and
none can be interrupted: the state lock (another nri-cpuplugin process - a hook, the CLI -
holds it), the durable commit (fsync on a slow disk), netlink (NIC locality) and the shared
containers' cgroup writes that precede a creation's answer.  So:

* **One worker thread runs the node** (daemon/worker.py): every event, the runtime's and the
  daemon's own (hotplug, a disconnection), one at a time, in the order they came.  The state
  is not thread-safe, and a release must never overtake the creation it follows.  The node's
  upkeep (interrupts, rescans, the sweep: ``UPKEEP``, and the interrupt passes the node queues)
  runs between them, in bounded steps and only while no request is queued, so no request
  waits behind it for more than the step under way (daemon/background.py).
* **A request waits for its event with a budget**: ``nri.request_budget`` (1.5 s), or 75 % of
  the runtime's request timeout when that is shorter (NRI >= 0.7 says it in Configure), which
  keeps it below the stub's last-resort guard (``stub.DEADLINE_SHARE``).
* **An event not handled within the budget is answered without it** (``FALLBACKS``), audited
  (``deadline``, its ``REASON`` saying what the node was waiting for) and counted
  (``nri_cpuplugin_deadline_misses_total``):

  ====================================================  ===================================
  request                                               answer
  ====================================================  ===================================
  CreateContainer of an exclusive candidate             an error saying what held it up
                                                        (kubelet retries the container)
  CreateContainer of a shared container                 the current shared pool
  StartContainer deciding its container (pin at start)  as CreateContainer: an error, or an
                                                        empty reply for a shared one
  UpdateContainer resizing around exclusive CPUs        an error (kubelet retries the resize)
  UpdateContainer otherwise                             the current cpuset, kept
  PostUpdateContainer                                   (empty)
  StopContainer, Synchronize                            no updates
  RemoveContainer, RemovePodSandbox, UpdatePodSandbox,  (empty)
  RunPodSandbox, StartContainer otherwise
  ====================================================  ===================================

* **The event goes on, and what it does late agrees with the answer** (daemon/late.py): an
  exclusive decision answered with an error is not made - the node checks, once it holds the
  lock and just before a durable commit - or is undone by the event the node named for that
  (``Effects.undo``); everything else stands, and what its reply would have carried is owed to
  the runtime's next reply (never an unsolicited UpdateContainers, which deadlocks containerd).

A creation that takes its pod's earmark is answered at once, on the event loop, when the
worker is idle (the state is then current), and decided after the answer has been written
(docs/architecture.md, "Earmarks").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.policy import PolicyError
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from . import events as ev
from .effects import NO_EFFECTS, Effects
from .late import finish_late, subject_of
from .node import Node
from .progress import CGROUPS, COMMIT, DECIDING, NIC, QUEUED, STATE_LOCK
from .worker import ERROR, FALLBACK, Job, Worker

# The budget's share of the runtime's request timeout, when that is the shorter bound.
BUDGET_SHARE = 0.75
# At exit, how long to wait for work already answered (a late release) to be committed.
DRAIN_TIMEOUT = 5.0

# The NRI request each event answers, as audit records and metrics name it.
REQUESTS = {
    ev.Configure: "Configure",
    ev.Synchronize: "Synchronize",
    ev.CreateContainer: "CreateContainer",
    ev.StartContainer: "StartContainer",
    ev.UpdateContainer: "UpdateContainer",
    ev.UpdatedContainer: "PostUpdateContainer",
    ev.StopContainer: "StopContainer",
    ev.RemoveContainer: "RemoveContainer",
    ev.RunPodSandbox: "RunPodSandbox",
    ev.RemovePodSandbox: "RemovePodSandbox",
    ev.UpdatePodSandbox: "UpdatePodSandbox",
}
# The daemon's own events, run on the worker without a request waiting.
BACKGROUND = {
    ev.CPUsChanged: "hotplug",
    ev.RecheckEvictions: "hotplug",
    ev.SweepRound: "sweep",
    ev.CommitHeld: "drain",
    ev.IrqRescan: "irq",
    ev.FinishHandOver: "systemd",
    ev.Disconnected: "disconnect",
}
# Those run as upkeep, between the runtime's requests (daemon/background.py); the others in
# order with the requests (a disconnection before the next connection's events, hotplug before
# the events it changes the CPUs of).
UPKEEP = (ev.RecheckEvictions, ev.SweepRound, ev.IrqRescan)


class Deadline:
    """The node's events run on the worker, each request answered within the budget."""

    def __init__(self, node: Node, audit: Audit, worker: Worker) -> None:
        self.node = node
        self.audit = audit
        self.worker = worker
        self.request_timeout: Callable[[], float | None] = lambda: None  # the stub's, once known

    @property
    def budget(self) -> float:
        """Seconds within which each request is answered."""
        budget = self.node.settings.nri_request_budget
        timeout = self.request_timeout()
        if timeout:
            budget = min(budget, timeout * BUDGET_SHARE)
        return budget

    async def configure(self, event: ev.Configure) -> None:
        """No budget: a Configure that cannot finish is no connection at all, and the stub's
        guard answers it (the settings and the state are the worker's, where a late job of
        the last connection may still run)."""
        job = self.worker.submit("Configure", self._handle, event)
        await self.worker.finished(job, None)
        job.outcome()

    async def handle(self, event: Any) -> Effects:
        """The event's effects, or its fallback's when it is not handled within the budget
        (raises PolicyError where that fallback is an error)."""
        if isinstance(event, ev.CreateContainer) and self.worker.idle():
            early = self.node.query_early_answer(event)
            if early is not None:
                answered = event.evolve(answered=early)
                self.worker.submit("CreateContainer", self._handle, answered, answered=True)
                return Effects(own=early)
        name = REQUESTS[type(event)]
        node = self.node
        if isinstance(event, ev.StartContainer):
            # Whether it decides its container, said now: by the time the budget runs out the
            # node may hold that decision already (a slow disk), and the answer is still one.
            event = event.evolve(decides=node.query_decides_at_start(event.workload.container_id))
        job = self.worker.submit(
            name,
            self._handle,
            event,
            late=lambda job: finish_late(node, job),
            refusable=_refusable(event),
        )
        budget = self.budget
        if await self.worker.finished(job, budget):
            return self._outcome(job)
        workload = getattr(event, "workload", None)
        job.subject = subject_of(event)
        answer, fallback = FALLBACKS[type(event)](self.node, event)
        job.answered = fallback
        if not job.abandon(answer):
            return self._outcome(job)  # it ended meanwhile
        identity = workload.identity() if workload is not None else {}
        if answer == FALLBACK:
            self._missed(job, budget, ANSWERED[type(event)](fallback), identity)
            return fallback
        self.node.metrics.pinning_request()
        self.node.metrics.pinning_error()
        why = self._missed(job, budget, "an error", identity)
        raise PolicyError(REFUSALS[type(event)](job.subject, budget, why), "deadline")

    def submit(self, event: Any) -> None:
        """Queue one of the daemon's own events (from the event loop); nobody waits for it."""
        name = BACKGROUND.get(type(event), type(event).__name__)
        if isinstance(event, UPKEEP):
            self.worker.upkeep(name, lambda: self._once(event))
        else:
            self.worker.submit(name, self._handle, event, awaited=False)

    async def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Wait up to ``timeout`` for the work queued so far - a late release, say, and the
        upkeep - to be done, before the daemon exits; whether it was."""
        drain = ev.CommitHeld()
        job = self.worker.upkeep("drain", lambda: self._once(drain), awaited=True, last=True)
        return await self.worker.finished(job, timeout)

    @staticmethod
    def _outcome(job: Job) -> Effects:
        effects: Effects = job.outcome()  # (a Job carries what its function returned: Any)
        return effects

    # --- on the worker ----------------------------------------------------------------------------

    def _handle(self, event: Any) -> Effects:
        return self.node.handle(event, self._deliver)

    def _once(self, event: Any) -> bool:
        """``event`` handled as one step of upkeep (nothing more to do after it)."""
        self.node.handle(event)
        return False

    def _deliver(self, effects: Effects) -> bool:
        """Hand a reply to the waiting request before the rest of the event is done; False when
        the request was answered with an error meanwhile."""
        job = self.worker.job_here()
        if job is None:
            return True
        return self.worker.deliver(effects) or job.answer != ERROR

    # --- a missed deadline ------------------------------------------------------------------------

    def _missed(self, job: Job, budget: float, answered: str, identity: Mapping[str, Any]) -> str:
        """Audit and count a request answered without its event; returns why it was late."""
        code, why = self._why(job)
        self.node.metrics.deadline_missed(job.name, code)
        self.audit.record(
            "deadline",
            f"{job.name} of {job.subject} was not decided within {budget:g} s ({why}): "
            f"answered with {answered}; the work goes on and is done when it can be",
            audit_mod.WARNING,
            reason=code,
            event=job.name,
            budget_seconds=f"{budget:g}",
            **identity,
        )
        return why

    def _why(self, job: Job) -> tuple[str, str]:
        """(reason code, what the job waits for): its own phase, or the phase of the job it is
        queued behind (the cause an operator can act on)."""
        phase = job.phase
        ahead = self.worker.current
        if phase == QUEUED and ahead is not None and ahead is not job:
            code, why = self._phase_why(ahead.phase)
            return code, f"it waits behind an earlier {ahead.name}, {why}"
        return self._phase_why(phase)

    def _phase_why(self, phase: str) -> tuple[str, str]:
        store = self.node.store
        reasons = {
            STATE_LOCK: f"waiting for the state lock {store.lock_path}, which another "
            f"nri-cpuplugin process holds (`fuser -v {store.lock_path}` shows which)",
            COMMIT: f"writing {store.state_path} durably: the disk is slow to sync, check it",
            NIC: "reading the pod's network interfaces over netlink",
            CGROUPS: "writing the shared containers' cpusets: the kernel is slow to apply them "
            "(a cgroup operation stuck on this node?)",
            QUEUED: "waiting for the worker thread",
        }
        if phase in reasons:
            return phase, reasons[phase]
        return DECIDING, "deciding"


def _refusable(event: Any) -> bool:
    """Whether an error answer (the stub's guard's, when it comes first) means the runtime's
    operation did not happen, so that the event must not go on deciding: a creation, an
    update (a resize), a start that decides its container.  Any other event happened all the
    same - a stop, a removal - and is done late, whatever the runtime was answered."""
    if isinstance(event, (ev.CreateContainer, ev.UpdateContainer)):
        return True
    return isinstance(event, ev.StartContainer) and event.decides


# --- what a request is answered with when its event is not handled in time ------------------------


def _creation(node: Node, event: ev.CreateContainer) -> tuple[str, Effects]:
    if node.query_eligible(event.workload):
        return ERROR, NO_EFFECTS  # kubelet retries the container
    return FALLBACK, Effects(own=node.query_target(event.workload.container_id))


def _start(node: Node, event: ev.StartContainer) -> tuple[str, Effects]:
    # Deciding (pin at start): an exclusive candidate is refused - also when the node holds
    # its decision already, not yet durable or written (a slow disk); a shared one starts on
    # its pod's CPUs, and the event writes the shared pool when it ends.
    if event.decides and node.query_eligible(event.workload):
        return ERROR, NO_EFFECTS
    return FALLBACK, NO_EFFECTS


def _update(node: Node, event: ev.UpdateContainer) -> tuple[str, Effects]:
    # A new CPU request around exclusive CPUs is a decision only the event can make: refused,
    # kubelet retries the resize.  Anything else keeps the cpuset, which is all it would do.
    cid = event.workload.container_id
    if event.resize and (cid in node.state.assignments or node.query_eligible(event.workload)):
        return ERROR, NO_EFFECTS
    return FALLBACK, node.query_kept(cid)


def _nothing(node: Node, event: Any) -> tuple[str, Effects]:
    return FALLBACK, NO_EFFECTS


FALLBACKS: dict[type, Callable[[Node, Any], tuple[str, Effects]]] = {
    ev.CreateContainer: _creation,
    ev.StartContainer: _start,
    ev.UpdateContainer: _update,
    ev.UpdatedContainer: _nothing,
    ev.StopContainer: _nothing,
    ev.Synchronize: _nothing,
    ev.RemoveContainer: _nothing,
    ev.RunPodSandbox: _nothing,
    ev.RemovePodSandbox: _nothing,
    ev.UpdatePodSandbox: _nothing,
}
# How the audit record names a fallback.
ANSWERED: dict[type, Callable[[Effects], str]] = {
    ev.CreateContainer: lambda fb: f"the shared pool {fb.own.cpus if fb.own else ''}",
    ev.StartContainer: lambda fb: "an empty reply",
    ev.UpdateContainer: lambda fb: "its cpuset kept",
    ev.UpdatedContainer: lambda fb: "an empty reply",
    ev.StopContainer: lambda fb: "no updates",
    ev.Synchronize: lambda fb: "no updates",
    ev.RemoveContainer: lambda fb: "an empty reply",
    ev.RunPodSandbox: lambda fb: "an empty reply",
    ev.RemovePodSandbox: lambda fb: "an empty reply",
    ev.UpdatePodSandbox: lambda fb: "an empty reply",
}
# The error a refused request gets.
REFUSALS: dict[type, Callable[[str, float, str], str]] = {
    ev.CreateContainer: lambda who, budget, why: (
        f"exclusive CPUs for {who} could not be decided within {budget:g} s: {why}; nothing "
        "was assigned, the container is not created now and kubelet retries it"
    ),
    ev.StartContainer: lambda who, budget, why: (
        f"exclusive CPUs for {who} could not be decided within {budget:g} s: {why}; nothing "
        "was assigned, the container is not started now and kubelet retries it"
    ),
    ev.UpdateContainer: lambda who, budget, why: (
        f"the CPU resize of {who} could not be decided within {budget:g} s: {why}; its CPUs "
        "are unchanged and kubelet retries the resize"
    ),
}
