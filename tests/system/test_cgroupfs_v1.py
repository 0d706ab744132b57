"""cgroupfs writers against this machine's real cgroup v1 cpuset and cpu hierarchies.

Each test works in a private top cgroup with ``sleep`` processes in it (removed afterwards,
processes by pid).  v1 enforces its rules at write time (child ⊆ parent, no shrinking a parent
below a child), so a wrong write order fails here with the kernel's own errno.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, sandbox

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware import cgroup_writes, cgroupfs
from nri_cpuplugin.hardware.cgroup_writes import Transaction
from nri_cpuplugin.hardware.cgroupfs import CgroupError, CgroupFS

C = CPUSet.parse
LAST = str(host.online_cpus()[-1])


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        yield fake_node


@pytest.fixture
def fs() -> Iterator[CgroupFS]:
    layout = cgroupfs.detect()
    if layout.version != cgroupfs.V1:
        pytest.fail(f"this test needs cgroup v1 cpusets; the host has v{layout.version}")
    with CgroupFS(layout) as opened:
        yield opened


def _write(d: Path, name: str, value: str) -> None:
    (d / name).write_text(value)


def _read(d: Path, name: str) -> str:
    return (d / name).read_text().strip()


def _spawn_in(box: CgroupSandbox, cgroup: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "100000"])
    box._procs[f"extra-{proc.pid}"] = proc  # killed by the sandbox's teardown
    _write(box.cpuset_dir(cgroup), "cgroup.procs", str(proc.pid))
    return proc


def test_parent_grows_before_the_child(box: CgroupSandbox, fs: CgroupFS) -> None:
    pod, ctr = f"{box.top}/kubepods/pod1", f"{box.top}/kubepods/pod1/ctr"
    box.make_cgroup(ctr)
    proc = _spawn_in(box, ctr)
    # Narrow the pod to CPU 0 (children first, as v1 demands), then ask for the last CPU.
    _write(box.cpuset_dir(ctr), "cpuset.cpus", "0")
    _write(box.cpuset_dir(pod), "cpuset.cpus", "0")
    with Transaction(fs) as tx:
        assert cgroup_writes.set_cpuset(tx, ctr, C(LAST))
    assert _read(box.cpuset_dir(pod), "cpuset.cpus") == str(C("0") | C(LAST))
    assert _read(box.cpuset_dir(ctr), "cpuset.cpus") == LAST
    assert host.cpus_allowed_list(proc.pid) == LAST


def test_nested_children_shrink_before_the_container(box: CgroupSandbox, fs: CgroupFS) -> None:
    ctr = f"{box.top}/kubepods/pod2/ctr"
    nested = f"{ctr}/inner"
    box.make_cgroup(nested)
    proc = _spawn_in(box, nested)
    # Writing the container first would fail with EBUSY (a child would no longer fit).
    with Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, ctr, C(LAST))
        order = [path for _, path, _, _ in tx.done]
    assert order == [nested, ctr]
    assert _read(box.cpuset_dir(nested), "cpuset.cpus") == LAST
    assert host.cpus_allowed_list(proc.pid) == LAST
    # And back: the container grows first, then its child.
    with Transaction(fs) as tx:
        cgroup_writes.set_cpuset(tx, ctr, C("0-" + LAST))
    assert host.cpus_allowed_list(proc.pid) == f"0-{LAST}"


def test_kernel_refusal_rolls_back_earlier_writes(box: CgroupSandbox, fs: CgroupFS) -> None:
    a, b = f"{box.top}/kubepods/pa/a", f"{box.top}/kubepods/pb/b"
    box.make_cgroup(a)
    box.make_cgroup(b)
    _spawn_in(box, a)
    before = _read(box.cpuset_dir(a), "cpuset.cpus")
    offline = str(max(host.online_cpus()) + 64)  # no such CPU: the kernel says EINVAL/EACCES
    tx = Transaction(fs)
    with pytest.raises(CgroupError, match="writing") as err, tx:
        cgroup_writes.set_cpuset(tx, a, C("0"))
        cgroup_writes.set_cpuset(tx, b, C(offline))
    assert "cpuset.cpus" in str(err.value)
    assert _read(box.cpuset_dir(a), "cpuset.cpus") == before
    assert tx.rollback_errors == []


def test_populated_looks_below_the_container(box: CgroupSandbox, fs: CgroupFS) -> None:
    ctr = f"{box.top}/kubepods/pod3/ctr"
    box.make_cgroup(f"{ctr}/inner")
    assert not fs.populated(ctr)
    _spawn_in(box, f"{ctr}/inner")
    assert fs.populated(ctr)


def test_lift_quota_v1(box: CgroupSandbox, fs: CgroupFS) -> None:
    if box.cpu_root is None:
        pytest.fail("no v1 cpu hierarchy mounted")
    ctr = f"{box.top}/kubepods/pod4/ctr"
    box.make_cgroup(ctr)
    _write(box.cpu_dir(ctr), "cpu.cfs_quota_us", "50000")
    tx = Transaction(fs)
    assert cgroup_writes.lift_quota(tx, ctr)
    assert _read(box.cpu_dir(ctr), "cpu.cfs_quota_us") == "-1"
    assert tx.rollback() == []
    assert _read(box.cpu_dir(ctr), "cpu.cfs_quota_us") == "50000"


def test_read_proc_cgroup_of_a_process_in_a_container(box: CgroupSandbox) -> None:
    ctr = f"{box.top}/kubepods/pod5/ctr"
    box.make_cgroup(ctr)
    proc = _spawn_in(box, ctr)
    _write(box.cpu_dir(ctr), "cgroup.procs", str(proc.pid))
    got = cgroupfs.read_proc_cgroup(proc.pid, cgroupfs.detect())
    assert got == cgroupfs.ContainerCgroups(ctr, ctr)
    with pytest.raises(CgroupError, match="does not exist"):
        cgroupfs.read_proc_cgroup(2**22 + 1, cgroupfs.detect())


# --- moving the shared pool (cpusets.move) -----------------------------------------------------


def test_move_shrinks_and_grows_leaves_and_what_nests_below(box: CgroupSandbox) -> None:
    """Leaves take one write each; a container with a cgroup nested below it, or below a pod
    narrowed by hand, goes through the general path - and every task ends where it should."""
    from nri_cpuplugin.hardware import cpusets

    leaf = f"{box.top}/kubepods/burstable/pa/ctr"
    nested = f"{box.top}/kubepods/burstable/pb/ctr"
    narrowed_pod = f"{box.top}/kubepods/burstable/pc"
    narrowed = f"{narrowed_pod}/ctr"
    for path in (leaf, f"{nested}/inner", narrowed):
        box.make_cgroup(path)
    procs = {
        "leaf": _spawn_in(box, leaf),
        "nested": _spawn_in(box, f"{nested}/inner"),
        "narrowed": _spawn_in(box, narrowed),
    }
    # The narrowed pod lacks the last CPU: growing its container must grow the pod first.
    _write(box.cpuset_dir(narrowed), "cpuset.cpus", "0")
    _write(box.cpuset_dir(narrowed_pod), "cpuset.cpus", "0")
    layout = cgroupfs.detect()

    def move(cpus: str) -> cpusets.Applied:
        targets = [
            cpusets.Target(name * 8, path, C(cpus))
            for name, path in (("leaf", leaf), ("nested", nested), ("narrowed", narrowed))
        ]
        return cpusets.move(layout, targets)

    assert move(LAST) == cpusets.Applied([], [], {})
    assert {name: host.cpus_allowed_list(p.pid) for name, p in procs.items()} == {
        "leaf": LAST, "nested": LAST, "narrowed": LAST,
    }  # fmt: skip
    assert _read(box.cpuset_dir(narrowed_pod), "cpuset.cpus") == str(C("0") | C(LAST))
    everything = str(C(f"0-{LAST}"))
    assert move(everything) == cpusets.Applied([], [], {})
    assert {name: host.cpus_allowed_list(p.pid) for name, p in procs.items()} == {
        "leaf": everything, "nested": everything, "narrowed": everything,
    }  # fmt: skip


def test_move_stops_each_leaf_asking_for_a_scheduler_domain_once(box: CgroupSandbox) -> None:
    """The root balances every CPU, so a leaf's sched_load_balance changes nothing for the
    scheduler - but while it is set, each write of the leaf's CPUs rebuilds the kernel's
    scheduler domains.  The daemon clears it the first time it moves a container, and never
    again (it keeps the set of containers done)."""
    from nri_cpuplugin.hardware import cpusets

    assert _read(Path("/sys/fs/cgroup/cpuset"), "cpuset.sched_load_balance") == "1"
    leaf = f"{box.top}/kubepods/burstable/pe/ctr"
    box.make_cgroup(leaf)
    layout = cgroupfs.detect()
    target = cpusets.Target("e" * 64, leaf, C("0"))
    assert cpusets.move(layout, [target]) == cpusets.Applied([], [], {})
    assert _read(box.cpuset_dir(leaf), "cpuset.sched_load_balance") == "1"  # not asked to
    done: set[str] = set()
    assert cpusets.move(layout, [target], done) == cpusets.Applied([], [], {})
    assert _read(box.cpuset_dir(leaf), "cpuset.sched_load_balance") == "0"
    assert done == {"e" * 64} and _read(box.cpuset_dir(leaf), "cpuset.cpus") == "0"
    _write(box.cpuset_dir(leaf), "cpuset.sched_load_balance", "1")
    assert cpusets.move(layout, [target.evolve(cpus=C(f"0-{LAST}"))], done).failed == []
    assert _read(box.cpuset_dir(leaf), "cpuset.sched_load_balance") == "1"  # once only


def test_move_reports_a_container_whose_cgroup_is_gone(box: CgroupSandbox) -> None:
    from nri_cpuplugin.hardware import cpusets

    there = f"{box.top}/kubepods/pd/ctr"
    box.make_cgroup(there)
    targets = [
        cpusets.Target("gone" * 16, f"{box.top}/kubepods/pd/exited", C("0")),
        cpusets.Target("there" * 12, there, C("0")),
    ]
    applied = cpusets.move(cgroupfs.detect(), targets)
    assert applied.failed == ["gone" * 16]
    assert _read(box.cpuset_dir(there), "cpuset.cpus") == "0"


def test_move_through_kept_open_files(box: CgroupSandbox) -> None:
    """The daemon keeps each shared container's cgroup and cpuset.cpus open
    (hardware/cpuset_files.py).  A leaf is written through them; a container with a cgroup
    nested below it since goes through the general path (its children move too); a removed
    cgroup's write fails, is reported, and its descriptors are dropped."""
    from nri_cpuplugin.hardware import cpusets
    from nri_cpuplugin.hardware.cpuset_files import OpenCpusets

    leaf, nested, gone = (f"{box.top}/kubepods/burstable/p{n}/ctr" for n in "fgh")
    for path in (leaf, nested, gone):
        box.make_cgroup(path)
    procs = {"leaf": _spawn_in(box, leaf), "nested": _spawn_in(box, nested)}
    layout = cgroupfs.detect()
    files = OpenCpusets()
    ids = {"leaf": "f" * 64, "nested": "g" * 64, "gone": "h" * 64}
    paths = {"leaf": leaf, "nested": nested, "gone": gone}

    def move(cpus: str, *names: str) -> cpusets.Applied:
        targets = [cpusets.Target(ids[n], paths[n], C(cpus)) for n in names]
        return cpusets.move(layout, targets, files=files)

    assert move(LAST, "leaf", "nested", "gone") == cpusets.Applied([], [], {})
    assert len(files) == 3
    assert {name: host.cpus_allowed_list(p.pid) for name, p in procs.items()} == {
        "leaf": LAST, "nested": LAST,
    }  # fmt: skip
    # A cgroup appears below the second container, its process in it; the third one goes.
    box.make_cgroup(f"{nested}/inner")
    _write(box.cpuset_dir(f"{nested}/inner"), "cpuset.cpus", LAST)
    _write(box.cpuset_dir(f"{nested}/inner"), "cgroup.procs", str(procs["nested"].pid))
    box.cpuset_dir(gone).rmdir()
    everything = str(C(f"0-{LAST}"))
    applied = move(everything, "leaf", "nested", "gone")
    assert applied.failed == [ids["gone"]] and ids["gone"] not in files
    assert {name: host.cpus_allowed_list(p.pid) for name, p in procs.items()} == {
        "leaf": everything, "nested": everything,
    }  # fmt: skip
    assert move("0", "leaf") == cpusets.Applied([], [], {})
    assert _read(box.cpuset_dir(leaf), "cpuset.cpus") == "0"
    files.close()
    assert len(files) == 0


