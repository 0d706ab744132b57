"""The policy follows the online CPUs (hotplug): replacement, degraded, return; and the state
document carries what that needs (owed CPUs, NIC preference), old documents still load."""

from __future__ import annotations

import orjson
import pytest
from builders import workload
from topologies import offline, topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.follow import follow_online
from nri_cpuplugin.core.placement import NICPreference
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.core.state import (
    Assignment,
    NodeState,
    StateFormatError,
    checksum,
    decode,
    encode,
    to_document,
)
from nri_cpuplugin.core.topology import Topology

P = CPUSet.parse


def follow(policy: StaticPolicy, state: NodeState, topo: Topology, previous=None):
    moved = StaticPolicy(topo, policy.reserved, policy.options)
    return moved, follow_online(moved, state, previous=previous or policy.topology)


XEON = topology("xeon-e5-2680v3-2s")  # 2 sockets = 2 NUMA nodes; siblings N and N+24
SMALL = topology("single-socket-no-smt")  # 8 CPUs


def test_lost_cpu_is_replaced_on_the_same_numa_node_and_returns_to_the_shared_pool():
    policy = StaticPolicy(XEON, P("0,24"))
    decision, state = policy.admit(policy.empty_state(), workload(2000))
    assert decision.cpus == P("1,25")
    moved, result = follow(policy, state, offline(XEON, "25"))
    [change] = result.changes
    held = result.state.assignments[decision.container_id]
    assert change.action == "replaced" and "same NUMA node" in change.reason
    assert held.cpus - P("1") <= XEON.numa_nodes[0] and len(held.cpus) == 2 and not held.lost
    assert 25 not in result.state.shared and not result.state.shared & held.cpus
    assert result.state.fingerprint == moved.topology.fingerprint()
    # CPU 25 comes back: the container was made whole already, so the CPU joins the pool.
    _back, again = follow(moved, result.state, XEON)
    assert again.changes == ()
    assert 25 in again.state.shared and again.state.assignments == result.state.assignments


def test_replacement_falls_back_to_another_numa_node_when_its_own_is_full():
    policy = StaticPolicy(XEON, P("0,24"))
    state = policy.empty_state()
    _, state = policy.admit(state, workload(22000))  # every free CPU of node 0
    assert state.exclusive == XEON.numa_nodes[0] - P("0,24")
    _, result = follow(policy, state, offline(XEON, "5"))
    [change] = result.changes
    assert change.action == "replaced" and "another socket" in change.reason
    assert change.cpus <= XEON.numa_nodes[1]


def test_no_free_cpu_degrades_and_the_cpu_returns_to_its_container():
    policy = StaticPolicy(SMALL, P("0"))
    state = policy.empty_state()
    one, state = policy.admit(state, workload(1000))
    rest, state = policy.admit(state, workload(6000))
    assert (one.cpus, rest.cpus) == (P("1"), P("2-7"))
    assert state.shared == P("0")
    moved, result = follow(policy, state, offline(SMALL, "1"))
    [change] = result.changes
    held = result.state.assignments[one.container_id]
    assert change.action == "degraded" and "shared pool" in change.reason
    assert held.cpus == CPUSet() and held.lost == P("1") and held.degraded and held.count == 1
    assert result.state.shared == P("0")
    # Nobody may take the owed CPU meanwhile, and the document stays consistent.
    assert decode(encode(result.state)) == result.state
    _back, again = follow(moved, result.state, SMALL)
    [change] = again.changes
    held = again.state.assignments[one.container_id]
    assert change.action == "restored" and held.cpus == P("1") and not held.lost
    assert again.state.shared == P("0")


def test_partial_loss_keeps_what_is_left():
    policy = StaticPolicy(SMALL, P("0"))
    decision, state = policy.admit(policy.empty_state(), workload(7000))
    assert decision.cpus == P("1-7")
    _, result = follow(policy, state, offline(SMALL, "6-7"))
    held = result.state.assignments[decision.container_id]
    assert (held.cpus, held.lost) == (P("1-5"), P("6-7"))


def test_an_owed_cpu_that_is_online_is_not_handed_to_anyone_else():
    policy = StaticPolicy(SMALL, P("0"))
    state = policy.empty_state()
    _one, state = policy.admit(state, workload(1000))
    _, state = policy.admit(state, workload(5000))  # 2-6; 7 stays free
    moved, result = follow(policy, state, offline(SMALL, "1"))
    assert result.changes[0].action == "replaced" and result.changes[0].cpus == P("7")
    # With a replacement, the returning CPU is free for anyone.
    back, again = follow(moved, result.state, SMALL)
    assert back.free_exclusive(again.state) == P("1")


def test_free_exclusive_excludes_cpus_owed_to_degraded_containers():
    policy = StaticPolicy(SMALL, P("0"))
    state = policy.empty_state()
    one, state = policy.admit(state, workload(1000))
    held = state.assignments[one.container_id]
    degraded = Assignment(**{**held.__dict__, "cpus": P(""), "lost": P("1")})
    owed = state.evolve(assignments={one.container_id: degraded})
    assert 1 not in policy.free_exclusive(owed)
    with pytest.raises(PolicyError):
        policy.admit(owed, workload(7000))


