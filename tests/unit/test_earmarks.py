"""Earmarks: CPUs set aside for a Guaranteed pod when its sandbox starts (policy.earmark), taken
by its exclusive containers without moving anyone, trimmed to what its containers can still ask
for, dropped with the pod; in the state file; and in the daemon, where a creation that takes a
whole earmark is answered before it is decided."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from builders import container, creation, guaranteed_pod, node_settings, pod, workload
from daemon_driver import SlowDisk, Threads, on_disk
from model_stall import until
from sysfs_gen import write_fake_device
from topologies import offline, topology

from nri_cpuplugin.core import state as state_mod
from nri_cpuplugin.core.annotation import EXCLUSIVE
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.engine import Engine
from nri_cpuplugin.core.policy import StaticPolicy
from nri_cpuplugin.core.reconcile import LiveContainer
from nri_cpuplugin.core.state import Earmark, StateFormatError
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.adapter import pod_cpu_limit
from nri_cpuplugin.hardware import netns_links
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops import status

P = CPUSet.parse


def mark(sandbox: str, limit: int, name: str = "", namespace: str = "") -> Earmark:
    """A pod's earmark as it asks for one (no CPUs yet)."""
    return Earmark(CPUSet(), sandbox, limit, pod_name=name, pod_namespace=namespace)


def policy_on(name: str, reserved: int = 2) -> StaticPolicy:
    return StaticPolicy.from_config(topology(name), reserved_count=reserved)


@pytest.mark.parametrize(
    ("machine", "limit", "earmarked"),
    [
        ("xeon-e5-2680v3-2s", 2000, "1,25"),  # one core, both threads
        ("xeon-e5-2680v3-2s", 2500, "1,25"),  # whole CPUs only
        ("xeon-e5-2680v3-2s", 4000, "1-2,25-26"),
        ("single-socket-no-smt", 3000, "2-4"),
        ("quad-socket", 1000, "1"),
        ("xeon-e5-2680v3-2s", 999, ""),  # less than a CPU: nothing
    ],
)
def test_a_pod_is_earmarked_its_whole_cpus_by_topology(machine, limit, earmarked):
    policy = policy_on(machine)
    state = policy.empty_state()
    after = policy.earmark(state, "pod-a", mark("sb-a", limit, "a", "ns"))
    want = P(earmarked)
    assert (after.earmarks["pod-a"].cpus if want else CPUSet()) == want
    assert after.shared == policy.shareable - want
    assert after.assigned == CPUSet()  # nobody holds them yet


def test_an_exclusive_container_takes_its_pods_earmark_and_moves_nobody():
    policy = policy_on("xeon-e5-2680v3-2s")
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", 2000))
    decision, after = policy.admit(state, workload(2000, pod="pod-a"))
    assert decision.cpus == P("1,25") and "earmarked" in decision.reason
    assert after.shared == state.shared  # the shared containers do not move
    assert "pod-a" not in after.earmarks
    # Another pod's container does not get them.
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", 2000))
    decision, _ = policy.admit(state, workload(2000, pod="pod-b"))
    assert not decision.cpus & P("1,25")


@pytest.mark.parametrize(
    ("limit", "containers", "left"),
    [
        # the pod's limit; (milli, kind) created in order; what stays earmarked after each
        (2000, [(1000, "app"), (1000, "app")], ["25", ""]),
        # Fractional: shared, claims it; the earmark (1-2,25) keeps the CPU whose core is not
        # its whole (the allocator's choice: core 1,25 goes back whole).
        (3000, [(1500, "app"), (1500, "app")], ["2", ""]),
        (2000, [(500, "init"), (2000, "app")], ["1,25", ""]),  # init containers claim nothing
        (2500, [(500, "app")], ["1,25"]),  # two whole CPUs could still be asked for
    ],
)
def test_the_earmark_keeps_only_what_the_pods_containers_can_still_ask_for(limit, containers, left):
    policy = policy_on("xeon-e5-2680v3-2s")
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", limit))
    for (milli, kind), want in zip(containers, left, strict=True):
        _, state = policy.admit(state, workload(milli, pod="pod-a", kind=kind))
        got = state.earmarks["pod-a"].cpus if "pod-a" in state.earmarks else CPUSet()
        assert got == P(want)
        assert state.shared == policy.shareable - state.exclusive


