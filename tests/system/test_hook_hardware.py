"""CPU hotplug and NIC locality on the OCI hook path, against real cgroup v1 with fake containers.

* CPU hotplug: the hook reconciles the online CPUs on every run.  CPU 1 of this machine is
  never taken offline here (tests/e2e/test_hotplug.py does that, with the daemon): a generated
  sysfs tree (``--sysfs``) says it is offline, and what cgroup v1 does to the cpusets when a
  CPU goes offline (it leaves every cpuset; a cpuset left empty has its processes moved to the
  nearest ancestor with CPUs) is done to the sandbox's cgroups by the test.
* NIC locality: real network namespaces and links (pyroute2), the device's NUMA node from a
  generated (fake) sysfs tree.  This machine has one NUMA node, so every exclusive placement
  the hook writes must be on node 0 (cpuset.mems of node 1 does not exist here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, pod, sandbox
from netns_util import host_nic, leftover_test_namespaces, pod_netns
from sysfs_gen import MachineSpec, write_fake_device, write_sysfs

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import NodeState
from nri_cpuplugin.hardware import nic
from nri_cpuplugin.storage.store import QUARANTINE_PREFIX, StateStore


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    if host.online_cpus() != [0, 1]:
        pytest.fail(f"written for this 2-CPU machine; online: {host.online_cpus()}")
    with sandbox() as fake_node:
        yield fake_node


@pytest.fixture(autouse=True)
def _no_leftover_namespaces() -> Iterator[None]:
    before = leftover_test_namespaces()
    yield
    assert leftover_test_namespaces() == before, "a test left a network namespace behind"


def state_of(box: CgroupSandbox) -> NodeState:
    result = StateStore(box.state_dir).peek()
    assert result.state is not None, result.problem
    return result.state


def records(result, action: str) -> list[dict[str, str]]:
    return [r for r in result.records if r["ACTION"] == action]


# --- CPU hotplug ---------------------------------------------------------------------------


def this_machine(tmp_path: Path, offline: frozenset[int] = frozenset()) -> Path:
    """A FAKE sysfs tree of this machine's CPUs (0-1, one NUMA node), ``offline`` offline."""
    name = f"fake-this-vm-offline-{'-'.join(map(str, sorted(offline))) or 'none'}"
    return write_sysfs(MachineSpec(name=name, cores_per_socket=2, offline=offline), tmp_path / name)


def kernel_offlines(box: CgroupSandbox, cpu: int) -> None:
    """What cgroup v1 does to the sandbox's cpusets when ``cpu`` goes offline: it leaves every
    cpuset (children first); a cpuset left without CPUs first loses its processes to its
    parent (the kernel: to the nearest ancestor that still has CPUs)."""
    top = box.cpuset_dir(box.top)
    below = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*below, top]:
        cpus = CPUSet.parse((d / "cpuset.cpus").read_text().strip())
        if cpu not in cpus:
            continue
        left = cpus - {cpu}
        if not left:
            for pid in (d / "cgroup.procs").read_text().split():
                (d.parent / "cgroup.procs").write_text(pid)
        (d / "cpuset.cpus").write_text(f"{left}\n" if left else "\n")


def cpuset_procs(box: CgroupSandbox, container) -> list[str]:
    return (box.cpuset_dir(container.cgroup) / "cgroup.procs").read_text().split()


