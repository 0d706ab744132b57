"""CPU hotplug in the daemon: real kernel uevents through the asyncio loop, the daemon following
topology changes of generated sysfs trees (state, what the runtime is told, audit, status), repair
at start, and the cgroup v1 repairs on this machine's real cgroup hierarchy."""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import subprocess
from pathlib import Path

import pytest
from builders import Machine, container, pod
from daemon_driver import Driver, Records
from model_stall import block_until

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware import cgroupfs, cpusets, hotplug
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.ops.status import render_text, snapshot

P = CPUSet.parse


# --- uevents ------------------------------------------------------------------------------------


def test_cpu_events_are_recognised_and_everything_else_ignored():
    def msg(**fields):
        return {"ACTION": "offline", "SUBSYSTEM": "cpu", "DEVPATH": "/devices/system/cpu/cpu3",
                "SEQNUM": "42", **fields}  # fmt: skip

    assert hotplug.cpu_event(msg(), 1.0) == hotplug.CPUEvent("offline", 3, 1.0)
    assert hotplug.cpu_event(msg(ACTION="online"), 2.0) == hotplug.CPUEvent("online", 3, 2.0)
    assert hotplug.cpu_event(msg(SUBSYSTEM="cpuid"), 1.0) is None
    assert hotplug.cpu_event(msg(ACTION="change"), 1.0) is None
    assert hotplug.cpu_event(msg(DEVPATH="/devices/system/cpu/cpufreq"), 1.0) is None


