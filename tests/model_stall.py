"""Stalls and the clock of request budgets, for tests/unit/test_model_races.py: deterministic
where wall-clock budgets are not.

In production a request's budget (daemon/deadline.py) runs out after a fixed time.  On a loaded
test machine a fixed time decides differently from run to run - a request that takes 60 ms
misses a 50 ms budget once in a while - and hypothesis needs every schedule to run the same
way each time it is replayed (else it stops with FlakyStrategyDefinition, and a failure found
cannot be shrunk).  So here time passes only while something stalls:

* outside a stall, no budget runs out (nothing the model does takes long);
* a full or failing disk (``failing``: every write raises) stalls nothing: time stands still;
* in a stall - the state file's disk (its durable write blocks), or the state lock held by
  another process (as the OCI hook or the CLI would hold it) - a request's budget runs out
  exactly when the worker is stuck on it (its job, or one ahead of it, waits for the disk or
  the lock), and not before.  In production the budget runs out at some moment while the
  worker is stuck; nothing else runs on the worker meanwhile, so which moment does not matter.

The same holds for the one decision the event loop makes by the worker's state: a creation
is answered from its pod's earmark only when the worker is idle.  Before each request the
worker is let finish what it has (``settle``) unless it is stuck.

Interrupt work (``SlowIrqWrites``) is timed the same way: each affinity write takes a fixed
time of a clock of its own, and nothing else takes any.  The clock stands still between
requests (a held write waits until a request waits for its answer), and a waiting request's
budget runs out exactly when the writes made meanwhile would outlast it: the writer stops
there until the test lets it go.

Waits are for conditions, checked every ``TICK`` (nothing waits out a time).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from nri_cpuplugin.base import files
from nri_cpuplugin.daemon.progress import STATE_LOCK
from nri_cpuplugin.daemon.worker import Job, Worker
from nri_cpuplugin.hardware.interrupts import affinity as irq
from nri_cpuplugin.storage.store import StateStore

TICK = 0.0005  # how often a condition is looked at
PATIENCE = 60.0  # a condition not met by then is a hang: the test fails


class Stall:
    """The disk or the state lock stalling, the disk failing, and the budgets' clock (see the
    module text).  Patches ``files.write_atomic`` (the state file's durable write, the health
    file's) until ``close``."""

    def __init__(self) -> None:
        self.what = ""  # "disk" or "lock" while stalled
        self.failing = 0  # an errno every write fails with (a full or failing disk), or 0
        self._gate = threading.Event()  # shut while the disk stalls
        self._gate.set()
        self._at_gate = threading.Event()  # a thread waits at the shut gate
        self._lock: Any = None
        self._write = files.write_atomic

        def write_atomic(*args: Any, **kwargs: Any) -> Any:
            if self.failing:
                raise OSError(self.failing, os.strerror(self.failing), args[1])
            if not self._gate.is_set():
                self._at_gate.set()
                assert self._gate.wait(PATIENCE), "the slow disk was never let go"
            return self._write(*args, **kwargs)

        files.write_atomic = write_atomic

    # --- the stall ----------------------------------------------------------------------------

    def begin(self, what: str, state_dir: str) -> None:
        """The disk stalls ("disk"), or another process takes the state lock ("lock")."""
        assert not self.what
        self.what = what
        if what == "disk":
            self._gate.clear()
        else:  # the lock is per open file: this thread's holds off the daemon's worker
            self._lock = StateStore(state_dir).locked(timeout=-1)
            self._lock.__enter__()

    def end(self) -> None:
        """The disk recovers, the lock is let go; what waited for them goes on."""
        if self.what == "disk":
            self._gate.set()
            self._at_gate.clear()
        elif self.what == "lock" and self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None
        self.what = ""

    def close(self) -> None:
        self.end()
        files.write_atomic = self._write

    def stuck(self, worker: Worker) -> bool:
        """Whether the worker waits for what stalls (nothing it has queued runs until the
        stall ends)."""
        if self.what == "disk":
            return self._at_gate.is_set()
        if self.what == "lock":
            job = worker.current  # (its phase is the lock's until it holds the lock)
            return job is not None and job.phase == STATE_LOCK
        return False

    # --- the clock ----------------------------------------------------------------------------

    def install(self, worker: Worker) -> None:
        """Make the worker's budgets run out by this clock: ``Worker.finished`` waits without
        a limit outside a stall, and in one until the job ends or the worker is stuck."""
        finished = worker.finished

        async def by_this_clock(job: Job, budget: float | None) -> bool:
            if budget is not None and self.what:
                await until(lambda: _ended(job) or self.stuck(worker))
                if not _ended(job):
                    return False  # the budget ran out: the worker is stuck
            return await finished(job, None)

        worker.finished = by_this_clock  # type: ignore[method-assign]

    async def settle(self, worker: Worker) -> None:
        """Let the worker finish everything queued so far, unless it is stuck: its jobs' late
        parts, the work after answers, the daemon's own events."""
        job = worker.submit("settle", _nothing)  # (queues the answered jobs before it, too)
        await until(lambda: (_ended(job) and worker.settled()) or self.stuck(worker))


class SlowIrqWrites:
    """Each interrupt affinity write (hardware/interrupts/affinity.py ``write``, what the daemon
    calls for every one) takes ``cost`` seconds of this clock (see the module text).  Patched in
    until ``close``; while ``held``, a write waits for a request to wait for its answer."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.now = 0.0  # seconds of writes made so far
        self.writes = 0
        self.held = False
        self.over = False  # a waiting request's budget ran out: the writer stopped there
        self._limit: float | None = None  # when the waiting request's budget runs out
        self._moved = threading.Condition()
        self._write = irq.write

        def write(*args: Any, **kwargs: Any) -> Any:
            with self._moved:
                while self.held and (self._limit is None or self.now + cost > self._limit):
                    self.over = self._limit is not None
                    self._moved.notify_all()
                    assert self._moved.wait(PATIENCE), "the held interrupt writes were never let go"
                self.now += cost
                self.writes += 1
            return self._write(*args, **kwargs)

        irq.write = write

    def release(self) -> None:
        """Writes go on without waiting (the clock no longer matters)."""
        with self._moved:
            self.held = False
            self._moved.notify_all()

    def close(self) -> None:
        self.release()
        irq.write = self._write

    def install(self, worker: Worker) -> None:
        """Make the worker's budgets run out by this clock while writes are held."""
        finished = worker.finished

        async def by_this_clock(job: Job, budget: float | None) -> bool:
            if budget is None or not self.held:
                return await finished(job, budget)
            with self._moved:
                self._limit, self.over = self.now + budget, False
                self._moved.notify_all()
            try:
                await until(lambda: _ended(job) or self.over)
                if not _ended(job):
                    return False  # the writes ahead of it outlast its budget
            finally:
                with self._moved:
                    self._limit = None
            return await finished(job, None)

        worker.finished = by_this_clock  # type: ignore[method-assign]


class StallClock:
    """The budgets' clock for tests that stall the worker their own way (another process
    holding the state lock, a slow disk, cgroup writes the kernel is slow to apply): as
    ``Stall``'s, a waiting request's budget runs out exactly when the worker is stuck on one
    of the stalls ``add``-ed (each says, given the worker, whether it is stuck on it), and
    never outside one.  ``ran_out`` counts the budgets that ran out.

    Not for requests the stub's guard may cancel while they wait (that is the stub's own
    clock; ``Worker.finished`` takes the cancellation there): leave such a worker's clock."""

    def __init__(self) -> None:
        self.stalls: list[Callable[[Worker], bool]] = []
        self.ran_out = 0

    def add(self, stuck: Callable[[Worker], bool]) -> None:
        self.stalls.append(stuck)

    def stuck(self, worker: Worker) -> bool:
        return any(stall(worker) for stall in self.stalls)

    def install(self, worker: Worker) -> None:
        finished = worker.finished

        async def by_this_clock(job: Job, budget: float | None) -> bool:
            if budget is not None:
                await until(lambda: _ended(job) or self.stuck(worker))
                if not _ended(job):
                    self.ran_out += 1
                    return False  # the budget ran out: the worker is stuck
            return await finished(job, None)

        worker.finished = by_this_clock  # type: ignore[method-assign]


class SteppedLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock the test moves on (``step``): its timers - the stub's guard
    among them - come due when the test says, not when real time has passed."""

    def __init__(self) -> None:
        super().__init__()
        self._ahead = 0.0

    def time(self) -> float:
        return super().time() + self._ahead

    def step(self, seconds: float) -> None:
        self._ahead += seconds


class SteppedTime:
    """A clock that moves only when its ``sleep`` is called (by as much as was asked), for
    code that takes ``clock`` and ``sleep``; ``on_sleep`` runs at each sleep first (what
    happens meanwhile)."""

    def __init__(self, on_sleep: Callable[[], None] | None = None) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.on_sleep is not None:
            self.on_sleep()
        self.slept.append(seconds)
        self.now += seconds


def waits_for_the_lock(worker: Worker) -> bool:
    """The worker's job waits for the state lock (its phase says so until it holds it)."""
    job = worker.current
    return job is not None and job.phase == STATE_LOCK


def _ended(job: Job) -> bool:
    """The job has ended, or delivered its result (``done`` is held until then)."""
    return not job.done.locked()


def _nothing() -> None:
    return None


async def until(condition: Callable[[], bool]) -> None:
    """Wait on the event loop (its callbacks run meanwhile) until ``condition()`` holds."""
    give_up = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < give_up, f"{condition.__doc__ or 'a condition'} never held"
        await asyncio.sleep(TICK)


def block_until(condition: Callable[[], bool]) -> None:
    """Wait, blocking the calling thread (the event loop's, when a test stalls the loop on
    purpose), until ``condition()`` holds."""
    give_up = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < give_up, f"{condition.__doc__ or 'a condition'} never held"
        time.sleep(TICK)