def test_a_restart_gets_its_previous_cpus_and_leaves_the_earmark_to_its_sibling():
    policy = policy_on("xeon-e5-2680v3-2s")
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", 2000))
    first = workload(1000, pod="pod-a", name="a")
    decision, state = policy.admit(state, first)
    _, state = policy.release(state, first.container_id)
    again = workload(1000, pod="pod-a", name="a", cid="a-restarted")
    decision_again, state = policy.admit(state, again)
    assert decision_again.cpus == decision.cpus and "previous CPUs" in decision_again.reason
    assert state.earmarks["pod-a"].cpus == P("1,25") - decision.cpus  # still the sibling's


def test_an_earmark_never_empties_the_shared_pool_nor_takes_held_cpus():
    policy = policy_on("single-socket-no-smt")  # 8 CPUs, 0-1 reserved (and shared)
    state = policy.earmark(policy.empty_state(), "big", mark("sb-big", 64000))
    assert state.earmarks["big"].cpus == P("2-7") and state.shared == P("0-1")
    assert policy.earmark(state, "next", mark("sb-next", 1000)) is state  # nothing left to earmark
    # A pod known already (a recreated sandbox) gets none: its restarts go by what they held.
    _, held = policy.admit(policy.empty_state(), workload(1000, pod="p"))
    assert policy.earmark(held, "p", mark("sb-p2", 1000)) is held


def test_removing_the_pod_or_a_synchronize_without_it_gives_the_earmark_back():
    policy = policy_on("xeon-e5-2680v3-2s")
    engine = Engine(policy)
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", 2000))
    removed = engine.remove_pod(state, "pod-a")
    assert removed.state.shared == policy.shareable and not removed.state.earmarks
    synced = engine.synchronize(state, [], ["pod-b"])
    assert not synced.state.earmarks and synced.state.shared == policy.shareable
    assert any("earmarked for gone pod" in e.message for e in synced.events)
    kept = engine.synchronize(state, [], ["pod-a"])
    assert kept.state.earmarks == state.earmarks
    # A live container of the pod placed by the synchronize takes it.
    live = LiveContainer(workload(2000, pod="pod-a"), CPUSet())
    assert engine.synchronize(state, [live], ["pod-a"]).state.assigned == P("1,25")


def test_a_hotplug_drops_earmarks_and_the_shared_containers_grow_back():
    policy = policy_on("xeon-e5-2680v3-2s")
    _, state = policy.admit(policy.empty_state(), workload(500, pod="web"))
    state = policy.earmark(state, "pod-a", mark("sb-a", 2000))
    after = StaticPolicy.from_config(offline(policy.topology, "47"), reserved_count=2)
    outcome = Engine(after).follow(state, policy)
    assert not outcome.state.earmarks
    assert outcome.state.shared == after.shareable
    assert [t.cpus for t in outcome.targets] == [after.shareable]  # the shared one grows


def test_the_earmark_outcome_moves_the_shared_containers_and_says_so():
    policy = policy_on("xeon-e5-2680v3-2s")
    engine = Engine(policy)
    _, state = policy.admit(policy.empty_state(), workload(500, pod="web"))
    outcome = engine.earmark(state, "pod-a", mark("sb-a", 2000, "a", "ns"))
    assert [t.cpus for t in outcome.targets] == [outcome.state.shared]
    assert [e.action for e in outcome.events] == ["earmark", "shared-resize"]
    assert engine.earmark(outcome.state, "pod-a", mark("sb-a", 2000)).state is outcome.state


