"""Static policy: pools, eligibility, annotations, restarts, init reuse, refusals."""

from __future__ import annotations

import pytest
from builders import workload
from topologies import topology

from nri_cpuplugin.core.allocator import STRICT_CPU_RESERVATION
from nri_cpuplugin.core.annotation import CRIO_CPU_QUOTA
from nri_cpuplugin.core.annotation import EXCLUSIVE as EXCLUSIVE_ANNOTATION
from nri_cpuplugin.core.annotation import ISOLATED as ISOLATED_ANNOTATION
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.core.workload import BESTEFFORT, BURSTABLE

P = CPUSet.parse


def xeon(**kw) -> tuple[StaticPolicy, object]:
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2, **kw)
    return policy, policy.empty_state()


@pytest.mark.parametrize(
    ("workload", "exclusive", "reason"),
    [
        (workload(2000), True, "guaranteed with 2 whole CPUs"),
        (workload(1500), False, "1500m (not whole CPUs)"),
        (workload(2000, qos=BURSTABLE), False, "burstable QoS shares"),
        (workload(0, qos=BESTEFFORT), False, "besteffort QoS shares"),
        (workload(2000, **{EXCLUSIVE_ANNOTATION: "false"}), False, "opted out"),
        (
            workload(2000, name="db", **{f"{EXCLUSIVE_ANNOTATION}/container.db": "false"}),
            False,
            "opted out",
        ),
        # the container-specific value wins over the pod-wide one
        (
            workload(
                2000,
                name="db",
                **{EXCLUSIVE_ANNOTATION: "false", f"{EXCLUSIVE_ANNOTATION}/container.db": "true"},
            ),
            True,
            "guaranteed",
        ),
        # an annotation cannot grant what QoS does not
        (workload(2000, qos=BURSTABLE, **{EXCLUSIVE_ANNOTATION: "true"}), False, "burstable"),
        (workload(2000, qos=BURSTABLE, **{ISOLATED_ANNOTATION: "true"}), False, "burstable"),
    ],
)
def test_eligibility(workload, exclusive, reason):
    policy, state = xeon()
    decision, new_state = policy.admit(state, workload)
    assert decision.exclusive is exclusive
    assert reason in decision.reason
    if not exclusive:
        assert decision.cpus == policy.shared_pool(CPUSet())
        assert not decision.mems and decision.shared_before == decision.shared_after
        assert new_state.sharing == {workload.container_id: workload.pod_uid}
        assert new_state.assignments == state.assignments


def test_exclusive_assignment_shrinks_shared_pool_and_sets_mems():
    policy, state = xeon()
    decision, state = policy.admit(state, workload(4000))
    assert decision.cpus == P("1-2,25-26")  # 0,24 are reserved
    assert decision.mems == P("0")
    assert decision.shared_before == P("0-47")  # reserved CPUs stay shared without strict mode
    assert decision.shared_after == P("0,3-24,27-47")
    assert state.shared == decision.shared_after
    shared, _ = policy.admit(state, workload(500))
    assert shared.cpus == decision.shared_after


def test_strict_reservation_keeps_reserved_out_of_shared_pool():
    _, state = xeon(options=[STRICT_CPU_RESERVATION])
    assert state.shared == P("1-23,25-47")


def test_odd_annotation_value_is_a_clear_error():
    policy, state = xeon()
    with pytest.raises(PolicyError, match=f"{EXCLUSIVE_ANNOTATION}='maybe'.*'true' or 'false'"):
        policy.admit(state, workload(1000, **{EXCLUSIVE_ANNOTATION: "maybe"}))


@pytest.mark.parametrize("value", ["disable", "true"])
def test_crio_quota_lift_on_an_opted_out_container_is_refused(value):
    """CRI-O's high-performance handler lifts the CFS quota of Guaranteed whole-CPU containers
    whose pod says cpu-quota.crio.io=disable: never for one we put in the shared pool."""
    policy, state = xeon()
    quota = {CRIO_CPU_QUOTA: value}
    with pytest.raises(PolicyError, match=rf"opted out .*{CRIO_CPU_QUOTA}={value}") as err:
        policy.admit(state, workload(2000, **{EXCLUSIVE_ANNOTATION: "false"}, **quota))
    assert err.value.code == "bad-annotation"
    # Exclusive CPUs: both lift the quota (cfs_quota = "unlimited"), no conflict.
    assert policy.admit(state, workload(2000, **quota))[0].exclusive
    # Containers CRI-O skips (Burstable, fractional CPUs) share as ever; so does "enable".
    assert not policy.admit(state, workload(2000, qos=BURSTABLE, **quota))[0].exclusive
    assert not policy.admit(state, workload(1500, **quota))[0].exclusive
    enable = {CRIO_CPU_QUOTA: "enable", EXCLUSIVE_ANNOTATION: "false"}
    assert not policy.admit(state, workload(2000, **enable))[0].exclusive


