"""Deadline discipline: every NRI request is answered within its budget, decided or not.

The runtime waits ``plugin_request_timeout`` (2 s by default, containerd and CRI-O alike) for
each answer.  A request left unanswered past it makes the runtime drop the plugin, and the
containers created meanwhile start unpinned.  Three of the daemon's waits can outlast it, and
none can be interrupted: the state lock (another nri-cpuplugin process - a hook, the CLI -
holds it), the durable commit (fsync on a slow disk) and netlink (NIC locality).  So:

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
  UpdateContainer resizing around exclusive CPUs        an error (kubelet retries the resize)
  UpdateContainer otherwise                             the current cpuset, kept
  StopContainer, Synchronize                            no updates
  RemoveContainer, RemovePodSandbox, UpdatePodSandbox   (empty)
  ====================================================  ===================================

* **The job goes on, and what it does late agrees with the answer** (``deadline-late``): an
  exclusive decision answered with an error is not made - checked when the job starts, once
  it holds the lock and just before the commit - or released again at once if its commit was
  already under way; everything else is committed when the job gets there (a release is
  never dropped), and the cpusets its reply would have carried go out as an unsolicited
  UpdateContainers.

The worker waits for the state lock as long as it takes: the budget, not the lock's timeout,
decides when the runtime is answered, and late work must not be lost to a busy lock.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
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
from .plugin import CPUPlugin, _fill

log = logging.getLogger("nri_cpuplugin")

# The budget's share of the runtime's request timeout, when that is the shorter bound.
BUDGET_SHARE = 0.75
# How long a handler blocks the event loop for its job before awaiting it instead: far above
# a normal job (about a millisecond), so the cheaper blocking hand-off serves nearly all.
FAST_WAIT = 0.02
# At exit, how long to wait for work already answered (a late release) to be committed.
DRAIN_TIMEOUT = 5.0

# What a job is doing: its phase, and so the REASON of a deadline miss.
QUEUED = "queued"  # behind another job (the miss is then reported with that job's phase)
DECIDING = "deciding"
STATE_LOCK = "state-lock"
COMMIT = "commit"
NIC = "nic"

# How the runtime was answered when the budget ran out first.
ERROR = "error"  # the operation failed: nothing the job decides may stay in force
FALLBACK = "fallback"  # answered as well as could be without the job: the job's result stands


class Abandoned(Exception):
    """Raised in the worker instead of going on with a job whose request was already answered
    with an error: the runtime is not creating (or resizing) that container after all."""


class Job:
    """One piece of the daemon's work, run by the Worker.

    ``answer`` is "" while the job may still answer its request itself, or how the request
    was answered when the budget ran out first (ERROR or FALLBACK); ``late`` then runs in the
    worker when the job ends, and ``on_end`` on the event loop after it (for a job nobody
    awaits: whenever it ends)."""

    __slots__ = (
        "_finished",
        "_lock",
        "_waiter",
        "answer",
        "answered_at",
        "answered_cpus",
        "args",
        "awaited",
        "deciding",
        "done",
        "error",
        "fn",
        "late",
        "loop",
        "name",
        "on_end",
        "phase",
        "pushes",
        "refusable",
        "result",
        "subject",
        "submitted",
        "tracked_before",
    )

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple,
        loop: asyncio.AbstractEventLoop,
        awaited: bool,
    ) -> None:
        self.name = name
        self.fn = fn
        self.args = args
        self.loop = loop
        self.awaited = awaited
        # An error answer means the runtime's operation did not happen (a creation, a resize):
        # the job then does nothing it has not done yet.
        self.refusable = False
        self.deciding = False  # running its function (not its late part, which must finish)
        self.submitted = time.monotonic()
        self.phase = QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.pushes: list[pb.ContainerUpdate] = []  # sent after the answer, never inside it
        self.late: Callable[[Job], None] | None = None
        self.on_end: Callable[[Job], None] | None = None
        self.answer = ""
        self.answered_at = 0.0
        self.answered_cpus = ""  # a shared creation answered with the pool: which CPUs
        self.subject = name  # what the request was about, for the audit trail
        self.tracked_before = False  # a creation: the container was tracked already
        self._lock = _thread.allocate_lock()
        self._finished = False
        self._waiter: asyncio.Future[bool] | None = None
        # Held until the job has ended: what a handler blocks on (the cheap hand-off).
        self.done = _thread.allocate_lock()
        self.done.acquire()

    def abandon(self, answer: str) -> bool:
        """The request was answered without the job (ERROR or FALLBACK).  False when the job
        ended meanwhile: its own result answers then."""
        with self._lock:
            if self._finished:
                return False
            self.answer = answer
            self.answered_at = time.monotonic()
            return True

    def _wait_with(self, waiter: asyncio.Future[bool]) -> bool:
        """Have the worker wake ``waiter`` when the job ends; False when it has already."""
        with self._lock:
            if self._finished:
                return False
            self._waiter = waiter
            return True

    def _finish(self) -> tuple[bool, asyncio.Future[bool] | None]:
        """(ended before its request was answered without it, who waits on the loop)."""
        with self._lock:
            self._finished = True
            return not self.answer, self._waiter

    def abandoned_check(self) -> None:
        """Raise Abandoned when the request was answered with an error: from then on the job
        does nothing more (checked before it starts, after it takes the lock, before an
        exclusive commit)."""
        if self.deciding and self.answer == ERROR:
            raise Abandoned(f"{self.name} was answered with an error before it was decided")

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Worker:
    """The thread that runs the daemon's jobs, one at a time, in the order submitted.

    Started with the first job; a daemon thread, so a job stuck in the kernel cannot keep the
    process from exiting.  Idle, it sleeps on its queue and wakes nobody.

    Both threads stay on one CPU while a handler waits for its job: the worker follows the
    CPU the event loop submits from, and the loop keeps to it until the job is done (its own
    affinity is restored then).  The loop only waits meanwhile, so no parallelism is lost,
    while a job on the other CPU - cold caches, an idle CPU to wake, the loop woken on yet
    another - measured 150 us slower per request here, where the hand-off itself is 20 us."""

    def __init__(self, name: str = "nri-cpuplugin-worker") -> None:
        self.name = name
        self.current: Job | None = None
        self._queue: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cpu = -1  # the CPU the thread is pinned to (-1: none)

    def submit(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        awaited: bool = True,
        late: Callable[[Job], None] | None = None,
        on_end: Callable[[Job], None] | None = None,
        refusable: bool = False,
    ) -> Job:
        """Queue ``fn(*args)``; call from the event loop.  ``awaited``: a handler waits for it
        (see ``finished``); ``late``, ``on_end`` and ``refusable``: see Job."""
        job = Job(name, fn, args, asyncio.get_running_loop(), awaited)
        job.late, job.on_end, job.refusable = late, on_end, refusable
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._follow()
        self._queue.put(job)
        return job

    def _follow(self) -> None:
        """Pin the thread to the CPU this (the loop's) thread is on, when that changed."""
        cpu = _current_cpu()
        if cpu == self._cpu or cpu < 0 or self._thread is None:
            return
        try:
            os.sched_setaffinity(self._thread.native_id, (cpu,))
        except OSError:  # gone offline meanwhile, say: no pinning until the next change
            cpu = -1
        self._cpu = cpu

    def job_here(self) -> Job | None:
        """The running job, when called from the worker thread itself (else None)."""
        thread = self._thread
        if thread is None or thread.ident != _thread.get_ident():
            return None
        return self.current

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            self.current = job
            job.phase = DECIDING
            job.deciding = True
            try:
                job.abandoned_check()
                job.result = job.fn(*job.args)
            except Exception as err:
                job.error = err
            job.deciding = False
            in_time, waiter = job._finish()
            job.done.release()
            if not in_time and job.late is not None:
                try:
                    job.late(job)
                except Exception:  # the worker must outlive a bug in one job
                    log.exception("finishing %s after its deadline failed", job.name)
            self.current = None
            if not job.awaited and job.error is not None:
                log.error("%s failed: %s", job.name, job.error)
            if in_time and job.awaited:
                if waiter is not None:
                    _call_soon(job.loop, _resolve, waiter, True)
            elif job.on_end is not None:
                _call_soon(job.loop, job.on_end, job)

    async def finished(self, job: Job, budget: float | None) -> bool:
        """Whether ``job`` ended within ``budget`` seconds of its submission (None: no limit,
        the caller's own timeout applies); its result or error is in it then."""
        wait = FAST_WAIT if budget is None else min(FAST_WAIT, budget)
        mask = _keep_to(self._cpu)
        try:
            done = job.done.acquire(True, wait)
        finally:
            if mask is not None:
                _restore(mask)
        if done:
            return True
        # Slow: free the event loop (metrics, the runtime's replies, hotplug) meanwhile.
        waiter = job.loop.create_future()
        if not job._wait_with(waiter):
            return True
        timer = None
        if budget is not None:
            remaining = budget - (time.monotonic() - job.submitted)
            timer = job.loop.call_later(max(0.0, remaining), _resolve, waiter, False)
        try:
            return await waiter
        except asyncio.CancelledError:
            # The stub's guard answered with an error, or the connection went.
            job.abandon(ERROR if job.refusable else FALLBACK)
            raise
        finally:
            if timer is not None:
                timer.cancel()


def _cpu_getter() -> Callable[[], int]:
    try:
        import ctypes

        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):  # not glibc or musl: the worker is not pinned
        return lambda: -1
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = ()
    return getcpu


