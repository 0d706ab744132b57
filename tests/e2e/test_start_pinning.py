"""``[nri] pin_at = "start"`` end to end, through real containerd 1.7.24, 2.1.9 and 2.3.4 and
runc (CPU 0 reserved and shared, CPU 1 exclusive): the daemon is never consulted at
CreateContainer, and every container is decided and written at its StartContainer, before its
first instruction."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import host
from harness.k8s import ContainerSpec, PodSpec

from e2e.daemon import Daemon, check_agreement, wait_for
from e2e.test_cpu_plugin import ALL, FIRST_LINE, burstable, guaranteed


@pytest.fixture
def daemon(containerd, tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text('[nri]\npin_at = "start"\n')
    process = Daemon(containerd.nri_socket, tmp_path / "state", config=config).start()
    yield process
    process.stop()


def test_an_earmarked_container_is_pinned_at_start_and_creation_asks_nobody(
    containerd, cri, daemon
):
    shared = [cri.run(f"s{i}", [burstable(f"w{i}")])[f"w{i}"] for i in range(4)]
    pids = [cri.inspect(cid).pid for cid in shared]
    spec = guaranteed("pinned", command=FIRST_LINE)
    pod_id = cri.run_pod(PodSpec.for_containers("exclusive", [spec]))
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 4  # moved at pod start
    cid = cri.create_container(pod_id, spec)
    assert cid not in daemon.state()["assignments"]  # not decided yet
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]  # its first instruction
    path = cri.cgroup_path(cid)
    assert host.read_cgroup(path, "cpuset.mems") == "0"
    assert host.read_cgroup(path, "cpu.cfs_quota_us", "cpu") == "-1"
    [allocate] = daemon.records("allocate")
    assert allocate["CPUS"] == "1" and "earmarked for its pod" in allocate["REASON"]
    check_agreement(daemon, cri)
    # Its stored spec names no cpuset (nobody was asked at creation): the next Synchronize
    # (a daemon restart here) carries it, and the decision stands.
    assert "cpus" not in cri.inspect(cid).spec["linux"]["resources"].get("cpu", {})
    daemon.stop()
    daemon.start()
    wait_for(
        "the runtime to apply the Synchronize reply",
        lambda: cri.inspect(cid).spec["linux"]["resources"]["cpu"].get("cpus") == "1",
    )
    assert host.cpus_allowed_list(cri.inspect(cid).pid) == "1"
    check_agreement(daemon, cri)
    cri.stop(cid)
    # Growing the pool back is no safety matter: when the stop's request outlives the daemon's
    # budget (a loaded machine) the growth is written after the answer.
    wait_for(
        "the shared containers back on every CPU",
        lambda: [host.cpus_allowed_list(pid) for pid in pids] == [ALL] * 4,
        timeout=30,
    )
    check_agreement(daemon, cri)


def test_without_an_earmark_the_shared_containers_move_before_it_starts(containerd, cri, daemon):
    noisy = cri.run("noisy", [burstable("burner")])
    pid = cri.inspect(noisy["burner"]).pid
    pod_id = cri.run_pod(PodSpec("no-resources", qos="guaranteed"))  # nothing to earmark
    cid = cri.create_container(pod_id, guaranteed("pinned", command=FIRST_LINE))
    assert host.cpus_allowed_list(pid) == ALL  # nobody asked us yet; nothing runs in it yet
    cri.start(cid)
    assert host.cpus_allowed_list(pid) == "0"
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
    check_agreement(daemon, cri)
    # No room left: its start is refused with the reason, and nothing is assigned.
    other = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
    refused = cri.create_container(other, ContainerSpec.guaranteed("x", 1))
    with pytest.raises(Exception, match="exclusive"):
        cri.start(refused)
    assert refused not in daemon.state()["assignments"]
    check_agreement(daemon, cri)
