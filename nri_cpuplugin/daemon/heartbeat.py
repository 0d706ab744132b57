"""The daemon's heartbeat: the health file (ops/health.py) and systemd's notifications.

Every ``interval`` seconds the event loop hands the worker a heartbeat job and rewrites the
health file: when it last ran (proof the loop runs), whether the stub is registered with the
runtime, when the worker last ran a heartbeat and how long that one waited behind the events
queued before it (proof the worker runs and keeps up).  Under systemd, ``READY=1`` goes out
once the daemon is first registered, ``STATUS=`` says what it waits for, and ``WATCHDOG=1``
only when the worker answered its last heartbeat in time: a stuck worker stops the pings and
systemd restarts the daemon.

The daemon's one periodic wake-up: a few microseconds of loop and worker time and one small
write to the page cache per interval (10 s unless ``health.interval`` says otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .. import __version__
from ..ops import health
from ..ops.notify import notify, watchdog_interval
from .worker import Worker

log = logging.getLogger("nri_cpuplugin")


class Heartbeat:
    def __init__(
        self,
        worker: Worker,
        state_dir: Callable[[], str],
        budget: Callable[[], float],
        interval: float = health.DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.clock = clock  # wall-clock seconds: the health file's reader is another process
        self.state_dir = state_dir
        self.budget = budget
        watchdog = watchdog_interval()
        self.watchdog = watchdog is not None
        # Pinged at least three times per watchdog period.
        self.interval = min(interval, watchdog / 3) if watchdog is not None else interval
        self.stale_after = health.stale_after(interval)
        self.started = self.clock()
        self.registered = False
        self.since = self.started
        self.runtime = ""
        self.connect_error = ""
        self.last_event: float | None = None
        self.worker_at: float | None = None
        self.worker_lag = 0.0
        self.waiting: float | None = None  # a heartbeat handed to the worker, not yet run
        self.ready_sent = False
        self.stuck = False  # the worker has not answered a heartbeat within stale_after
        self._write_failed = False
        self._written = False
        self._stopping = asyncio.Event()

    # --- what the daemon tells it ---------------------------------------------------------

    def connection(self, registered: bool, detail: str) -> None:
        """The stub registered with the runtime (``detail``: which), or is not (why not)."""
        if not registered and not self.registered and detail == self.connect_error:
            return  # the same failed attempt again (each second): the beat rewrites the file
        if registered != self.registered:
            self.registered, self.since = registered, self.clock()
        self.runtime, self.connect_error = (detail, "") if registered else (self.runtime, detail)
        self.publish()  # first: whoever hears READY=1 finds the file saying so
        if not registered:
            notify(f"STATUS=not registered with the runtime: {detail}")
        elif self.ready_sent:
            notify(f"STATUS=registered with {detail}")
        else:
            self.ready_sent = notify(f"READY=1\nSTATUS=registered with {detail}")

    def event_seen(self) -> None:
        self.last_event = self.clock()

    # --- the beat -------------------------------------------------------------------------

    async def run(self) -> None:
        """Beat until ``stop()``."""
        while not self._stopping.is_set():
            self.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval)

    def stop(self) -> None:
        self._stopping.set()

    def beat(self) -> None:
        """One heartbeat (on the event loop): the worker's job, the file, the watchdog."""
        now = self.clock()
        stuck = self.waiting is not None and now - self.waiting > self.stale_after
        # The file first: it then says whether the last beat's job ran (a job handed over
        # just before would look like one waiting until the next write).
        self.publish()
        if self.waiting is None:
            self.waiting = now
            self.worker.submit("heartbeat", self._worker_beat, now, awaited=False)
        if stuck and not self.stuck:
            job = self.worker.current
            doing = f" ({job.name}, {job.phase})" if job is not None else ""
            log.warning(
                "the worker has not answered a heartbeat for %.1fs%s: the daemon is not live",
                now - (self.waiting or now), doing,
            )  # fmt: skip
            notify(f"STATUS=stuck: the worker has not answered for {self.stale_after:g}s{doing}")
        elif self.stuck and not stuck:
            log.warning("the worker answers again: the daemon is live")
            notify("STATUS=the worker answers again")
        self.stuck = stuck
        if self.watchdog and not stuck:
            notify("WATCHDOG=1")  # not while stuck: systemd's watchdog then restarts us

    def _worker_beat(self, submitted: float) -> None:
        """On the worker: it runs, and the beat waited this long behind the queued events."""
        self.worker_at = self.clock()
        self.worker_lag = self.worker_at - submitted
        self.waiting = None

    def report(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": __version__,
            "started": self.started,
            "updated": self.clock(),
            "registered": self.registered,
            "since": self.since,
            "runtime": self.runtime,
            "connect_error": self.connect_error,
            "last_event": self.last_event,
            "worker": self.worker_at,
            "worker_lag": self.worker_lag,
            "waiting": self.waiting,
            "interval": self.interval,
            "stale_after": self.stale_after,
            "budget": self.budget(),
        }

    def publish(self) -> None:
        """Write the health file; a failure is logged once (the daemon pins all the same)."""
        try:
            health.write(self.state_dir(), self.report(), first=not self._written)
            self._written = True
        except FileNotFoundError:
            pass  # no state directory yet (runtime-launched: until Configure names it)
        except OSError as err:
            if not self._write_failed:
                log.warning("cannot write the health file (status and probes read it): %s", err)
            self._write_failed = True
        else:
            self._write_failed = False