def test_a_nested_cgroup_refuses_a_kept_write_that_takes_its_cpus_and_the_general_path_moves_it(
    box: CgroupSandbox,
) -> None:
    """Taking CPUs away through a kept file is not checked for nested cgroups beforehand: the
    kernel refuses it (EBUSY) while a cgroup below still uses them, and the general path
    moves the subtree, bottom-up."""
    from nri_cpuplugin.hardware import cpusets
    from nri_cpuplugin.hardware.cpuset_files import OpenCpusets

    path = f"{box.top}/kubepods/burstable/pn/ctr"
    box.make_cgroup(path)
    proc = _spawn_in(box, path)
    layout = cgroupfs.detect()
    files = OpenCpusets()
    everything = str(C(f"0-{LAST}"))

    def move(cpus: str) -> cpusets.Applied:
        return cpusets.move(layout, [cpusets.Target("n" * 64, path, C(cpus))], files=files)

    assert move(everything) == cpusets.Applied([], [], {}) and len(files) == 1
    inner = box.cpuset_dir(f"{path}/inner")
    box.make_cgroup(f"{path}/inner")
    _write(inner, "cpuset.cpus", LAST)
    _write(inner, "cgroup.procs", str(proc.pid))
    assert move("0") == cpusets.Applied([], [], {})
    assert _read(inner, "cpuset.cpus") == "0" and _read(box.cpuset_dir(path), "cpuset.cpus") == "0"
    assert host.cpus_allowed_list(proc.pid) == "0"
    files.close()