def test_request_beyond_free_fails_naming_request_and_free():
    policy, state = xeon()
    _, state = policy.admit(state, workload(40000))
    with pytest.raises(PolicyError) as err:
        policy.admit(state, workload(8000, pod="big"))
    message = str(err.value)
    assert "asks for 8 exclusive CPUs" in message and "(6)" in message and "pod ns/big" in message


def test_shared_pool_is_never_emptied():
    t = topology("single-socket-no-smt")
    policy = StaticPolicy(t, P("0"), [STRICT_CPU_RESERVATION])
    with pytest.raises(PolicyError, match="leave the shared pool empty"):
        policy.admit(policy.empty_state(), workload(7000))
    decision, _ = policy.admit(policy.empty_state(), workload(6000))
    assert decision.shared_after == P("7")


def test_isolated_cpus_only_on_request_and_never_shared():
    t = topology("offline-isolcpus")  # isolated 2-3,10-11; offline 5,13
    policy = StaticPolicy.from_config(t, reserved_count=1)
    state = policy.empty_state()
    assert not state.shared & t.isolated
    plain, state = policy.admit(state, workload(2000))
    assert not plain.cpus & t.isolated
    iso, state = policy.admit(state, workload(2000, **{ISOLATED_ANNOTATION: "true"}))
    assert iso.cpus == P("2,10")
    assert iso.shared_after == iso.shared_before  # isolated CPUs were never shared
    with pytest.raises(PolicyError, match="isolated CPUs"):
        policy.admit(state, workload(4000, **{ISOLATED_ANNOTATION: "true"}))


def test_restarted_container_gets_previous_cpus_back():
    policy, state = xeon()
    first = workload(2000, name="app", pod="p1")
    decision, state = policy.admit(state, workload(2000))  # take the lowest CPUs first
    mine, state = policy.admit(state, first)
    _, state = policy.release(state, first.container_id)
    _, state = policy.release(state, decision.container_id)  # lower CPUs are now free again
    restarted = workload(2000, name="app", pod="p1", cid="app-restarted")
    again, state = policy.admit(state, restarted)
    assert again.cpus == mine.cpus and "previous CPUs" in again.reason


def test_restart_gets_new_cpus_when_previous_are_taken():
    policy, state = xeon()
    first = workload(2000, name="app", pod="p1")
    mine, state = policy.admit(state, first)
    _, state = policy.release(state, first.container_id)
    _, state = policy.admit(state, workload(2000, pod="thief"))  # takes the same, lowest CPUs
    again, _ = policy.admit(state, workload(2000, name="app", pod="p1", cid="app-restarted"))
    assert again.cpus != mine.cpus and "topology" in again.reason


def test_finished_init_container_cpus_go_to_app_containers_of_its_pod():
    policy, state = xeon()
    init = workload(4000, name="init", pod="p1", kind="init")
    init_decision, state = policy.admit(state, init)
    _, state = policy.admit(state, workload(2000, pod="other"))
    _, state = policy.release(state, init.container_id)
    app, state = policy.admit(state, workload(2000, name="app", pod="p1"))
    assert app.cpus <= init_decision.cpus and "init" in app.reason
    sidecar, _ = policy.admit(state, workload(2000, name="side", pod="p1", kind="sidecar"))
    assert sidecar.cpus <= init_decision.cpus  # sidecars are app containers here


def test_other_pods_do_not_reuse_init_cpus_first():
    policy, state = xeon()
    init = workload(2000, name="init", pod="p1", kind="init")
    _, state = policy.admit(state, init)
    _, state = policy.release(state, init.container_id)
    other, _ = policy.admit(state, workload(2000, pod="p2"))
    assert "topology" in other.reason