def test_earmarks_in_the_state_file_round_trip_and_are_checked():
    policy = policy_on("xeon-e5-2680v3-2s")
    state = policy.earmark(policy.empty_state(), "pod-a", mark("sb-a", 2000, "a", "ns"))
    assert state_mod.decode(state_mod.encode(state)) == state
    # A document without earmarks keeps the bytes it had before they existed.
    assert b"earmarks" not in state_mod.encode(policy.empty_state())
    _, held = policy.admit(policy.empty_state(), workload(2000, pod="pod-b"))
    doc = state_mod.to_document(held)
    doc["earmarks"] = {"pod-a": {**state_mod.to_document(state)["earmarks"]["pod-a"]}}
    doc["shared"] = str(held.shared - P("1,25"))
    doc["checksum"] = state_mod.checksum(doc)
    with pytest.raises(StateFormatError, match="earmarked for pod 'pod-a' and"):
        state_mod.decode(state_mod.jsonbytes.dumps(doc))
    doc["earmarks"]["pod-a"]["limit_milli"] = "2000"
    doc["checksum"] = state_mod.checksum(doc)
    with pytest.raises(StateFormatError, match="limit_milli must be a non-negative integer"):
        state_mod.decode(state_mod.jsonbytes.dumps(doc))


# --- the daemon -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qos", "milli", "want"),
    [("guaranteed", 2000, 2000), ("guaranteed", 800, 0), ("burstable", 2000, 0)],
)
def test_which_pods_are_earmarked(qos, milli, want):
    sandbox = guaranteed_pod("a", milli)
    if qos != "guaranteed":
        sandbox.linux.cgroup_parent = "/kubepods/burstable/poda"
    assert pod_cpu_limit(sandbox) == want
    assert pod_cpu_limit(pod("no-resources")) == 0  # not sent: nothing


async def sandbox_started(daemon, sandbox: pb.PodSandbox) -> None:
    """A daemon connected to containerd 2.1.9, synchronized, and ``sandbox`` started."""
    nri = daemon.adapter
    await nri.configure("", "containerd", "v2.1.9")
    await nri.synchronize([], [])
    await nri.run_pod_sandbox(sandbox)


def test_the_daemon_earmarks_at_pod_start_and_answers_the_creation_from_it(tmp_path, daemons):
    daemon, records = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)

    async def scenario():
        await sandbox_started(daemon, db)
        assert on_disk(daemon).earmarks["uid-db"].cpus == P("1,25")  # committed
        assert not daemon.node.state.shared & P("1,25")
        settings = daemon.node.settings
        report = status.snapshot(settings.state_dir, settings.sysfs)
        assert report["exclusive"] == "" and report["earmarked"]["uid-db"]["cpus"] == "1,25"
        assert "earmarked   1,25  for pod ns/db (starting)" in status.render_text(report)
        assert report["numa"]["0"]["free_exclusive"] == str(P("2-11,26-35"))
        early = daemon.node.query_early_answer(creation(db, pg))
        assert early is not None and early.cpus == P("1,25")
        adjust, updates = await nri.create_container(db, pg)
        # Answered from the earmark: before anything was decided.
        assert pg.id not in daemon.node.state.assignments
        assert adjust.linux.resources.cpu.cpus == "1,25" and updates == []
        await nri.start_container(db, container("pg", db, 2000, cpus="1,25"))
        assert await daemon.drain()

    asyncio.run(scenario())
    state = daemon.node.state
    assert state.assignments[pg.id].cpus == P("1,25")
    assert "uid-db" not in state.earmarks
    assert [r["ACTION"] for r in records.of("earmark")] == ["earmark"]
    assert not records.of("deadline") and not daemon.node.owed


def test_a_creation_decided_otherwise_than_answered_is_set_right_when_it_starts(tmp_path, daemons):
    """The earmark knows nothing of NICs; the decision that follows the early answer does:
    the pod's interface is on NUMA node 1, its earmark on node 0.  The container is owed to
    the runtime (its StartContainer finds it on the earmark and writes what was decided) and
    audited."""
    settings = node_settings(tmp_path)
    write_fake_device(Path(settings.sysfs), "pci", "0000:81:00.0", numa_node=1)
    eth0 = netns_links.Link(2, "eth0", "", "pci", "0000:81:00.0", None, None, False)
    daemon, records = daemons(settings)
    daemon.pod_nics.lister = lambda netns: ([eth0], None)  # netlink, as the pod starts
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)
    db.linux.namespaces.add(type="network", path="/var/run/netns/cni-db")
    pg = container("pg", db, 2000)

    async def scenario():
        await sandbox_started(daemon, db)
        assert daemon.node.state.earmarks["uid-db"].cpus == P("1,25")
        adjust, _ = await nri.create_container(db, pg)
        assert adjust.linux.resources.cpu.cpus == "1,25"  # what was answered
        assert await daemon.drain()

    asyncio.run(scenario())
    decided = daemon.node.state.assignments[pg.id].cpus
    assert len(decided) == 2 and decided <= daemon.node.policy.topology.numa_nodes[1]
    assert pg.id in daemon.node.owed
    [note] = [r for r in records.of("earmark") if r.get("REASON") == "decided otherwise"]
    assert "set right when it starts" in note["MESSAGE"] and note["CPUS"] == str(decided)


