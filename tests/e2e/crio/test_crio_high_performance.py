"""CRI-O's own high-performance annotations next to our pinning, through a runtime handler that
allows them (what a RuntimeClass for latency-sensitive pods does on such nodes).

CRI-O acts on ``cpu-quota.crio.io`` and ``cpu-load-balancing.crio.io`` at StartContainer, for
Guaranteed containers with whole CPUs - the containers we consider for exclusive CPUs - on the
cpuset of the spec, which on the NRI path already carries our adjustment.  Where the two
could disagree - CRI-O lifting the CFS quota of a container we put in the shared pool - we
refuse the container, so they never do (docs/cri-o.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import host
from harness.cri import CRIError
from harness.crio import Crio
from harness.k8s import ContainerSpec, PodSpec
from harness.runc import hook_program

from e2e.crio.hooksd import hook_files
from e2e.daemon import Daemon, check_agreement

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
HANDLER = "high-performance"
ALLOWED = ["cpu-quota.crio.io", "cpu-load-balancing.crio.io"]
LATENCY = {"cpu-quota.crio.io": "disable", "cpu-load-balancing.crio.io": "disable"}


def with_handler(instance: Crio) -> Crio:
    """A second runtime handler: runc as the default one, plus the allowed annotations."""
    runc = dict(instance.config()["crio"]["runtime"]["runtimes"]["runc"])
    instance.config_overrides = {
        "crio": {"runtime": {"runtimes": {HANDLER: {**runc, "allowed_annotations": ALLOWED}}}}
    }
    return instance


@pytest.fixture
def node(make_crio: Callable[..., Crio], tmp_path: Path) -> Iterator[tuple[Crio, Daemon]]:
    instance = with_handler(make_crio(start=False))
    instance.start()
    daemon = Daemon(instance.nri_socket, tmp_path / "state")
    daemon.start()
    yield instance, daemon
    daemon.stop()


def test_latency_pod_gets_our_cpus_and_both_lift_the_quota(node: tuple[Crio, Daemon]) -> None:
    instance, daemon = node
    cri = instance.cri()
    spec = PodSpec("latency", qos="guaranteed", annotations=LATENCY, runtime_handler=HANDLER)
    pod_id = cri.run_pod(spec)
    since = instance.log_size()
    cid = cri.create_container(pod_id, ContainerSpec.guaranteed("rt", 1, command=FIRST_LINE))
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
    # CRI-O's hooks ran on the spec's cpuset, which NRI had already set to our CPU.
    instance.wait_log(f'Disable cpu cfs quota for container \\"{cid}', since=since)
    path = cri.cgroup_path(cid)
    assert host.read_cgroup(path, "cpu.cfs_quota_us", "cpu") == "-1"  # ours and CRI-O's
    pod_cgroup = path.rsplit("/", 1)[0]
    assert host.read_cgroup(pod_cgroup, "cpu.cfs_quota_us", "cpu") == "-1"  # CRI-O's, pod-wide
    assert host.read_cgroup(path, "cpuset.sched_load_balance") == "0"  # CRI-O's, cgroup v1
    assert cri.inspect(cid).spec["linux"]["resources"]["cpu"]["cpus"] == "1"
    assert check_agreement(daemon, cri) == {"rt": "1"}


def test_a_shared_container_may_not_lose_its_quota(node: tuple[Crio, Daemon]) -> None:
    """Opted out of exclusive CPUs, but asking CRI-O to lift its quota: refused by us, with a
    message that says why - CRI-O would otherwise let it take the whole shared pool."""
    instance, daemon = node
    cri = instance.cri()
    shared = cri.run("shared", [ContainerSpec("s", cpu_request_milli=250, memory="32Mi")])
    annotations = {**LATENCY, "exclusive-cpus.nri-cpuplugin.io": "false"}
    spec = PodSpec("greedy", qos="guaranteed", annotations=annotations, runtime_handler=HANDLER)
    pod_id = cri.run_pod(spec)
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, ContainerSpec.guaranteed("g", 1))
    message = str(err.value)
    assert "cpu-quota.crio.io=disable" in message and "shared pool" in message, message
    assert daemon.records("refuse")
    assert cri.containers(pod_id) == []
    # Without the quota annotation the same opted-out container shares, quota kept.
    plain = PodSpec(
        "plain", qos="guaranteed", runtime_handler=HANDLER,
        annotations={"exclusive-cpus.nri-cpuplugin.io": "false"},
    )  # fmt: skip
    cid = cri.create_container(cri.run_pod(plain), ContainerSpec.guaranteed("p", 1))
    cri.start(cid)
    assert host.read_cgroup(cri.cgroup_path(cid), "cpu.cfs_quota_us", "cpu") == "100000"
    assert check_agreement(daemon, cri) == {"s": "0-1", "p": "0-1"}
    assert shared


def test_the_hook_refuses_the_same_way(make_crio: Callable[..., Crio], tmp_path: Path) -> None:
    instance = with_handler(make_crio(start=False, nri=False))
    program = hook_program(tmp_path / "bin")
    for name, doc in hook_files(program, tmp_path / "state").items():
        instance.install_hook(name, doc)
    instance.start()
    cri = instance.cri()
    annotations = {**LATENCY, "exclusive-cpus.nri-cpuplugin.io": "false"}
    spec = PodSpec("greedy", qos="guaranteed", annotations=annotations, runtime_handler=HANDLER)
    with pytest.raises(CRIError, match=r"cpu-quota\.crio\.io=disable"):
        cri.create_container(cri.run_pod(spec), ContainerSpec.guaranteed("g", 1))
    latency = PodSpec("latency", qos="guaranteed", annotations=LATENCY, runtime_handler=HANDLER)
    cid = cri.create_container(
        cri.run_pod(latency), ContainerSpec.guaranteed("rt", 1, command=FIRST_LINE)
    )
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
    # Our hook lifted the quota at createRuntime, CRI-O again at StartContainer: they agree.
    instance.wait_log(f'Disable cpu cfs quota for container \\"{cid}')
    assert host.read_cgroup(cri.cgroup_path(cid), "cpu.cfs_quota_us", "cpu") == "-1"
