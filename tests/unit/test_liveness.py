"""Container liveness from cgroups: path conversion, and a FAKE cgroup v1 tree (plain files
named like the kernel's, since real cgroups cannot be made up)."""

from __future__ import annotations

import pytest

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.liveness import Liveness, cgroup_path, pinned_cpus


@pytest.mark.parametrize(
    ("runtime_path", "expected"),
    [
        ("/kubepods/pod1/abc", "/kubepods/pod1/abc"),
        (
            "kubepods-burstable-pod1.slice:cri-containerd:abc",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/"
            "cri-containerd-abc.scope",
        ),
        ("kubepods-pod2.slice:crio:def", "/kubepods.slice/kubepods-pod2.slice/crio-def.scope"),
        ("-.slice:libpod:x", "/libpod-x.scope"),
    ],
)
def test_cgroup_path_of_both_drivers(runtime_path, expected):
    assert cgroup_path(runtime_path) == expected


def test_fake_v1_tree_alive_ended_and_unknown(tmp_path):
    cpuset = tmp_path / "cpuset"
    (cpuset / "kubepods/pod1/running").mkdir(parents=True)
    (cpuset / "kubepods/pod1/exited").mkdir(parents=True)
    (cpuset / "cpuset.cpus").write_text("0-1\n")
    (cpuset / "kubepods/pod1/running/cgroup.procs").write_text("4242\n")
    (cpuset / "kubepods/pod1/exited/cgroup.procs").write_text("")
    live = Liveness(str(tmp_path))
    assert live.alive("/kubepods/pod1/running") is True
    assert live.alive("/kubepods/pod1/exited") is False
    assert live.alive("/kubepods/pod1/removed") is False
    assert live.alive("") is None  # nothing recorded: cannot tell
    assert live.alive("/kubepods/../etc") is None  # refused, not guessed
    assert Liveness(str(tmp_path / "nowhere")).alive("/kubepods/pod1/running") is None


def fake_container(root, path: str, cpus: str, shares: int, running: bool = True) -> None:
    d = root / "cpuset" / path.strip("/")
    d.mkdir(parents=True)
    (d / "cpuset.cpus").write_text(cpus + "\n")
    (d / "cgroup.procs").write_text("4242\n" if running else "")
    c = root / "cpu" / path.strip("/")
    c.mkdir(parents=True)
    (c / "cpu.shares").write_text(f"{shares}\n")


@pytest.mark.parametrize("top", ["", "/node-slice"])
def test_pinned_cpus_look_like_exclusive_assignments(tmp_path, top):
    for hierarchy in ("cpuset", "cpu"):
        (tmp_path / hierarchy).mkdir()
    (tmp_path / "cpuset/cpuset.cpus").write_text("0-7\n")
    (tmp_path / "cpu/cpu.cfs_quota_us").write_text("-1\n")
    fake_container(tmp_path, f"{top}/kubepods/podA/pause", "0-7", 2)
    fake_container(tmp_path, f"{top}/kubepods/podA/db", "2-3", 2048)  # 2 CPUs, on 2 CPUs
    fake_container(tmp_path, f"{top}/kubepods/podB/app", "0-1,4-7", 2048)  # on the shared pool
    fake_container(tmp_path, f"{top}/kubepods/podB/half", "5", 512)  # 0.5 CPU: never exclusive
    fake_container(tmp_path, f"{top}/kubepods/podF/all", "0-7", 8192)  # every CPU: nothing said
    fake_container(tmp_path, f"{top}/kubepods/burstable/podC/web", "6", 1024)  # not guaranteed
    fake_container(tmp_path, f"{top}/kubepods/podE/gone", "4", 1024, running=False)
    fake_container(tmp_path, "/system.slice/other", "1", 1024)  # not a pod
    assert pinned_cpus(str(tmp_path)) == CPUSet.parse("2-3")
    assert pinned_cpus(str(tmp_path / "nowhere")) == CPUSet()