def test_an_idle_daemon_answers_from_the_earmark_before_its_worker_decides(tmp_path, daemons):
    """With nothing queued, the answer is given on the event loop; the decision is queued once
    the answer is out (the loop's next turn) and runs wherever the scheduler has room."""
    threads = Threads()
    daemon, _ = daemons(node_settings(tmp_path), threads)
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)

    async def scenario():
        await sandbox_started(daemon, db)
        assert daemon.worker.idle()
        adjust, _ = await daemon.adapter.create_container(db, pg)
        assert adjust.linux.resources.cpu.cpus == "1,25"
        assert pg.id not in daemon.node.state.assignments and not daemon.worker.idle()
        await until(daemon.worker.idle)  # decided (nothing else queued: nothing pins it)
        assert await daemon.drain()

    asyncio.run(scenario())
    assert daemon.node.state.assignments[pg.id].cpus == P("1,25") and not daemon.node.owed
    [(thread, cpus)] = threads.made_on["allocate"]
    assert thread == "nri-cpuplugin-worker" and cpus == os.sched_getaffinity(0)


def test_a_busy_daemon_answers_from_the_earmark_after_what_is_queued(
    tmp_path, daemons, monkeypatch
):
    """While an event runs (here: another pod's earmark, its commit on a slow disk), the state
    may be about to change: the answer waits for the worker."""
    daemon, _ = daemons(node_settings(tmp_path, budget=5.0))
    nri = daemon.adapter
    db, other = guaranteed_pod("db", 2000), guaranteed_pod("other", 2000)
    pg = container("pg", db, 2000)

    async def scenario():
        await sandbox_started(daemon, db)
        disk = SlowDisk(monkeypatch)
        starting = asyncio.ensure_future(nri.run_pod_sandbox(other))
        assert await asyncio.to_thread(disk.entered.wait, 10)  # the worker is busy
        creating = asyncio.ensure_future(nri.create_container(db, pg))
        await asyncio.sleep(0)  # its handler runs, up to where it waits for the worker
        assert not creating.done()  # not answered from a state an event may still change
        disk.go()
        adjust, _ = await creating
        assert adjust.linux.resources.cpu.cpus == "1,25"
        await starting
        assert await daemon.drain()

    asyncio.run(scenario())
    state = daemon.node.state
    assert state.assignments[pg.id].cpus == P("1,25") and not daemon.node.owed
    assert state.earmarks["uid-other"].cpus == P("2,26")


@pytest.mark.parametrize(
    "change",
    ["other size", "annotation", "before synchronize", "other sandbox", "owed", "restart"],
)
def test_creations_the_earmark_may_not_answer_are_decided_first(tmp_path, daemons, change):
    daemon, _ = daemons(node_settings(tmp_path))
    nri = daemon.adapter
    db = guaranteed_pod("db", 3000 if change == "restart" else 2000)
    pg = container("pg", db, 1000 if change == "other size" else 2000)
    if change == "annotation":
        pg.annotations[EXCLUSIVE] = "false"

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        if change != "before synchronize":
            await nri.synchronize([], [])
        await nri.run_pod_sandbox(db)
        if change == "other sandbox":
            db.id = "sb-db-recreated"
        if change == "owed":
            daemon.deadline.submit(ev.Owe(("x" * 64,)))
        if change == "restart":  # "pg" took one of three CPUs; a new "pg" asks for the rest
            await nri.create_container(db, container("pg", db, 1000))
            assert await daemon.drain() and len(daemon.node.state.earmarks["uid-db"].cpus) == 2
            pg.id = "restarted".ljust(64, "0")
        assert await daemon.drain()  # nothing queued: an earmark's answer could be given now
        return daemon.node.query_early_answer(creation(db, pg))

    assert asyncio.run(scenario()) is None