def test_release_returns_grown_shared_pool_and_forget_pod_clears_memory():
    policy, state = xeon()
    w = workload(2000, pod="p1")
    granted, state = policy.admit(state, w)
    released, state = policy.release(state, w.container_id)
    assert released.cpus == granted.cpus
    assert released.shared_after == released.shared_before | granted.cpus
    assert policy.release(state, w.container_id) == (None, state)
    assert ("p1", w.container_name) in state.released
    state = policy.forget_pod(state, "p1")
    assert not state.released and not state.assignments


def test_repeated_create_event_is_idempotent():
    policy, state = xeon()
    w = workload(2000)
    first, state = policy.admit(state, w)
    second, state2 = policy.admit(state, w)
    assert second.cpus == first.cpus and state2 == state


def test_reserved_must_be_cpus_of_the_machine_and_nonempty():
    t = topology("xeon-e5-2680v3-2s")
    with pytest.raises(PolicyError, match="not CPUs of this machine"):
        StaticPolicy(t, P("99"))
    # An offline reserved CPU is fine (hotplug): it reserves nothing until it returns.
    offline = topology("offline-isolcpus")  # CPUs 5 and 13 offline
    assert StaticPolicy(offline, P("0,5")).reserved == P("0,5")
    with pytest.raises(PolicyError, match="no reserved CPUs"):
        StaticPolicy(t, CPUSet())
    with pytest.raises(PolicyError, match="reserved_cpu_count"):
        StaticPolicy.from_config(t)


def test_check_rejects_state_that_no_longer_fits_the_machine():
    policy, state = xeon()
    _, state = policy.admit(state, workload(2000))
    assert policy.check(state) is None
    other = StaticPolicy(topology("xeon-e5-2680v3-2s"), P("0-1,24-25"))
    assert "no longer assignable" in other.check(state)


def test_no_cpu_is_ever_assigned_twice_under_churn():
    import random

    rng = random.Random(3)
    policy, state = xeon()
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            _, state = policy.release(state, live.pop(rng.randrange(len(live))))
        else:
            w = workload(rng.choice([1000, 2000, 3000, 4000, 1500]), pod=f"p{rng.randrange(20)}")
            try:
                decision, state = policy.admit(state, w)
            except PolicyError:
                continue
            if decision.exclusive:
                live.append(w.container_id)
        seen: set[int] = set()
        for a in state.assignments.values():
            assert not a.cpus & seen and not a.cpus & policy.reserved
            seen |= a.cpus
        assert state.shared == policy.shared_pool(CPUSet(seen)) and state.shared


def test_a_new_container_supersedes_a_dead_one_of_the_same_pod_and_name():
    policy, state = xeon()
    failed = workload(2000, name="app", pod="p1")
    first, state = policy.admit(state, failed)  # creation then failed in the runtime
    retry = workload(2000, name="app", pod="p1", cid="app-retried")
    second, state = policy.admit(state, retry)
    assert second.cpus == first.cpus  # the dead one's CPUs, as for a restart
    assert list(state.assignments) == [retry.container_id]
    assert second.shared_before == first.shared_after


def test_adopt_keeps_cpus_a_container_already_runs_on_only_if_free_and_exact():
    policy, state = xeon()
    w = workload(2000, pod="p1")
    adopted = policy.adopt(state, w, P("5,29"))
    assert adopted.assignments[w.container_id].cpus == P("5,29")
    assert policy.adopt(state, workload(2000), P("5")) is None  # wrong size
    assert policy.adopt(adopted, workload(2000), P("5,29")) is None  # taken
    assert policy.adopt(state, workload(2000), P("0,24")) is None  # reserved
    assert policy.adopt(state, workload(500), P("5")) is None  # not eligible


def test_release_and_forget_pod_track_shared_containers():
    policy, state = xeon()
    shared_one = workload(500, qos=BURSTABLE, pod="p1")
    _, state = policy.admit(state, shared_one)
    assert state.sharing == {shared_one.container_id: "p1"}
    assert policy.release(state, shared_one.container_id)[1].sharing == {}
    assert policy.forget_pod(state, "p1").sharing == {}


def test_remembered_stops_are_bounded():
    """Missed RemovePodSandbox events must not grow every commit without bound."""
    from nri_cpuplugin.core.policy import MAX_RELEASED

    policy = StaticPolicy(topology("xeon-e5-2680v3-2s"), P("0,24"))
    state = policy.empty_state()
    for i in range(2000):
        decision, state = policy.admit(state, workload(1000, name=f"c{i}", pod=f"p{i}"))
        _, state = policy.release(state, decision.container_id)
    assert len(state.released) == MAX_RELEASED