# The calling thread's CPU (-1 when it cannot be told), for Worker._follow.
_current_cpu = _cpu_getter()


def _keep_to(cpu: int) -> set[int] | None:
    """Keep the calling thread on ``cpu``; the affinity to restore, or None if unchanged."""
    if cpu < 0:
        return None
    try:
        mask = os.sched_getaffinity(0)
        if mask != {cpu}:
            os.sched_setaffinity(0, (cpu,))
            return mask
    except OSError:
        pass
    return None


def _restore(mask: set[int]) -> None:
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, mask)


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: the daemon is exiting
        log.debug("not delivered after the event loop closed: %s", callback)


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
        job = self.worker.job_here()
        if job is None:
            return super().commit(state)
        job.phase = COMMIT
        try:
            return super().commit(state)
        finally:
            job.phase = DECIDING


class DeadlinePlugin(CPUPlugin):
    """The daemon's plugin: CPUPlugin's decisions, made on the worker thread and answered
    within the budget (see the module docstring)."""

    def __init__(self, settings: Settings, audit: Audit, flags: Mapping[str, Any] = ()) -> None:
        self.worker = Worker()
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

    async def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        # Settings and the state are the worker's, where a late job of the last connection may
        # still run.  No budget: a Configure that cannot finish is no connection at all, and the
        # stub's guard answers it.
        job = self.worker.submit("Configure", self._apply_config, config)
        await self.worker.finished(job, None)
        job.outcome()
        await super().configure(config, runtime_name, runtime_version)

    async def create_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        job = self.worker.submit(
            "CreateContainer", self._create_job, pod, container,
            late=self._create_late, on_end=self._late_sent, refusable=True,
        )  # fmt: skip
        budget = self.budget
        if await self.worker.finished(job, budget):
            return self._deliver(job)
        workload = from_nri(pod, container)
        job.subject = describe(workload)
        try:
            exclusive = self.policy.eligibility(workload)[0] is not None
        except PolicyError:
            exclusive = True  # refused by its annotations: no answer but an error is right
        if exclusive:
            if not job.abandon(ERROR):
                return self._deliver(job)
            self.metrics.pinning_request()
            self.metrics.pinning_error()
            why = self._missed(job, budget, "an error", workload.identity())
            raise PolicyError(
                f"exclusive CPUs for {job.subject} could not be decided within {budget:g} s: "
                f"{why}; nothing was assigned, the container is not created now and kubelet "
                "retries it",
                "deadline",
            )
        target = self.engine.target(self.state, container.id)
        job.answered_cpus = str(target.cpus)  # before abandon(): the late job compares with it
        if not job.abandon(FALLBACK):
            return self._deliver(job)
        adjust = pb.ContainerAdjustment()
        _fill(adjust.linux.resources.cpu, target)
        self._missed(
            job, budget, f"the shared pool {target.cpus}", workload.identity(), cpus=target.cpus
        )
        return adjust, []

    async def update_container(
        self, pod: pb.PodSandbox, container: pb.Container, resources: pb.LinuxResources
    ) -> list[pb.ContainerUpdate]:
        job = self.worker.submit(
            "UpdateContainer", super().update_container, pod, container, resources,
            late=self._replay_late, on_end=self._late_sent, refusable=True,
        )  # fmt: skip
        budget = self.budget
        if await self.worker.finished(job, budget):
            return self._deliver(job)
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
                return self._deliver(job)
            why = self._missed(job, budget, "an error", workload.identity())
            raise PolicyError(
                f"the CPU resize of {job.subject} could not be decided within {budget:g} s: "
                f"{why}; its CPUs are unchanged and kubelet retries the resize",
                "deadline",
            )
        targets = self.engine.update(self.state, container.id).targets
        if not job.abandon(FALLBACK):
            return self._deliver(job)
        self._missed(job, budget, "its cpuset kept", workload.identity())
        return [self._update(t, ignore_failure=False) for t in targets]

    async def stop_container(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> list[pb.ContainerUpdate]:
        subject = f"container {container.name!r} of pod {pod.namespace}/{pod.name}"
        return await self._answered(
            "StopContainer", super().stop_container, (pod, container), [], subject, container.id
        )

    async def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        subject = f"container {container.name!r} of pod {pod.namespace}/{pod.name}"
        await self._answered(
            "RemoveContainer", super().remove_container, (pod, container), None, subject,
            container.id,
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
        return await self.worker.finished(self.worker.submit("drain", _nothing), timeout)

    # --- the work, on the worker thread ----------------------------------------------------------

    def _create_job(
        self, pod: pb.PodSandbox, container: pb.Container
    ) -> tuple[pb.ContainerAdjustment, list[pb.ContainerUpdate]]:
        job = self.worker.current
        state = self.state
        if job is not None and state is not None:
            # A repeated creation of a tracked container answered with an error must not
            # release what it already held.
            job.tracked_before = container.id in state.assignments or container.id in state.sharing
        return super().create_container(pod, container)

    def _commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
        if durable and outcome.state is not self.state:
            job = self.worker.job_here()
            if job is not None:
                # Checked under the lock, before the commit: past this point the decision is
                # durable and _create_late releases it again instead.
                job.abandoned_check()
        return super()._commit(outcome, durable)

    def _nic_locality(self, pod: pb.PodSandbox, workload: Workload) -> nic.Locality | None:
        job = self.worker.job_here()
        if job is None:
            return super()._nic_locality(pod, workload)
        job.phase = NIC
        try:
            return super()._nic_locality(pod, workload)
        finally:
            job.phase = DECIDING

    def _push(self, targets: Iterable[Target]) -> None:
        job = self.worker.job_here()
        if job is None:
            super()._push(targets)
            return
        # Sent when the job has answered (or ended), never from the worker thread itself.
        job.pushes += [self._update(t) for t in self._write_followers(targets)]

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
            if job.tracked_before or (cid not in state.assignments and cid not in state.sharing):
                what = "nothing to undo"
            else:
                # The runtime is not creating it: what was committed for it goes again.
                held = state.assignments.get(cid)
                with self.store.locked():
                    outcome = self._commit(self.engine.stop(self.state, cid))
                self._spec_lags.discard(cid)
                self.audit.emit(outcome.events)
                self._push(outcome.targets)
                what = (
                    f"its exclusive CPUs {held.cpus} were released again"
                    if held is not None
                    else "its record was dropped again"
                )
        else:
            adjust, updates = job.result
            cpu = adjust.linux.resources.cpu
            if cpu.cpus != job.answered_cpus:
                # The pool moved while it waited (an earlier late job): the runtime may already
                # know the container by then; if not, it follows the pool's next change.
                update = pb.ContainerUpdate(container_id=cid, ignore_failure=True)
                update.linux.resources.cpu.CopyFrom(cpu)
                job.pushes.append(update)
            job.pushes += updates
            what = f"recorded in the shared pool {cpu.cpus}"
        self._late_record(job, what)

    def _replay_late(self, job: Job) -> None:
        """Any other request that ended after it was answered without it: what its reply
        would have carried goes out as an unsolicited update."""
        if job.error is not None:
            what = (
                "nothing was changed"
                if isinstance(job.error, Abandoned)
                else f"it failed: {job.error}"
            )
        else:
            if isinstance(job.result, list):
                job.pushes += job.result
            what = "committed"
        if job.pushes:
            what += f", {len(job.pushes)} cpusets sent to the runtime"
        self._late_record(job, what)

    def _late_record(self, job: Job, what: str) -> None:
        late = time.monotonic() - job.answered_at
        subject = job.subject
        if subject == job.name and len(job.args) > 1 and isinstance(job.args[1], pb.Container):
            # Answered by the stub's guard, not by us: named here, off the fast path.
            pod, container = job.args[:2]
            subject = f"container {container.name!r} of pod {pod.namespace}/{pod.name}"
        self.audit.record(
            "deadline-late",
            f"{job.name} of {subject} ended {late:.2f} s after it was answered with "
            f"{'an error' if job.answer == ERROR else 'a fallback'}: {what}",
            audit_mod.NOTICE,
            event=job.name,
            late_seconds=f"{late:.3f}",
        )

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
        job = self.worker.submit(name, fn, *args, late=self._replay_late, on_end=self._late_sent)
        budget = self.budget
        if await self.worker.finished(job, budget):
            return self._deliver(job)
        job.subject = subject  # before abandon(): the late job's record names it
        if not job.abandon(FALLBACK):
            return self._deliver(job)
        answered = "no updates" if fallback is not None else "an empty reply"
        self._missed(job, budget, answered, {"container_id": container_id})
        return fallback

    def _deliver(self, job: Job) -> Any:
        """A job's own answer; what it must tell the runtime besides goes out right after."""
        self._send(job.pushes)
        return job.outcome()

    def _send(self, updates: list[pb.ContainerUpdate]) -> None:
        if updates and self.stub is not None:
            self.stub.schedule_update_containers(updates, self._updates_done)

    def _late_sent(self, job: Job) -> None:
        self._send(job.pushes)

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
        if phase == QUEUED:
            return phase, "waiting for the worker thread"
        return DECIDING, "deciding"

    def _eligible(self, workload: Workload) -> bool:
        try:
            return self.policy.eligibility(workload)[0] is not None
        except PolicyError:
            return True

    # --- background work: also the worker's, since it touches the state -----------------------

    def cpu_events(self, events: list[Any]) -> None:
        self.worker.submit(
            "hotplug", super().cpu_events, events, awaited=False, on_end=self._late_sent
        )

    def _schedule_eviction_rechecks(self, cids: list[str]) -> None:
        job = self.worker.job_here()
        if job is None:
            super()._schedule_eviction_rechecks(cids)
        else:  # the timers live on the event loop
            _call_soon(job.loop, super()._schedule_eviction_rechecks, cids)

    def _recheck_evictions(self, cids: list[str]) -> None:
        self.worker.submit(
            "hotplug", super()._recheck_evictions, cids, awaited=False, on_end=self._late_sent
        )

    def _sweep(self, loop: Any) -> None:
        # _sweeping stays set until the round has ended: one chain of sweeps at a time.
        self.worker.submit("sweep", self._sweep_round, loop, awaited=False, on_end=self._late_sent)

    def _sweep_round(self, loop: Any) -> None:
        more = self._sweep_once()
        _call_soon(loop, self._swept, loop, more)

    def _swept(self, loop: Any, more: bool) -> None:
        self._sweeping = False
        if more:
            self._sweep_later(loop)


def _nothing() -> None:
    return None
