"""hardware/cpuset_files.py on a look-alike cgroup v1 tree of plain files (the real kernel
files are tested in tests/system/test_cgroupfs_v1.py)."""

from __future__ import annotations

import errno
import os

import pytest

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware import cgroupfs, cpuset_files, cpusets
from nri_cpuplugin.hardware.cpuset_files import OpenCpusets, mount_type

C = CPUSet.parse


def on_the_kernels_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The look-alike tree's files treated as the kernel's (a cgroup v1 mount): a write
    replaces the value in place, and only growths are checked for nested cgroups."""
    monkeypatch.setattr(cpuset_files, "mount_type", lambda path: "cgroup")


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "cpuset"
    for cid in ("a", "b", "c"):
        d = root / "kubepods" / "pod1" / cid
        d.mkdir(parents=True)
        (d / "cpuset.cpus").write_text("0-47\n")
    return cgroupfs.Layout(cgroupfs.V1, str(root), None), root / "kubepods" / "pod1"


def test_writes_replace_the_value_and_reuse_the_open_file(tree):
    layout, pod = tree
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.write(fs, "a", "/kubepods/pod1/a", C("0,2-47"))
    (pod / "a" / "cpuset.cpus").rename(pod / "a" / "moved")  # the kept file, not the path
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.write(fs, "a", "/kubepods/pod1/a", C("0"))
    assert (pod / "a" / "moved").read_text() == "0\n"  # a shorter value leaves nothing behind


def test_a_cgroup_with_nested_cgroups_is_left_to_the_general_path(tree):
    layout, pod = tree
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.open(fs, "b", "/kubepods/pod1/b")
        (pod / "b" / "inner").mkdir()
        assert not files.write(fs, "b", "/kubepods/pod1/b", C("0"))
    assert (pod / "b" / "cpuset.cpus").read_text() == "0-47\n"


def test_a_failed_write_drops_the_entry_and_says_why(tree, monkeypatch):
    layout, _ = tree
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.open(fs, "c", "/kubepods/pod1/c")

        def refused(*args):
            raise OSError(19, "No such device")

        monkeypatch.setattr("os.pwrite", refused)
        with pytest.raises(cgroupfs.CgroupError, match=r"/kubepods/pod1/c/cpuset\.cpus.*removed"):
            files.write(fs, "c", "/kubepods/pod1/c", C("0"))
    assert "c" not in files and len(files) == 0


def test_limits_what_is_kept_and_never_keeps_cgroup_v2_files(tree):
    layout, _ = tree
    files = OpenCpusets(limit=1)
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.open(fs, "a", "/kubepods/pod1/a")
        assert not files.write(fs, "b", "/kubepods/pod1/b", C("0"))  # over the limit
        assert not files.open(fs, "missing", "/kubepods/pod1/missing")
        files.keep_only({"b"})
        assert len(files) == 0 and files.open(fs, "b", "/kubepods/pod1/b")
    v2 = cgroupfs.Layout(cgroupfs.V2, layout.cpuset_root, layout.cpuset_root)
    with cgroupfs.CgroupFS(v2) as fs:
        assert not OpenCpusets().open(fs, "a", "/kubepods/pod1/a")
    files.close()


def test_mount_type_reads_mountinfo(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    )
    assert mount_type("/sys/fs/cgroup/cpuset", str(mountinfo)) == "cgroup"
    assert mount_type("/sys/fs/cgroup", str(mountinfo)) == "tmpfs"
    assert mount_type("/elsewhere", str(mountinfo)) is None
    assert mount_type("/", str(tmp_path / "missing")) is None


def test_write_kept_writes_only_what_is_open_and_returns_the_rest(tree):
    layout, pod = tree
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.open(fs, "a", "/kubepods/pod1/a") and files.open(fs, "b", "/kubepods/pod1/b")
    (pod / "b" / "inner").mkdir()
    left = files.write_kept([("a", C("0")), ("b", C("0")), ("c", C("0"))])
    assert left == ["b", "c"]  # b has a cgroup nested below it, c's files are not kept
    assert (pod / "a" / "cpuset.cpus").read_text() == "0\n"
    assert (pod / "b" / "cpuset.cpus").read_text() == "0-47\n"


def test_taking_cpus_away_is_one_write_and_a_refusal_goes_to_the_general_path(tree, monkeypatch):
    """Only a write that adds CPUs checks for nested cgroups (cgroup v1 grows no child): the
    kernel refuses to take CPUs a nested cgroup still uses (EBUSY), and the write is left to
    the general path, the files still kept.  A write by the runtime in between makes the next
    one checked again."""
    layout, _ = tree
    on_the_kernels_files(monkeypatch)  # where a refusal comes from the kernel
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.write(fs, "a", "/kubepods/pod1/a", C("0-3"))
    checks = []
    real_fstat = os.fstat
    monkeypatch.setattr("os.fstat", lambda fd: checks.append(fd) or real_fstat(fd))
    assert files.write_kept([("a", C("0-1"))]) == [] and checks == []
    assert files.write_kept([("a", C("0-2"))]) == [] and len(checks) == 1  # adds CPU 2

    def refused(*args):
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr("os.pwrite", refused)
    assert files.write_kept([("a", C("0"))]) == ["a"] and "a" in files
    files.written_elsewhere("a")
    assert files.write_kept([("a", C("0"))]) == ["a"] and len(checks) == 2
    files.close()


def test_a_write_by_the_general_path_makes_the_next_kept_write_checked(tree, monkeypatch):
    """A target with memory nodes (or a quota) goes through cpusets.apply, not the kept file:
    what the file last wrote no longer says what is there."""
    layout, _ = tree
    on_the_kernels_files(monkeypatch)  # only growths are checked
    files = OpenCpusets()
    with cgroupfs.CgroupFS(layout) as fs:
        assert files.write(fs, "a", "/kubepods/pod1/a", C("0-3"))
    cpusets.move(layout, [cpusets.Target("a", "/kubepods/pod1/a", C("0-1"), C("0"))], None, files)
    checks = []
    real_fstat = os.fstat
    monkeypatch.setattr("os.fstat", lambda fd: checks.append(fd) or real_fstat(fd))
    # 0-2 adds CPU 2 to what the general path wrote (0-1), though not to what the file did.
    assert files.write_kept([("a", C("0-2"))]) == [] and len(checks) == 1
    files.close()