def test_the_listener_delivers_real_kernel_uevents_through_the_loop():
    """A synthetic uevent (written to the CPU's ``uevent`` file) travels the same path as a
    real hotplug one - kernel, netlink, epoll, our reader - without changing anything."""
    cpu = max(int(p.name[3:]) for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"))

    async def main() -> list[hotplug.CPUEvent]:
        got: asyncio.Queue = asyncio.Queue()
        listener = hotplug.UeventListener(got.put_nowait)
        listener.start(asyncio.get_running_loop())
        try:
            Path(f"/sys/devices/system/cpu/cpu{cpu}/uevent").write_text("online")
            return await asyncio.wait_for(got.get(), 5)
        finally:
            listener.close()

    [event] = asyncio.run(main())
    assert (event.action, event.cpu) == ("online", cpu)
    assert event.received > 0  # stamped when read (what "hotplug-applied" measures from)


# --- the daemon following generated trees ----------------------------------------------------


class FakeStub:
    """Records unsolicited UpdateContainers, which the daemon must never send: they can
    deadlock the runtime (docs/architecture.md, "Changes outside event replies")."""

    def __init__(self) -> None:
        self.sent: list[list[pb.ContainerUpdate]] = []

    def schedule_update_containers(self, updates, done=None):
        self.sent.append(list(updates))

    async def update_containers(self, updates, timeout=None):
        self.sent.append(list(updates))
        return []


@pytest.fixture
def node(tmp_path):
    machine = Machine(tmp_path)
    machine.set()
    settings = Settings(
        sysfs=str(machine.root), state_dir=str(tmp_path / "state"), reserved_cpus=P("0")
    )
    plugin = Driver(settings)
    plugin.configure()
    plugin.daemon.stop_hotplug()  # events are submitted below; real ones would find no change
    stub = plugin.daemon.stub = FakeStub()
    yield machine, plugin, plugin.records
    plugin.close()
    assert stub.sent == [], "an unsolicited UpdateContainers was sent"


def cpus_of(update: pb.ContainerUpdate) -> str:
    return update.linux.resources.cpu.cpus


def next_reply(plugin: Driver) -> dict[str, pb.ContainerUpdate]:
    """The updates the runtime gets with its next event that can carry some: here a
    StopContainer of a container the daemon does not place.  The generated trees have no
    cgroups, so every change after hotplug is owed to the runtime (never written directly)."""
    other = pod("other", "besteffort")
    return {u.container_id: u for u in plugin.stop_container(other, container("x", other, 0))}


def test_offline_degrades_online_restores_and_the_runtime_is_told_each_time(node, tmp_path):
    machine, plugin, records = node
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    db = pod("db")
    adjust, _ = plugin.create_container(db, container("pg", db, 7000))
    assert adjust.linux.resources.cpu.cpus == "1-7"
    pg, nginx = "pg".ljust(64, "0"), "nginx".ljust(64, "0")

    machine.set(offline={7})  # partial loss: nothing free to replace it
    plugin.hotplug("offline", 7)
    held = plugin.state.assignments[pg]
    assert (held.cpus, held.lost) == (P("1-6"), P("7")) and held.degraded
    [outside] = records.of("outside-reply")
    assert (outside["CONTAINER_IDS"], outside["WRITTEN"], outside["OWED"]) == (pg, "0", "1")
    assert {cid: cpus_of(u) for cid, u in next_reply(plugin).items()} == {pg: "1-6"}
    assert next_reply(plugin) == {}  # told once
    assert records.of("degraded") and records.of("hotplug")
    assert records.of("hotplug-applied")[-1]["CONTAINERS"] == "1"

    report = snapshot(plugin.settings.state_dir, str(machine.root))
    assert [a["container_name"] for a in report["degraded"]] == ["pg"]
    assert "DEGRADED" in render_text(report) and "lost 7" in render_text(report)

    machine.set()  # back online: the CPU returns to the container that lost it
    plugin.hotplug("online", 7)
    held = plugin.state.assignments[pg]
    assert (held.cpus, held.lost) == (P("1-7"), CPUSet())
    assert {cid: cpus_of(u) for cid, u in next_reply(plugin).items()} == {pg: "1-7"}
    assert records.of("cpu-restored")
    assert plugin.state.shared == P("0")
    assert nginx in plugin.state.sharing


def test_a_container_that_loses_its_only_cpu_runs_shared_and_bounded_meanwhile(node):
    machine, plugin, _records = node
    db = pod("db")
    plugin.create_container(db, container("one", db, 1000))
    rest = pod("rest")
    plugin.create_container(rest, container("six", rest, 6000))
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    one, nginx = "one".ljust(64, "0"), "nginx".ljust(64, "0")
    machine.set(offline={1})
    plugin.hotplug("offline", 1)
    held = plugin.state.assignments[one]
    assert held.cpus == CPUSet() and held.lost == P("1")
    updates = next_reply(plugin)
    cpu = updates[one].linux.resources.cpu
    assert cpu.cpus == "0" and cpu.quota.value == 100000 and cpu.period.value == 100000
    assert nginx not in updates  # the pool did not change
    # It follows the shared pool like any shared container until its CPU returns.
    assert one in {t.container_id for t in plugin.node.engine.followers(plugin.state, "")}
    machine.set()
    plugin.hotplug("online", 1)
    update = next_reply(plugin)[one]
    assert update.linux.resources.cpu.cpus == "1" and update.linux.resources.cpu.quota.value == -1


def test_owed_updates_ride_on_the_next_create_and_a_synchronize_settles_them(node):
    machine, plugin, records = node
    db = pod("db")
    plugin.create_container(db, container("one", db, 1000))
    one = "one".ljust(64, "0")
    machine.set(offline={1})
    plugin.hotplug("offline", 1)
    # The next CreateContainer's reply carries the moved container's update (it had its CPU
    # replaced) - never one for the container being created, which the runtime would refuse.
    web = pod("web", "burstable")
    _adjust, updates = plugin.create_container(web, container("nginx", web, 500))
    assert [u.container_id for u in updates] == [one] and updates[0].ignore_failure
    assert cpus_of(updates[0]) == "2"
    assert next_reply(plugin) == {}  # told once
    machine.set()
    plugin.hotplug("online", 1)  # nginx grows onto CPU 1 again: owed too
    assert records.of("outside-reply")[-1]["OWED"] == "1"
    # A Synchronize answers with every live container's settings: nothing stays owed.
    live = [container("one", db, 1000), container("nginx", web, 500)]
    assert {u.container_id: cpus_of(u) for u in plugin.synchronize([db, web], live)}[one] == "2"
    assert next_reply(plugin) == {}


def test_a_replacement_is_preferred_and_the_returning_cpu_joins_the_shared_pool(node):
    machine, plugin, records = node
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))  # 1-2 on socket 0 (CPUs 0-3)
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    pg, nginx = "pg".ljust(64, "0"), "nginx".ljust(64, "0")
    assert plugin.state.assignments[pg].cpus == P("1-2")
    machine.set(offline={2})
    plugin.hotplug("offline", 2)
    held = plugin.state.assignments[pg]
    assert held.cpus == P("1,3") and not held.lost  # same NUMA node
    [change] = records.of("cpu-replaced")
    assert "same NUMA node" in change["MESSAGE"]
    sent = {cid: cpus_of(u) for cid, u in next_reply(plugin).items()}
    assert sent == {pg: "1,3", nginx: "0,4-7"}
    machine.set()
    plugin.hotplug("online", 2)
    assert plugin.state.shared == P("0,2,4-7")
    assert {cid: cpus_of(u) for cid, u in next_reply(plugin).items()} == {nginx: "0,2,4-7"}


def test_events_without_a_change_do_nothing(node):
    _machine, plugin, records = node
    plugin.hotplug("online", 3)
    assert next_reply(plugin) == {} and records.of("hotplug")[-1]["PRIORITY"] == "7"
    assert not records.of("outside-reply")


def test_a_change_while_nothing_ran_is_repaired_at_start_not_refused(node, tmp_path):
    machine, plugin, _records = node
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    machine.set(offline={2, 5})
    again = Records()
    plugin.close()  # the old daemon is gone (its claim with it)
    restarted = Driver(plugin.node.file_settings, again)
    try:
        restarted.daemon.load_state()
        pg = "pg".ljust(64, "0")
        assert restarted.state.assignments[pg].cpus == P("1,3")  # replaced on its node
        assert again.of("state-repair") and not again.of("state-rebuild")
        assert again.of("cpu-replaced")  # what changed is audited like a live event
        assert not list((tmp_path / "state").glob("state.json.bad-*"))
        assert restarted.state.shared == P("0,4,6-7")
        assert restarted.state.fingerprint == restarted.node.policy.topology.fingerprint()
    finally:
        restarted.close()