def test_strict_nic_locality_limits_replacements_to_the_nic_nodes():
    policy = StaticPolicy(XEON, P("0,24"))
    state = policy.empty_state()
    nic = NICPreference(P("1"), strict=True, nics=("net1 (pci/0000:3b:00.0, NUMA 1)",))
    decision, state = policy.admit(state, workload(2000), nic)
    assert decision.cpus <= XEON.numa_nodes[1]
    _, state = policy.admit(state, workload(22000), NICPreference(P("1")))  # the rest of node 1
    assert not policy.free_exclusive(state) & XEON.numa_nodes[1]
    lost = CPUSet([min(decision.cpus)])
    _, result = follow(policy, state, offline(XEON, str(lost)))
    changes = {c.container_id: c for c in result.changes}
    assert changes[decision.container_id].action == "degraded"  # node 0 is free, but far


def test_the_shared_pool_is_never_left_empty():
    # Only CPU 0 is shared (1-7 exclusive); CPU 0 going away must not leave shared containers
    # nowhere to run: the largest assignment gives one CPU back, owed to it.
    policy = StaticPolicy(SMALL, P("0"))
    state = policy.empty_state()
    _small, state = policy.admit(state, workload(2000))
    big, state = policy.admit(state, workload(5000))
    without_0 = offline(SMALL, "0")
    moved = StaticPolicy(without_0, P("0"))
    result = follow_online(moved, state, previous=SMALL)
    [change] = result.changes
    assert change.action == "preempted" and change.container_id == big.container_id
    assert result.state.shared == P("7")
    assert result.state.assignments[big.container_id].lost == P("7")
    assert decode(encode(result.state)) == result.state


def test_reserved_cpus_may_be_offline():
    policy = StaticPolicy(offline(SMALL, "1"), P("0-1"))
    assert policy.empty_state().shared == P("0,2-7")
    assert policy.free_exclusive(policy.empty_state()) == P("2-7")


def test_check_accepts_offline_cpus_and_rejects_online_unassignable_ones():
    policy = StaticPolicy(SMALL, P("0"))
    decision, state = policy.admit(policy.empty_state(), workload(2000))
    assert StaticPolicy(offline(SMALL, str(decision.cpus)), P("0")).check(state) is None
    assert "no longer assignable" in StaticPolicy(SMALL, P("0-1")).check(state)


# --- the document --------------------------------------------------------------------------


def test_new_fields_round_trip_and_are_omitted_when_unset():
    policy = StaticPolicy(XEON, P("0,24"))
    nic = NICPreference(P("1"), True, ("net1 (pci/0000:3b:00.0, NUMA 1)",))
    decision, state = policy.admit(policy.empty_state(), workload(2000), nic)
    plain, state = policy.admit(state, workload(1000))
    doc = to_document(state)
    entry = doc["assignments"][decision.container_id]
    assert entry["nic_nodes"] == "1" and entry["nic_strict"] is True
    assert entry["nics"] == ["net1 (pci/0000:3b:00.0, NUMA 1)"]
    assert set(doc["assignments"][plain.container_id]) == {
        "cpus", "pod_uid", "container_name", "pod_name", "pod_namespace", "kind"
    }  # fmt: skip
    assert decode(encode(state)) == state


def test_a_document_written_before_these_fields_still_loads():
    policy = StaticPolicy(SMALL, P("0"))
    _, state = policy.admit(policy.empty_state(), workload(2000))
    doc = to_document(state)
    for entry in doc["assignments"].values():
        assert "lost" not in entry and "nics" not in entry
    assert decode(orjson.dumps(doc)) == state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cpus": "", "lost": ""}, "has no CPUs"),
        ({"lost": "2"}, "is held by"),
        ({"nic_strict": "yes"}, "must be a boolean"),
        ({"nics": "eth0"}, "list of strings"),
    ],
)
def test_inconsistent_hotplug_fields_are_refused(change, message):
    policy = StaticPolicy(SMALL, P("0"))
    decision, state = policy.admit(policy.empty_state(), workload(1000))
    _, state = policy.admit(state, workload(1000))  # holds 2
    doc = to_document(state)
    doc["assignments"][decision.container_id].update(change)
    doc["checksum"] = checksum(doc)
    with pytest.raises(StateFormatError, match=message):
        decode(orjson.dumps(doc))


def test_the_store_accepts_any_layout_when_the_caller_repairs_it(tmp_path):
    from nri_cpuplugin.storage.store import Expected, StateStore

    policy = StaticPolicy(SMALL, P("0"))
    _, state = policy.admit(policy.empty_state(), workload(2000))
    store = StateStore(tmp_path / "state")
    with store.locked():
        store.commit(state.evolve(fingerprint="online=0-15;isolated=;smt=1;numa=1"))
        assert store.load(Expected(policy.name, None, policy.reserved)).state is not None
        strict = store.load(Expected(policy.name, SMALL.fingerprint(), policy.reserved))
    assert strict.state is None and "CPU topology changed" in strict.problem
