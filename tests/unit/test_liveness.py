"""Container liveness from cgroups: path conversion, and a FAKE cgroup v1 tree (plain files
named like the kernel's, since real cgroups cannot be made up)."""

from __future__ import annotations

import pytest

from nri_cpuplugin.hardware.liveness import Liveness, cgroup_path


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
