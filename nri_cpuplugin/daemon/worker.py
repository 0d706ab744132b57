"""The daemon's worker thread: jobs run one at a time, in order, and a handler waits for its
job within a budget (daemon/deadline.py says what is answered when the budget runs out).

A job's *phase* says what it is waiting for, so that a missed deadline can name its cause;
its *answer* says how its request was answered without it, so that what it does late agrees.
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
from collections.abc import Callable, Iterator
from typing import Any

from .progress import DECIDING, QUEUED, Abandoned

log = logging.getLogger("nri_cpuplugin")

# How long a handler blocks the event loop for its job before awaiting it instead: far above
# a normal job (about a millisecond), so the cheaper blocking hand-off serves nearly all.
FAST_WAIT = 0.02

# How the runtime was answered when the budget ran out first.
ERROR = "error"  # the operation failed: nothing the job decides may stay in force
FALLBACK = "fallback"  # answered as well as could be without the job: the job's result stands


class Job:
    """One piece of the daemon's work, run by the Worker.

    ``answer`` is "" while the job may still answer its request itself, or how the request
    was answered when the budget ran out first (ERROR or FALLBACK); ``late`` then runs in the
    worker when the job ends."""

    __slots__ = (
        "_finished",
        "_lock",
        "_waiter",
        "answer",
        "answered",
        "answered_at",
        "args",
        "awaited",
        "deciding",
        "delivered",
        "done",
        "error",
        "fn",
        "late",
        "loop",
        "name",
        "phase",
        "refusable",
        "result",
        "subject",
        "submitted",
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
        self.delivered = False  # its result went to the handler before its function returned
        self.submitted = time.monotonic()
        self.phase = QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.late: Callable[[Job], None] | None = None
        self.answer = ""
        self.answered: Any = None  # the reply the request got without the job
        self.answered_at = 0.0
        self.subject = name  # what the request was about, for the audit trail
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

    def idle(self) -> bool:
        """Nothing queued or running: the daemon's state is current and stays so until the
        event loop submits again (call from the event loop)."""
        return self._ended == self._submitted

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
            job = self._queue.get()
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
