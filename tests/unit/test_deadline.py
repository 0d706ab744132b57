"""The daemon's deadline discipline (daemon/deadline.py): every request answered within its
budget, with the state lock held by another nri-cpuplugin process or the disk slow to sync,
and the work done late agreeing with what was answered.  The daemon as ``nri-cpuplugin run``
builds it (daemon/service.py), its NRI adapter called on an event loop as the stub calls it;
generated 48-CPU topology (CPUs 0 and 24 reserved), real state directory, real lock.

No answer here is timed: a request's budget runs out exactly when the worker is stuck on what
the test stalls - the lock held by another process, a slow disk, cgroup writes the kernel is
slow to apply - and never otherwise (tests/model_stall.py ``StallClock``), so a busy machine
decides as an idle one.  That an answer did not wait for a stall shows in its coming while the
stall still holds, and in the budgets that ran out (``clock.ran_out``).  The tests of the
stub's own guard keep the worker's real clock (``by_time``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable

import pytest
from builders import Machine, container, creation, guaranteed_pod, node_settings, pod
from daemon_driver import Driver, Records, SlowDisk, Threads, Timers, on_disk, uevent
from fake_runtime import FakeRuntime
from model_stall import StallClock, SteppedLoop, block_until, until, waits_for_the_lock

from nri_cpuplugin.base import files
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.core.workload import from_nri
from nri_cpuplugin.daemon import deadline
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.adapter import pod_of
from nri_cpuplugin.daemon.node import Node
from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.hardware.liveness import Liveness
from nri_cpuplugin.nri.handlers import EVENT_BITS
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.ops.metrics import Metrics

P = CPUSet.parse
BUDGET = 1.5  # node_settings' default, as answers and records say it (the stalls run it out)
ONLINE = P("0-47")
WORKER = "nri-cpuplugin-worker"  # the worker thread's name (daemon/worker.py)


@contextlib.asynccontextmanager
async def connected(daemon: Daemon, socket_path):
    """A FAKE runtime on ``socket_path`` and the real stub serving ``daemon``, registered (as
    ``nri-cpuplugin run`` connects them)."""
    runtime = FakeRuntime(socket_path)
    await runtime.start()
    stub = Stub(
        daemon.adapter, "cpuplugin", "50", socket_path=str(socket_path),
        observe=daemon.observe_request,
    )  # fmt: skip
    daemon.stub = stub
    served = asyncio.create_task(stub.run())
    try:
        await asyncio.wait_for(runtime.registered.wait(), 10)
        yield runtime, stub
    finally:
        stub.stop()
        await runtime.close()
        await asyncio.wait_for(served, 5)


@pytest.fixture
def clock() -> StallClock:
    return StallClock()


@pytest.fixture
def daemons(daemons, clock):
    """conftest's ``daemons``, each request's budget run out by ``clock`` (see the module
    text); ``by_time=True``: by the worker's own clock (the tests of the stub's guard)."""

    def make(settings: Settings, records: Records | None = None, *, by_time=False, **options):
        daemon, records = daemons(settings, records, **options)
        if not by_time:
            clock.install(daemon.worker)
        return daemon, records

    return make


@pytest.fixture
def holders(holders, clock):
    """conftest's ``holders``; while one holds the lock, a worker waiting for it is stuck."""

    def hold(state_dir: str):
        holder = holders(state_dir)
        clock.add(lambda worker: holder.holding() and waits_for_the_lock(worker))
        return holder

    return hold


async def answer(coro):
    """What a request is answered: its reply, or the error the stub answers with."""
    try:
        return await coro
    except PolicyError as err:
        return err


def lock_waited(daemon: Daemon) -> Callable[[], bool]:
    def waiting() -> bool:
        """the worker's job waiting for the state lock"""
        return waits_for_the_lock(daemon.worker)

    return waiting


def resize(milli: int) -> pb.LinuxResources:
    """What kubelet's in-place resize sends for a new CPU request (and limit)."""
    r = pb.LinuxResources()
    r.cpu.shares.value = milli * 1024 // 1000
    r.cpu.quota.value, r.cpu.period.value = milli * 100, 100000
    return r


CID = {name: name.ljust(64, "0") for name in ("pg", "nginx", "web2", "big", "redis")}


# --- the fast path ------------------------------------------------------------------------------


