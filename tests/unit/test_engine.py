"""The engine (core/engine.py) with plain values: every rule both front ends rely on, on named
topologies, without files, sockets or cgroups."""

from __future__ import annotations

import pytest
from builders import workload
from topologies import offline, topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.engine import Engine
from nri_cpuplugin.core.outcome import CFS_PERIOD_US, UNLIMITED, Outcome, Target
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.core.reconcile import LiveContainer
from nri_cpuplugin.core.state import Assignment
from nri_cpuplugin.core.workload import BURSTABLE

P = CPUSet.parse


def engine(name: str, reserved: str = "0", cfs_quota: str = "unlimited") -> Engine:
    return Engine(StaticPolicy(topology(name), P(reserved)), cfs_quota)


def actions(outcome: Outcome) -> list[str]:
    return [e.action for e in outcome.events]


# (machine, reserved, requests in order) -> exclusive CPUs of the last request
PLACEMENTS = [
    ("single-socket-no-smt", "0", [2], "1-2"),
    ("xeon-e5-2680v3-2s", "0,24", [2], "1,25"),  # one whole core, siblings N and N+24
    ("xeon-e5-2680v3-2s", "0,24", [1, 1], "25"),  # the second half of the first one's core
    ("snc-2s-2numa", "0,32", [4], "1-2,33-34"),
    ("epyc-1s-4numa", "0,64", [8], "1-4,65-68"),  # one LLC group (8-core CCX)
]


@pytest.mark.parametrize(("machine", "reserved", "requests", "last"), PLACEMENTS)
def test_create_places_by_topology_and_targets_follow(machine, reserved, requests, last):
    eng = engine(machine, reserved)
    state = eng.policy.empty_state()
    outcome = eng.create(state, workload(500, BURSTABLE, name="web"))
    state = outcome.state
    for i, count in enumerate(requests):
        outcome = eng.create(state, workload(count * 1000, name=f"db{i}"))
        state = outcome.state
    decision = outcome.decision
    assert decision.exclusive and decision.cpus == P(last)
    mine, *siblings = outcome.targets
    topo = eng.topology
    assert mine == Target(f"db{len(requests) - 1}-id", P(last), topo.numa_of(P(last)), -1, True)
    # The shared container follows the pool in the same outcome, off every exclusive CPU.
    assert [t.container_id for t in siblings] == ["web-id"]
    assert siblings[0].cpus == state.shared and not siblings[0].cpus & state.exclusive
    assert actions(outcome) == ["allocate", "shared-resize"]


def test_shared_creation_touches_nobody_else():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(2000, name="db")).state
    outcome = eng.create(state, workload(500, BURSTABLE, name="web"))
    assert outcome.targets == (Target("web-id", state.shared),)
    assert actions(outcome) == ["share"] and outcome.events[0].priority == 7


def test_refusal_changes_nothing_and_is_worded_for_the_user():
    eng = engine("single-socket-no-smt", "0")
    state = eng.create(eng.policy.empty_state(), workload(6000, name="big")).state
    with pytest.raises(PolicyError) as info:
        eng.create(state, workload(2000, name="more"))
    event = eng.refused(workload(2000, name="more"), info.value)
    assert event.action == "refuse" and event.fields["code"] == "refused"
    assert "asks for 2 exclusive CPUs" in event.message


def test_stop_returns_cpus_to_the_pool_and_every_follower_hears_it():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(500, BURSTABLE, name="web")).state
    state = eng.create(state, workload(250, BURSTABLE, name="api")).state
    state = eng.create(state, workload(2000, name="db")).state
    outcome = eng.stop(state, "db-id")
    assert outcome.state.shared == eng.policy.shared_pool(CPUSet())
    assert [t.container_id for t in outcome.targets] == ["api-id", "web-id"]
    assert all(t.cpus == outcome.state.shared for t in outcome.targets)
    assert actions(outcome) == ["release", "shared-resize"]
    # A second stop of the same container is a no-op: nothing to write, nothing to say.
    again = eng.stop(outcome.state, "db-id")
    assert again.targets == () and again.events == ()


def test_ended_and_removed_pods_release_like_stops():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(500, BURSTABLE, name="web")).state
    state = eng.create(state, workload(2000, name="db")).state
    ended = eng.ended(state, ["db-id"], "its cgroup is gone")
    assert "db-id" not in ended.state.assignments
    assert [t.container_id for t in ended.targets] == ["web-id"]
    removed = eng.remove_pod(state, "db-pod")
    assert removed.state.shared == ended.state.shared
    assert ("db-pod", "db") not in removed.state.released  # forgotten with its pod


def test_update_reasserts_our_cpuset_only_for_containers_we_place():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(2000, name="db")).state
    assert eng.update(state, "db-id").targets == (eng.target(state, "db-id"),)
    assert eng.update(state, "stranger").targets == ()


