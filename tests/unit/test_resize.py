"""In-place resize (core/resize.py through the engine) on named topologies: grow around what a
container holds, shrink back to what it started with, cross between shared and exclusive."""

from __future__ import annotations

import pytest
from builders import workload
from topologies import topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.engine import Engine
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.core.state import decode, encode
from nri_cpuplugin.core.workload import BURSTABLE

P = CPUSet.parse


def engine(name: str, reserved: str) -> Engine:
    return Engine(StaticPolicy(topology(name), P(reserved)))


def place(eng: Engine, *requests: tuple[str, int]):
    state = eng.create(eng.policy.empty_state(), workload(500, BURSTABLE, name="web")).state
    for name, milli in requests:
        state = eng.create(state, workload(milli, name=name)).state
    return state


# (machine, reserved, others placed first, db's request, db's new request, expected CPUs)
GROWTHS = [
    # Xeon (siblings N, N+24): 1 CPU -> 2 takes the other thread of its own core.
    ("xeon-e5-2680v3-2s", "0,24", [], 1000, 2000, "1,25"),
    # Its core's sibling is taken: the next CPUs come from its NUMA node (= its socket here).
    ("xeon-e5-2680v3-2s", "0,24", [("x", 1000)], 1000, 2000, "2,25"),
    # EPYC NPS4 (8-core LLC groups, siblings N, N+64): 2 -> 4 stays in its LLC group.
    ("epyc-1s-4numa", "0,64", [], 2000, 4000, "1-2,65-66"),
    # Its LLC group (0-7, 64-71) is full after "fill" and db (7,71): its NUMA node next.
    ("epyc-1s-4numa", "0,64", [("fill", 12000)], 2000, 4000, "7-8,71-72"),
]


@pytest.mark.parametrize(("machine", "reserved", "others", "old", "new", "expected"), GROWTHS)
def test_grow_keeps_what_it_holds_and_adds_the_closest(
    machine, reserved, others, old, new, expected
):
    eng = engine(machine, reserved)
    state = place(eng, *others, ("db", old))
    held = state.assignments["db-id"].cpus
    outcome = eng.resize(state, workload(new, name="db"))
    cpus = outcome.state.assignments["db-id"].cpus
    assert held <= cpus and len(cpus) == new // 1000
    topo = eng.topology
    assert topo.numa_of(cpus) == topo.numa_of(held)  # room there: never across NUMA
    assert cpus == P(expected)
    mine, *siblings = outcome.targets
    assert mine.cpus == cpus and mine.mems == topo.numa_of(cpus)
    assert [t.container_id for t in siblings] == ["web-id"]
    assert not siblings[0].cpus & cpus  # the shared pool shrinks in the same outcome
    assert [e.action for e in outcome.events] == ["resize", "shared-resize"]


def test_grow_across_numa_only_when_forced():
    eng = engine("snc-2s-2numa", "0,32")  # 4 NUMA nodes of 8 cores x 2 threads
    node0 = eng.topology.numa_nodes[0]
    state = place(eng, ("db", 14000))  # every free CPU of node 0 (16 minus the reserved 2)
    assert state.assignments["db-id"].cpus == node0 - P("0,32")
    outcome = eng.resize(state, workload(16000, name="db"))
    cpus = outcome.state.assignments["db-id"].cpus
    assert cpus - node0 and len(eng.topology.numa_of(cpus)) == 2
    # SNC: the socket-wide LLC group spans both of its NUMA nodes.
    assert "its LLC group, across NUMA nodes" in outcome.decision.reason


def test_shrink_gives_back_the_newest_and_ends_on_the_first_set():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = place(eng, ("db", 2000))
    first = state.assignments["db-id"].cpus
    for count in (4, 6):
        state = eng.resize(state, workload(count * 1000, name="db")).state
    grown = state.assignments["db-id"]
    assert first <= grown.cpus and len(grown.cpus) == 6 and grown.initial == first
    back_to_4 = eng.resize(state, workload(4000, name="db")).state.assignments["db-id"]
    assert back_to_4.cpus == first | CPUSet(grown.added[:2])  # the two added last went
    original = eng.resize(state, workload(2000, name="db")).state.assignments["db-id"]
    assert original.cpus == first and original.added == ()
    # Below the first set: a compact part of it.
    smaller = eng.resize(state, workload(1000, name="db")).state.assignments["db-id"]
    assert len(smaller.cpus) == 1 and smaller.cpus <= first


def test_resized_assignment_survives_the_state_document():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.resize(place(eng, ("db", 2000)), workload(4000, name="db")).state
    assert decode(encode(state)) == state
    # Never resized: the document keeps the bytes it had before these fields existed.
    plain = place(eng, ("db", 2000))
    assert b"initial" not in encode(plain) and b"added" not in encode(plain)


def test_exclusive_to_shared_and_back():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = place(eng, ("db", 2000))
    held = state.assignments["db-id"].cpus
    shared = eng.resize(state, workload(1500, name="db"))  # 2 -> 1500m: no longer whole CPUs
    assert "db-id" not in shared.state.assignments and "db-id" in shared.state.sharing
    assert held <= shared.state.shared
    assert shared.targets[0].cpus == shared.state.shared and not shared.targets[0].exclusive
    # Its memory nodes were those of its CPUs (NUMA 0): they go back to its parent's.
    assert shared.targets[0].mems_from_parent
    back = eng.resize(shared.state, workload(2000, name="db"))  # 1500m -> 2: placed like a new one
    assert back.decision.exclusive and len(back.decision.cpus) == 2
    assert back.targets[0].mems == P("0") and not back.targets[0].mems_from_parent
    # A shared container that stays shared keeps its memory nodes as they are.
    again = eng.resize(shared.state, workload(1200, name="db"))
    assert not any(t.mems_from_parent for t in again.targets)
    assert "db-id" not in back.state.sharing


def test_a_limit_that_leaves_the_request_makes_it_share():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = place(eng, ("db", 2000))
    outcome = eng.resize(state, workload(2000, name="db", limit=4000))  # Burstable-shaped
    assert "db-id" in outcome.state.sharing
    assert "Burstable-shaped" in outcome.decision.reason


def test_infeasible_growth_is_refused_and_changes_nothing():
    eng = engine("single-socket-no-smt", "0")  # 8 CPUs, no SMT
    state = place(eng, ("db", 2000), ("other", 4000))
    with pytest.raises(PolicyError) as info:
        eng.resize(state, workload(4000, name="db"))
    message = str(info.value)
    assert "asks to grow from 2 to 4" in message and "free for exclusive use" in message
    assert "nothing changed" in message


def test_a_container_we_do_not_place_or_an_unchanged_request():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = place(eng, ("db", 2000))
    assert eng.resize(state, workload(2000, name="stranger")).targets == ()
    same = eng.resize(state, workload(2000, name="db"))
    assert same.state is state and same.events == () and same.targets[0].container_id == "db-id"
    web = eng.resize(state, workload(700, BURSTABLE, name="web"))  # still shared: re-asserted
    assert web.state is state and web.targets[0].cpus == state.shared
