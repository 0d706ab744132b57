"""The daemon's worker thread: jobs run one at a time, in order, and a handler waits for its
job within a budget (daemon/deadline.py says what is answered when the budget runs out).

A job's *phase* says what it is waiting for, so that a missed deadline can name its cause;
its *answer* says how its request was answered without it, so that what it does late agrees.

**Requests first.**  Two queues: the *jobs* - the runtime's requests, what they do after
their answers, the events whose order matters (a disconnection, CPU hotplug) - run in the
order submitted; *upkeep* (daemon/background.py: interrupt narrowing and rescans, the sweep,
eviction rechecks) runs in steps, one step at a time and only while no job is queued.  A step
stops at its next bounded point once a job is queued (``waiting``), so a request waits for at
most the write or read a step is in, never for the whole of the node's upkeep.  Upkeep runs in
the order queued, each item to its end before the next (``drain`` waits behind all of it).
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .job import ERROR, FALLBACK, Job
from .progress import DECIDING

log = logging.getLogger("nri_cpuplugin")

# How long a handler blocks the event loop for its job before awaiting it instead: far above
# a normal job (about a millisecond), so the cheaper blocking hand-off serves nearly all.
FAST_WAIT = 0.02


class Worker:
    """The thread that runs the daemon's jobs, one at a time, in the order submitted, and its
    upkeep between them (see the module text).

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
        # Jobs, and None: a wake-up for upkeep queued while the thread sleeps on its queue.
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._upkeep: collections.deque[Job] = collections.deque()  # the head is stepping
        self._stepping = False  # a step of upkeep runs now
        self._thread: threading.Thread | None = None
        self._cpu = -1  # the CPU the thread is pinned to (-1: none)
        # Jobs of requests answered already, queued on the event loop's next turn (after the
        # answer is written) or before any later job, whichever comes first.
        self._after_answer: list[Job] = []
        # Counted by one thread each (the loop submits, the worker ends), so never torn.
        self._submitted = 0
        self._ended = 0

    def submit(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        awaited: bool = True,
        late: Callable[[Job], None] | None = None,
        refusable: bool = False,
        answered: bool = False,
    ) -> Job:
        """Queue ``fn(*args)``; call from the event loop.  ``awaited``: a handler waits for it
        (see ``finished``); ``late`` and ``refusable``: see Job.  ``answered``: its request
        was answered without it (nobody waits, a failure is logged as one after its answer),
        and it is queued once the answer has been written: woken before, the worker would
        take the answer's CPU from it."""
        job = Job(name, fn, args, asyncio.get_running_loop(), awaited and not answered)
        job.late, job.refusable = late, refusable
        self._submitted += 1
        if answered:
            job.delivered = True
            if not self._after_answer:
                job.loop.call_soon(self._queue_answered)
            self._after_answer.append(job)
            return job
        self._queue_answered()
        self._enqueue(job)
        return job

    def upkeep(
        self, name: str, step: Callable[[], bool], *, awaited: bool = False, last: bool = False
    ) -> Job:
        """Queue background work: ``step()`` runs while no job is queued, again while it
        returns True (see the module text); ``last``: only once no other upkeep is left (what
        the jobs running now queue, too).  From the event loop, or from a running job."""
        here = self.job_here()
        loop = here.loop if here is not None else asyncio.get_running_loop()
        job = Job(name, step, (), loop, awaited)
        job.last = last
        if here is None:
            self._queue_answered()  # (they come first all the same)
            self._start()
        self._upkeep.append(job)
        if here is None:
            self._queue.put(None)
        return job

    def waiting(self) -> bool:
        """Whether a job is queued: the running step of upkeep stops as soon as it can."""
        return bool(self._after_answer) or not self._queue.empty()

    def idle(self) -> bool:
        """No job queued or running, no step of upkeep running: the daemon's state is current
        and stays so until the event loop submits again (call from the event loop).  Upkeep
        still queued comes after whatever is submitted now, as if it had come later."""
        return self._ended == self._submitted and not self._stepping

    def settled(self) -> bool:
        """Idle, and no upkeep left either."""
        return self.idle() and not self._upkeep

    def _queue_answered(self) -> None:
        jobs, self._after_answer = self._after_answer, []
        if not jobs:
            return
        # Nobody waits for these: not on the loop's CPU, where the runtime's own work after
        # the answer often wakes, but wherever the scheduler finds room (measured: 0.3 ms
        # off the creation it answered, here).  The next awaited job pins the thread again.
        self._start()
        self._pin(None)
        for job in jobs:
            self._queue.put(job)

    def _enqueue(self, job: Job) -> None:
        self._start()
        self._follow()
        self._queue.put(job)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        """Pin the thread to the CPU this (the loop's) thread is on, when that changed."""
        cpu = _current_cpu()
        if cpu != self._cpu and cpu >= 0:
            self._pin(cpu)

    def _pin(self, cpu: int | None) -> None:
        """Keep the thread to ``cpu``; None: to the loop's CPUs."""
        assert self._thread is not None and self._thread.native_id is not None
        try:
            cpus = os.sched_getaffinity(0) if cpu is None else (cpu,)
            os.sched_setaffinity(self._thread.native_id, cpus)
        except OSError:  # gone offline meanwhile, say: no pinning until the next change
            cpu = None
        self._cpu = -1 if cpu is None else cpu

    def job_here(self) -> Job | None:
        """The running job, when called from the worker thread itself (else None)."""
        thread = self._thread
        if thread is None or thread.ident != _thread.get_ident():
            return None
        return self.current

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """The running job waits for ``phase`` meanwhile (when called on the worker thread):
        daemon/progress.py."""
        job = self.job_here()
        if job is None:
            yield
            return
        job.phase = phase
        try:
            yield
        finally:
            job.phase = DECIDING

    def check(self) -> None:
        """Raise Abandoned when the running job's request was answered with an error (when
        called on the worker thread): daemon/progress.py."""
        job = self.job_here()
        if job is not None:
            job.abandoned_check()

    def deliver(self, result: Any) -> bool:
        """Called by the running job: hand ``result`` to its handler now and go on with the
        rest of the job (what the answer does not wait for: applying it, committing it).
        False when the request was answered without it already (its ``late`` runs when the
        job ends).  The next job still starts only when this one has ended."""
        job = self.current
        assert job is not None and self.job_here() is job, "deliver() outside a running job"
        job.result = result
        job.delivered = True
        in_time = self._complete(job)
        # The handler's thread waits on this CPU (see the class docstring): let it send the
        # answer now rather than when the rest of the job first blocks.
        os.sched_yield()
        return in_time

    def _complete(self, job: Job) -> bool:
        """Wake whoever waits for ``job``; whether it ended before its request was answered."""
        in_time, waiter = job._finish()
        job.done.release()
        if in_time and job.awaited and waiter is not None:
            _call_soon(job.loop, _resolve, waiter, True)
        return in_time

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(block=not self._upkeep)
            except queue.Empty:
                head = self._upkeep[0]
                if head.last and not all(job.last for job in self._upkeep):
                    self._upkeep.rotate(-1)
                else:
                    self._step(head)
                continue
            if job is not None:
                self._execute(job)

    def _step(self, job: Job) -> None:
        """One step of the upkeep at the head of its queue; it ends when the step says so."""
        self._stepping = True
        self.current = job
        job.phase = DECIDING
        try:
            more = bool(job.fn(*job.args))
        except Exception as err:  # the worker must outlive a bug in one step
            job.error, more = err, False
        self.current = None
        self._stepping = False
        if not more:
            self._upkeep.popleft()
            self._complete(job)
            if job.error is not None:
                log.error("%s failed: %s", job.name, job.error)

    def _execute(self, job: Job) -> None:
        """Run one job to its end (its late part too, when it was answered without it)."""
        self.current = job
        job.phase = DECIDING
        job.deciding = True
        try:
            job.abandoned_check()
            result = job.fn(*job.args)
            if not job.delivered:
                job.result = result
        except Exception as err:
            if job.delivered and not job.answer:
                # Its answer went out in time: nobody else will hear of this failure.
                log.exception("%s failed after its answer", job.name)
            else:
                job.error = err
        job.deciding = False
        in_time = (not job.answer) if job.delivered else self._complete(job)
        if not in_time and job.late is not None:
            try:
                job.late(job)
            except Exception:  # the worker must outlive a bug in one job
                log.exception("finishing %s after its deadline failed", job.name)
        self.current = None
        self._ended += 1
        if not job.awaited and job.error is not None:
            log.error("%s failed: %s", job.name, job.error)

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
        waiter: asyncio.Future[bool] = job.loop.create_future()
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
            answer = ERROR if job.refusable else FALLBACK
            if not job.abandon(answer) and job.late is not None:
                # It had ended, its result waiting behind a stalled event loop: the answer did
                # not carry it, so its late part runs all the same, after it.
                self.submit(
                    f"{job.name} (late)", _late, job, answer, time.monotonic(), awaited=False
                )
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


def _late(job: Job, answer: str, answered_at: float) -> None:
    """The late part of a job that ended before its request was answered without it."""
    job.answer, job.answered_at = answer, answered_at
    assert job.late is not None
    job.late(job)


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: the daemon is exiting
        log.debug("not delivered after the event loop closed: %s", callback)
