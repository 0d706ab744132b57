"""The daemon's deadline discipline (daemon/deadline.py): every request answered within its
budget, with the state lock held by another nri-cpuplugin process or the disk slow to sync,
and the work done late agreeing with what was answered.  Generated 48-CPU topology (CPUs 0
and 24 reserved), real state directory, real lock; budgets of 0.3 s to keep this quick."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest
from fake_runtime import FakeRuntime
from lock_holder import LockHolder
from nri_messages import container, pod
from topologies import build

from nri_cpuplugin.base import files
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.daemon.deadline import DeadlinePlugin
from nri_cpuplugin.daemon.plugin import CPUPlugin
from nri_cpuplugin.nri.handlers import EVENT_BITS
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.ops.metrics import Metrics
from nri_cpuplugin.storage.store import StateStore

P = CPUSet.parse
BUDGET = 0.3
# How much later than the budget an answer may come on a machine busy with other tests.
SLACK = 0.5
ONLINE = P("0-47")


class Records(list):
    def __call__(self, record):
        self.append(record)

    def of(self, action):
        return [r for r in self if r["ACTION"] == action]


def make(tmp_path, budget: float = BUDGET, cls=DeadlinePlugin, state: str = "state"):
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    records = Records()
    settings = Settings(
        sysfs=str(root),
        state_dir=str(tmp_path / state),
        reserved_cpu_count=2,
        nri_request_budget=budget,
    )
    return cls(settings, Audit(records)), records


@pytest.fixture
def holders():
    made: list[LockHolder] = []

    def hold(state_dir: str) -> LockHolder:
        made.append(LockHolder(state_dir))
        return made[-1]

    yield hold
    for holder in made:
        holder.release()


class SlowDisk:
    """The state file's durable write (write, fsync, rename, fsync) blocks until ``go``."""

    def __init__(self, monkeypatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        write = files.write_atomic

        def slow(*args, **kwargs):
            self.entered.set()
            self.gate.wait(30)
            return write(*args, **kwargs)

        monkeypatch.setattr(files, "write_atomic", slow)

    def go(self) -> None:
        self.gate.set()


def on_disk(plugin) -> object:
    return StateStore(plugin.settings.state_dir).peek().state


@contextlib.asynccontextmanager
async def connected(plugin, socket_path):
    """A FAKE runtime on ``socket_path`` and the real stub serving ``plugin``, registered."""
    runtime = FakeRuntime(socket_path)
    await runtime.start()
    stub = Stub(plugin, "cpuplugin", "50", socket_path=str(socket_path))
    plugin.stub = stub
    served = asyncio.create_task(stub.run())
    try:
        await asyncio.wait_for(runtime.registered.wait(), 10)
        yield runtime, stub
    finally:
        stub.stop()
        await runtime.close()
        await asyncio.wait_for(served, 5)


async def timed(coro):
    started = time.monotonic()
    try:
        result = await coro
    except PolicyError as err:
        return err, time.monotonic() - started
    return result, time.monotonic() - started


CID = {name: name.ljust(64, "0") for name in ("pg", "nginx", "web2", "big", "redis")}


# --- the fast path ------------------------------------------------------------------------------


def test_within_the_budget_the_answers_are_the_synchronous_plugins(tmp_path):
    """Same events, same answers, same state as CPUPlugin called directly; nothing missed."""
    plugin, records = make(tmp_path)
    direct, _ = make(tmp_path, cls=CPUPlugin, state="direct")
    web, db = pod("web", "burstable"), pod("db")
    events = [
        ("create_container", (web, container("nginx", web, 500))),
        ("create_container", (db, container("pg", db, 2000))),
        ("update_container", (db, container("pg", db, 2000), pb.LinuxResources())),
        ("stop_container", (db, container("pg", db, 2000))),
        ("remove_container", (db, container("pg", db, 2000))),
        ("remove_pod_sandbox", (db,)),
    ]

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await direct.configure("", "containerd", "v2.1.9")
        for name, args in events:
            got = await getattr(plugin, name)(*args)
            want = getattr(direct, name)(*args)
            assert repr(got) == repr(want), name
        assert plugin.worker._thread.ident != threading.get_ident()  # decided off the loop

    asyncio.run(scenario())
    assert plugin.state == direct.state
    assert not records.of("deadline") and not records.of("deadline-late")
    assert [r["ACTION"] for r in records if r["ACTION"] in ("allocate", "release")] == [
        "allocate",
        "release",
    ]


def test_the_budget_is_kept_below_the_runtimes_own_timeout(tmp_path):
    plugin, _ = make(tmp_path, budget=1.5)
    assert plugin.budget == 1.5
    plugin.stub = Stub(plugin, "cpuplugin", "50")  # not connected: 2 s until Configure says
    assert plugin.budget == 1.5
    plugin.stub.request_timeout = 1.0  # a runtime configured for 1 s (Configure field 5)
    assert plugin.budget == 0.75
    assert plugin.stub.request_timeout * 0.9 > plugin.budget  # the stub's guard comes later
    # The stub takes the plugin as it is: CPUPlugin's subscription, nothing more (no
    # PostCreateContainer: a creation's cgroup writes are done before its answer).
    base = Stub(make(tmp_path, cls=CPUPlugin)[0], "x", "50").events
    assert plugin.stub.events == base
    assert not base & EVENT_BITS["post_create_container"]


# --- the state lock held by another process -------------------------------------------------


def test_exclusive_create_behind_a_held_lock_is_refused_in_time_and_never_assigned(
    tmp_path, holders
):
    plugin, records = make(tmp_path)
    plugin.metrics = Metrics()
    db = pod("db")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        holder = holders(plugin.settings.state_dir)
        err, elapsed = await timed(plugin.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        assert BUDGET <= elapsed < BUDGET + SLACK
        message = str(err)
        assert "exclusive CPUs for container 'pg' of pod ns/db" in message
        assert f"could not be decided within {BUDGET:g} s" in message
        assert f"state lock {plugin.store.lock_path}" in message and "fuser -v" in message
        assert "kubelet retries it" in message
        holder.release()
        assert await plugin.drain()

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
    assert CID["pg"] not in plugin.state.assignments and plugin.state.shared == ONLINE
    assert on_disk(plugin).assignments == {}
    registry = plugin.metrics.registry
    labels = {"event": "CreateContainer", "reason": "state-lock"}
    assert registry.get_sample_value("nri_cpuplugin_deadline_misses_total", labels) == 1
    assert registry.get_sample_value("nri_cpuplugin_pinning_errors_total") == 1


def test_shared_create_behind_a_held_lock_gets_the_pool_and_follows_it_later(tmp_path, holders):
    plugin, records = make(tmp_path)
    db, web = pod("db"), pod("web", "burstable")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        adjust, _ = await plugin.create_container(db, container("pg", db, 2000))
        assert adjust.linux.resources.cpu.cpus == "1,25"
        holder = holders(plugin.settings.state_dir)
        (adjust, updates), elapsed = await timed(
            plugin.create_container(web, container("nginx", web, 500))
        )
        assert elapsed < BUDGET + SLACK
        assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
        assert updates == []
        assert CID["nginx"] not in plugin.state.sharing  # not decided yet ...
        holder.release()
        assert await plugin.drain()
        assert CID["nginx"] in plugin.state.sharing  # ... but recorded once the lock was free
        # So it follows the pool: when pg's CPUs come back, nginx is told.
        updates = await plugin.stop_container(db, container("pg", db, 2000))
        assert {u.container_id: u.linux.resources.cpu.cpus for u in updates} == {
            CID["nginx"]: str(ONLINE)
        }

    asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["REASON"] == "state-lock" and "shared pool 0,2-24,26-47" in missed["MESSAGE"]
    [late] = records.of("deadline-late")
    assert "answered with a fallback: recorded in the shared pool 0,2-24,26-47" in late["MESSAGE"]
    assert CID["nginx"] in on_disk(plugin).sharing


def test_events_queued_behind_a_late_one_keep_their_order_and_say_why(tmp_path, holders):
    """A stop, then a creation, both behind the held lock: answered in turn within their own
    budgets; done in order once it is free - the creation then sees the released CPUs."""
    plugin, records = make(tmp_path)
    db, web = pod("db"), pod("web", "burstable")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.create_container(db, container("pg", db, 2000))
        holder = holders(plugin.settings.state_dir)
        updates, elapsed = await timed(plugin.stop_container(db, container("pg", db, 2000)))
        assert updates == [] and elapsed < BUDGET + SLACK
        assert CID["pg"] in plugin.state.assignments  # not released yet: the lock is held
        (adjust, _), elapsed = await timed(
            plugin.create_container(web, container("nginx", web, 500))
        )
        assert elapsed < BUDGET + SLACK
        # Answered with the pool as it was: pg's release is still waiting in front of it.
        assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
        await plugin.remove_container(db, container("pg", db, 2000))
        holder.release()
        assert await plugin.drain()

    asyncio.run(scenario())
    assert CID["pg"] not in plugin.state.assignments
    assert plugin.state.sharing.keys() == {CID["nginx"]}
    assert on_disk(plugin) == plugin.state
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
    tmp_path, holders
):
    plugin, records = make(tmp_path)
    db = pod("db")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        pg = container("pg", db, 2000)
        await plugin.create_container(db, pg)
        holder = holders(plugin.settings.state_dir)
        # A new CPU request of an exclusive container: only the job can decide it.
        grow = pb.LinuxResources()
        grow.cpu.shares.value, grow.cpu.quota.value, grow.cpu.period.value = 4096, 400000, 100000
        err, elapsed = await timed(plugin.update_container(db, pg, grow))
        assert isinstance(err, PolicyError) and elapsed < BUDGET + SLACK
        assert "the CPU resize of container 'pg' of pod ns/db could not be decided" in str(err)
        assert "kubelet retries the resize" in str(err)
        # Something else than the CPU request (no shares), queued behind it: cpuset kept.
        [kept], elapsed = await timed(plugin.update_container(db, pg, pb.LinuxResources()))
        assert elapsed < BUDGET + SLACK
        assert (kept.container_id, kept.linux.resources.cpu.cpus) == (CID["pg"], "1,25")
        assert not kept.ignore_failure
        holder.release()
        assert await plugin.drain()

    asyncio.run(scenario())
    # The refused resize was not committed late: pg still has its 2 CPUs.
    assert plugin.state.assignments[CID["pg"]].cpus == P("1,25")
    assert on_disk(plugin).assignments[CID["pg"]].cpus == P("1,25")
    assert [(r["EVENT"], r["REASON"]) for r in records.of("deadline")] == [
        ("UpdateContainer", "state-lock")
    ] * 2
    assert "answered with its cpuset kept" in records.of("deadline")[1]["MESSAGE"]
    assert "nothing was changed" in records.of("deadline-late")[0]["MESSAGE"]
    assert not records.of("resize")


# --- a slow disk ----------------------------------------------------------------------------


def test_exclusive_create_whose_commit_is_slow_is_refused_and_released_again(tmp_path, monkeypatch):
    """The decision was being committed when the budget ran out: it is durable by the time
    the job sees the answer, so it is released again at once - in memory and on disk."""
    plugin, records = make(tmp_path)
    plugin.metrics = Metrics()
    web, db = pod("web", "burstable"), pod("db")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.create_container(web, container("nginx", web, 500))
        assert await plugin.drain()  # its commit follows its answer
        disk = SlowDisk(monkeypatch)
        err, elapsed = await timed(plugin.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and elapsed < BUDGET + SLACK
        assert disk.entered.is_set()
        assert "the disk is slow to sync" in str(err) and "state.json durably" in str(err)
        disk.go()
        assert await plugin.drain()

    asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["REASON"] == "commit"
    assert [r["ACTION"] for r in records if r["ACTION"] in ("allocate", "release")] == [
        "allocate",
        "release",
    ]
    [late] = records.of("deadline-late")
    assert "its exclusive CPUs 1,25 were released again" in late["MESSAGE"]
    assert plugin.state.assignments == {} and plugin.state.shared == ONLINE
    assert on_disk(plugin).assignments == {}
    assert CID["nginx"] in on_disk(plugin).sharing
    labels = {"event": "CreateContainer", "reason": "commit"}
    assert (
        plugin.metrics.registry.get_sample_value("nri_cpuplugin_deadline_misses_total", labels) == 1
    )


def test_a_resize_answered_with_an_error_during_its_commit_is_undone(tmp_path, monkeypatch):
    """The budget ran out while the resize was being committed: kubelet was told it failed,
    so the container keeps its CPUs - in memory and on disk - and none are given out twice."""
    plugin, records = make(tmp_path)
    db = pod("db")
    pg = container("pg", db, 2000)

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.create_container(db, pg)
        disk = SlowDisk(monkeypatch)
        grow = pb.LinuxResources()
        grow.cpu.shares.value, grow.cpu.quota.value, grow.cpu.period.value = 4096, 400000, 100000
        err, elapsed = await timed(plugin.update_container(db, pg, grow))
        assert isinstance(err, PolicyError) and elapsed < BUDGET + SLACK
        assert disk.entered.is_set()
        disk.go()
        assert await plugin.drain()

    asyncio.run(scenario())
    assert plugin.state.assignments[CID["pg"]].cpus == P("1,25")
    assert on_disk(plugin).assignments[CID["pg"]].cpus == P("1,25")
    assert plugin.state.shared == ONLINE - P("1,25")
    [late] = records.of("deadline-late")
    assert "its resize was undone: it keeps its exclusive CPUs 1,25" in late["MESSAGE"]


def test_updates_owed_to_others_survive_a_creation_answered_with_an_error(tmp_path, monkeypatch):
    """A creation's reply carries the updates owed to other containers; when the creation is
    answered with an error instead, they are owed again, to the next reply."""
    plugin, _ = make(tmp_path)
    slow, gate = threading.Event(), threading.Event()

    def write(direct):
        if direct and slow.is_set():
            gate.wait(30)
        return []

    monkeypatch.setattr(plugin, "_split_followers", lambda targets: (list(targets), []))
    monkeypatch.setattr(CPUPlugin, "_write_direct", lambda self, direct: write(direct))
    web, db, other = pod("web", "burstable"), pod("db"), pod("other")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        await plugin.create_container(web, container("nginx", web, 500))
        await plugin.create_container(other, container("big", other, 2000))
        plugin._owed.add(CID["big"])  # as after a hotplug under the systemd driver
        slow.set()
        err, _ = await timed(plugin.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        gate.set()
        assert await plugin.drain()

    asyncio.run(scenario())
    assert CID["big"] in plugin._owed


def test_a_sweep_round_that_fails_lets_the_next_start_sweep_again(tmp_path):
    plugin, _ = make(tmp_path)

    def broken():
        raise RuntimeError("a bug")

    plugin._sweep_once = broken

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        plugin._sweeping = True  # as _start_sweep leaves it
        plugin._sweep(asyncio.get_running_loop())
        assert await plugin.drain()
        await asyncio.sleep(0.05)  # the round's end is told on the loop

    asyncio.run(scenario())
    assert not plugin._sweeping


def test_a_shared_create_on_a_slow_disk_gets_the_pool_and_is_kept(tmp_path, monkeypatch):
    plugin, records = make(tmp_path)
    web = pod("web", "burstable")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        disk = SlowDisk(monkeypatch)
        (adjust, _), elapsed = await timed(
            plugin.create_container(web, container("nginx", web, 500))
        )
        assert elapsed < BUDGET + SLACK
        assert adjust.linux.resources.cpu.cpus == str(ONLINE)
        disk.go()
        assert await plugin.drain()

    asyncio.run(scenario())
    assert not records.of("deadline")  # answered before the commit, which did not hold it up
    assert CID["nginx"] in plugin.state.sharing and CID["nginx"] in on_disk(plugin).sharing


def test_once_the_runtime_lists_its_containers_an_exclusive_answer_does_not_wait_for_the_disk(
    tmp_path, monkeypatch
):
    """After a Synchronize the runtime lists its containers at every connection, and a crash
    before the commit is repaired from that list (the container is adopted on its CPUs): the
    exclusive creation is answered at once, and committed at the container's StartContainer,
    before its first instruction."""
    plugin, records = make(tmp_path)
    db = pod("db")
    pg = container("pg", db, 2000)

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        disk = SlowDisk(monkeypatch)
        (adjust, _), elapsed = await timed(plugin.create_container(db, pg))
        assert elapsed < BUDGET and adjust.linux.resources.cpu.cpus == "1,25"
        assert not await asyncio.to_thread(disk.entered.wait, 0.2)  # no commit after it
        assert CID["pg"] not in on_disk(plugin).assignments
        disk.go()
        await plugin.start_container(db, pg)
        assert disk.entered.is_set()

    asyncio.run(scenario())
    assert not records.of("deadline")
    assert on_disk(plugin).assignments[CID["pg"]].cpus == P("1,25")  # ... and completes


def test_once_the_runtime_lists_its_containers_a_stop_is_answered_before_the_disk_and_writes(
    tmp_path, monkeypatch
):
    """A stop gives CPUs back: nothing runs where it must not if the shared containers get
    them a moment later, and a crash before the commit is repaired from the runtime's list.
    So the answer goes first; a write that fails after it is owed to the next reply."""
    plugin, records = make(tmp_path)
    db, web = pod("db"), pod("web", "burstable")
    pg, nginx = container("pg", db, 2000), container("nginx", web, 500)
    written: list[str] = []

    def split(targets):
        return list(targets), []  # as if every sibling had a cgroupfs path

    def write(direct):
        written.extend(t.container_id for t in direct)
        return direct  # every write fails

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        await plugin.create_container(web, nginx)
        await plugin.create_container(db, pg)
        await plugin.start_container(db, pg)
        monkeypatch.setattr(plugin, "_split_followers", split)
        monkeypatch.setattr(plugin, "_write_direct", write)
        disk = SlowDisk(monkeypatch)
        updates, elapsed = await timed(plugin.stop_container(db, pg))
        assert updates == [] and elapsed < BUDGET
        assert await asyncio.to_thread(disk.entered.wait, 5)  # the commit follows the answer
        assert CID["pg"] in on_disk(plugin).assignments and written == [CID["nginx"]]
        disk.go()
        assert await plugin.drain()
        # The write that failed goes with the next reply.
        _, updates = await plugin.create_container(web, container("php", web, 250))
        assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [
            (CID["nginx"], str(ONLINE))
        ]

    asyncio.run(scenario())
    assert not records.of("deadline")
    assert CID["pg"] not in on_disk(plugin).assignments


def test_a_commit_put_off_is_written_when_the_daemon_drains_before_it_exits(tmp_path):
    plugin, _ = make(tmp_path)
    db = pod("db")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        started = time.monotonic()
        await plugin.create_container(db, container("pg", db, 2000))
        assert await plugin.drain()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1
    assert on_disk(plugin).assignments[CID["pg"]].cpus == P("1,25")


def test_cgroup_writes_that_outlast_the_budget_fail_the_exclusive_creation_in_time(
    tmp_path, monkeypatch
):
    """The shared containers a creation moves are written before its answer.  Writes the
    kernel is slow to apply count against the budget: the exclusive creation is answered with
    an error in time (REASON cgroup-writes), nothing is assigned, and the containers written
    meanwhile get the shared pool back."""
    plugin, records = make(tmp_path)
    gate = threading.Event()
    written: list[tuple[str, str]] = []

    def split(targets):
        return list(targets), []  # as if every sibling had a cgroupfs path

    def write(direct):
        if not direct:
            return []
        gate.wait(30)
        written.extend((t.container_id, str(t.cpus)) for t in direct)
        return []

    monkeypatch.setattr(plugin, "_split_followers", split)
    monkeypatch.setattr(CPUPlugin, "_write_direct", lambda self, direct: write(direct))
    web, db = pod("web", "burstable"), pod("db")
    nginx = container("nginx", web, 500)

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])  # the commit may follow the answer
        await plugin.create_container(web, nginx)
        pool = str(plugin.state.shared)
        err, elapsed = await timed(plugin.create_container(db, container("pg", db, 2000)))
        assert isinstance(err, PolicyError) and err.code == "deadline"
        assert BUDGET <= elapsed < BUDGET + SLACK
        assert "writing the shared containers' cpusets" in str(err)
        gate.set()
        assert await plugin.drain()
        return pool

    pool = asyncio.run(scenario())
    [missed] = records.of("deadline")
    assert missed["EVENT"] == "CreateContainer" and missed["REASON"] == "cgroup-writes"
    assert written == [(CID["nginx"], "0,2-24,26-47"), (CID["nginx"], pool)]
    assert not on_disk(plugin).assignments and str(plugin.state.shared) == pool


# --- through the real stub, as the runtime sees it ---------------------------------------------


def test_the_runtime_gets_answers_in_time_stays_connected_and_hears_what_came_late(
    tmp_path, holders
):
    """A FAKE runtime over the real NRI wire: with the lock held, a stop is answered empty, a
    shared creation with the pool as it still is, an exclusive creation with our error - each
    well before the runtime's 2 s.  Once the lock is free the release is committed, and the
    shared container, which the pool grew under meanwhile, is owed the grown pool, carried by
    the next reply that can carry it (never an unsolicited UpdateContainers)."""
    plugin, records = make(tmp_path)
    socket_path = tmp_path / "nri.sock"
    db, web, big = pod("db"), pod("web", "burstable"), pod("big")

    async def call(runtime, method, request):
        started = time.monotonic()
        reply = await runtime.call(method, request)
        return reply, time.monotonic() - started

    async def scenario():
        async with connected(plugin, socket_path) as (runtime, stub):
            pg = container("pg", db, 2000)
            reply, _ = await call(
                runtime, "CreateContainer", pb.CreateContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0
            holder = holders(plugin.settings.state_dir)
            reply, elapsed = await call(
                runtime, "StopContainer", pb.StopContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0 and elapsed < BUDGET + SLACK
            assert not pb.StopContainerResponse.FromString(reply.payload).update
            nginx = container("nginx", web, 500)
            reply, elapsed = await call(
                runtime, "CreateContainer", pb.CreateContainerRequest(pod=web, container=nginx)
            )
            assert reply.code == 0 and elapsed < BUDGET + SLACK
            adjust = pb.CreateContainerResponse.FromString(reply.payload).adjust
            assert adjust.linux.resources.cpu.cpus == str(ONLINE - P("1,25"))
            reply, elapsed = await call(
                runtime,
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
            )
            assert reply.code != 0 and elapsed < BUDGET + SLACK
            assert "cpuplugin: exclusive CPUs for container 'big' of pod ns/big" in reply.message
            assert "could not be decided within 0.3 s" in reply.message
            assert stub.connected.is_set() and runtime.connections == 1
            holder.release()
            assert await plugin.drain()
            # Never an unsolicited UpdateContainers (it deadlocks containerd): the shared
            # container, whose cgroup cannot be written here, is owed to the next reply.
            await asyncio.sleep(0.1)
            assert runtime.update_requests == []
            assert plugin._owed == {CID["nginx"]}
            # Still connected and deciding: the next exclusive creation is pinned, and its reply
            # carries the shared container to the pool as it is now.
            reply, _ = await call(
                runtime,
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("redis", big, 1000)),
            )
            assert reply.code == 0
            response = pb.CreateContainerResponse.FromString(reply.payload)
            cpu = response.adjust.linux.resources.cpu
            assert len(P(cpu.cpus)) == 1 and cpu.quota.value == -1  # exclusive: pinned
            pool = str(ONLINE - P(cpu.cpus))
            assert [(u.container_id, u.linux.resources.cpu.cpus) for u in response.update] == [
                (CID["nginx"], pool)
            ]
            assert runtime.connections == 1
            assert await plugin.drain()  # the commit waits for StartContainer, or the exit

    asyncio.run(scenario())
    assert [r["EVENT"] for r in records.of("deadline")] == [
        "StopContainer",
        "CreateContainer",
        "CreateContainer",
    ]
    assert not records.of("disconnect")
    assert CID["big"] not in plugin.state.assignments
    assert set(plugin.state.assignments) == {CID["redis"]}


# --- background work is the worker's too ------------------------------------------------------


def test_the_sweep_runs_on_the_worker_behind_the_events(tmp_path, holders):
    """Containers known only from the state file are checked by a background sweep: on the
    worker thread, so it waits its turn (and for the lock) like any event, never on the loop."""
    first, _ = make(tmp_path)
    db = pod("db")

    async def setup():
        await first.configure("", "containerd", "v2.1.9")
        await first.create_container(db, container("pg", db, 2000))

    asyncio.run(setup())
    first.release_claim()
    plugin, records = make(tmp_path)
    seen = []
    sweep_once = plugin._sweep_once

    def sweep_once_here():
        seen.append(threading.get_ident())
        return sweep_once()

    plugin._sweep_once = sweep_once_here

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        assert CID["pg"] in plugin.unverified and plugin._sweeping
        holder = holders(plugin.settings.state_dir)
        plugin._sweep(asyncio.get_running_loop())  # as its timer would, on the loop
        await asyncio.sleep(0.1)
        assert seen == [plugin.worker._thread.ident]  # started on the worker ...
        assert CID["pg"] in plugin.state.assignments  # ... and waits there for the lock
        holder.release()
        assert await plugin.drain()

    asyncio.run(scenario())
    # No cgroup tells that pg still runs, so it stays; the round is done and another queued.
    assert CID["pg"] in plugin.unverified and plugin._sweeping
    assert not records.of("deadline")


def test_hotplug_is_followed_on_the_worker_and_owed_to_the_next_reply(tmp_path):
    """CPU hotplug is the worker's job like any event; what it cannot write (no cgroups in a
    generated tree) is owed to the runtime's next reply, never sent unsolicited."""
    from sysfs_gen import MachineSpec, write_sysfs

    from nri_cpuplugin.hardware import hotplug

    spec = MachineSpec(name="hotplug-8", sockets=2, cores_per_socket=4, threads_per_core=1)
    root = tmp_path / "sysfs"
    root.symlink_to(write_sysfs(spec, tmp_path / "tree-1"))
    records = Records()
    plugin = DeadlinePlugin(
        Settings(sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpus=P("0")),
        Audit(records),
    )
    sent = []

    class Runtime:
        """Where unsolicited updates would go (the stub's side of them): nothing may."""

        request_timeout = 2.0

        def schedule_update_containers(self, updates, done=None):
            sent.append((threading.get_ident(), [u.linux.resources.cpu.cpus for u in updates]))

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        plugin.stop_hotplug()
        plugin.stub = Runtime()
        db = pod("db")
        await plugin.create_container(db, container("pg", db, 7000))
        (tmp_path / "sysfs.new").symlink_to(
            write_sysfs(
                MachineSpec(**{**spec.__dict__, "offline": frozenset({7})}), tmp_path / "t2"
            )
        )
        (tmp_path / "sysfs.new").replace(root)
        plugin.cpu_events([hotplug.CPUEvent("offline", 7, time.monotonic())])
        assert await plugin.drain()
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert plugin.state.assignments[CID["pg"]].lost == P("7")
    assert sent == []
    assert plugin._owed == {CID["pg"]}
    assert records.of("hotplug-applied")


def test_the_worker_answers_configure_errors_and_outlives_a_failing_job(tmp_path):
    plugin, _ = make(tmp_path)

    async def scenario():
        with pytest.raises(Exception, match="unknown key 'bogus'"):
            await plugin.configure("bogus = 1", "containerd", "v2.1.9")
        await plugin.configure("", "containerd", "v2.1.9")
        job = plugin.worker.submit("broken", lambda: 1 / 0)
        assert await plugin.worker.finished(job, 1.0)
        with pytest.raises(ZeroDivisionError):
            job.outcome()
        db = pod("db")
        adjust, _ = await plugin.create_container(db, container("pg", db, 2000))
        assert adjust.linux.resources.cpu.cpus == "1,25"

    asyncio.run(scenario())


def test_when_the_stubs_guard_answers_first_a_creation_is_dropped_and_a_release_kept(
    tmp_path, holders, monkeypatch
):
    """The stub's last-resort guard (its DEADLINE_SHARE of the runtime's timeout) cancels a
    handler still waiting: the runtime gets DEADLINE_EXCEEDED.  A creation the runtime then
    abandons is never assigned; a stop, which happened all the same, is still committed."""
    from nri_cpuplugin.daemon import deadline
    from nri_cpuplugin.nri import stub as stub_module

    monkeypatch.setattr(stub_module, "DEADLINE_SHARE", 0.2)  # 2 s * 0.2: the guard at 0.4 s
    monkeypatch.setattr(deadline, "BUDGET_SHARE", 5.0)  # our budget (5 s) after it, for once
    plugin, records = make(tmp_path, budget=5.0)
    socket_path = tmp_path / "nri.sock"
    db, big = pod("db"), pod("big")

    async def scenario():
        async with connected(plugin, socket_path) as (runtime, stub):
            pg = container("pg", db, 2000)
            reply = await runtime.call(
                "CreateContainer", pb.CreateContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 0
            holder = holders(plugin.settings.state_dir)
            reply = await runtime.call(
                "StopContainer", pb.StopContainerRequest(pod=db, container=pg)
            )
            assert reply.code == 4 and "did not finish within 0.40s" in reply.message
            reply = await runtime.call(
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
            )
            assert reply.code == 4
            holder.release()
            assert await plugin.drain()
            assert stub.connected.is_set()

    asyncio.run(scenario())
    assert plugin.state.assignments == {} and on_disk(plugin).assignments == {}
    assert [r["CONTAINER_ID"] for r in records.of("release")] == [CID["pg"]]
    assert [r["ACTION"] for r in records if r["ACTION"] == "allocate"] == ["allocate"]
    late = [r["MESSAGE"] for r in records.of("deadline-late")]
    assert late[0].startswith("StopContainer of container 'pg' of pod ns/db ended")
    assert late[1].startswith("CreateContainer of container 'big' of pod ns/big ended")
    assert late[1].endswith("answered with an error: nothing was assigned")


def test_a_creation_that_ended_while_the_loop_stalled_past_the_guard_is_undone(
    tmp_path, holders, monkeypatch
):
    """The job ends while the event loop is stalled past the stub's guard: the guard's error
    goes out (its timer comes before the job's result), so the runtime does not create the
    container - and the exclusive CPUs decided for it are released again, not kept until
    kubelet's retry."""
    from nri_cpuplugin.daemon import deadline
    from nri_cpuplugin.nri import stub as stub_module

    monkeypatch.setattr(stub_module, "DEADLINE_SHARE", 0.2)  # 2 s * 0.2: the guard at 0.4 s
    monkeypatch.setattr(deadline, "BUDGET_SHARE", 5.0)  # our budget (5 s) after it
    plugin, records = make(tmp_path, budget=5.0)
    socket_path = tmp_path / "nri.sock"
    big = pod("big")

    async def scenario():
        async with connected(plugin, socket_path) as (runtime, stub):
            holder = holders(plugin.settings.state_dir)
            loop = asyncio.get_running_loop()

            def stall() -> None:  # the job gets the lock and ends; the loop sees it too late
                assert plugin.worker.current is not None  # waiting for the lock
                holder.release()
                give_up = time.monotonic() + 10
                while plugin.worker.current is not None and time.monotonic() < give_up:
                    time.sleep(0.005)
                time.sleep(max(0.0, sent + 0.5 - time.monotonic()))  # past the guard

            sent = time.monotonic()
            loop.call_later(0.1, stall)
            reply = await runtime.call(
                "CreateContainer",
                pb.CreateContainerRequest(pod=big, container=container("big", big, 4000)),
            )
            assert reply.code == 4 and "did not finish within 0.40s" in reply.message
            assert await plugin.drain()
            assert stub.connected.is_set()

    asyncio.run(scenario())
    assert [r["ACTION"] for r in records if r["ACTION"] == "allocate"] == ["allocate"]
    assert plugin.state.assignments == {}
    [late] = records.of("deadline-late")
    assert "CreateContainer of container 'big' of pod ns/big ended" in late["MESSAGE"]
    assert "were released again" in late["MESSAGE"] or "dropped again" in late["MESSAGE"]


def test_a_resize_undone_late_does_not_undo_what_was_committed_after_it(tmp_path):
    """A resize's late part put off behind other work (the stub's guard answered after the
    job had ended): going back to the state the resize began with would also undo what the
    later work committed, so the resize stands and its reply is owed instead."""
    from nri_cpuplugin.daemon.worker import ERROR, Job

    plugin, records = make(tmp_path)
    plugin.load_state()
    db, web = pod("db"), pod("web", "burstable")
    pg = container("pg", db, 2000)
    before = plugin.state
    CPUPlugin.create_container(plugin, db, pg)  # stands in for the resize the job made
    after = plugin.state
    CPUPlugin.create_container(plugin, web, container("nginx", web, 500))  # later work
    later = plugin.state
    job = Job("UpdateContainer", lambda: None, (db, pg, pb.LinuxResources()), None, True)
    job.before, job.after, job.answer, job.result = before, after, ERROR, []
    plugin._update_late(job)
    assert plugin.state is later
    [late] = records.of("deadline-late")
    assert "undone" not in late["MESSAGE"] and "committed" in late["MESSAGE"]


def test_the_worker_runs_where_the_loop_is_and_the_loop_keeps_its_cpus(tmp_path):
    """The worker follows the event loop's CPU (a job on the other CPU costs cold caches and
    wake-ups); the loop is held there only while it waits, its own affinity given back."""
    plugin, _ = make(tmp_path)
    allowed = os.sched_getaffinity(0)
    db = pod("db")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        for name in ("pg", "redis"):
            await plugin.create_container(db, container(name, db, 1000))
            worker = os.sched_getaffinity(plugin.worker._thread.native_id)
            assert len(worker) == 1 and worker <= allowed
            assert os.sched_getaffinity(0) == allowed

    asyncio.run(scenario())
    assert set(plugin.state.assignments) == {CID["pg"], CID["redis"]}
