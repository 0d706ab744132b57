"""The CRI-O harness itself: a private CRI-O 1.36.3 runs kubelet-shaped pods with conmon and
runc, below its own top cgroup; restarts and crashes keep containers; a CRI-O that cannot
start fails with the reason from its log; teardown leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import crio as crio_harness
from harness import host
from harness.cri import BESTEFFORT, BURSTABLE, GUARANTEED, ContainerSpec, CRIClient, PodSpec
from harness.crio import Crio, HarnessError

REPORT_AND_SLEEP = (
    "grep Cpus_allowed_list /proc/self/status; grep cpuset /proc/self/cgroup; exec sleep infinity"
)


def test_runtime_answers_with_nri_and_private_paths(crio: Crio, crio_cri: CRIClient) -> None:
    version = crio_cri.version()
    assert (version["runtime_name"], version["runtime_version"]) == ("cri-o", "1.36.3")
    assert crio_cri.status()["RuntimeReady"] is True
    assert crio.nri_socket.is_socket() and crio.address.is_socket()
    for pinned in ("crio", "pinns", "copyimg"):
        binary = crio_harness.binaries(crio.lab) / pinned
        assert crio_harness._sha256(binary) == crio_harness.BINARIES[pinned]


def test_guaranteed_container_in_its_crio_cgroup_below_the_top(
    crio: Crio, crio_cri: CRIClient
) -> None:
    cri = crio_cri
    pod = PodSpec("guaranteed-pod", qos=GUARANTEED)
    pod_id = cri.run_pod(pod)
    cpu = str(host.online_cpus()[-1])
    cid = cri.create_container(
        pod_id, ContainerSpec.guaranteed("work", 1, command=REPORT_AND_SLEEP, cpuset_cpus=cpu)
    )
    cri.start(cid)
    lines = cri.wait_logs(cid, 2)
    assert lines[0] == f"Cpus_allowed_list:\t{cpu}"
    expected = f"{crio.top_cgroup}/kubepods/pod{pod.uid}/crio-{cid}"
    assert lines[1].endswith(f":cpuset:{expected}")
    pid, spec = cri.inspect(cid)
    assert spec["linux"]["cgroupsPath"] == expected
    assert host.read_cgroup(expected, "cpu.shares") == "1024"
    assert host.read_cgroup(expected, "cpu.cfs_quota_us") == "100000"
    # kubelet asked -997; the runc wrapper raised it to what this host lets runc set.
    assert spec["process"]["oomScoreAdj"] == -997
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "0"
    # conmon stays in CRI-O's own cgroups here; teardown finds it by the short directory on
    # its command line (its exit and attach paths).
    conmons = [p for p in host.pids() if b"conmon" in host.cmdline(p).split(b"\0")[0]]
    mine = [p for p in conmons if cid.encode() in host.cmdline(p)]
    assert mine and str(crio.short_dir).encode() in host.cmdline(mine[0])


@pytest.mark.parametrize(
    ("qos", "container", "parent"),
    [
        (GUARANTEED, ContainerSpec.guaranteed("c", 1), "kubepods/pod"),
        (
            BURSTABLE,
            ContainerSpec("c", cpu_request_milli=250, memory="32Mi"),
            "kubepods/burstable/pod",
        ),
        (BESTEFFORT, ContainerSpec("c"), "kubepods/besteffort/pod"),
    ],
    ids=[GUARANTEED, BURSTABLE, BESTEFFORT],
)
def test_qos_class_decides_the_cgroup_parent(
    crio: Crio, crio_cri: CRIClient, qos: str, container: ContainerSpec, parent: str
) -> None:
    running = crio_cri.run(PodSpec("qos-pod", qos=qos), [container])
    path = crio_cri.cgroup_path(running["c"])
    assert path.startswith(f"{crio.top_cgroup}/{parent}{running.spec.uid}/crio-")


def test_containers_survive_a_restart_and_a_crash(crio: Crio, crio_cri: CRIClient) -> None:
    cri = crio_cri
    running = cri.run("survivor", [ContainerSpec.guaranteed("work", 1)])
    pid = cri.inspect(running["work"]).pid
    started = host.start_time(pid)

    crio.restart()
    cri.reconnect()
    assert cri.state(running["work"]) == "CONTAINER_RUNNING"
    assert cri.inspect(running["work"]).pid == pid

    crio.kill()
    assert host.is_alive(pid, started)  # conmon keeps it
    crio.start()
    cri.reconnect()
    assert cri.state(running["work"]) == "CONTAINER_RUNNING"
    other = cri.create_container(running.id, ContainerSpec("more", command="echo hi"))
    cri.start(other)
    assert cri.wait_logs(other, 1) == ["hi"]


def test_a_crio_that_cannot_start_fails_with_its_reason(make_crio: Callable[..., Crio]) -> None:
    broken = make_crio(
        start=False, config_overrides={"crio": {"runtime": {"cgroup_manager": "no-such-manager"}}}
    )
    with pytest.raises(HarnessError) as err:
        broken.start(timeout=20)
    message = str(err.value)
    assert "exited with" in message and "no-such-manager" in message.splitlines()[0], message


@pytest.mark.parametrize("runtime_state", ["running", "killed"])
def test_teardown_leaves_no_cgroups_mounts_or_processes(
    make_crio: Callable[..., Crio], runtime_state: str
) -> None:
    instance = make_crio()
    cri = instance.cri()
    for qos in (GUARANTEED, BURSTABLE, BESTEFFORT):
        # One pod shares its PID namespace: CRI-O then runs an infra (pause) container too,
        # whose oom_score_adj -998 the runc wrapper must clamp.
        pod = PodSpec(f"{qos}-pod", qos=qos, share_process_namespace=qos == BURSTABLE)
        cri.start(cri.create_container(cri.run_pod(pod), "work"))
    owned = {p: host.start_time(p) for p in instance_processes(instance)}
    assert len(owned) >= 1 + 3 + 3  # CRI-O, conmon and a container per pod (+ the infra)
    assert host.mounts_under(instance.short_dir)  # pinned namespaces and shm
    if runtime_state == "killed":
        instance.kill()

    assert instance.teardown() == []

    assert not instance.dir.exists() and not instance.short_dir.exists()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert str(instance.short_dir) not in mountinfo and str(instance.dir) not in mountinfo
    top = instance.top_cgroup.lstrip("/")
    for hierarchy in {*host.cgroup_hierarchies().values(), *Path("/sys/fs/cgroup").iterdir()}:
        assert not (hierarchy / top).exists(), f"{hierarchy / top} left behind"
    assert [p for p, started in owned.items() if host.is_alive(p, started)] == []
    # Nothing of CRI-O's defaults outside the instance (paths it would use unconfigured).
    for default in ("/etc/crio", "/var/lib/crio", "/var/run/crio", "/var/lib/containers"):
        assert not Path(default).exists(), f"{default} was created"


def instance_processes(instance: Crio) -> list[int]:
    from harness.containerd import _instance_pids

    return _instance_pids(instance.dir, instance.short_dir, instance.top_cgroup)