def test_cpu_offline_while_nothing_ran_degrades_then_online_restores(
    box: CgroupSandbox, tmp_path: Path
) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0
    assert box.hook(db).returncode == 0
    assert (box.affinity(db), box.affinity(web), box.quota(db)) == ("1", "0", "-1")
    online_fingerprint = state_of(box).fingerprint

    # CPU 1 goes offline while no hook runs: the kernel empties db's cpuset and moves its
    # process up to the pod's cgroup.
    kernel_offlines(box, 1)
    assert box.cpus(db) == "" and cpuset_procs(box, db) == []
    offline = this_machine(tmp_path, frozenset({1}))

    # The next hook run (another container) repairs instead of setting the state aside.
    late = box.add(pod("late", "besteffort"), "late")
    result = box.hook(late, args=["--sysfs", str(offline)])
    assert result.returncode == 0, result.stderr
    assert "state-rebuild" not in result.actions()
    assert not list(box.state_dir.glob(f"{QUARANTINE_PREFIX}*"))
    [repair] = records(result, "state-repair")
    assert online_fingerprint in repair["MESSAGE"]
    [degraded] = records(result, "degraded")
    assert degraded["CONTAINER_ID"] == db.id and degraded["LOST_CPUS"] == "1"
    assert "runs in the shared pool" in degraded["MESSAGE"]
    [returned] = records(result, "cgroup-repair")
    assert returned["CONTAINER_ID"] == db.id and returned["PROCESSES"] == "1"
    state = state_of(box)
    held = state.assignments[db.id]
    assert (str(held.cpus), str(held.lost)) == ("", "1")
    assert str(state.shared) == "0" and state.fingerprint != online_fingerprint
    # db runs in the shared pool, back in its own cgroup, bounded by its CPU limit again.
    assert cpuset_procs(box, db) == [str(db.pid)]
    assert (box.cpus(db), box.affinity(db), box.quota(db)) == ("0", "0", "100000")
    assert (box.affinity(web), box.affinity(late)) == ("0", "0")

    # A run that sees the same online set changes nothing more.
    again = box.hook(late, args=["--sysfs", str(offline)])
    assert again.returncode == 0, again.stderr
    assert not records(again, "state-repair")

    # CPU 1 comes back (cgroup v1 gives it to no cpuset); the next run on the real sysfs
    # gives it back to db, and to the ancestors the kernel took it from.
    box.stop(late)
    result = box.hook(late, stage="poststop")
    assert result.returncode == 0, result.stderr
    assert len(records(result, "state-repair")) == 1
    [restored] = records(result, "cpu-restored")
    assert restored["CONTAINER_ID"] == db.id and restored["CPUS"] == "1"
    state = state_of(box)
    assert str(state.assignments[db.id].cpus) == "1" and not state.assignments[db.id].lost
    assert state.fingerprint == online_fingerprint
    assert (box.affinity(db), box.quota(db)) == ("1", "-1")
    assert (box.cpuset_dir(box.top) / "cpuset.cpus").read_text().strip() == "0-1"
    assert box.problems([web, db]) == []

    # db stops: the shared container gets both CPUs, which needs the repaired ancestors.
    box.stop(db)
    assert box.hook(db, stage="poststop").returncode == 0
    assert box.affinity(web) == "0-1"
    assert box.problems([web]) == []


def test_state_committed_while_a_cpu_was_offline_is_repaired_not_set_aside(
    box: CgroupSandbox, tmp_path: Path
) -> None:
    """The other way round: the state was committed with CPU 1 offline (a shared-only node),
    CPU 1 is online now: the state is kept, the shared pool grows to it."""
    offline = this_machine(tmp_path, frozenset({1}))
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    result = box.hook(web, args=["--sysfs", str(offline)])
    assert result.returncode == 0, result.stderr
    kernel_offlines(box, 1)
    assert box.affinity(web) == "0"
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    (box.cpuset_dir(db.cgroup) / "cpuset.cpus").write_text("0\n")  # as runc made it then
    before = state_of(box)
    assert str(before.shared) == "0" and web.id in before.sharing

    result = box.hook(db)  # the real sysfs: CPUs 0-1 online
    assert result.returncode == 0, result.stderr
    assert records(result, "state-repair") and "state-rebuild" not in result.actions()
    assert not list(box.state_dir.glob(f"{QUARANTINE_PREFIX}*"))
    assert box.affinity(db) == "1"  # CPU 1 was in no ancestor any more: grown back first
    assert box.affinity(web) == "0"
    assert box.problems([web, db]) == []


# --- NIC locality ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lower():
    return host_nic()


def two_nodes(tmp_path: Path, lower, node: int) -> Path:
    """A FAKE sysfs tree: CPU 0 on NUMA node 0, CPU 1 on node 1 (CPU 2 on node 2 is offline
    and reserved, so both online CPUs are assignable), with the host NIC's device faked onto
    ``node``."""
    spec = MachineSpec(name="fake-2-online-nodes", sockets=3, cores_per_socket=1, offline={2})
    root = write_sysfs(spec, tmp_path / "fake-sysfs-nodes")
    write_fake_device(root, lower.parent_bus, lower.parent_dev, node, parent="fake-0000:00:03.0")
    return root


def netns(path: str) -> list[dict[str, str]]:
    return [{"type": "pid"}, {"type": "network", "path": path}]


