"""Smoke tests of the guest node: the machine is a production node's shape, each runtime runs
pods the way kubelet's systemd driver places them, and the project's daemon pins on it.

What the guest kernel and systemd report is what is checked (scenarios.py gathers it in the
guest); each test prints the facts and timings it saw, for the CI log.
"""

from __future__ import annotations

import json
import time

import pytest
from harness import guest_runtimes
from harness.guest import Guest
from harness.guest_node import GuestNode
from harness.guest_runtimes import GuestRuntime
from harness.host import parse_cpu_list

from guest.conftest import ON_BOTH, RUNTIMES

CONTROLLERS = "cpuset"


@pytest.mark.parametrize("guest", ON_BOTH, indirect=True)
def test_kernel_reports_a_production_node(guest: Guest) -> None:
    """2 sockets, 2 NUMA nodes, 2 threads per core; cgroup v2 only; systemd as PID 1; the
    cpuset controller enabled from the root down to kubepods.slice and its QoS slices.  The
    kernel, systemd and the OCI runtimes are the releases the guest's recipe pins (bookworm:
    6.1, 252, runc 1.1.5; trixie: 6.12, 257, runc 1.3.6 and crun 1.21)."""
    topology = guest.kernel_topology()
    print(f"accelerator: {guest.vm.accel_reason}; boot {guest.boot_seconds} s")
    print(f"guest kernel: {topology.summary()}")
    assert topology.sockets == 2, topology.lscpu
    assert topology.numa_nodes == 2, topology.lscpu
    assert topology.threads_per_core == 2, topology.lscpu
    assert topology.node_cpus == {0: "0-3", 1: "4-7"}, topology.node_cpus
    assert sorted(set(topology.thread_siblings.values())) == ["0-1", "2-3", "4-5", "6-7"]
    facts = guest.call("guest.scenarios:node")
    print(json.dumps(facts, indent=1))
    assert facts["cgroup_statfs"] == "cgroup2fs", facts
    assert facts["cgroup_fs"] == "cgroup2" and facts["v1_hierarchies"] == [], "v2 only"
    assert facts["pid1"] == "systemd"
    for level in ("root", "kubepods"):
        assert CONTROLLERS in facts[f"{level}_subtree_control"], facts
    assert CONTROLLERS in facts["kubepods_controllers"], facts
    assert CONTROLLERS in facts["burstable_controllers"], facts
    assert facts["kubepods_cpus_effective"] == "0-7"
    assert facts["kubepods_mems_effective"] == "0-1"
    recipe = guest.recipe
    assert facts["kernel_release"] == recipe.kernel_release, facts
    systemd = next(d for d in recipe.pinned if d.name == "systemd")
    assert facts["systemd_version"].startswith(f"systemd {systemd.version.split('.')[0]} "), facts
    oci = guest_runtimes.for_recipe(recipe, guest.lab)
    expected = {oci.runc: guest_runtimes.RUNC_RELEASE[recipe.suite]}
    if oci.crun is not None:
        expected[oci.crun] = "crun version 1.21"
    for program, release in expected.items():
        said = guest.check([program, "--version"], timeout=60).splitlines()
        print(f"{program}: {said[0]}")
        assert said[0].startswith(release), said


@pytest.mark.parametrize("runtime_name", RUNTIMES)
def test_daemon_pins_a_guaranteed_pod_on_one_core(
    guest: Guest, node: GuestNode, on_runtime: GuestRuntime
) -> None:
    """With ``nri-cpuplugin run`` as packaging/ installs it (pin_at default), a 2-CPU
    Guaranteed container is born on one whole core - its first instruction already sees
    the pair of SMT siblings, and systemd's ``AllowedCPUs`` of its scope agrees - and a
    Burstable pod running before it is moved off that core."""
    started = time.monotonic()
    node.start_daemon()
    print(f"daemon synchronized in {time.monotonic() - started:.1f} s")
    _check_pinned_on_one_core(guest, on_runtime)
    # This daemon's records only (an earlier test's daemon is not judged here).
    records = node.daemon_records("allocate", after=node.started_at)
    assert records, "the daemon's audit trail in the journal names the allocation"
    # The runtime's NRI timeouts are raised under TCG (guest_runtimes.py); the daemon's own
    # request budget is not, and must still hold.
    missed = [r["MESSAGE"] for r in node.daemon_records("deadline", after=node.started_at)]
    assert not missed, f"the daemon missed its own request budget: {missed}"


@pytest.mark.parametrize("runtime_name", ["crio-hooks"])
def test_hook_pins_a_guaranteed_pod_on_one_core(guest: Guest, on_runtime: GuestRuntime) -> None:
    """CRI-O with NRI off and hooks/*.json in hooks.d (packaging/crio's hook mode): the OCI
    hook places the containers, under the systemd driver too - the same whole core from the
    first instruction, ``AllowedCPUs`` set through systemd, the Burstable pod moved off."""
    _check_pinned_on_one_core(guest, on_runtime)


def _check_pinned_on_one_core(guest: Guest, runtime: GuestRuntime) -> None:
    started = time.monotonic()
    facts = guest.call("guest.scenarios:pinned_and_shared", address=runtime.cri_socket)
    print(f"{runtime.name}: scenario {time.monotonic() - started:.1f} s")
    print(json.dumps(facts, indent=1))
    siblings = set(guest.kernel_topology().thread_siblings.values())
    pinned, shared = facts["pinned"], facts["shared"]
    first = facts["pinned_first_line"]
    assert first in siblings, f"born on {first}, not on one whole core of {sorted(siblings)}"
    assert pinned["cpus_allowed_list"] == first
    assert pinned["cpuset_cpus_effective"] == first
    assert pinned["allowed_cpus"] == first.replace(",", " "), "systemd's view of the scope"
    exclusive = set(parse_cpu_list(first))
    assert not exclusive & set(parse_cpu_list(shared["cpus_allowed_list"])), shared
    assert not exclusive & set(parse_cpu_list(shared["cpuset_cpus_effective"])), shared
    assert not exclusive & set(parse_cpu_list(shared["allowed_cpus"])), (
        "systemd's view of the scope"
    )
    assert facts["shared_moved_after_s"] == 0, "moved by the pinned container's creation"
    _check_scope_in_pod_slice(facts, runtime)


def _check_scope_in_pod_slice(facts: dict, runtime: GuestRuntime) -> None:
    """The systemd driver as kubelet uses it: the pod's cgroup parent is the slice name
    ``kubepods-pod<uid>.slice``, and the runtime makes the container a scope inside it (an
    active systemd unit) with the cpuset controller available to it."""
    assert facts["runtime"]["runtime_version"].lstrip("v").startswith(runtime.release), facts
    pinned, pod_slice = facts["pinned"], facts["pinned_pod_slice"]
    assert pod_slice.startswith("kubepods-pod") and pod_slice.endswith(".slice")
    prefix = "cri-containerd" if runtime.name.startswith("containerd") else "crio"
    scope = f"{prefix}-{pinned['id']}.scope"
    assert pinned["cgroup"] == f"/kubepods.slice/{pod_slice}/{scope}", pinned
    assert pinned["cgroups_path"] == f"{pod_slice}:{prefix}:{pinned['id']}", pinned
    assert pinned["unit_active"] == "active", "the scope is a live systemd unit"
    assert CONTROLLERS in pinned["scope_controllers"], pinned
