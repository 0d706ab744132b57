"""Rebuilding state from the runtime's list of live containers."""

from __future__ import annotations

from builders import workload
from topologies import topology

from nri_cpuplugin.core.annotation import EXCLUSIVE as EXCLUSIVE_ANNOTATION
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import StaticPolicy
from nri_cpuplugin.core.reconcile import LiveContainer, reconcile
from nri_cpuplugin.core.workload import BURSTABLE

P = CPUSet.parse


def policy() -> StaticPolicy:
    return StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)


def test_rebuild_from_nothing_adopts_running_cpus_and_places_newcomers():
    p = policy()
    live = [
        LiveContainer(
            workload(2000, name="a", pod="p"), P("7,31")
        ),  # already pinned by an earlier life of ours
        LiveContainer(
            workload(2000, name="b", pod="p"), P("0-47")
        ),  # created while we were down: unpinned
        LiveContainer(workload(500, BURSTABLE, name="c", pod="p"), P("0-47")),
    ]
    result = reconcile(p, p.empty_state(), live, ["p"])
    cpus = {a.container_name: a.cpus for a in result.state.assignments.values()}
    assert cpus == {"a": P("7,31"), "b": P("1,25")}
    assert result.state.sharing == {workload(2000, name="c", pod="p").container_id: "p"}
    assert result.state.shared == P("0,2-6,8-24,26-30,32-47")
    assert any("adopted 7,31" in n for n in result.notes)


def test_stale_assignments_are_dropped_and_kept_ones_stay():
    p = policy()
    state = p.empty_state()
    _, state = p.admit(state, workload(2000, name="keep", pod="p"))
    _, state = p.admit(state, workload(2000, name="gone", pod="dead-pod"))
    _, state = p.release(state, workload(2000, name="gone", pod="dead-pod").container_id)
    _, state = p.admit(state, workload(2000, name="stale", pod="p"))
    result = reconcile(
        p, state, [LiveContainer(workload(2000, name="keep", pod="p"), CPUSet())], ["p"]
    )
    assert [a.container_name for a in result.state.assignments.values()] == ["keep"]
    assert not result.state.released  # the pod is gone: nothing to remember it by
    assert any(n.startswith("dropped") and "stale" in n for n in result.notes)


def test_opted_out_and_unsatisfiable_containers_share():
    p = policy()
    live = [
        LiveContainer(
            workload(2000, name="optout", pod="p", **{EXCLUSIVE_ANNOTATION: "false"}), P("0-47")
        ),
        LiveContainer(workload(60000, name="huge", pod="p"), P("0-47")),
        LiveContainer(
            workload(2000, name="odd", pod="p", **{EXCLUSIVE_ANNOTATION: "perhaps"}), P("0-47")
        ),
    ]
    result = reconcile(p, p.empty_state(), live, ["p"])
    assert not result.state.assignments
    assert len(result.state.sharing) == 3
    assert any("left in the shared pool" in n for n in result.notes)
    assert any("'perhaps'" in n for n in result.notes)
