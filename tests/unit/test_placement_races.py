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
