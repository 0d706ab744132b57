"""Placement under races and refusals (issue: no shared container may run on exclusive CPUs, no
refusal may keep CPUs, no earmark may split a core): each finding reproduced as the runtime
orders things, in process, on the production composition (tests/daemon_driver.py) or the
policy itself."""

from __future__ import annotations

import pytest
from test_policy import wl
from topologies import topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import StaticPolicy
from nri_cpuplugin.core.state import Earmark

P = CPUSet.parse


def earmarked(policy: StaticPolicy, limit: int):
    wanted = Earmark(CPUSet(), "sb-a", limit, pod_name="a", pod_namespace="ns")
    return policy.earmark(policy.empty_state(), "pod-a", wanted)


def whole_cores(policy: StaticPolicy, cpus: CPUSet) -> bool:
    """Every core these CPUs touch is theirs whole."""
    siblings = policy.topology.siblings
    return all(siblings(cpu) <= cpus for cpu in cpus)


# --- an earmark trimmed by a claim keeps whole cores ---------------------------------------------


@pytest.mark.parametrize("options", [(), ("full-pcpus-only",)])
def test_a_trimmed_earmark_keeps_whole_cores_for_the_container_that_takes_it(options):
    """A pod of sidecar 500m + main 2 CPUs + 500m (limit 3 CPUs): its earmark has a whole core
    and a thread of another.  The first sidecar claims 500m, and two whole CPUs stay earmarked:
    they must be one core (threads N and N+24 here), not the lowest two ids (1 and 2, halves of
    two cores whose siblings then run shared containers)."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    policy = StaticPolicy(policy.topology, policy.reserved, options)
    state = earmarked(policy, 3000)
    _, state = policy.admit(state, wl(500, pod="pod-a", name="sidecar", qos="guaranteed"))
    kept = state.earmarks["pod-a"].cpus
    assert len(kept) == 2 and whole_cores(policy, kept)
    decision, state = policy.admit(state, wl(2000, pod="pod-a", name="main"))
    assert decision.cpus == kept and whole_cores(policy, decision.cpus)


# --- init containers, as kubelet annotates them ---------------------------------------------------


def test_kubelets_container_type_annotation_makes_an_init_container():
    """kubelet annotates every container with its kind in the pod spec; the runtime's view has
    nothing else to tell an init container by (NRI and OCI alike)."""
    from nri_messages import container, pod

    from nri_cpuplugin.core.workload import CONTAINER_TYPE, from_nri
    from nri_cpuplugin.hook.oci import OCIConfig, OCIState, from_oci

    db = pod("db")
    init = container("migrate", db, 1000)
    init.annotations[CONTAINER_TYPE] = "init"
    app = container("pg", db, 1000)
    app.annotations[CONTAINER_TYPE] = "container"
    assert from_nri(db, init).kind == "init"
    assert from_nri(db, app).kind == "app"
    assert from_nri(db, container("old", db, 1000)).kind == "app"  # an older kubelet: none
    state = OCIState("c1", "created", 1, "/b", {})
    config = OCIConfig({CONTAINER_TYPE: "init"}, 1024, None, None)
    assert from_oci(state, config, "/kubepods/poddb/c1", ("uid", "db", "ns", "c")).kind == "init"


def test_an_init_container_claims_nothing_and_its_cpus_serve_the_app_container():
    """Pod: an init container of 2 CPUs, then an app container of 2 CPUs (kubelet's pod limit:
    the larger, 2 CPUs).  The init container takes the earmark; once it has finished, the app
    container gets its CPUs again."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 2000)
    init = wl(2000, pod="pod-a", name="migrate", kind="init")
    first, state = policy.admit(state, init)
    _, state = policy.release(state, init.container_id)
    decision, state = policy.admit(state, wl(2000, pod="pod-a", name="main"))
    assert decision.cpus == first.cpus and "init containers' CPUs" in decision.reason


def test_a_sidecar_claims_its_share_when_the_app_container_comes():
    """kubelet annotates a sidecar (a restartable init container) "init" too: still running
    when the app container is created, it claims its limit then, and the earmark keeps no CPU
    that no container of the pod can ask for."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 3500)  # sidecar 1.5 CPUs (shared) + main 2 CPUs
    sidecar = wl(1500, pod="pod-a", name="proxy", kind="init")
    _, state = policy.admit(state, sidecar)
    assert len(state.earmarks["pod-a"].cpus) == 3  # not decided yet: it may be a plain init
    _, state = policy.admit(state, wl(2000, pod="pod-a", name="main"))
    assert "pod-a" not in state.earmarks  # claimed whole: 1.5 + 2 CPUs
    assert state.shared == policy.shareable - state.exclusive


def test_deferred_init_containers_are_kept_in_the_state_file_and_checked():
    from nri_cpuplugin.base import jsonbytes
    from nri_cpuplugin.core import state as state_mod

    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 3500)
    _, state = policy.admit(state, wl(1500, pod="pod-a", name="proxy", kind="init"))
    again = state_mod.decode(state_mod.encode(state))
    assert again.earmarks["pod-a"].deferred == state.earmarks["pod-a"].deferred != ()
    doc = state_mod.to_document(state)
    doc["earmarks"]["pod-a"]["deferred"] = [["c", "proxy", -5]]
    doc["checksum"] = state_mod.checksum(doc)
    with pytest.raises(state_mod.StateFormatError, match=r"\[id, name, millicores\]"):
        state_mod.decode(jsonbytes.dumps(doc))
