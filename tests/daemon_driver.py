"""The daemon as ``nri-cpuplugin run`` builds it (daemon/service.py), driven by tests.

``Driver`` calls the NRI adapter's handlers - the very methods the stub calls - one at a time
on one event loop of its own, and waits on conditions (the worker idle), never on time.  The
runtime is what the test plays; cgroupfs is whatever the settings' sysfs tree holds (a
generated tree has none, or tests/fake_cgroup_v2.py's FAKE one).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from nri_cpuplugin.base import files
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.hardware import hotplug
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.storage.store import StateStore


class Records(list):
    """Audit records, as the journal would get them."""

    def __call__(self, record: dict) -> None:
        self.append(record)

    def of(self, action: str) -> list[dict]:
        return [r for r in self if r["ACTION"] == action]


class Threads(Records):
    """Audit records as the journal gets them, and for each the thread that made it and the
    CPUs that thread may run on then."""

    def __init__(self) -> None:
        super().__init__()
        self.made_on: dict[str, list[tuple[str, set[int]]]] = {}

    def __call__(self, record: dict) -> None:
        super().__call__(record)
        here = (threading.current_thread().name, os.sched_getaffinity(0))
        self.made_on.setdefault(record["ACTION"], []).append(here)


class SlowDisk:
    """The state file's durable write (write, fsync, rename, fsync) blocks until ``go``;
    ``entered`` is set once a write waits there."""

    def __init__(self, monkeypatch: Any, clock: Any = None) -> None:
        """``clock``: a budgets' clock (tests/model_stall.py ``StallClock``) the worker is
        stuck for while a write waits here."""
        self.gate = threading.Event()
        self.entered = threading.Event()
        if clock is not None:
            clock.add(self.stuck)
        write = files.write_atomic

        def slow(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.gate.wait(60), "the slow disk was never let go"
            return write(*args, **kwargs)

        monkeypatch.setattr(files, "write_atomic", slow)

    def stuck(self, worker: object = None) -> bool:
        """A write waits for ``go``."""
        return self.entered.is_set() and not self.gate.is_set()

    def go(self) -> None:
        self.gate.set()


class Timers:
    """The daemon's timers (``Daemon(later=...)``), held: the events they would submit after
    their delay wait here for the test to submit them, or look at them (time never passes by
    itself)."""

    def __init__(self) -> None:
        self.due: list[object] = []

    def __call__(self, delay: float, event: object) -> bool:
        self.due.append(event)
        return True

    def take(self, kind: type) -> list[object]:
        """The events of ``kind`` set since the last take (no longer due)."""
        taken = [e for e in self.due if isinstance(e, kind)]
        self.due = [e for e in self.due if not isinstance(e, kind)]
        return taken


def uevent(action: str, cpu: int) -> ev.CPUsChanged:
    """A kernel uevent for ``cpu`` as the daemon's hotplug listener submits it: stamped with
    the time it was read (what the daemon's "hotplug-applied" record measures from)."""
    return ev.CPUsChanged((hotplug.CPUEvent(action, cpu, time.monotonic()),))


def on_disk(daemon: Daemon) -> Any:
    """The state the daemon's state file holds."""
    return StateStore(daemon.node.settings.state_dir).peek().state


class Driver:
    """Synchronous calls into an asynchronous daemon: ``driver.create_container(pod, c)``
    returns what the stub would send back (or raises what the stub answers as an error), once
    the daemon is idle again (what it does after a reply - commit, audit - is done too)."""

    def __init__(
        self,
        settings: Settings,
        records: Records | None = None,
        flags: dict | tuple = (),
        **options: Any,
    ) -> None:
        self.records = Records() if records is None else records
        self.daemon = Daemon(settings, Audit(self.records), flags, **options)
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self.daemon.adapter, name)

        def call(*args: Any) -> Any:
            try:
                result = handler(*args)
                if asyncio.iscoroutine(result):
                    result = self.run(result)
            finally:
                self.settle()
            return result

        return call

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def configure(self, config: str = "", runtime: str = "containerd", version: str = "v2.1.9"):
        return self.run(self.daemon.adapter.configure(config, runtime, version))

    def submit(self, event: object) -> None:
        """One of the daemon's own events (hotplug, the sweep), as its sources submit them,
        run to its end."""

        async def submit() -> None:
            self.daemon.deadline.submit(event)

        self.run(submit())
        self.settle()

    def hotplug(self, action: str, cpu: int) -> None:
        """A kernel uevent for ``cpu``, as the daemon's hotplug listener submits it, followed
        to its end."""
        self.submit(uevent(action, cpu))

    def settle(self) -> None:
        """Wait until every event queued so far (late work, background events) has run."""
        assert self.run(self.daemon.drain(timeout=30)), "the worker did not settle in 30 s"

    @property
    def node(self) -> Any:
        return self.daemon.node

    @property
    def state(self) -> Any:
        return self.daemon.node.state

    @property
    def settings(self) -> Settings:
        return self.daemon.node.settings

    def on_disk(self) -> Any:
        return on_disk(self.daemon)

    def close(self) -> None:
        """What the end of the daemon's process would give up: its claim on the state
        directory, its hotplug listener, its event loop."""
        self.daemon.stop_hotplug()
        self.daemon.release_claim()
        self.loop.close()