@pytest.mark.parametrize(
    ("cfs_quota", "exclusive_quota", "degraded_quota"),
    [("unlimited", UNLIMITED, 2 * CFS_PERIOD_US), ("keep", None, None)],
)
def test_quota_targets(cfs_quota, exclusive_quota, degraded_quota):
    eng = engine("xeon-e5-2680v3-2s", "0,24", cfs_quota)
    state = eng.create(eng.policy.empty_state(), workload(2000, name="db")).state
    assert eng.target(state, "db-id").quota == exclusive_quota
    # Degraded: hotplug took every CPU it held; it runs in the shared pool, bounded by quota.
    held = state.assignments["db-id"]
    state = state.evolve(
        assignments={"db-id": held.evolve(cpus=CPUSet(), lost=held.cpus)},
        shared=eng.policy.shared_pool(CPUSet()),
    )
    degraded = eng.target(state, "db-id")
    assert (degraded.cpus, degraded.mems, degraded.quota) == (state.shared, None, degraded_quota)
    assert degraded.mems_from_parent  # no longer held to its lost CPUs' NUMA node
    assert [t.container_id for t in eng.followers(state)] == ["db-id"]


def test_followers_are_the_targets_of_every_shared_and_degraded_container_in_id_order():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.policy.empty_state()
    for name, milli in (("web", 500), ("db", 2000), ("api", 250), ("cache", 1000)):
        state = eng.create(state, workload(milli, name=name)).state
    held = state.assignments["cache-id"]
    state = state.evolve(assignments={**state.assignments, "cache-id": held.evolve(cpus=CPUSet())})
    followers = eng.followers(state, exclude="web-id")
    assert [t.container_id for t in followers] == ["api-id", "cache-id"]
    assert followers == tuple(eng.target(state, t.container_id) for t in followers)
    assert all(t.cpus == state.shared and not t.exclusive for t in followers)


def test_synchronize_targets_every_live_container_and_drops_the_dead():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(2000, name="gone")).state
    live = [
        LiveContainer(workload(2000, name="db"), P("5,29")),  # adopted where it runs
        LiveContainer(workload(500, BURSTABLE, name="web"), P("0-47")),
    ]
    outcome = eng.synchronize(state, live, ["db-pod", "web-pod"])
    assert set(outcome.state.assignments) == {"db-id"}
    assert outcome.state.assignments["db-id"].cpus == P("5,29")
    assert [t.container_id for t in outcome.targets] == ["db-id", "web-id"]
    assert all(e.action == "reconcile" for e in outcome.events)


def test_load_follows_a_changed_online_set_and_rebuilds_what_it_cannot_use():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(2000, name="db")).state
    loaded = eng.load(state, None, None)
    assert loaded.trusted and [e.action for e in loaded.events] == ["state-loaded"]
    assert not eng.load(state, None, None, announce=False).events
    moved = state.evolve(fingerprint="elsewhere")
    loaded = eng.load(moved, None, None)
    assert loaded.followed is not None and loaded.events[0].action == "state-repair"
    # An assignment on a reserved CPU: this policy cannot honour the file; set it aside.
    bad = state.evolve(assignments={"x": Assignment("x", P("0"), "p", "x")})
    loaded = eng.load(bad, None, None)
    assert loaded.set_aside and not loaded.trusted and not loaded.state.assignments
    assert [e.action for e in loaded.events] == ["state-rebuild"]
    fresh = eng.load(None, "no state file", None)
    assert [e.action for e in fresh.events] == ["state-new"] and not fresh.set_aside


def test_follow_targets_only_containers_whose_cpuset_changed():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    state = eng.create(eng.policy.empty_state(), workload(500, BURSTABLE, name="web")).state
    state = eng.create(state, workload(2000, name="db")).state
    state = eng.create(state, workload(2000, name="cache")).state
    held = state.assignments["db-id"].cpus
    after = Engine(StaticPolicy(offline(eng.topology, str(max(held))), P("0,24")))
    outcome = after.follow(state, eng.policy)
    changed = [t.container_id for t in outcome.targets]
    assert "db-id" in changed and "cache-id" not in changed
    assert outcome.events[0].action == "cpu-replaced"


def test_then_keeps_later_targets_and_all_events():
    eng = engine("xeon-e5-2680v3-2s", "0,24")
    first = eng.create(eng.policy.empty_state(), workload(500, BURSTABLE, name="web"))
    second = eng.create(first.state, workload(2000, name="db"))
    both = first.then(second)
    assert both.state is second.state and both.decision is second.decision
    assert [t.container_id for t in both.targets] == ["web-id", "db-id"]
    assert both.targets[0] == second.targets[1]  # the later target of web wins
    assert actions(both) == ["share", "allocate", "shared-resize"]
