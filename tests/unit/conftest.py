"""Fixtures the unit tests share: the daemon as ``nri-cpuplugin run`` builds it, for tests that
call it on an event loop of their own (deadlines, concurrency), and another process holding its
state lock.  Tests that need neither use tests/daemon_driver.py's Driver."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from daemon_driver import Records
from lock_holder import LockHolder
from topologies import scratch_dir

from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test's own directory, on tmpfs when there is a roomy one (topologies.scratch_dir).
    Unit tests generate sysfs trees of hundreds of files and commit state files durably
    (write, fsync, rename, fsync): on a disk each costs milliseconds and waits behind whatever
    else the machine writes; here nothing is meant to outlive the test."""
    fast = scratch_dir()
    if fast is None:
        yield tmp_path_factory.mktemp("t")
        return
    path = Path(tempfile.mkdtemp(prefix="nri-unit-", dir=fast))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class MakeDaemon(Protocol):
    def __call__(
        self, settings: Settings, records: Records | None = None, **options: Any
    ) -> tuple[Daemon, Records]: ...


@pytest.fixture
def daemons() -> Iterator[MakeDaemon]:
    """``daemons(settings) -> (daemon, records)``: the composition of daemon/service.py, its
    audit records collected (``records``: a sink of the test's own).  Each daemon gives up its
    hotplug listener and its claim on the state directory when the test ends, as its process
    would when it exits."""
    made: list[Daemon] = []

    def make(
        settings: Settings, records: Records | None = None, **options: Any
    ) -> tuple[Daemon, Records]:
        records = Records() if records is None else records
        daemon = Daemon(settings, Audit(records), **options)
        made.append(daemon)
        return daemon, records

    yield make
    for daemon in made:
        daemon.stop_hotplug()
        daemon.release_claim()


@pytest.fixture
def holders() -> Iterator[Any]:
    """``holders(state_dir) -> LockHolder``: another nri-cpuplugin process holding the state
    lock (as the OCI hook or the CLI would), released at the end at the latest."""
    made: list[LockHolder] = []

    def hold(state_dir: str) -> LockHolder:
        made.append(LockHolder(state_dir))
        return made[-1]

    yield hold
    for holder in made:
        holder.release()


# The longest unit tests, longest first (tens of seconds each, the rest take a second or less).
LONGEST = (
    "test_model_races.py::TestDBusNodeModel::runTest",
    "test_model_races.py::TestNodeModel::runTest",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, each of the longest tests heads the first batch of a worker of its
    own: the load scheduler hands each worker a quarter of its share of consecutive tests to
    begin with, the rest as they finish.  Where they happened to be collected they could land
    on one worker, one after the other, the other worker idle at the end."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers:
        return
    longest = [item for name in LONGEST for item in items if item.nodeid.endswith(name)]
    rest = [item for item in items if all(item is not long for long in longest)]
    batch = max(len(items) // workers // 4, 2)
    for k, item in enumerate(longest[:workers]):
        rest.insert(k * batch, item)
    rest.extend(longest[workers:])
    items[:] = rest