def test_within_the_budget_each_request_gets_its_events_own_effects(tmp_path, daemons, monkeypatch):
    """Same events, same effects, same state as the node handling them directly (no worker,
    no budget); nothing missed; every commit made off the event loop."""
    daemon, records = daemons(node_settings(tmp_path))
    direct = Node(node_settings(tmp_path, state="direct"), Audit(Records()))
    committed_on: list[str] = []  # the threads that wrote the daemon's state file
    write = files.write_atomic

    def noting(directory, *args, **kwargs):
        if directory == daemon.node.settings.state_dir:
            committed_on.append(threading.current_thread().name)
        return write(directory, *args, **kwargs)

    monkeypatch.setattr(files, "write_atomic", noting)
    web, db = pod("web", "burstable"), pod("db")
    nginx, pg = container("nginx", web, 500), container("pg", db, 2000)
    events = [
        creation(web, nginx),
        creation(db, pg),
        ev.UpdateContainer(from_nri(db, pg), resize=False),
        ev.StopContainer(from_nri(db, pg)),
        ev.RemoveContainer(from_nri(db, pg)),
        ev.RemovePodSandbox(pod_of(db)),
    ]

    async def scenario():
        await daemon.adapter.configure("", "containerd", "v2.1.9")
        direct.handle(ev.Configure(""))
        for event in events:
            got = await daemon.deadline.handle(event)
            want = direct.handle(event)
            assert got == want, type(event).__name__
        assert await daemon.drain()

    try:
        asyncio.run(scenario())
    finally:
        direct.release_claim()
    assert daemon.node.state == direct.state
    assert committed_on and set(committed_on) == {WORKER}
    assert not records.of("deadline") and not records.of("deadline-late")
    assert [r["ACTION"] for r in records if r["ACTION"] in ("allocate", "release")] == [
        "allocate",
        "release",
    ]


def test_the_budget_is_kept_below_the_runtimes_own_timeout(tmp_path, daemons):
    daemon, _ = daemons(node_settings(tmp_path, budget=1.5))
    assert daemon.deadline.budget == 1.5
    daemon.stub = Stub(daemon.adapter, "cpuplugin", "50")  # not connected: 2 s until Configure
    assert daemon.deadline.budget == 1.5
    daemon.stub.request_timeout = 1.0  # a runtime configured for 1 s (Configure field 5)
    assert daemon.deadline.budget == 0.75
    assert daemon.stub.request_timeout * 0.9 > daemon.deadline.budget  # the stub's guard later
    # No PostCreateContainer: a creation's cgroup writes are done before its answer.
    assert not daemon.stub.events & EVENT_BITS["post_create_container"]


# --- the state lock held by another process -------------------------------------------------