def test_nic_locality_on_the_hook_path(box: CgroupSandbox, tmp_path: Path, lower) -> None:
    root = two_nodes(tmp_path, lower, 0)
    args = ["--sysfs", str(root), "--reserved-cpus", "2"]
    with pod_netns() as ns:
        ns.add_macvlan(lower.name, "net1")
        ns.add_veth("eth0")  # virtual: says nothing

        # prefer (the default): the NIC's node is chosen, and the audit trail says so.
        fwd = box.add(pod("fwd"), "fwd", millicores=1000, limit=1000, namespaces=netns(ns.path))
        result = box.hook(fwd, args=args)
        assert result.returncode == 0, result.stderr
        [allocate] = records(result, "allocate")
        assert allocate["CPUS"] == "0" and "next to its NICs on NUMA 0" in allocate["REASON"]
        [locality] = records(result, "nic-locality")
        assert (locality["HONOURED"], locality["NIC_NUMA"]) == ("honoured", "0")
        assert (
            f"net1 ({lower.parent_bus}/{lower.parent_dev} via {lower.name}, NUMA 0)"
            in (locality["NICS"])
        )
        held = state_of(box).assignments[fwd.id]
        assert (str(held.nic_nodes), held.nic_strict) == ("0", False)
        assert (box.affinity(fwd), box.quota(fwd)) == ("0", "-1")
        assert (box.cpuset_dir(fwd.cgroup) / "cpuset.mems").read_text().strip() == "0"

        # strict, and node 0 has no free CPU left: refused with our one line, nothing placed.
        strict = box.add(
            pod("strict"),
            "strict",
            millicores=1000,
            limit=1000,
            annotations={nic.LOCALITY_ANNOTATION: "strict"},
            namespaces=netns(ns.path),
        )
        before = (box.state_dir / "state.json").read_bytes()
        result = box.hook(strict, args=args)
        assert result.returncode == 1
        [line] = result.reason_lines
        assert line.startswith("nri-cpuplugin: container 'strict' of pod default/strict")
        assert "NIC locality is strict" in line and "free there: none" in line
        [refuse] = records(result, "refuse")
        assert refuse["CONTAINER_ID"] == strict.id and refuse["PRIORITY"] == "3"
        assert (box.state_dir / "state.json").read_bytes() == before
        assert strict.id not in state_of(box).assignments

        # strict with a named interface the pod does not have: refused before the lock.
        missing = box.add(
            pod("missing"),
            "missing",
            millicores=1000,
            limit=1000,
            annotations={nic.LOCALITY_ANNOTATION: "strict", nic.NICS_ANNOTATION: "net9"},
            namespaces=netns(ns.path),
        )
        result = box.hook(missing, args=args)
        assert result.returncode == 1
        [line] = result.reason_lines
        assert "net9 not found in" in line and ns.path in line
        assert records(result, "refuse")

    assert box.problems([fwd]) == []


def test_host_network_and_shared_containers_get_no_nic_preference(
    box: CgroupSandbox, tmp_path: Path, lower
) -> None:
    root = two_nodes(tmp_path, lower, 0)
    args = ["--sysfs", str(root), "--reserved-cpus", "2"]
    # No network namespace path: the host network.  Strict does not matter then.
    host_pod = box.add(
        pod("host"),
        "app",
        millicores=1000,
        limit=1000,
        annotations={nic.LOCALITY_ANNOTATION: "strict"},
        namespaces=[{"type": "network"}],  # a new one, made by the runtime: not a pod's
    )
    result = box.hook(host_pod, args=args)
    assert result.returncode == 0, result.stderr
    [locality] = records(result, "nic-locality")
    assert locality["HONOURED"] == "no preference" and "host network" in locality["MESSAGE"]
    # Shared containers are never inspected (nobody's CPUs are chosen for them).
    web = box.add(pod("web", "burstable"), "web", millicores=500, namespaces=netns("/nonexistent"))
    result = box.hook(web, args=args)
    assert result.returncode == 0, result.stderr
    assert not records(result, "nic-locality")


def test_host_network_with_annotated_host_interface_prefers_its_node(
    box: CgroupSandbox, tmp_path: Path, lower
) -> None:
    root = two_nodes(tmp_path, lower, 0)
    app = box.add(
        pod("hostnic"),
        "app",
        millicores=1000,
        limit=1000,
        annotations={nic.NICS_ANNOTATION: lower.name},
    )
    result = box.hook(app, args=["--sysfs", str(root), "--reserved-cpus", "2"])
    assert result.returncode == 0, result.stderr
    [locality] = records(result, "nic-locality")
    assert (locality["HONOURED"], locality["NIC_NUMA"]) == ("honoured", "0")
    assert f"{lower.name} ({lower.parent_bus}/{lower.parent_dev}, NUMA 0)" in locality["NICS"]
    assert box.affinity(app) == "0"