# --- cgroup v1 repairs, on this machine's real hierarchy ---------------------------------------


@pytest.fixture
def v1_tree():
    layout = cgroupfs.detect()
    if layout.version != cgroupfs.V1:
        pytest.fail("this test needs the cgroup v1 cpuset hierarchy of the CI machine")
    top = f"/nri-hotplug-test-{secrets.token_hex(3)}"
    container = f"{top}/pod/ctr"
    made = []
    for root in (layout.cpuset_root, layout.cpu_root):
        for path in (top, f"{top}/pod", container):
            os.mkdir(root + path)
            made.append(root + path)
            if root == layout.cpuset_root:
                Path(root + path, "cpuset.mems").write_text("0")
                Path(root + path, "cpuset.cpus").write_text("0")
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield layout, container, proc.pid
    finally:
        proc.kill()
        proc.wait()
        for path in reversed(made):
            rmdir_once_empty(path)


def rmdir_once_empty(path: str) -> None:
    """cgroup v1 lets a cgroup go a moment after its last task has exited (EBUSY until then)."""

    def removed() -> bool:
        """the cgroup removed"""
        try:
            os.rmdir(path)
        except OSError as err:
            if err.errno != errno.EBUSY:
                raise
            return False
        return True

    block_until(removed)


def test_apply_grows_ancestors_and_puts_back_tasks_the_kernel_evicted(v1_tree):
    layout, container, pid = v1_tree
    cpuset, cpu = layout.cpuset_root, layout.cpu_root
    Path(cpu + container, "cgroup.procs").write_text(str(pid))
    # What cgroup v1 does when a cpuset loses its last CPU: the task moves to the parent, in
    # the cpuset hierarchy only.
    Path(cpuset + container.rsplit("/", 1)[0], "cgroup.procs").write_text(str(pid))
    applied = cpusets.apply(layout, [cpusets.Target("c" * 64, container, P("1"), P("0"))])
    assert applied.errors == [] and applied.returned == {"c" * 64: 1}
    top = container.split("/")[1]
    assert Path(cpuset, top, "cpuset.cpus").read_text().strip() == "0-1"
    assert Path(cpuset + container, "cpuset.cpus").read_text().strip() == "1"
    assert Path(cpuset + container, "cgroup.procs").read_text().split() == [str(pid)]
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Cpus_allowed_list:\t1\n" in status


def test_apply_writes_the_quota_with_the_cpuset_and_lifts_it_again(v1_tree):
    """A degraded container gets its CPU limit back as CFS quota, a restored one loses it:
    written with the cpuset (the runtime is not asked: daemon/routes.py, Routes.push)."""
    layout, container, _ = v1_tree
    quota = Path(layout.cpu_root + container, "cpu.cfs_quota_us")
    assert quota.read_text().strip() == "-1"
    degraded = cpusets.Target("c" * 64, container, P("0"), None, 100_000)
    assert cpusets.apply(layout, [degraded], repair=False).errors == []
    assert quota.read_text().strip() == "100000"
    assert Path(layout.cpu_root + container, "cpu.cfs_period_us").read_text().strip() == "100000"
    restored = cpusets.Target("c" * 64, container, P("1"), None, -1)
    assert cpusets.apply(layout, [restored], repair=False).errors == []
    assert quota.read_text().strip() == "-1"
    assert Path(layout.cpuset_root + container, "cpuset.cpus").read_text().strip() == "1"
    # No quota in the target: the quota is left as it is.
    quota.write_text("50000")
    assert cpusets.apply(layout, [cpusets.Target("c" * 64, container, P("0"))]).errors == []
    assert quota.read_text().strip() == "50000"


def test_tasks_of_other_containers_are_left_alone(v1_tree):
    layout, container, pid = v1_tree
    parent = container.rsplit("/", 1)[0]
    Path(layout.cpuset_root + parent, "cgroup.procs").write_text(str(pid))  # not ours in cpu
    with cgroupfs.CgroupFS(layout) as fs:
        assert cpusets.return_evicted_tasks(fs, container) == 0
    assert Path(layout.cpuset_root + parent, "cgroup.procs").read_text().split() == [str(pid)]


def test_ancestors_get_returning_cpus_back_and_the_container_is_left_alone(v1_tree):
    layout, container, _ = v1_tree
    parts = container.strip("/").split("/")
    assert cpusets.grow_ancestors(layout, [container], P("1")) == []
    cpus = [
        Path(layout.cpuset_root, *parts[:depth], "cpuset.cpus").read_text().strip()
        for depth in range(1, len(parts) + 1)
    ]
    assert cpus == ["0-1", "0-1", "0"]
