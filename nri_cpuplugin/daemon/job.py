"""One piece of the daemon's work, as the worker (daemon/worker.py) runs it: what it runs, what
it waits for (its *phase*), and how its request was answered when the budget ran out first
(its *answer*), so that what it does late agrees."""

from __future__ import annotations

import _thread
import asyncio
import time
from collections.abc import Callable
from typing import Any

from .progress import QUEUED, Abandoned

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
        "last",
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
        self.last = False  # upkeep that waits behind all other upkeep, queued before or after
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
