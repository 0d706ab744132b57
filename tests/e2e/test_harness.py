"""The e2e harness itself: real containerd 1.7, 2.1 and 2.3 run kubelet-shaped pods, the kernel
applies what CRI asked for, restarts keep containers, and teardown leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import host
from harness.containerd import Containerd
from harness.cri import (
    BESTEFFORT,
    BURSTABLE,
    GUARANTEED,
    ContainerSpec,
    CRIClient,
    PodSpec,
    memory_bytes,
    milli_to_quota,
    milli_to_shares,
    parse_cri_log,
    qos_class,
)

# Prints what the container sees of its CPUs and its cpuset cgroup, then idles.
REPORT_AND_SLEEP = (
    "grep Cpus_allowed_list /proc/self/status; grep cpuset /proc/self/cgroup; exec sleep infinity"
)


def _last_cpu() -> str:
    return str(host.online_cpus()[-1])


# -- runtime, pods and containers ------------------------------------------------------------


def test_runtime_answers_and_nri_is_enabled(containerd: Containerd, cri: CRIClient) -> None:
    version = cri.version()
    assert version["runtime_name"] == "containerd"
    # Debian's builds say "1.7.24~ds1" / "2.1.9+unknown"; upstream's "v2.3.4".
    assert version["runtime_version"].removeprefix("v").startswith(containerd.release)
    assert cri.status()["RuntimeReady"] is True
    assert containerd.nri_socket.is_socket()
    assert containerd.plugin_path.is_dir() and containerd.plugin_config_path.is_dir()


def test_guaranteed_container_sees_requested_cpuset_in_private_cgroup(
    containerd: Containerd, cri: CRIClient
) -> None:
    pod = PodSpec("guaranteed-pod", qos=GUARANTEED)
    pod_id = cri.run_pod(pod)
    cpu = _last_cpu()
    # cpuset_cpus is what kubelet's static CPU manager would send for an exclusive CPU.
    cid = cri.create_container(
        pod_id, ContainerSpec.guaranteed("work", 1, command=REPORT_AND_SLEEP, cpuset_cpus=cpu)
    )
    cri.start(cid)

    lines = cri.wait_logs(cid, 2)
    assert lines[0] == f"Cpus_allowed_list:\t{cpu}"

    expected = f"{containerd.top_cgroup}/kubepods/pod{pod.uid}/{cid}"
    assert lines[1].endswith(f":cpuset:{expected}")  # the container's own /proc/self/cgroup
    pid, spec = cri.inspect(cid)
    assert spec["linux"]["cgroupsPath"] == expected
    assert host.proc_cgroups(pid)["cpuset"] == expected
    assert host.read_cgroup(expected, "cpuset.cpus") == cpu
    assert host.read_cgroup(expected, "cpu.shares") == "1024"
    assert host.read_cgroup(expected, "cpu.cfs_quota_us") == "100000"
    assert host.read_cgroup(expected, "memory.limit_in_bytes") == str(64 * 2**20)
    pod_labels = {p.id: p.labels for p in cri.pods()}[pod_id]
    assert pod_labels["io.kubernetes.pod.uid"] == pod.uid


@pytest.mark.parametrize(
    ("qos", "container", "shares", "quota"),
    [
        (GUARANTEED, ContainerSpec.guaranteed("c", 2), 2048, 200_000),
        (BURSTABLE, ContainerSpec("c", cpu_request_milli=250, cpu_limit_milli=500), 256, 50_000),
        (BESTEFFORT, ContainerSpec("c"), 2, -1),
    ],
    ids=[GUARANTEED, BURSTABLE, BESTEFFORT],
)
def test_qos_class_decides_cgroup_parent_and_kubelet_cpu_values(
    containerd: Containerd,
    cri: CRIClient,
    qos: str,
    container: ContainerSpec,
    shares: int,
    quota: int,
) -> None:
    running = cri.run(f"{qos}-pod", [container])
    assert running.spec.qos == qos  # derived from the container, as Kubernetes does
    qos_dir = "" if qos == GUARANTEED else f"/{qos}"
    path = f"{containerd.top_cgroup}/kubepods{qos_dir}/pod{running.spec.uid}/{running['c']}"
    assert cri.cgroup_path(running["c"]) == path
    assert host.read_cgroup(path, "cpu.shares") == str(shares)
    assert host.read_cgroup(path, "cpu.cfs_quota_us") == str(quota)
    assert host.read_cgroup(path, "cpu.cfs_period_us") == "100000"


def test_update_resources_reaches_the_live_cgroup(cri: CRIClient) -> None:
    cpus = host.online_cpus()
    first, last = str(cpus[0]), str(cpus[-1])
    pod_id = cri.run_pod("update-pod", qos=GUARANTEED)
    cid = cri.create_container(
        pod_id, ContainerSpec.guaranteed("work", 1, command=REPORT_AND_SLEEP, cpuset_cpus=last)
    )
    cri.start(cid)
    cri.wait_logs(cid, 2)
    pid, spec = cri.inspect(cid)
    path = spec["linux"]["cgroupsPath"]

    cri.update_resources(cid, cpuset_cpus=first)

    assert host.read_cgroup(path, "cpuset.cpus") == first
    assert host.cpus_allowed_list(pid) == first
    code, out, _ = cri.exec_sync(cid, "grep Cpus_allowed_list /proc/self/status")
    assert (code, out.strip()) == (0, f"Cpus_allowed_list:\t{first}")
    assert cri.inspect(cid).spec["linux"]["resources"]["cpu"]["cpus"] == first


def test_containers_survive_a_restart(containerd: Containerd, cri: CRIClient) -> None:
    pod_id = cri.run_pod("restart-pod", qos=GUARANTEED)
    cid = cri.create_container(pod_id, ContainerSpec.guaranteed("work", 1))
    cri.start(cid)
    pid = cri.inspect(cid).pid
    started = host.start_time(pid)

    containerd.restart()

    assert [(c.id, c.state) for c in cri.containers(pod_id)] == [(cid, "CONTAINER_RUNNING")]
    assert cri.inspect(cid).pid == pid and host.is_alive(pid, started)
    # The restarted runtime still runs new containers in the old pod.
    other = cri.create_container(pod_id, ContainerSpec.guaranteed("more", 1, command="echo hi"))
    cri.start(other)
    assert cri.wait_logs(other, 1) == ["hi"]


def test_containers_survive_a_crash(containerd: Containerd, cri: CRIClient) -> None:
    pod_id = cri.run_pod("crash-pod", qos=BESTEFFORT)
    cid = cri.create_container(pod_id, "work")
    cri.start(cid)
    pid = cri.inspect(cid).pid

    containerd.kill()
    assert host.is_alive(pid)  # the shim keeps the container running
    containerd.start()

    assert cri.state(cid) == "CONTAINER_RUNNING"
    assert cri.inspect(cid).pid == pid


def test_init_containers_run_to_completion_first(cri: CRIClient) -> None:
    containers = [
        ContainerSpec("setup", command="echo setup done", kind="init"),
        ContainerSpec.guaranteed("app", 1, command="echo app; exec sleep infinity"),
    ]
    running = cri.run("init-pod", containers)
    assert running.spec.qos == BURSTABLE  # the init container has no limits
    assert cri.state(running["setup"]) == "CONTAINER_EXITED"
    assert cri.logs(running["setup"]) == ["setup done"]
    assert cri.wait_logs(running["app"], 1) == ["app"]


# -- teardown --------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime_state", ["running", "killed"])
def test_teardown_leaves_no_cgroups_mounts_or_processes(
    make_containerd: Callable[..., Containerd], runtime_state: str
) -> None:
    """Also with containerd SIGKILLed first, so CRI cannot clean up and the harness must find
    shims and containers on its own."""
    ctrd = make_containerd()
    cri = ctrd.cri()
    for qos in (GUARANTEED, BURSTABLE, BESTEFFORT):
        # One pod shares its PID namespace: its pause process then outlives a killed shim
        # until PID 1 reaps the container, which teardown has to wait for.
        pod = PodSpec(f"{qos}-pod", qos=qos, share_process_namespace=qos == BURSTABLE)
        pod_id = cri.run_pod(pod)
        cri.start(cri.create_container(pod_id, "work"))
    container_pids = [cri.inspect(c.id).pid for c in cri.containers()]
    owned = {p: host.start_time(p) for p in [*ctrd.processes(), ctrd.pid]}
    assert len(owned) >= 1 + 3 + 3  # containerd, 3 containers, 3 pause (+ shims)
    assert set(container_pids) <= set(owned)
    assert host.mounts_under(ctrd.dir)  # rootfs overlays and shm exist before teardown
    shim_sockets = [
        path
        for pid in owned
        if b"containerd-shim" in host.cmdline(pid)
        for path in host.unix_socket_paths(pid)
        if host.is_under(path, ctrd.shim_socket_dir)  # /run/containerd/s before 2.3
    ]
    assert shim_sockets
    if runtime_state == "killed":
        ctrd.kill()

    assert ctrd.teardown() == []

    # Check the host directly rather than trusting the harness' own report.
    assert not ctrd.dir.exists()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert str(ctrd.dir) not in mountinfo
    top = ctrd.top_cgroup.lstrip("/")
    hierarchies = {*host.cgroup_hierarchies().values(), *Path("/sys/fs/cgroup").iterdir()}
    for hierarchy in hierarchies:
        assert not (hierarchy / top).exists(), f"{hierarchy / top} left behind"
    # SIGKILLed shims leave their sockets behind; teardown must remove them.
    assert [path for path in shim_sockets if Path(path).exists()] == []
    assert not ctrd.short_dir.exists()
    survivors = [p for p, started in owned.items() if host.is_alive(p, started)]
    assert survivors == []
    for pid in host.pids():
        argv = host.cmdline(pid)
        assert str(ctrd.dir).encode() not in argv, f"process {pid} still refers to {ctrd.dir}"
        if argv:
            try:
                paths = host.proc_cgroups(pid).values()
            except OSError:
                continue  # exited meanwhile
            assert not any(host.is_under(p, ctrd.top_cgroup) for p in paths), pid


# -- kubelet arithmetic (no runtime needed) --------------------------------------------------


def test_kubelet_cpu_conversions() -> None:
    assert milli_to_shares(0) == 2 and milli_to_shares(1) == 2
    assert milli_to_shares(250) == 256 and milli_to_shares(1000) == 1024
    assert milli_to_quota(None) == 0 and milli_to_quota(5) == 1000
    assert milli_to_quota(1500) == 150_000
    assert memory_bytes("64Mi") == 64 * 2**20 and memory_bytes("1G") == 10**9
    assert memory_bytes(123) == 123 and memory_bytes(None) is None


def test_qos_class_follows_kubernetes() -> None:
    assert qos_class([ContainerSpec.guaranteed("a", 1)]) == GUARANTEED
    assert qos_class([ContainerSpec("a", cpu_limit_milli=500)]) == BURSTABLE  # no memory
    assert qos_class([ContainerSpec("a")]) == BESTEFFORT
    assert qos_class([ContainerSpec.guaranteed("a", 1), ContainerSpec("b")]) == BURSTABLE
    pod = PodSpec.for_containers(
        "p",
        [
            ContainerSpec.guaranteed("a", 1, memory="1Gi"),
            ContainerSpec.guaranteed("b", 0.5, memory="1Gi"),
            ContainerSpec.guaranteed("init", 2, memory="1Gi", kind="init"),
        ],
    )
    # The init container runs alone, so the pod needs max(1 + 0.5, 2) CPUs and max(2, 1) Gi.
    assert (pod.qos, pod.cpu_request_milli, pod.cpu_limit_milli) == (GUARANTEED, 2000, 2000)
    assert pod.memory == 2 * 2**30


def test_cri_log_parsing() -> None:
    text = (
        "2026-01-01T00:00:00.000000001Z stdout F first\n"
        "2026-01-01T00:00:00.000000002Z stderr F oops\n"
        "2026-01-01T00:00:00.000000003Z stdout P sec\n"
        "2026-01-01T00:00:00.000000004Z stdout F ond\n"
        "2026-01-01T00:00:00.000000005Z stdout F \n"
    )
    assert parse_cri_log(text) == ["first", "second", ""]
    assert parse_cri_log(text, "stderr") == ["oops"]
    assert parse_cri_log(text, None) == ["first", "oops", "second", ""]