def test_exclusive_create_behind_a_held_lock_is_refused_in_time_and_never_assigned(
    tmp_path, daemons, holders, clock
):
    metrics = Metrics()
    daemon, records = daemons(node_settings(tmp_path), metrics=metrics)
    nri = daemon.adapter
    db = pod("db")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        holder = holders(daemon.node.settings.state_dir)
        err = await answer(nri.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        assert clock.ran_out == 1 and holder.holding()  # refused once stuck, not before
        message = str(err)
        assert "exclusive CPUs for container 'pg' of pod ns/db" in message
        assert f"could not be decided within {BUDGET:g} s" in message
        assert f"state lock {daemon.node.store.lock_path}" in message and "fuser -v" in message
        assert "kubelet retries it" in message
        holder.release()
        assert await daemon.drain()

    asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert (missed["REASON"], missed["EVENT"], missed["POD_NAME"]) == (
        "state-lock",
        "CreateContainer",
        "db",
    )
    [late] = records.of("deadline-late")
    assert "answered with an error: nothing was assigned" in late["MESSAGE"]
    assert not records.of("allocate")
    state = daemon.node.state
    assert CID["pg"] not in state.assignments and state.shared == ONLINE
    assert on_disk(daemon).assignments == {}
    registry = metrics.registry
    labels = {"event": "CreateContainer", "reason": "state-lock"}
    assert registry.get_sample_value("nri_cpuplugin_deadline_misses_total", labels) == 1
    assert registry.get_sample_value("nri_cpuplugin_pinning_errors_total") == 1


def test_shared_create_behind_a_held_lock_gets_the_pool_and_follows_it_later(
    tmp_path, daemons, holders, clock
):
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db, web = pod("db"), pod("web", "burstable")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        adjust, _ = await nri.create_container(db, container("pg", db, 2000))
        assert adjust.linux.resources.cpu.cpus == "1,25"
        holder = holders(daemon.node.settings.state_dir)
        adjust, updates = await nri.create_container(web, container("nginx", web, 500))
        assert clock.ran_out == 1  # answered with its fallback, the lock still held
        assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
        assert updates == []
        assert CID["nginx"] not in daemon.node.state.sharing  # not decided yet ...
        holder.release()
        assert await daemon.drain()
        assert CID["nginx"] in daemon.node.state.sharing  # ... but recorded once the lock was free
        # So it follows the pool: when pg's CPUs come back, nginx is told.
        updates = await nri.stop_container(db, container("pg", db, 2000))
        assert {u.container_id: u.linux.resources.cpu.cpus for u in updates} == {
            CID["nginx"]: str(ONLINE)
        }

    asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["REASON"] == "state-lock" and "shared pool 0,2-24,26-47" in missed["MESSAGE"]
    [late] = records.of("deadline-late")
    assert "answered with a fallback: recorded in the shared pool 0,2-24,26-47" in late["MESSAGE"]
    assert CID["nginx"] in on_disk(daemon).sharing


def test_events_queued_behind_a_late_one_keep_their_order_and_say_why(
    tmp_path, daemons, holders, clock
):
    """A stop, then a creation, both behind the held lock: answered in turn within their own
    budgets; done in order once it is free - the creation then sees the released CPUs."""
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db, web = pod("db"), pod("web", "burstable")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.create_container(db, container("pg", db, 2000))
        holder = holders(daemon.node.settings.state_dir)
        updates = await nri.stop_container(db, container("pg", db, 2000))
        assert updates == [] and clock.ran_out == 1
        assert CID["pg"] in daemon.node.state.assignments  # not released yet: the lock is held
        adjust, _ = await nri.create_container(web, container("nginx", web, 500))
        assert clock.ran_out == 2  # its own budget: it ran out behind the stop
        # Answered with the pool as it was: pg's release is still waiting in front of it.
        assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
        await nri.remove_container(db, container("pg", db, 2000))
        holder.release()
        assert await daemon.drain()

    asyncio.run(scenario())
    state = daemon.node.state
    assert CID["pg"] not in state.assignments
    assert state.sharing.keys() == {CID["nginx"]}
    assert on_disk(daemon) == state
    stop, create, remove = records.of("deadline")
    assert [r["EVENT"] for r in (stop, create, remove)] == [
        "StopContainer",
        "CreateContainer",
        "RemoveContainer",
    ]
    # The creation waited behind the stop, which waited for the lock: the cause is the lock.
    assert create["REASON"] == "state-lock"
    assert (
        "it waits behind an earlier StopContainer, waiting for the state lock"
        in (create["MESSAGE"])
    )
    assert [r["EVENT"] for r in records.of("deadline-late")] == [
        "StopContainer",
        "CreateContainer",
        "RemoveContainer",
    ]
    assert records.of("release")[0]["CONTAINER_ID"] == CID["pg"]


def test_update_behind_a_held_lock_keeps_the_cpuset_and_refuses_an_exclusive_resize(
    tmp_path, daemons, holders, clock
):
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db = pod("db")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        pg = container("pg", db, 2000)
        await nri.create_container(db, pg)
        holder = holders(daemon.node.settings.state_dir)
        # A new CPU request of an exclusive container: only the event can decide it.
        err = await answer(nri.update_container(db, pg, resize(4000)))
        assert isinstance(err, PolicyError) and clock.ran_out == 1
        assert "the CPU resize of container 'pg' of pod ns/db could not be decided" in str(err)
        assert "kubelet retries the resize" in str(err)
        # Something else than the CPU request (no shares), queued behind it: cpuset kept.
        [kept] = await nri.update_container(db, pg, pb.LinuxResources())
        assert clock.ran_out == 2 and holder.holding()
        assert (kept.container_id, kept.linux.resources.cpu.cpus) == (CID["pg"], "1,25")
        assert not kept.ignore_failure
        holder.release()
        assert await daemon.drain()

    asyncio.run(scenario())
    # The refused resize was not committed late: pg still has its 2 CPUs.
    assert daemon.node.state.assignments[CID["pg"]].cpus == P("1,25")
    assert on_disk(daemon).assignments[CID["pg"]].cpus == P("1,25")
    assert [(r["EVENT"], r["REASON"]) for r in records.of("deadline")] == [
        ("UpdateContainer", "state-lock")
    ] * 2
    assert "answered with its cpuset kept" in records.of("deadline")[1]["MESSAGE"]
    assert "nothing was changed" in records.of("deadline-late")[0]["MESSAGE"]
    assert not records.of("resize")


# --- a slow disk ----------------------------------------------------------------------------


def test_exclusive_create_whose_commit_is_slow_is_refused_and_released_again(
    tmp_path, daemons, monkeypatch, clock
):
    """The decision was being committed when the budget ran out: it is durable by the time
    the job sees the answer, so it is released again at once - in memory and on disk."""
    metrics = Metrics()
    daemon, records = daemons(node_settings(tmp_path), metrics=metrics)
    nri = daemon.adapter
    web, db = pod("web", "burstable"), pod("db")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.create_container(web, container("nginx", web, 500))
        assert await daemon.drain()  # its commit follows its answer
        disk = SlowDisk(monkeypatch, clock)
        err = await answer(nri.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and clock.ran_out == 1
        assert disk.stuck()  # answered while the commit waits for the disk
        assert "the disk is slow to sync" in str(err) and "state.json durably" in str(err)
        disk.go()
        assert await daemon.drain()

    asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["REASON"] == "commit"
    assert [r["ACTION"] for r in records if r["ACTION"] in ("allocate", "release")] == [
        "allocate",
        "release",
    ]
    [late] = records.of("deadline-late")
    assert "its exclusive CPUs 1,25 were released again" in late["MESSAGE"]
    assert daemon.node.state.assignments == {} and daemon.node.state.shared == ONLINE
    assert on_disk(daemon).assignments == {}
    assert CID["nginx"] in on_disk(daemon).sharing
    labels = {"event": "CreateContainer", "reason": "commit"}
    registry = metrics.registry
    assert registry.get_sample_value("nri_cpuplugin_deadline_misses_total", labels) == 1


def test_a_resize_answered_with_an_error_during_its_commit_is_undone(
    tmp_path, daemons, monkeypatch, clock
):
    """The budget ran out while the resize was being committed: kubelet was told it failed,
    so the container keeps its CPUs - in memory and on disk - and none are given out twice."""
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db = pod("db")
    pg = container("pg", db, 2000)

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.create_container(db, pg)
        disk = SlowDisk(monkeypatch, clock)
        err = await answer(nri.update_container(db, pg, resize(4000)))
        assert isinstance(err, PolicyError) and clock.ran_out == 1
        assert disk.stuck()
        disk.go()
        assert await daemon.drain()

    asyncio.run(scenario())
    state = daemon.node.state
    assert state.assignments[CID["pg"]].cpus == P("1,25")
    assert on_disk(daemon).assignments[CID["pg"]].cpus == P("1,25")
    assert state.shared == ONLINE - P("1,25")
    [late] = records.of("deadline-late")
    assert "its resize was undone: it keeps its exclusive CPUs 1,25" in late["MESSAGE"]


def test_updates_owed_to_others_survive_a_creation_answered_with_an_error(
    tmp_path, daemons, monkeypatch, clock
):
    """A creation's reply carries the updates owed to other containers; when the creation is
    answered with an error instead, they are owed again, to the next reply."""
    daemon, _ = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    slow, writing, gate = threading.Event(), threading.Event(), threading.Event()

    def write(targets):  # cgroup writes the kernel is slow to apply, once ``slow`` is set
        targets = list(targets)
        if targets and slow.is_set():
            writing.set()
            assert gate.wait(60)
        return []

    clock.add(lambda worker: writing.is_set() and not gate.is_set())

    monkeypatch.setattr(daemon.node.writer, "write", write)
    web, db, other = pod("web", "burstable"), pod("db"), pod("other")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        await nri.create_container(web, container("nginx", web, 500))
        await nri.create_container(other, container("big", other, 2000))
        daemon.deadline.submit(ev.Owe((CID["big"],)))  # as after a hotplug, systemd driver
        slow.set()
        err = await answer(nri.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        gate.set()
        assert await daemon.drain()

    asyncio.run(scenario())
    assert CID["big"] in daemon.node.owed


def test_a_shared_create_on_a_slow_disk_gets_the_pool_and_is_kept(
    tmp_path, daemons, monkeypatch, clock
):
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    web = pod("web", "burstable")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        disk = SlowDisk(monkeypatch, clock)
        adjust, _ = await nri.create_container(web, container("nginx", web, 500))
        assert clock.ran_out == 0  # answered before its commit, which waits for the disk
        assert adjust.linux.resources.cpu.cpus == str(ONLINE)
        disk.go()
        assert await daemon.drain()

    asyncio.run(scenario())
    assert not records.of("deadline")  # answered before the commit, which did not hold it up
    assert CID["nginx"] in daemon.node.state.sharing and CID["nginx"] in on_disk(daemon).sharing


def test_once_the_runtime_lists_its_containers_an_exclusive_answer_does_not_wait_for_the_disk(
    tmp_path, daemons, monkeypatch, clock
):
    """After a Synchronize the runtime lists its containers at every connection, and a crash
    before the commit is repaired from that list (the container is adopted on its CPUs): the
    exclusive creation is answered at once, and committed at the container's StartContainer,
    before its first instruction."""
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db = pod("db")
    pg = container("pg", db, 2000)

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        disk = SlowDisk(monkeypatch, clock)
        adjust, _ = await nri.create_container(db, pg)
        assert clock.ran_out == 0 and adjust.linux.resources.cpu.cpus == "1,25"
        await until(daemon.worker.idle)  # the creation's work is done: no commit after it
        assert not disk.entered.is_set()
        assert CID["pg"] not in on_disk(daemon).assignments
        disk.go()
        await nri.start_container(db, pg)
        assert disk.entered.is_set()

    asyncio.run(scenario())
    assert not records.of("deadline")
    assert on_disk(daemon).assignments[CID["pg"]].cpus == P("1,25")  # ... and completes


def test_once_the_runtime_lists_its_containers_a_stop_is_answered_before_the_disk_and_writes(
    tmp_path, daemons, monkeypatch, clock
):
    """A stop gives CPUs back: nothing runs where it must not if the shared containers get
    them a moment later, and a crash before the commit is repaired from the runtime's list.
    So the answer goes first; a write that fails after it is owed to the next reply."""
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db, web = pod("db"), pod("web", "burstable")
    pg, nginx = container("pg", db, 2000), container("nginx", web, 500)
    written: list[str] = []

    def write(targets):  # every write fails
        failed = [t.container_id for t in targets]
        written.extend(failed)
        return failed

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        await nri.create_container(web, nginx)
        await nri.create_container(db, pg)
        await nri.start_container(db, pg)
        writer = daemon.node.writer
        monkeypatch.setattr(writer, "can_write", lambda path: True)  # as cgroupfs paths
        monkeypatch.setattr(writer, "write", write)
        disk = SlowDisk(monkeypatch, clock)
        updates = await nri.stop_container(db, pg)
        assert updates == [] and clock.ran_out == 0
        assert await asyncio.to_thread(disk.entered.wait, 5)  # the commit follows the answer
        assert CID["pg"] in on_disk(daemon).assignments and written == [CID["nginx"]]
        disk.go()
        assert await daemon.drain()
        # The write that failed goes with the next reply.
        _, updates = await nri.create_container(web, container("php", web, 250))
        assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [
            (CID["nginx"], str(ONLINE))
        ]

    asyncio.run(scenario())
    assert not records.of("deadline")
    assert CID["pg"] not in on_disk(daemon).assignments


def test_a_commit_put_off_is_written_when_the_daemon_drains_before_it_exits(tmp_path, daemons):
    """The drain writes it: no timer of the daemon's comes due meanwhile (they are held)."""
    timers = Timers()
    daemon, _ = daemons(node_settings(tmp_path), later=timers)
    nri = daemon.adapter
    db = pod("db")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        await nri.create_container(db, container("pg", db, 2000))
        assert CID["pg"] not in on_disk(daemon).assignments  # put off until its start
        assert await daemon.drain()

    asyncio.run(scenario())
    assert timers.due == []
    assert on_disk(daemon).assignments[CID["pg"]].cpus == P("1,25")


def test_cgroup_writes_that_outlast_the_budget_fail_the_exclusive_creation_in_time(
    tmp_path, daemons, monkeypatch, clock
):
    """The shared containers a creation moves are written before its answer.  Writes the
    kernel is slow to apply count against the budget: the exclusive creation is answered with
    an error in time (REASON cgroup-writes), nothing is assigned, and the containers written
    meanwhile get the shared pool back."""
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    writing, gate = threading.Event(), threading.Event()
    written: list[tuple[str, str]] = []

    def write(targets):  # as if every shared container had a cgroupfs path; slow ones
        targets = list(targets)
        if not targets:
            return []
        writing.set()
        assert gate.wait(60)
        written.extend((t.container_id, str(t.cpus)) for t in targets)
        return []

    monkeypatch.setattr(daemon.node.writer, "write", write)
    clock.add(lambda worker: writing.is_set() and not gate.is_set())
    web, db = pod("web", "burstable"), pod("db")
    nginx = container("nginx", web, 500)

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])  # the commit may follow the answer
        await nri.create_container(web, nginx)
        pool = str(daemon.node.state.shared)
        err = await answer(nri.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        assert clock.ran_out == 1 and not gate.is_set()  # once the writes held it, not before
        assert "writing the shared containers' cpusets" in str(err)
        gate.set()
        assert await daemon.drain()
        return pool

    pool = asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["EVENT"] == "CreateContainer" and missed["REASON"] == "cgroup-writes"
    assert written == [(CID["nginx"], "0,2-24,26-47"), (CID["nginx"], pool)]
    assert not on_disk(daemon).assignments and str(daemon.node.state.shared) == pool


# --- through the real stub, as the runtime sees it ---------------------------------------------


def test_the_runtime_gets_answers_in_time_stays_connected_and_hears_what_came_late(
    tmp_path, daemons, holders, clock
):
    """A FAKE runtime over the real NRI wire: with the lock held, a stop is answered empty, a
    shared creation with the pool as it still is, an exclusive creation with our error - each
    well before the runtime's 2 s.  Once the lock is free the release is committed, and the
    shared container, which the pool grew under meanwhile, is owed the grown pool, carried by
    the next reply that can carry it (never an unsolicited UpdateContainers)."""
    daemon, records = daemons(node_settings(tmp_path))
    socket_path = tmp_path / "nri.sock"
    db, web, big = pod("db"), pod("web", "burstable"), pod("big")

    async def call(runtime, method, request):
        return await runtime.call(method, request)

    async def scenario():
        async with connected(daemon, socket_path) as (runtime, stub):
            pg = container("pg", db, 2000)
            reply = await call(
                runtime, "CreateContainer", pb.CreateContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0
            holder = holders(daemon.node.settings.state_dir)
            reply = await call(
                runtime, "StopContainer", pb.StopContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0 and clock.ran_out == 1
            assert not pb.StopContainerResponse.FromString(reply.payload).update
            nginx = container("nginx", web, 500)
            reply = await call(
                runtime, "CreateContainer", pb.CreateContainerRequest(pod=web, container=nginx)
            )
            assert reply.code == 0 and clock.ran_out == 2
            adjust = pb.CreateContainerResponse.FromString(reply.payload).adjust
            assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
            reply = await call(
                runtime,
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
            )
            assert reply.code != 0 and clock.ran_out == 3 and holder.holding()
            assert "cpuplugin: exclusive CPUs for container 'big' of pod ns/big" in reply.message
            assert f"could not be decided within {BUDGET:g} s" in reply.message
            assert stub.connected.is_set() and runtime.connections == 1
            holder.release()
            assert await daemon.drain()
            # The shared container, whose cgroup cannot be written here, is owed to the next
            # reply.
            assert CID["nginx"] in daemon.node.owed
            # Still connected and deciding: the next exclusive creation is pinned, and its reply
            # carries the shared container to the pool as it is now.
            reply = await call(
                runtime,
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("redis", big, 1000)),
            )
            assert reply.code == 0
            response = pb.CreateContainerResponse.FromString(reply.payload)
            cpu = response.adjust.linux.resources.cpu
            assert len(P(cpu.cpus)) == 1 and cpu.quota.value == 0  # exclusive: pinned, no quota
            pool = str(ONLINE - P(cpu.cpus))
            assert [(u.container_id, u.linux.resources.cpu.cpus) for u in response.update] == [
                (CID["nginx"], pool)
            ]
            # Never an unsolicited UpdateContainers (it deadlocks containerd): none came before
            # this reply, which the plugin's side of the connection sent after anything earlier.
            assert runtime.update_requests == []
            assert runtime.connections == 1
            assert await daemon.drain()  # the commit waits for StartContainer, or the exit

    asyncio.run(scenario())
    assert [r["EVENT"] for r in records.of("deadline")] == [
        "StopContainer",
        "CreateContainer",
        "CreateContainer",
    ]
    assert not records.of("disconnect")
    assert CID["big"] not in daemon.node.state.assignments
    assert set(daemon.node.state.assignments) == {CID["redis"]}


# --- background work is the worker's too ------------------------------------------------------


def restarted_with_pg(tmp_path, daemons, timers: Timers) -> tuple[Daemon, Records]:
    """A daemon started on the state a previous one left: "pg", known only from the file; its
    timers held in ``timers``."""
    settings = node_settings(tmp_path)
    first = Driver(settings)
    try:
        first.configure()
        db = pod("db")
        first.create_container(db, container("pg", db, 2000))
    finally:
        first.close()  # the old daemon is gone (its claim with it)
    return daemons(settings, later=timers)


def test_the_sweep_runs_on_the_worker_behind_the_events(tmp_path, daemons, holders, monkeypatch):
    """Containers known only from the state file are checked by a background sweep: on the
    worker thread, so it waits its turn (and for the lock) like any event, never on the loop."""
    timers = Timers()
    daemon, records = restarted_with_pg(tmp_path, daemons, timers)
    asked: list[str] = []  # the threads that checked a cgroup; none tells (no cgroups here)
    monkeypatch.setattr(
        Liveness, "alive", lambda self, path: asked.append(threading.current_thread().name)
    )

    async def scenario():
        await daemon.adapter.configure("", "containerd", "v2.1.9")
        assert len(daemon.node.unverified) == 1 and timers.take(ev.SweepRound)  # its first
        holder = holders(daemon.node.settings.state_dir)
        daemon.deadline.submit(ev.SweepRound())  # as its timer does, on the loop
        await until(lock_waited(daemon))  # started on the worker ...
        assert daemon.worker.current.name == "sweep" and asked == []
        assert CID["pg"] in daemon.node.state.assignments  # ... and waits there for the lock
        holder.release()
        assert await daemon.drain()

    asyncio.run(scenario())
    assert asked and set(asked) == {WORKER}
    # No cgroup tells that pg still runs, so it stays; the round is done and another set.
    assert len(daemon.node.unverified) == 1 and len(timers.take(ev.SweepRound)) == 1
    assert not records.of("deadline")


def test_a_sweep_round_that_fails_ends_its_chain_and_the_next_start_sweeps_again(
    tmp_path, daemons, monkeypatch
):
    """A round that fails (a bug) schedules no other, each to fail again; the runtime's next
    Configure begins a new chain.  Here the sweep looks for the cgroup of a pod the runtime
    listed with its earmark (whose removal containerd may not relay), and that look fails."""
    timers = Timers()
    daemon, _ = daemons(node_settings(tmp_path), later=timers)
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)

    def broken(self, cgroup_parent):
        raise RuntimeError("a bug")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.run_pod_sandbox(db)
        await nri.synchronize([db], [])
        [first] = timers.take(ev.SweepRound)  # for the earmarked pod's cgroup
        with monkeypatch.context() as patched:
            patched.setattr(Liveness, "pod_gone", broken)
            daemon.deadline.submit(first)  # its timer is due
            assert await daemon.drain()
            assert timers.take(ev.SweepRound) == []  # no next round
        await nri.configure("", "containerd", "v2.1.9")
        assert len(timers.take(ev.SweepRound)) == 1

    asyncio.run(scenario())


def test_a_sweep_round_whose_checks_fail_is_followed_by_the_next(
    tmp_path, daemons, monkeypatch, caplog
):
    """Checking the containers known only from the state file fails (a cgroup that cannot be
    read as expected, a lock that cannot be had): said, and tried again at the next round."""
    timers = Timers()
    daemon, _ = restarted_with_pg(tmp_path, daemons, timers)

    def broken(self, path):
        raise RuntimeError("unexpected cgroup contents")

    async def scenario():
        await daemon.adapter.configure("", "containerd", "v2.1.9")
        [first] = timers.take(ev.SweepRound)
        monkeypatch.setattr(Liveness, "alive", broken)
        daemon.deadline.submit(first)  # its timer is due
        assert await daemon.drain()

    asyncio.run(scenario())
    assert len(timers.take(ev.SweepRound)) == 1 and len(daemon.node.unverified) == 1
    assert "checking unverified containers failed: unexpected cgroup contents" in caplog.text


def test_hotplug_is_followed_on_the_worker_and_owed_to_the_next_reply(tmp_path, daemons):
    """CPU hotplug is the worker's job like any event; what it cannot write (no cgroups in a
    generated tree) is owed to the runtime's next reply, never sent unsolicited."""
    machine = Machine(tmp_path)
    machine.set()
    settings = Settings(
        sysfs=str(machine.root), state_dir=str(tmp_path / "state"), reserved_cpus=P("0")
    )
    daemon, records = daemons(settings)
    nri = daemon.adapter
    sent = []

    class Runtime:
        """Where unsolicited updates would go (the stub's side of them): nothing may."""

        request_timeout = 2.0

        def schedule_update_containers(self, updates, done=None):
            sent.append((threading.get_ident(), [u.linux.resources.cpu.cpus for u in updates]))

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        daemon.stop_hotplug()  # the event comes from the test
        daemon.stub = Runtime()
        db = pod("db")
        await nri.create_container(db, container("pg", db, 7000))
        machine.set(offline={7})
        daemon.deadline.submit(uevent("offline", 7))
        assert await daemon.drain()
        assert daemon.node.state.assignments[CID["pg"]].lost == P("7")
        other = pod("other", "besteffort")
        return await nri.stop_container(other, container("x", other, 0))

    updates = asyncio.run(scenario())
    assert sent == []
    assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [(CID["pg"], "1-6")]
    assert records.of("hotplug-applied")


def test_the_worker_answers_configure_errors_and_outlives_a_failing_job(tmp_path, daemons):
    daemon, _ = daemons(node_settings(tmp_path))
    nri = daemon.adapter

    async def scenario():
        with pytest.raises(Exception, match="unknown key 'bogus'"):
            await nri.configure("bogus = 1", "containerd", "v2.1.9")
        await nri.configure("", "containerd", "v2.1.9")
        job = daemon.worker.submit("broken", lambda: 1 / 0)
        assert await daemon.worker.finished(job, 1.0)
        with pytest.raises(ZeroDivisionError):
            job.outcome()
        db = pod("db")
        adjust, _ = await nri.create_container(db, container("pg", db, 2000))
        assert adjust.linux.resources.cpu.cpus == "1,25"

    asyncio.run(scenario())


def test_when_the_stubs_guard_answers_first_a_creation_is_dropped_and_a_release_kept(
    tmp_path, daemons, holders, monkeypatch
):
    """The stub's last-resort guard (its DEADLINE_SHARE of the runtime's timeout) cancels a
    handler still waiting: the runtime gets DEADLINE_EXCEEDED.  A creation the runtime then
    abandons is never assigned; a stop, which happened all the same, is still committed.  The
    guard comes at 1.8 s of the loop's clock, which the test moves on (``SteppedLoop``)."""
    monkeypatch.setattr(deadline, "BUDGET_SHARE", 5.0)  # our budget (5 s) after it, for once
    daemon, records = daemons(node_settings(tmp_path, budget=5.0), by_time=True)
    socket_path = tmp_path / "nri.sock"
    db, big = pod("db"), pod("big")

    async def guarded(call):
        """The reply to ``call``, the loop's clock moved on while it waits (the lock is held:
        the first timer due is the stub's guard, before the budget and the runtime's own)."""
        loop = asyncio.get_running_loop()
        replied = asyncio.ensure_future(call)
        while not replied.done():
            loop.step(0.25)
            await asyncio.sleep(0)
        return replied.result()

    async def scenario():
        async with connected(daemon, socket_path) as (runtime, stub):
            pg = container("pg", db, 2000)
            reply = await runtime.call(
                "CreateContainer", pb.CreateContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0
            holder = holders(daemon.node.settings.state_dir)
            reply = await guarded(
                runtime.call("StopContainer", pb.StopContainerRequest(pod=db, container=pg))
            )
            assert reply.code == 4 and "did not finish within 1.80s" in reply.message
            reply = await guarded(
                runtime.call(
                    "CreateContainer",
                    pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
                )
            )
            assert reply.code == 4
            holder.release()
            assert await daemon.drain()
            assert stub.connected.is_set()

    with asyncio.Runner(loop_factory=SteppedLoop) as runner:
        runner.run(scenario())
    assert daemon.node.state.assignments == {} and on_disk(daemon).assignments == {}
    assert [r["CONTAINER_ID"] for r in records.of("release")] == [CID["pg"]]
    assert [r["ACTION"] for r in records if r["ACTION"] == "allocate"] == ["allocate"]
    late = [r["MESSAGE"] for r in records.of("deadline-late")]
    assert late[0].startswith("StopContainer of container 'pg' of pod ns/db ended")
    assert late[1].startswith("CreateContainer of container 'big' of pod ns/big ended")
    assert late[1].endswith("answered with an error: nothing was assigned")


def test_a_creation_that_ended_while_the_loop_stalled_past_the_guard_is_undone(
    tmp_path, daemons, holders, monkeypatch
):
    """The job ends while the event loop is stalled past the stub's guard: the guard's error
    goes out (its timer comes before the job's result), so the runtime does not create the
    container - and the exclusive CPUs decided for it are released again, not kept until
    kubelet's retry.  The guard comes at 1.8 s of the loop's clock, which the test moves on
    (``SteppedLoop``)."""
    monkeypatch.setattr(deadline, "BUDGET_SHARE", 5.0)  # our budget (5 s) after it
    daemon, records = daemons(node_settings(tmp_path, budget=5.0), by_time=True)
    socket_path = tmp_path / "nri.sock"
    big = pod("big")

    async def scenario():
        async with connected(daemon, socket_path) as (runtime, stub):
            holder = holders(daemon.node.settings.state_dir)
            loop = asyncio.get_running_loop()

            async def stall() -> None:
                await until(lock_waited(daemon))
                # The loop stalls (this coroutine blocks it): the job gets the lock and ends,
                # and the loop sees that only once the guard's time has come.
                holder.release()
                block_until(daemon.worker.idle)
                loop.step(2.0)

            stalled = asyncio.ensure_future(stall())
            reply = await runtime.call(
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
            )
            await stalled
            assert reply.code == 4 and "did not finish within 1.80s" in reply.message
            assert await daemon.drain()
            assert stub.connected.is_set()

    with asyncio.Runner(loop_factory=SteppedLoop) as runner:
        runner.run(scenario())
    assert [r["ACTION"] for r in records if r["ACTION"] == "allocate"] == ["allocate"]
    assert daemon.node.state.assignments == {}
    [late] = records.of("deadline-late")
    assert "CreateContainer of container 'big' of pod ns/big ended" in late["MESSAGE"]
    assert "were released again" in late["MESSAGE"] or "dropped again" in late["MESSAGE"]


def test_a_resize_undone_late_does_not_undo_what_was_committed_after_it(tmp_path, daemons, holders):
    """The stub's guard answers a resize with an error after its job had ended (the event loop
    was stalled meanwhile), and a stop is committed before the resize's late part runs: going
    back to the state the resize began with would undo the stop too, so the resize stands and
    its reply is owed instead (kubelet's retry finds it made)."""
    daemon, records = daemons(node_settings(tmp_path, budget=5.0), by_time=True)
    nri = daemon.adapter
    db, web = pod("db"), pod("web", "burstable")
    pg, nginx = container("pg", db, 2000), container("nginx", web, 500)

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.create_container(web, nginx)
        await nri.create_container(db, pg)
        holder = holders(daemon.node.settings.state_dir)
        resizing = asyncio.ensure_future(nri.update_container(db, pg, resize(4000)))
        await until(lock_waited(daemon))
        # The loop stalls (this coroutine blocks it) while the resize gets the lock and ends.
        holder.release()
        block_until(daemon.worker.idle)
        # When the loop goes on, a stop comes first, then the stub's guard (a cancellation)
        # answers the resize with an error: its late part is queued behind the stop.
        stopping = asyncio.ensure_future(nri.stop_container(web, nginx))
        resizing.cancel()
        await stopping
        with pytest.raises(asyncio.CancelledError):
            await resizing
        assert await daemon.drain()

    asyncio.run(scenario())
    state = daemon.node.state
    assert state.assignments[CID["pg"]].cpus == P("1-2,25-26")  # the resize stands ...
    assert CID["nginx"] not in state.sharing  # ... and so does the stop
    assert on_disk(daemon) == state
    [late] = records.of("deadline-late")
    assert late["EVENT"] == "UpdateContainer"
    assert "undone" not in late["MESSAGE"] and "committed" in late["MESSAGE"]


def test_the_worker_runs_where_the_loop_is_and_the_loop_keeps_its_cpus(tmp_path, daemons):
    """The worker follows the event loop's CPU (a job on the other CPU costs cold caches and
    wake-ups); the loop is held there only while it waits, its own affinity given back."""
    threads = Threads()
    daemon, _ = daemons(node_settings(tmp_path), threads)
    nri = daemon.adapter
    allowed = os.sched_getaffinity(0)
    db = pod("db")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        for name in ("pg", "redis"):
            await nri.create_container(db, container(name, db, 1000))
            assert os.sched_getaffinity(0) == allowed
        assert await daemon.drain()  # (each audits its decision after its answer)

    asyncio.run(scenario())
    assert set(daemon.node.state.assignments) == {CID["pg"], CID["redis"]}
    made_on = threads.made_on["allocate"]  # each decided on the worker, on one CPU
    assert len(made_on) == 2
    for thread, cpus in made_on:
        assert thread == WORKER and len(cpus) == 1 and cpus <= allowed
