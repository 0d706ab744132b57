"""Real CPU hotplug under real containerd 1.7.24 / 2.1.9 / 2.3.4, the daemon and running containers.

CPU 1 of this 2-CPU machine goes offline and comes back (``/sys/devices/system/cpu/cpu1/online``)
while an exclusive container is pinned to it and a shared container runs on CPU 0.  After each
step the state file, the live cgroups and the kernel's ``Cpus_allowed_list`` must agree:

* offline: the exclusive container has nowhere exclusive to go (CPU 0 is reserved): it is
  degraded, audited, and runs - in its own cgroup, not wherever cgroup v1 moved its tasks - on
  the shared CPU;
* online: CPU 1 returns to it; cgroup v1 did not give CPU 1 back to any cpuset, our updates do
  (the shared container then grows to both CPUs when the exclusive one stops).

Taking a CPU offline affects everything on the machine, so CPU 1 is back online before each
test returns, whatever happened (``cpu_offline`` restores it in ``finally``; a session-scoped
fixture and an atexit hook are the safety nets: e2e/cpu_hotplug.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from harness import host
from harness.k8s import ContainerSpec, PodSpec

from e2e.cpu_hotplug import check_hotpluggable, cpu_offline, restore_cpu
from e2e.daemon import check_agreement, wait_for


@pytest.fixture(scope="session", autouse=True)
def _cpu_restored_at_session_end() -> Iterator[None]:
    check_hotpluggable()
    yield
    restore_cpu()


def guaranteed(name: str) -> ContainerSpec:
    return ContainerSpec.guaranteed(name, 1)


def burstable(name: str) -> ContainerSpec:
    return ContainerSpec(name, cpu_request_milli=250, memory="32Mi")


def live(cri, cid: str) -> tuple[str, str, str]:
    """(cgroup cpuset.cpus, the process's cpuset cgroup, its Cpus_allowed_list)."""
    path = cri.cgroup_path(cid)
    pid = cri.inspect(cid).pid
    return (
        host.read_cgroup(path, "cpuset.cpus"),
        host.proc_cgroups(pid)["cpuset"],
        host.cpus_allowed_list(pid),
    )


def test_offline_degrades_and_online_gives_the_cpu_back(containerd, cri, daemon):
    shared = cri.run("shared", [burstable("s")])
    pinned = cri.run("pinned", [guaranteed("p")])
    s, p = shared["s"], pinned["p"]
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}
    p_cgroup = cri.cgroup_path(p)

    with cpu_offline():
        offline_at = time.monotonic()
        wait_for(
            "the state to show the exclusive container degraded",
            lambda: daemon.state()["assignments"].get(p, {}).get("lost") == "1",
        )
        state = daemon.state()
        assert state["assignments"][p]["cpus"] == "" and state["shared"] == "0"
        # Its processes run on the shared CPU, in its own cgroup (cgroup v1 had moved them to
        # the pod's cgroup when their cpuset lost its last CPU; the daemon put them back).
        wait_for(
            "the exclusive container to run on CPU 0 in its own cgroup",
            lambda: live(cri, p) == ("0", p_cgroup, "0"),
            timeout=5,
        )
        assert live(cri, s)[0::2] == ("0", "0")
        # ... and it says so (right away, or in one of its bounded re-checks).
        wait_for(
            "the repair of the evicted processes to be audited",
            lambda: any(r["CONTAINER_ID"] == p for r in daemon.new_records("cgroup-repair")),
            timeout=5,
        )
        [degraded] = daemon.new_records("degraded")
        assert degraded["CONTAINER_ID"] == p and degraded["LOST_CPUS"] == "1"
        report = daemon.status()
        assert [a["container_id"] for a in report["degraded"]] == [p]
        applied = daemon.new_records("hotplug-applied")[-1]
        assert float(applied["LATENCY_MS"]) < 1000
        assert time.monotonic() - offline_at < 10

    wait_for(
        "CPU 1 to return to the exclusive container",
        lambda: daemon.state()["assignments"].get(p, {}).get("cpus") == "1",
    )
    wait_for("its cgroup and processes to follow", lambda: live(cri, p) == ("1", p_cgroup, "1"))
    assert "lost" not in daemon.state()["assignments"][p]
    assert daemon.new_records("cpu-restored")
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}
    assert daemon.status()["degraded"] == []

    # cgroup v1 had taken CPU 1 from every ancestor of the shared container too: when the
    # exclusive container stops, the shared one must be able to grow back to both CPUs.
    cri.stop(p)
    wait_for("the shared container to get CPU 1 back", lambda: live(cri, s)[2] == "0-1")
    assert check_agreement(daemon, cri) == {"s": "0-1"}


def test_a_change_while_the_daemon_was_down_is_repaired_at_its_start(containerd, cri, daemon):
    shared = cri.run("shared", [burstable("s")])
    pinned = cri.run("pinned", [guaranteed("p")])
    s, p = shared["s"], pinned["p"]
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}
    p_cgroup = cri.cgroup_path(p)
    daemon.stop()
    with cpu_offline():
        # cgroup v1 empties p's cpuset and moves its process to the pod's cgroup; nobody
        # listens.  The restarted daemon finds a state from another online set: repaired in
        # place (never set aside), the cgroup fixed, the process put back.
        wait_for(
            "the kernel to evict p",
            lambda: host.proc_cgroups(cri.inspect(p).pid)["cpuset"] != p_cgroup,
        )
        daemon.start()
        assert daemon.new_records("state-repair") and not daemon.new_records("state-rebuild")
        state = daemon.state()
        assert state["assignments"][p]["lost"] == "1" and state["shared"] == "0"
        wait_for(
            "p to run in its own cgroup on CPU 0", lambda: live(cri, p) == ("0", p_cgroup, "0")
        )
        assert live(cri, s)[0::2] == ("0", "0")
    wait_for("CPU 1 to return to p", lambda: live(cri, p) == ("1", p_cgroup, "1"))
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}


def test_a_pod_made_while_the_cpu_was_offline_can_use_it_once_it_returns(containerd, cri, daemon):
    """cgroup v1 gives a returning CPU back to no cpuset, and a pod cgroup made while the CPU
    was offline holds only the CPUs online then.  A container created in it after the CPU
    returned must still start on it - exclusive, and shared on the regrown pool."""
    with cpu_offline():
        wait_for(
            "the daemon to follow CPU 1 going offline", lambda: daemon.state()["shared"] == "0"
        )
        late = cri.run_pod(PodSpec("late", qos="guaranteed"))
        shared_late = cri.run_pod(PodSpec("shared-late", qos="burstable"))
    wait_for("the daemon to follow CPU 1 coming back", lambda: daemon.state()["shared"] == "0-1")
    s = cri.create_container(shared_late, burstable("s"))
    cri.start(s)
    assert live(cri, s)[0::2] == ("0-1", "0-1")
    p = cri.create_container(late, guaranteed("p"))
    cri.start(p)
    assert live(cri, p)[0::2] == ("1", "1")
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}
