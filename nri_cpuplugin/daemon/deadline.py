"""Deadline discipline: every NRI request is answered within its budget, decided or not.

The runtime waits ``plugin_request_timeout`` (2 s by default, containerd and CRI-O alike) for
each answer.  A request left unanswered past it makes the runtime drop the plugin, and the
containers created meanwhile start unpinned.  Four of the daemon's waits can outlast it, and
none can be interrupted: the state lock (another nri-cpuplugin process - a hook, the CLI -
holds it), the durable commit (fsync on a slow disk), netlink (NIC locality) and the shared
containers' cgroup writes that precede a creation's answer.  So:

* **One worker thread does the daemon's work**: every handler's, the background sweep's and
  CPU hotplug's, one job at a time, in the order the events came.  The state is not
  thread-safe, and a release must never overtake the creation it follows.
* **The handler waits for its job with a budget**: ``nri.request_budget`` (1.5 s), or 75 % of
  the runtime's request timeout when that is shorter (NRI >= 0.7 says it in Configure), which
  keeps it below the stub's last-resort guard (``stub.DEADLINE_SHARE``).  It first blocks for
  up to ``FAST_WAIT``, which costs one thread hand-off each way on one CPU (tens of
  microseconds, the price every request pays; see Worker); a job still running then frees
  the event loop and is awaited.
* **A job not done within the budget is answered without it**, audited (``deadline``, its
  ``REASON`` saying what the job was waiting for) and counted
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
  StopContainer, Synchronize                            no updates
  RemoveContainer, RemovePodSandbox, UpdatePodSandbox   (empty)
  ====================================================  ===================================

  (RunPodSandbox is answered at once, on the event loop: it only starts reading the pod's
  interfaces in the background, daemon/pod_nics.py.)

* **The job goes on, and what it does late agrees with the answer** (``deadline-late``): an
  exclusive decision answered with an error is not made - checked when the job starts, once
  it holds the lock and just before the commit - or undone at once if its commit was already
  under way (a creation's CPUs released, a resize's previous CPUs restored); everything else
  is committed when the job gets there (a release is never dropped), and the cpusets its
  reply would have carried are written directly or owed to the runtime's next reply (never
  an unsolicited UpdateContainers, which deadlocks containerd).

The worker waits for the state lock as long as it takes: the budget, not the lock's timeout,
decides when the runtime is answered, and late work must not be lost to a busy lock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..core.engine import Outcome, Target
from ..core.policy import PolicyError, describe
from ..core.workload import Workload, from_nri
from ..hardware import nic
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod
from ..ops.audit import Audit
from ..ops.config import Settings
from ..storage.store import CommitTiming, StateStore
from . import earmarks
from .late import LateWork, subject_of
from .plugin import CPUPlugin
from .targets import fill_cpu
from .worker import (
    CGROUPS,
    COMMIT,
    DECIDING,
    ERROR,
    FALLBACK,
    NIC,
    QUEUED,
    STATE_LOCK,
    Job,
    Worker,
    _call_soon,
)  # fmt: skip

log = logging.getLogger("nri_cpuplugin")

# The budget's share of the runtime's request timeout, when that is the shorter bound.
BUDGET_SHARE = 0.75
# At exit, how long to wait for work already answered (a late release) to be committed.
DRAIN_TIMEOUT = 5.0


class PhasedStore(StateStore):
    """The state store as the worker uses it: the lock is waited for as long as it takes, and
    the running job knows what it waits for (the REASON of a deadline miss)."""

    def __init__(self, state_dir: str, worker: Worker) -> None:
        super().__init__(state_dir, lock_timeout=-1)
        self.worker = worker

    @contextlib.contextmanager
    def locked(self, timeout: float | None = None) -> Iterator[StateStore]:
        job = self.worker.job_here()
        if job is None or self.holds_lock():
            with super().locked(timeout) as store:
                yield store
            return
        job.phase = STATE_LOCK
        with super().locked(timeout) as store:
            job.phase = DECIDING
            job.abandoned_check()  # nothing decided once the runtime has been told no
            yield store

    def commit(self, state: Any) -> CommitTiming:
        with self.worker.phase(COMMIT):
            return super().commit(state)


class DeadlinePlugin(LateWork, CPUPlugin):
    """The daemon's plugin: CPUPlugin's decisions, made on the worker thread and answered
    within the budget (see the module docstring)."""

    def __init__(self, settings: Settings, audit: Audit, flags: Mapping[str, Any] = ()) -> None:
        self.worker = Worker()
        # While a creation answered from its pod's earmark is decided: (its id, that answer).
        self._early: tuple[str, pb.ContainerAdjustment] | None = None
        super().__init__(settings, audit, flags)

    def _build(self, settings: Settings) -> None:
        super()._build(settings)
        self.store = PhasedStore(settings.state_dir, self.worker)

    @property
    def budget(self) -> float:
        """Seconds within which each request is answered."""
        budget = self.settings.nri_request_budget
        timeout = getattr(self.stub, "request_timeout", None)
        if timeout:
            budget = min(budget, timeout * BUDGET_SHARE)
        return budget

    # --- NRI handlers --------------------------------------------------------------------------

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> int | None:
        # Settings and the state are the worker's, where a late job of the last connection may
        # still run.  No budget: a Configure that cannot finish is no connection at all, and the
        # stub's guard answers it.
        job = self.worker.submit("Configure", self._apply_config, config)
        await self.worker.finished(job, None)
        job.outcome()
        return await super().configure(config, runtime_name, runtime_version)

    async def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        if (early := self._earmarked_now(pod, container)) is not None:
            return early, []
        job, workload = await self._decision(
            "CreateContainer", self._create_job, self._create_late, pod, container, "created"
        )
        if workload is None:
            return job.outcome()
        target = self.engine.target(self.state, container.id)
        job.answered_cpus = str(target.cpus)  # before abandon(): the late job compares with it
        if not job.abandon(FALLBACK):
            return job.outcome()
        adjust = pb.ContainerAdjustment()
        fill_cpu(adjust.linux.resources.cpu, target)
        answered = f"the shared pool {target.cpus}"
        self._missed(job, self.budget, answered, workload.identity(), cpus=target.cpus)
        return adjust, []

    def _earmarked_now(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> pb.ContainerAdjustment | None:
        """The earmark's answer on the event loop while the worker is idle (the state is then
        current), the decision queued after the reply (docs/architecture.md, "Earmarks")."""
        early = self._earmarked(pod, container) if self.worker.idle() else None
        if early is not None:
            self.worker.submit(
                "CreateContainer", self._decide_answered, pod, container, early, answered=True
            )
        return early

    async def update_container(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        job = self.worker.submit(
            "UpdateContainer", self._update_job, pod, container, resources,
            late=self._update_late, refusable=True,
        )  # fmt: skip
        budget = self.budget
        if await self.worker.finished(job, budget):
            return job.outcome()
        updated = pb.Container()
        updated.CopyFrom(container)
        updated.linux.resources.CopyFrom(resources)
        workload = from_nri(pod, updated)
        job.subject = describe(workload)
        # A new CPU request around exclusive CPUs is a decision only the job can make: refused,
        # kubelet retries the resize.  Anything else keeps the cpuset, which is all it would do.
        resize = bool(resources.cpu.shares.value) and (
            container.id in self.state.assignments or self._eligible(workload)
        )
        if resize:
            if not job.abandon(ERROR):
                return job.outcome()
            why = self._missed(job, budget, "an error", workload.identity())
            raise PolicyError(
                f"the CPU resize of {job.subject} could not be decided within {budget:g} s: "
                f"{why}; its CPUs are unchanged and kubelet retries the resize",
                "deadline",
            )
        targets = self.engine.update(self.state, container.id).targets
        if not job.abandon(FALLBACK):
            return job.outcome()
        self._missed(job, budget, "its cpuset kept", workload.identity())
        return [self._update(t, ignore_failure=False) for t in targets]

    async def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        return await self._answered(
            "StopContainer", super().stop_container, (pod, container), [],
            subject_of(pod, container), container.id,
        )  # fmt: skip

    async def start_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        if not self._decides_at_start(container.id):
            await self._answered(
                "StartContainer", super().start_container, (pod, container), None,
                subject_of(pod, container), container.id,
            )  # fmt: skip
            return
        # [nri] pin_at = "start": this decides the container, missed as a creation is.
        job, workload = await self._decision(
            "StartContainer", self._start_job, self._start_late, pod, container, "started"
        )
        if workload is None or not job.abandon(FALLBACK):
            return job.outcome()
        # It starts on its pod's CPUs; the job writes the shared pool when it ends.
        self._missed(job, self.budget, "an empty reply", workload.identity())

    async def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        await self._answered(
            "RemoveContainer", super().remove_container, (pod, container), None,
            subject_of(pod, container), container.id,
        )  # fmt: skip

    async def run_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        self._read_nics_ahead(pod)  # it only starts a read: on the event loop
        limit = self._earmark_limit(pod)
        if limit:
            await self._answered(
                "RunPodSandbox", self._earmark, (pod, limit), None,
                f"pod {pod.namespace}/{pod.name}",
            )  # fmt: skip

    async def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        await self._answered(
            "RemovePodSandbox", super().remove_pod_sandbox, (pod,), None,
            f"pod {pod.namespace}/{pod.name}",
        )  # fmt: skip

    async def update_pod_sandbox(
        self, pod: pb.PodSandbox, overhead: pb.LinuxResources, resources: pb.LinuxResources
    ) -> None:
        await self._answered(
            "UpdatePodSandbox", super().update_pod_sandbox, (pod, overhead, resources), None,
            f"pod {pod.namespace}/{pod.name}",
        )  # fmt: skip

    async def synchronize(
        self, pods: Iterable[pb.PodSandbox], containers: Iterable[pb.Container]
    ) -> list[pb.ContainerUpdate]:
        containers = list(containers)
        return await self._answered(
            "Synchronize", super().synchronize, (list(pods), containers), [],
            f"the runtime's {len(containers)} containers",
        )  # fmt: skip

    async def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Wait up to ``timeout`` for the work queued so far - a late release, say - to be
        done, before the daemon exits; whether it was."""
        return await self.worker.finished(self.worker.submit("drain", self._write_held), timeout)

    # --- the work, on the worker thread ----------------------------------------------------------

    def _create_job(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        job = self.worker.current
        if job is not None:
            job.before = self.state
        early = self._earmarked(pod, container) if job is not None else None
        if early is None:
            return super().create_container(pod, container)
        # Answered now; the decision, made next as for any creation, normally says the same.
        self.worker.deliver((early, []))
        return self._decide_answered(pod, container, early)

    def _start_job(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        job = self.worker.current
        if job is not None:
            job.before = self.state
        super().start_container(pod, container)

    def _decide_answered(
        self, pod: pb.PodSandbox, container: pb.Container, early: pb.ContainerAdjustment
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        self._early = (container.id, early)
        try:
            return super().create_container(pod, container)
        finally:
            self._early = None

    def _earmarked(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> pb.ContainerAdjustment | None:
        if self._owed or not self.runtime_lists:
            # The reply must carry the owed updates; without the runtime's lists at each
            # connection the decision must be durable before the answer.
            return None
        return earmarks.early_answer(
            self.engine, self.state, pod, container, self.returned | self.pinned
        )

    def _update_job(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        job = self.worker.current
        if job is not None:
            job.before = self.state
        try:
            return super().update_container(pod, container, resources)
        finally:
            if job is not None:
                job.after = self.state

    def _answer(self, reply: object) -> bool:
        job = self.worker.job_here()
        if job is None:
            return True
        if self._early is None:
            return self.worker.deliver(reply) or job.answer != ERROR
        cid, early = self._early
        adjust, updates = reply  # type: ignore[misc]
        if adjust.linux.resources.cpu != early.linux.resources.cpu or updates:
            # Decided otherwise (NIC locality, say): its StartContainer finds its cgroup on
            # the earmarked CPUs and writes what was decided, before its first instruction;
            # the runtime's stored specs get it with the next reply that can carry updates.
            self._owed |= {cid, *(u.container_id for u in updates)}
            self.audit.record(
                "earmark",
                f"container {cid[:12]} was answered with the CPUs earmarked for its pod "
                f"({early.linux.resources.cpu.cpus}), but decided on "
                f"{adjust.linux.resources.cpu.cpus}: set right when it starts",
                audit_mod.NOTICE,
                container_id=cid,
                cpus=adjust.linux.resources.cpu.cpus,
                reason="decided otherwise",
            )
        return True

    def _commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
        if durable and outcome.state is not self.state:
            job = self.worker.job_here()
            if job is not None:
                # Checked under the lock, before the commit: past this point the decision is
                # durable and _create_late releases it again instead.
                job.abandoned_check()
        return super()._commit(outcome, durable)

    def _nic_locality(self, pod: pb.PodSandbox, workload: Workload) -> nic.Locality | None:
        with self.worker.phase(NIC):
            return super()._nic_locality(pod, workload)

    def _write_direct(self, direct: list[Target]) -> list[Target]:
        with self.worker.phase(CGROUPS):
            return super()._write_direct(direct)

    # --- on the event loop ---------------------------------------------------------------------

    async def _answered(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple,
        fallback: Any,
        subject: str,
        container_id: str = "",
    ) -> Any:
        """Run ``fn(*args)`` on the worker; ``fallback`` if it is not done within the budget
        (the job goes on and its effects are sent when it ends)."""
        job = self.worker.submit(name, fn, *args, late=self._replay_late)
        budget = self.budget
        if await self.worker.finished(job, budget):
            return job.outcome()
        job.subject = subject  # before abandon(): the late job's record names it
        if not job.abandon(FALLBACK):
            return job.outcome()
        answered = "no updates" if fallback is not None else "an empty reply"
        self._missed(job, budget, answered, {"container_id": container_id})
        return fallback

    def _missed(
        self, job: Job, budget: float, answered: str, identity: Mapping[str, Any], **fields: Any
    ) -> str:
        """Audit and count a request answered without its job; returns why it was late."""
        code, why = self._why(job)
        self.metrics.deadline_missed(job.name, code)
        self.audit.record(
            "deadline",
            f"{job.name} of {job.subject} was not decided within {budget:g} s ({why}): "
            f"answered with {answered}; the work goes on and is done when it can be",
            audit_mod.WARNING,
            reason=code,
            event=job.name,
            budget_seconds=f"{budget:g}",
            **identity,
            **fields,
        )
        return why

    async def _decision(
        self,
        name: str,
        fn: Callable[..., Any],
        late: Callable[[Job], None],
        pod: pb.PodSandbox,
        container: pb.Container,
        verb: str,
    ) -> tuple[Job, Workload | None]:
        """A container's decision on the worker, within the budget: (job, None) when the job's
        outcome is the answer; (job, workload) when a shared container's fallback is the
        caller's to give.  An exclusive candidate not decided in time is refused: kubelet
        retries it."""
        job = self.worker.submit(name, fn, pod, container, late=late, refusable=True)
        budget = self.budget
        if await self.worker.finished(job, budget):
            return job, None
        workload = from_nri(pod, container)
        job.subject = describe(workload)
        if not self._eligible(workload):
            return job, workload
        if not job.abandon(ERROR):
            return job, None  # it ended meanwhile
        self.metrics.pinning_request()
        self.metrics.pinning_error()
        why = self._missed(job, budget, "an error", workload.identity())
        raise PolicyError(
            f"exclusive CPUs for {job.subject} could not be decided within {budget:g} s: {why}; "
            f"nothing was assigned, the container is not {verb} now and kubelet retries it",
            "deadline",
        )

    def _why(self, job: Job) -> tuple[str, str]:
        """(reason code, what the job waits for): its own phase, or the phase of the job it
        is queued behind (the cause an operator can act on)."""
        phase = job.phase
        ahead = self.worker.current
        if phase == QUEUED and ahead is not None and ahead is not job:
            code, why = self._phase_why(ahead.phase)
            return code, f"it waits behind an earlier {ahead.name}, {why}"
        return self._phase_why(phase)

    def _phase_why(self, phase: str) -> tuple[str, str]:
        if phase == STATE_LOCK:
            path = self.store.lock_path
            return phase, (
                f"waiting for the state lock {path}, which another nri-cpuplugin process holds "
                f"(`fuser -v {path}` shows which)"
            )
        if phase == COMMIT:
            return phase, (
                f"writing {self.store.state_path} durably: the disk is slow to sync, check it"
            )
        if phase == NIC:
            return phase, "reading the pod's network interfaces over netlink"
        if phase == CGROUPS:
            return phase, (
                "writing the shared containers' cpusets: the kernel is slow to apply them "
                "(a cgroup operation stuck on this node?)"
            )
        if phase == QUEUED:
            return phase, "waiting for the worker thread"
        return DECIDING, "deciding"

    def _eligible(self, workload: Workload) -> bool:
        """An exclusive candidate; so is one its annotations make the policy refuse (no answer
        but an error is right for it)."""
        try:
            return self.policy.eligibility(workload)[0] is not None
        except PolicyError:
            return True

    # --- background work: also the worker's, since it touches the state -----------------------

    def cpu_events(self, events: list[Any]) -> None:
        self.worker.submit("hotplug", super().cpu_events, events, awaited=False)

    def _schedule_eviction_rechecks(self, cids: list[str]) -> None:
        job = self.worker.job_here()
        if job is None:
            super()._schedule_eviction_rechecks(cids)
        else:  # the timers live on the event loop
            _call_soon(job.loop, super()._schedule_eviction_rechecks, cids)

    def _recheck_evictions(self, cids: list[str]) -> None:
        self.worker.submit("hotplug", super()._recheck_evictions, cids, awaited=False)

    def _sweep(self, loop: Any) -> None:
        # _sweeping stays set until the round has ended: one chain of sweeps at a time.
        self.worker.submit("sweep", self._sweep_round, loop, awaited=False)

    def _sweep_round(self, loop: Any) -> None:
        more = False
        try:
            more = self._sweep_once()
        finally:  # a round that failed ends the chain, and the next start begins a new one
            _call_soon(loop, self._swept, loop, more)

    def _swept(self, loop: Any, more: bool) -> None:
        self._sweeping = False
        if more:
            self._sweep_later(loop)
