"""The hook, in process, on a FAKE cgroup v2 tree, a fake /proc and a generated 48-CPU sysfs.

Same node and the same two containers as tests/unit/test_plugin.py's first test: the hook must
reach exactly the decision the NRI plugin reaches (db gets CPUs 1,25 on NUMA node 0, CFS quota
lifted; the shared container shrinks to 0,2-24,26-47), and write it as cgroup v2 files.
The fake's ``cpuset.cpus.effective`` files hold what the kernel would report (plain files
cannot compute it); a wrong one shows that the read-back catches it and rolls back.
"""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pytest
from fake_cgroup_v2 import FakeV2
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.topology import Topology
from nri_cpuplugin.core.workload import from_nri
from nri_cpuplugin.hardware import cgroupfs
from nri_cpuplugin.hook import containers, oci, topology_cache
from nri_cpuplugin.hook import entry as hook
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.storage.store import StateStore


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.sysfs, _ = build("xeon-e5-2680v3-2s", tmp_path)
        self.fake = FakeV2(tmp_path / "fake-cgroup2")
        self.proc = tmp_path / "fake-proc"
        self.bundles = tmp_path / "bundles"
        self.state_dir = tmp_path / "state"
        self.records: list[dict[str, str]] = []
        self.next_pid = 1000

    def container(
        self, cid: str, qos: str, milli: int, pod_uid: str, **extra: str
    ) -> tuple[int, str]:
        """A fake container: its cgroup, its process's /proc/<pid>/cgroup, its bundle."""
        parent = "kubepods" if qos == "guaranteed" else f"kubepods/{qos}"
        cgroup = f"/{parent}/pod{pod_uid}/{cid}"
        self.fake.mk(
            cgroup, effective="0-47", mems_effective="0-1", cpu_max=f"{milli * 100} 100000"
        )
        self.next_pid += 1
        (self.proc / str(self.next_pid)).mkdir(parents=True)
        (self.proc / str(self.next_pid) / "cgroup").write_text(f"0::{cgroup}\n")
        bundle = self.bundles / cid
        bundle.mkdir(parents=True)
        annotations = {
            "io.kubernetes.pod.uid": pod_uid,
            "io.kubernetes.pod.name": pod_uid.removeprefix("uid-"),
            "io.kubernetes.pod.namespace": "ns",
            "io.kubernetes.container.name": cid,
            **extra,
        }
        cpu = {"shares": max(2, milli * 1024 // 1000), "quota": milli * 100, "period": 100000}
        (bundle / "config.json").write_text(
            json.dumps({"annotations": annotations, "linux": {"resources": {"cpu": cpu}}})
        )
        return self.next_pid, cgroup

    def hook(self, cid: str, pid: int | None, stage: str = "createRuntime") -> tuple[int, str]:
        state = {
            "ociVersion": "1.0.2",
            "id": cid,
            "status": "creating",
            "bundle": str(self.bundles / cid),
        }
        if pid is not None:
            state["pid"] = pid
        settings = Settings(
            sysfs=str(self.sysfs), state_dir=str(self.state_dir), reserved_cpu_count=2
        )
        options = hook.Options(stage=stage, cgroup_root=str(self.fake.root), proc=str(self.proc))
        err = io.StringIO()
        code = hook.run(
            settings,
            options,
            io.BytesIO(json.dumps(state).encode()),
            err,
            Audit(self.records.append),
        )
        return code, err.getvalue()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_same_decision_as_the_nri_plugin_written_as_v2_files(node: Node) -> None:
    web_pid, web = node.container("nginx", "burstable", 500, "uid-web")
    assert node.hook("nginx", web_pid) == (0, "")
    assert node.fake.read(web, "cpuset.cpus") == "0-47"

    db_pid, db = node.container("postgres", "guaranteed", 2000, "uid-db")
    # What the kernel will report once the writes are done.
    (node.fake.root / db.strip("/") / "cpuset.cpus.effective").write_text("1,25\n")
    (node.fake.root / db.strip("/") / "cpuset.mems.effective").write_text("0\n")
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text("0,2-24,26-47\n")
    assert node.hook("postgres", db_pid) == (0, "")

    assert node.fake.read(db, "cpuset.cpus") == "1,25"  # as tests/unit/test_plugin.py
    assert node.fake.read(db, "cpuset.mems") == "0"
    assert node.fake.read(db, "cpu.max") == "max 100000"
    assert node.fake.read(web, "cpuset.cpus") == "0,2-24,26-47"
    # Fresh v2 ancestors inherit (empty cpuset.cpus): never written.
    assert node.fake.read("kubepods", "cpuset.cpus") == ""
    state = StateStore(node.state_dir).peek().state
    assert str(state.assignments["postgres"].cpus) == "1,25"
    allocate = next(r for r in node.records if r["ACTION"] == "allocate")
    assert allocate["CPUS"] == "1,25" and allocate["POD_NAME"] == "db"


def test_effective_mismatch_rolls_back_and_state_does_not_claim_it(node: Node) -> None:
    web_pid, web = node.container("nginx", "burstable", 500, "uid-web")
    assert node.hook("nginx", web_pid)[0] == 0
    db_pid, db = node.container("postgres", "guaranteed", 2000, "uid-db")
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text("0,2-24,26-47\n")
    (node.fake.root / db.strip("/") / "cpuset.mems.effective").write_text("0\n")
    # cpuset.cpus.effective stays 0-47: the kernel did not apply 1,25.
    code, err = node.hook("postgres", db_pid)
    assert code == 1
    assert err.count("\n") == 1 and "kernel applied" in err and "rolled back" in err
    assert node.fake.read(web, "cpuset.cpus") == "0-47"  # the sibling's shrink undone
    assert node.fake.read(db, "cpuset.mems") == ""
    assert node.fake.read(db, "cpu.max") == "200000 100000"
    state = StateStore(node.state_dir).peek().state
    assert not state.assignments and set(state.sharing) == {"nginx"}
    assert not (node.state_dir / hook.RECORDS_DIR / "postgres.json").exists()


def test_poststop_on_v2_grows_the_shared_container_back(node: Node) -> None:
    web_pid, web = node.container("nginx", "burstable", 500, "uid-web")
    node.hook("nginx", web_pid)
    db_pid, db = node.container("postgres", "guaranteed", 2000, "uid-db")
    (node.fake.root / db.strip("/") / "cpuset.cpus.effective").write_text("1,25\n")
    (node.fake.root / db.strip("/") / "cpuset.mems.effective").write_text("0\n")
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text("0,2-24,26-47\n")
    assert node.hook("postgres", db_pid)[0] == 0
    # The runtime deleted it: no process, its cgroup empty.
    (node.fake.root / db.strip("/") / "cgroup.events").write_text("populated 0\n")
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text("0-47\n")
    assert node.hook("postgres", None, stage="poststop") == (0, "")
    assert node.fake.read(web, "cpuset.cpus") == "0-47"
    assert not StateStore(node.state_dir).peek().state.assignments


# --- the Workload: same as the NRI path ------------------------------------------------------


@pytest.mark.parametrize(
    ("cgroup", "shares", "quota", "qos", "milli", "limit"),
    [
        ("/kubepods/poduid/ctr", 2048, 200000, "guaranteed", 2000, 2000),
        ("/kubepods/burstable/poduid/ctr", 512, 0, "burstable", 500, None),
        ("/kubepods/besteffort/poduid/ctr", 2, -1, "besteffort", 0, None),
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poduid.slice/crio-c.scope",
            1536,
            150000,
            "burstable",
            1500,
            1500,
        ),
        (
            "/kubepods.slice/kubepods-poduid.slice/crio-c.scope/container",
            1024,
            -1,
            "guaranteed",
            1000,
            None,
        ),
    ],
)
def test_workload_matches_the_nri_path(
    cgroup: str, shares: int, quota: int, qos: str, milli: int, limit: int | None
) -> None:
    annotations = {
        "io.kubernetes.pod.uid": "uid",
        "io.kubernetes.pod.name": "p",
        "io.kubernetes.pod.namespace": "ns",
        "io.kubernetes.container.name": "c",
        "exclusive-cpus.nri-cpuplugin.io": "false",
    }
    state = oci.OCIState("ctr", "creating", 7, "/b", {})
    config = oci.OCIConfig(annotations, shares, quota, 100000)
    from_hook = oci.from_oci(state, config, cgroup, oci.kubernetes_identity(annotations))

    sandbox = pb.PodSandbox(id="sb", name="p", uid="uid", namespace="ns")
    sandbox.linux.cgroup_parent = cgroup.rsplit("/", 1)[0]
    c = pb.Container(id="ctr", pod_sandbox_id="sb", name="c")
    c.annotations.update(annotations)
    c.linux.resources.cpu.shares.value = shares
    c.linux.resources.cpu.quota.value = quota
    c.linux.resources.cpu.period.value = 100000
    from_plugin = from_nri(sandbox, c)

    fields = (
        "container_id",
        "container_name",
        "pod_uid",
        "pod_name",
        "pod_namespace",
        "qos",
        "cpu_request_milli",
        "cpu_limit_milli",
        "kind",
    )
    assert [getattr(from_hook, f) for f in fields] == [getattr(from_plugin, f) for f in fields]
    assert (from_hook.qos, from_hook.cpu_request_milli, from_hook.cpu_limit_milli) == (
        qos,
        milli,
        limit,
    )
    assert dict(from_hook.annotations) == dict(from_plugin.annotations)


def test_a_workload_keeps_only_the_annotations_a_decision_reads() -> None:
    pod_wide = {
        "exclusive-cpus.nri-cpuplugin.io": "true",
        "isolated-cpus.nri-cpuplugin.io/container.c": "true",
        "cpu-quota.crio.io": "disable",
        "kubectl.kubernetes.io/last-applied-configuration": "x" * 5000,
        "nics.nri-cpuplugin.io/container.other": "eth9",
    }
    sandbox = pb.PodSandbox(id="sb", name="p", uid="uid", namespace="ns")
    sandbox.annotations.update(pod_wide)
    c = pb.Container(id="ctr", pod_sandbox_id="sb", name="c")
    c.annotations.update({"exclusive-cpus.nri-cpuplugin.io": "false", "unrelated": "1"})
    expected = {
        "exclusive-cpus.nri-cpuplugin.io": "false",  # the container's value wins
        "isolated-cpus.nri-cpuplugin.io/container.c": "true",
        "cpu-quota.crio.io": "disable",
    }
    assert dict(from_nri(sandbox, c).annotations) == expected
    state = oci.OCIState("ctr", "creating", 7, "/b", {})
    config = oci.OCIConfig({**pod_wide, **c.annotations}, 1024, 0, 100000)
    identity = ("uid", "p", "ns", "c")
    assert dict(oci.from_oci(state, config, "/kubepods/poduid/ctr", identity).annotations) == (
        expected
    )


def test_outside_kubepods_is_never_guaranteed() -> None:
    assert oci.qos_from_cgroup("/libpod_parent/libpod-abc") == "besteffort"
    assert oci.qos_from_cgroup("/kubepods/podx/abc") == "guaranteed"
    # The container's own cgroup name does not count: only its parents.
    assert oci.qos_from_cgroup("/x/kubepods-burstable") == "besteffort"


def test_identity_from_containerd_cri_annotations() -> None:
    annotations = {
        "io.kubernetes.cri.sandbox-uid": "u",
        "io.kubernetes.cri.sandbox-name": "p",
        "io.kubernetes.cri.sandbox-namespace": "ns",
        "io.kubernetes.cri.container-name": "c",
    }
    assert oci.kubernetes_identity(annotations) == ("u", "p", "ns", "c")
    assert oci.is_sandbox({"io.kubernetes.cri.container-type": "sandbox"})
    assert oci.kubernetes_identity({"io.kubernetes.pod.uid": "u"}) is None


def test_topology_is_cached_per_boot_and_cpu_sets(tmp_path: Path) -> None:
    root, expected = build("xeon-e5-2680v3-2s", tmp_path)
    state_dir = str(tmp_path / "state")
    dir_fd = StateStore(state_dir).open_dir()

    def cached_topology(sysfs: str, state_dir: str) -> Topology:
        return topology_cache.cached_topology(sysfs, state_dir, dir_fd)

    assert cached_topology(str(root), state_dir) == expected
    # A change discover() would see, but not one that can happen without the online, present
    # or isolated sets changing: the cache answers.
    cpu_dir = root / "devices/system/cpu"
    (cpu_dir / "cpu1/topology/physical_package_id").write_text("1\n")
    assert cached_topology(str(root), state_dir) == expected
    (cpu_dir / "isolated").write_text("47\n")  # now the key differs: discovered again
    fresh = cached_topology(str(root), state_dir)
    assert fresh.by_id[1].socket == 1 and fresh.isolated == CPUSet({47})
    (tmp_path / "state" / hook.TOPOLOGY_CACHE).write_text('{"key": "torn')
    assert cached_topology(str(root), state_dir) == fresh


def test_a_known_container_whose_cgroup_cannot_be_read_is_not_taken_for_gone(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors (EMFILE), the hook cannot tell whether a recorded container still
    runs: it fails, and the CPUs that container holds are not given to anyone else."""
    db_pid, db = node.container("postgres", "guaranteed", 2000, "uid-db")
    (node.fake.root / db.strip("/") / "cpuset.cpus.effective").write_text("1,25\n")
    (node.fake.root / db.strip("/") / "cpuset.mems.effective").write_text("0\n")
    assert node.hook("postgres", db_pid) == (0, "")
    other_pid, _ = node.container("redis", "guaranteed", 2000, "uid-redis")

    def no_descriptors(self: cgroupfs.CgroupFS, path: str) -> bool:
        error = cgroupfs.CgroupError(f"cgroup {path}: Too many open files")
        error.errno = errno.EMFILE
        raise error

    monkeypatch.setattr(cgroupfs.CgroupFS, "populated", no_descriptors)
    code, err = node.hook("redis", other_pid)
    assert code != 0 and "cannot tell whether container postgres still runs" in err
    state = StateStore(node.state_dir).peek().state
    assert str(state.assignments["postgres"].cpus) == "1,25" and "redis" not in state.assignments


@pytest.mark.parametrize(
    ("cgroup", "cid", "named"),
    [
        ("/kubepods/burstable/poduid/abc", "abc", True),
        ("/kubepods.slice/kubepods-poduid.slice/crio-abc.scope", "abc", True),
        ("/kubepods.slice/kubepods-poduid.slice/crio-abc.scope/container", "abc", True),
        ("/libpod_parent/libpod-abc", "abc", True),
        ("/kubepods.slice/kubepods-poduid.slice/crio-abcdef.scope", "abc", False),
        ("/kubepods.slice/kubepods-poduid.slice/crio-abc.scope", "crio", False),
        ("/kubepods/burstable/poduid/xabc", "abc", False),
    ],
)
def test_the_container_cgroup_must_be_named_after_the_container(cgroup, cid, named) -> None:
    if named:
        containers.check_container_cgroup(cgroup, cid, 1234)
    else:
        with pytest.raises(oci.InputError, match="is not named after container"):
            containers.check_container_cgroup(cgroup, cid, 1234)


def test_a_container_that_was_exclusive_gets_its_parent_memory_nodes_back(node: Node) -> None:
    """A run that finds a container exclusive no more (resized to a fraction of a CPU, or its
    CPUs hot-unplugged) writes its memory nodes back, even when its CPUs already say the
    shared pool."""
    from nri_cpuplugin.core.engine import Engine
    from nri_cpuplugin.core.policy import StaticPolicy
    from nri_cpuplugin.core.workload import BURSTABLE, Workload
    from nri_cpuplugin.hook.apply import apply_targets
    from nri_cpuplugin.hook.records import Record

    engine = Engine(StaticPolicy(topology_cache.discover(str(node.sysfs)), CPUSet.parse("0,24")))
    workload = Workload(
        container_id="db", container_name="db", pod_uid="uid-db", pod_name="db",
        pod_namespace="ns", qos=BURSTABLE, cpu_request_milli=1500, cpu_limit_milli=None,
    )  # fmt: skip
    state = engine.create(engine.policy.empty_state(), workload).state
    node.fake.mk("/kubepods/burstable", mems_effective="0-1")
    cgroup = "/kubepods/burstable/poduid-db/db"
    node.fake.mk(
        cgroup, cpus=str(state.shared), mems="0", effective=str(state.shared), mems_effective="0-1"
    )
    records = {"db": Record(workload, cgroupfs.ContainerCgroups(cgroup, cgroup))}
    requested = {"db": state.shared}
    with node.fake.fs() as fs:
        written, _ = apply_targets(fs, engine, state, records, requested, None, lambda _: None)
        assert written == [] and node.fake.read(cgroup, "cpuset.mems") == "0"  # shared before
        written, _ = apply_targets(
            fs, engine, state, records, requested, None, lambda _: None, was_exclusive={"db"}
        )
    assert written == [f"db={state.shared}"]
    assert node.fake.read(cgroup, "cpuset.mems") == "0-1"


def one_nic_interrupt(node: Node, affinity: str, default: str) -> Path:
    """A generated /proc/irq with one NIC interrupt, 30; returns that directory."""
    irq = node.proc / "irq"
    (irq / "30").mkdir(parents=True)
    (irq / "30" / "smp_affinity_list").write_text(f"{affinity}\n")
    (irq / "default_smp_affinity").write_text(f"{default}\n")
    (node.proc / "interrupts").write_text(
        "      " + " ".join(f"CPU{i}" for i in range(48)) + "\n"
        " 30: " + " 0" * 48 + " PCI-MSIX 0-edge nic0\n"
    )
    return irq


def irq_free_db(node: Node) -> tuple[int, str]:
    """A 2-CPU Guaranteed container asking for its CPUs free of interrupts, which the kernel
    will report on CPUs 1,25 once written."""
    pid, db = node.container(
        "postgres", "guaranteed", 2000, "uid-db", **{"irq-free.nri-cpuplugin.io": "true"}
    )
    (node.fake.root / db.strip("/") / "cpuset.cpus.effective").write_text("1,25\n")
    (node.fake.root / db.strip("/") / "cpuset.mems.effective").write_text("0\n")
    return pid, db


def test_the_hook_keeps_an_asking_pods_cpus_free_of_interrupts(node: Node) -> None:
    """The same plan as the daemon's (core/irq.py), on a generated /proc/irq in the hook's
    fake /proc; given back when the container is gone."""
    irq = one_nic_interrupt(node, "0-47", "0000ffff,ffffffff")
    pid, db = irq_free_db(node)
    assert node.hook("postgres", pid) == (0, "")
    assert (irq / "30" / "smp_affinity_list").read_text() == "0,2-24,26-47\n"
    assert (irq / "default_smp_affinity").read_text() == "0000ffff,fdfffffd\n"
    assert str(StateStore(node.state_dir).peek().state.irqs[30].taken) == "1,25"
    assert [r["ACTION"] for r in node.records].count("irq") == 1
    (node.fake.root / db.strip("/") / "cgroup.events").write_text("populated 0\n")  # deleted
    assert node.hook("postgres", None, stage="poststop") == (0, "")
    assert (irq / "30" / "smp_affinity_list").read_text() == "0-47\n"
    assert not StateStore(node.state_dir).peek().state.irqs


def test_the_hooks_irqbalance_ban_is_lifted_when_no_interrupt_was_narrowed(node: Node) -> None:
    """Every interrupt already off the container's CPUs: nothing narrowed, nothing recorded,
    but irqbalance's next start is told (our environment file); once the container is gone,
    that ban is lifted too."""
    one_nic_interrupt(node, "0", "00000000,00000001")
    ban = node.proc.parent / "run" / "nri-cpuplugin" / "irqbalance.env"
    pid, db = irq_free_db(node)
    assert node.hook("postgres", pid) == (0, "")
    assert not StateStore(node.state_dir).peek().state.irqs
    assert "IRQBALANCE_BANNED_CPULIST=1,25\n" in ban.read_text()
    (node.fake.root / db.strip("/") / "cgroup.events").write_text("populated 0\n")  # deleted
    assert node.hook("postgres", None, stage="poststop") == (0, "")
    assert not ban.exists()


def test_the_hook_leaves_interrupts_alone_when_their_record_cannot_be_saved(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded before written, in the hook too: a full disk at the interrupt record's commit
    leaves every affinity as it was (a crash then cannot leave CPUs out of them for good), the
    container still starts on its CPUs, the audit trail says why; the next run after the disk
    recovers narrows them."""
    irq = one_nic_interrupt(node, "0-47", "0000ffff,ffffffff")
    commit = StateStore.commit

    def full_for_interrupts(store: StateStore, state):  # type: ignore[no-untyped-def]
        if state.irqs:
            raise OSError(errno.ENOSPC, "No space left on device", "state.json")
        return commit(store, state)

    monkeypatch.setattr(StateStore, "commit", full_for_interrupts)
    pid, db = irq_free_db(node)
    assert node.hook("postgres", pid) == (0, "")
    assert node.fake.read(db, "cpuset.cpus") == "1,25"
    assert (irq / "30" / "smp_affinity_list").read_text() == "0-47\n"
    assert (irq / "default_smp_affinity").read_text() == "0000ffff,ffffffff\n"
    assert not StateStore(node.state_dir).peek().state.irqs
    said = [r["MESSAGE"] for r in node.records if r["ACTION"] == "irq"]
    assert len(said) == 1 and "could not be recorded" in said[0], said
    assert "No space left on device" in said[0]

    monkeypatch.setattr(StateStore, "commit", commit)  # the disk has room again
    web_pid, web = node.container("nginx", "burstable", 500, "uid-web")
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text("0,2-24,26-47\n")
    assert node.hook("nginx", web_pid) == (0, "")
    assert (irq / "30" / "smp_affinity_list").read_text() == "0,2-24,26-47\n"
    assert str(StateStore(node.state_dir).peek().state.irqs[30].taken) == "1,25"
