"""cgroupfs writers on a FAKE cgroup v2 tree (plain files in a temp directory).

This machine runs cgroup v1 (its cpuset controller cannot be enabled on the unified mount), so
v2 is exercised on a generated look-alike: a directory tree with the files a v2 cpuset cgroup
has.  A plain file cannot compute ``cpuset.cpus.effective`` the way the kernel does, so each
test seeds the effective values the kernel would report; what is checked is our side of the
contract - which files are written, in which order, that the effective value is read back and
a mismatch rolls everything back, and that nothing outside the tree is ever touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fake_cgroup_v2 import FakeV2

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware import cgroup_writes, cgroupfs
from nri_cpuplugin.hardware.cgroup_writes import Transaction
from nri_cpuplugin.hardware.cgroupfs import CgroupError

C = CPUSet.parse


@pytest.fixture
def fake(tmp_path: Path) -> FakeV2:
    return FakeV2(tmp_path / "fake-cgroup2")


def test_detects_fake_v2_tree(fake: FakeV2) -> None:
    layout = cgroupfs.detect(str(fake.root))
    assert layout.version == cgroupfs.V2
    assert layout.cpuset_root == layout.cpu_root == os.path.realpath(fake.root)


def test_parse_proc_cgroup_v2_line() -> None:
    layout = cgroupfs.Layout(cgroupfs.V2, "/x", "/x")
    got = cgroupfs.parse_proc_cgroup("0::/kubepods.slice/crio-abc.scope/container\n", layout)
    assert got == cgroupfs.ContainerCgroups(
        "/kubepods.slice/crio-abc.scope/container", "/kubepods.slice/crio-abc.scope/container"
    )
    with pytest.raises(CgroupError, match="no cgroup v2 line"):
        cgroupfs.parse_proc_cgroup("7:cpuset:/a\n", layout)


def test_writes_leaf_cpus_and_mems_and_reads_effective_back(fake: FakeV2) -> None:
    fake.mk("kubepods")
    fake.mk("kubepods/pod1")
    fake.mk("kubepods/pod1/ctr", effective="2", mems_effective="1")
    with fake.fs() as fs, Transaction(fs) as tx:
        assert cgroup_writes.set_cpuset(tx, "/kubepods/pod1/ctr", C("2"), C("1"))
        names = [(path, name) for _, path, name, _ in tx.done]
    assert fake.read("kubepods/pod1/ctr", "cpuset.cpus") == "2"
    assert fake.read("kubepods/pod1/ctr", "cpuset.mems") == "1"
    # Empty ancestors inherit everything: never written.  Memory nodes before CPUs.
    assert names == [("/kubepods/pod1/ctr", "cpuset.mems"), ("/kubepods/pod1/ctr", "cpuset.cpus")]


def test_memory_nodes_from_the_parent_for_a_container_that_was_exclusive(fake: FakeV2) -> None:
    """Exclusive on NUMA node 1 until now (crun's nested ``container`` cgroup below it too):
    back in the shared pool, the container may use every node its pod cgroup may."""
    fake.mk("kubepods")
    fake.mk("kubepods/pod1", mems_effective="0-1")
    fake.mk("kubepods/pod1/ctr", cpus="2", mems="1", effective="0-3", mems_effective="0-1")
    fake.mk("kubepods/pod1/ctr/container", mems="1", effective="0-3", mems_effective="0-1")
    with fake.fs() as fs, Transaction(fs) as tx:
        assert cgroup_writes.set_cpuset(tx, "/kubepods/pod1/ctr", C("0-3"), mems_from_parent=True)
    for path in ("kubepods/pod1/ctr", "kubepods/pod1/ctr/container"):
        assert fake.read(path, "cpuset.mems") == "0-1"
    assert fake.read("kubepods/pod1/ctr", "cpuset.cpus") == "0-3"
    # Without it, memory nodes are left as they are.
    fake.mk("kubepods/pod1/other", cpus="2", mems="1", effective="0-3")
    with fake.fs() as fs, Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, "/kubepods/pod1/other", C("0-3"))
    assert fake.read("kubepods/pod1/other", "cpuset.mems") == "1"


def test_effective_mismatch_fails_and_rolls_back(fake: FakeV2) -> None:
    fake.mk("kubepods", cpus="0-1")
    # The fake's effective value stays 0-1: what the kernel reports when no ancestor further
    # up offers CPU 3 and it falls back to the parent's set.
    fake.mk("kubepods/ctr", cpus="0-1", effective="0-1")
    with fake.fs() as fs, pytest.raises(CgroupError, match="kernel applied"), Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, "/kubepods/ctr", C("3"))
    assert fake.read("kubepods", "cpuset.cpus") == "0-1"  # was grown to 0-1,3, then restored
    assert fake.read("kubepods/ctr", "cpuset.cpus") == "0-1"


def test_ancestors_with_explicit_cpus_grow_top_down(fake: FakeV2) -> None:
    fake.mk("kubepods", cpus="0")
    fake.mk("kubepods/burstable")  # empty: inherits, left alone
    fake.mk("kubepods/burstable/pod", cpus="0")
    fake.mk("kubepods/burstable/pod/ctr", cpus="0", effective="2")
    with fake.fs() as fs, Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, "/kubepods/burstable/pod/ctr", C("2"))
        order = [path for _, path, _, _ in tx.done]
    assert order == ["/kubepods", "/kubepods/burstable/pod", "/kubepods/burstable/pod/ctr"]
    assert fake.read("kubepods", "cpuset.cpus") == "0,2"
    assert fake.read("kubepods/burstable", "cpuset.cpus") == ""
    assert fake.read("kubepods/burstable/pod", "cpuset.cpus") == "0,2"
    assert fake.read("kubepods/burstable/pod/ctr", "cpuset.cpus") == "2"


def test_nested_cgroups_below_the_container_follow_it_bottom_up(fake: FakeV2) -> None:
    fake.mk("kubepods/pod/ctr", cpus="0-3", effective="1")
    fake.mk("kubepods/pod/ctr/container", cpus="0-3", effective="1")  # crun's sub-cgroup
    fake.mk("kubepods/pod/ctr/inherits")  # empty: inherits the container's set
    with fake.fs() as fs, Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, "/kubepods/pod/ctr", C("1"))
        order = [path for _, path, _, _ in tx.done]
    assert order == ["/kubepods/pod/ctr/container", "/kubepods/pod/ctr"]
    assert fake.read("kubepods/pod/ctr/inherits", "cpuset.cpus") == ""


def test_lift_quota_keeps_the_period_and_rolls_back(fake: FakeV2) -> None:
    fake.mk("kubepods/pod/ctr", cpu_max="150000 50000")
    with fake.fs() as fs:
        tx = Transaction(fs)
        assert cgroup_writes.lift_quota(tx, "/kubepods/pod/ctr")
        assert not cgroup_writes.lift_quota(tx, "/kubepods/pod/ctr")  # already unlimited
        assert fake.read("kubepods/pod/ctr", "cpu.max") == "max 50000"
        assert tx.rollback() == []
    assert fake.read("kubepods/pod/ctr", "cpu.max") == "150000 50000"


def test_failed_write_rolls_back_earlier_writes(fake: FakeV2) -> None:
    fake.mk("kubepods/a", cpus="0-3", effective="0")
    broken = fake.mk("kubepods/b", cpus="0-3", effective="0")
    (broken / "cpuset.cpus").unlink()
    (broken / "cpuset.cpus").mkdir()  # any open for writing now fails (EISDIR)
    with fake.fs() as fs:
        tx = Transaction(fs)
        with pytest.raises(CgroupError), tx:
            cgroup_writes.set_cpuset(tx, "/kubepods/a", C("0"))
            cgroup_writes.set_cpuset(tx, "/kubepods/b", C("0"))
    assert fake.read("kubepods/a", "cpuset.cpus") == "0-3"
    assert tx.rollback_errors == []


def test_populated_and_cpus_use_v2_files(fake: FakeV2) -> None:
    fake.mk("kubepods/live", effective="1-2")
    fake.mk("kubepods/dead", populated=False)
    with fake.fs() as fs:
        assert fs.populated("/kubepods/live")
        assert not fs.populated("/kubepods/dead")
        assert fs.cpus("/kubepods/live") == C("1-2")
        assert not fs.exists("cpuset", "/kubepods/gone")


# --- confinement -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/kubepods/../../etc",
        "/kubepods/./x",
        "kubepods/relative",
        "/kubepods/nul\0byte",
        "/" + "a" * 300,
        "/a" * 2100,
    ],
    ids=["dotdot", "dot", "relative", "nul", "long-component", "long-path"],
)
def test_hostile_paths_are_refused_before_any_io(fake: FakeV2, path: str) -> None:
    with fake.fs() as fs:
        tx = Transaction(fs)
        with pytest.raises(CgroupError):
            cgroup_writes.set_cpuset(tx, path, C("1"))
        assert tx.done == []


def test_symlink_out_of_the_tree_is_never_followed(fake: FakeV2, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cpuset.cpus").write_text("untouched\n")
    (outside / "cpuset.cpus.effective").write_text("1\n")
    fake.mk("kubepods")
    (fake.root / "kubepods" / "evil").symlink_to(outside)
    with fake.fs() as fs:
        with pytest.raises(CgroupError, match=r"symbolic link|not a directory"):
            cgroup_writes.set_cpuset(Transaction(fs), "/kubepods/evil", C("1"))
        assert not fs.exists("cpuset", "/kubepods/evil")
    assert (outside / "cpuset.cpus").read_text() == "untouched\n"


def test_symlinked_file_is_never_followed(fake: FakeV2, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("untouched\n")
    d = fake.mk("kubepods/ctr", cpus="0-3", effective="1")
    (d / "cpuset.cpus").unlink()
    (d / "cpuset.cpus").symlink_to(target)
    with fake.fs() as fs, pytest.raises(CgroupError):
        cgroup_writes.set_cpuset(Transaction(fs), "/kubepods/ctr", C("1"))
    assert target.read_text() == "untouched\n"


def test_root_cgroup_and_empty_sets_are_refused(fake: FakeV2) -> None:
    with fake.fs() as fs:
        with pytest.raises(CgroupError, match="root cgroup"):
            cgroup_writes.set_cpuset(Transaction(fs), "/", C("1"))
        fake.mk("kubepods/ctr")
        with pytest.raises(CgroupError, match="empty cpuset"):
            cgroup_writes.set_cpuset(Transaction(fs), "/kubepods/ctr", CPUSet())


def test_detect_refuses_a_root_without_cpuset(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="no cpuset controller"):
        cgroupfs.detect(str(tmp_path))


# --- moving the shared pool (cpusets.move) -----------------------------------------------------


def test_move_writes_a_leaf_once_and_checks_what_the_kernel_applied(fake: FakeV2) -> None:
    from nri_cpuplugin.hardware import cpusets

    fake.mk("kubepods")
    fake.mk("kubepods/pod1")
    fake.mk("kubepods/pod1/ctr", cpus="0-3", effective="0,2-3")  # what the kernel would apply
    layout = cgroupfs.detect(str(fake.root))
    applied = cpusets.move(layout, [cpusets.Target("a" * 64, "/kubepods/pod1/ctr", C("0,2-3"))])
    assert applied.failed == [] and applied.errors == []
    assert fake.read("kubepods/pod1/ctr", "cpuset.cpus") == "0,2-3"


def test_move_reports_a_set_the_kernel_did_not_apply(fake: FakeV2) -> None:
    """An ancestor that does not offer the CPUs: v2 accepts the write and applies less.  The
    general path finds that out too and restores the old value: the container is reported
    as failed (the daemon then leaves it to the runtime)."""
    from nri_cpuplugin.hardware import cpusets

    fake.mk("kubepods", cpus="0-1")
    fake.mk("kubepods/ctr", cpus="0-1", effective="0-1")
    layout = cgroupfs.detect(str(fake.root))
    applied = cpusets.move(layout, [cpusets.Target("b" * 64, "/kubepods/ctr", C("3"))])
    assert applied.failed == ["b" * 64]
    assert "kernel applied" in applied.errors[0]
    assert fake.read("kubepods/ctr", "cpuset.cpus") == "0-1"
