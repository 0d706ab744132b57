"""The daemon with containers of the systemd cgroup driver: every cpuset change it makes to
them goes to systemd too (the scope's AllowedCPUs/AllowedMemoryNodes, daemon/units.py), so
no reply has to carry them (no ``runc update`` per shared container) and systemd keeps them.

A real dbus-daemon with a FAKE systemd on it (tests/fake_systemd.py: systemd cannot be PID 1 on
this host) and a FAKE cgroup v2 tree below the generated sysfs; the real systemd is tested in
the QEMU guest (tests/guest/)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import time
from collections.abc import Iterator

import pytest
from builders import container, guaranteed_pod, pod
from daemon_driver import Driver
from fake_cgroup_v2 import FakeV2, on_generated_node
from fake_systemd import FakeSystemd, PrivateBus
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.daemon import units as units_mod
from nri_cpuplugin.hardware.systemd.client import SystemdClient
from nri_cpuplugin.hook import entry as hook
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import Settings

POOL = "0,2-24,26-47"  # once CPUs 1 and 25 are exclusive


@pytest.fixture
def systemd() -> Iterator[tuple[PrivateBus, FakeSystemd]]:
    with PrivateBus() as bus, FakeSystemd(bus) as fake:
        yield bus, fake


def node(tmp_path, bus: str, **settings) -> tuple[Driver, FakeV2]:
    root, fake = on_generated_node(tmp_path)
    base = Settings(
        sysfs=str(root),
        state_dir=str(tmp_path / "state"),
        reserved_cpu_count=2,
        systemd_bus=bus,
        **settings,
    )
    plugin = Driver(base)
    plugin.configure()
    plugin.synchronize([], [])  # the runtime lists its containers: the usual connection
    return plugin, fake


def scope(fake: FakeV2, ctr, slice_: str, effective: str, held: bool = True, **files: str) -> str:
    """``ctr`` as the systemd driver places it; its scope's cgroup in the fake tree (whose
    effective sets are what the test says the kernel will apply), and the transient unit file
    systemd keeps for it: with ``AllowedCPUs`` as runc gives a container created with a cpuset
    in its spec (``held``), or with none."""
    ctr.linux.cgroups_path = f"{slice_}:cri-containerd:{ctr.id}"
    parts = slice_.removesuffix(".slice").split("-")
    slices = ["-".join(parts[: i + 1]) + ".slice" for i in range(len(parts))]
    unit = f"cri-containerd-{ctr.id}.scope"
    path = "/".join([*slices, unit])
    fake.mk(path, effective=effective, **files)
    transient = fake.root.parent.parent.parent / "run" / "systemd" / "transient"
    transient.mkdir(parents=True, exist_ok=True)
    (transient / unit).write_text("[Scope]\nDelegate=yes\n" + (f"AllowedCPUs={effective}\n" * held))
    return path


def calls_for(fake_systemd: FakeSystemd, ctr) -> list[list]:
    """The properties of each call made for the container's unit, in order."""
    unit = f"cri-containerd-{ctr.id}.scope"
    return [c["properties"] for c in fake_systemd.calls() if c["unit"] == unit]


def cpus_of(properties: list) -> set[int]:
    mask = int.from_bytes(bytes.fromhex(properties[0][2]), "little")
    return {cpu for cpu in range(48) if mask >> cpu & 1}


RELEASE = [["AllowedCPUs", "ay", ""], ["AllowedMemoryNodes", "ay", ""]]


def running_shared(plugin: Driver, fake: FakeV2):
    """A Burstable container of the systemd driver, created and started on the whole pool;
    the container and its scope's cgroup."""
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    path = scope(fake, nginx, "kubepods-burstable-podweb.slice", effective=POOL)
    plugin.create_container(web, nginx)
    plugin.start_container(web, nginx)
    return nginx, path


def test_a_shared_container_moves_through_systemd_and_no_reply_carries_it(tmp_path, systemd):
    """The first change to a unit runc gave a cpuset (here: set right at its start, the kernel
    having applied another): set through systemd (a re-apply meanwhile puts the new one back),
    then released; from then on the cgroup file alone, which systemd no longer touches."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, path = running_shared(plugin, fake)
    [set_, release] = calls_for(fake_systemd, nginx)
    assert set_[0][0] == "AllowedCPUs" and cpus_of(set_) == set(range(48))
    assert release == RELEASE
    db = pod("db")
    adjust, updates = plugin.create_container(db, container("pg", db, 2000))
    assert adjust.linux.resources.cpu.cpus == "1,25"
    assert list(updates) == []  # no runc update for the shared container
    assert fake.read(path, "cpuset.cpus") == POOL
    assert len(calls_for(fake_systemd, nginx)) == 2  # bare: written directly
    plugin.close()


def test_the_runtimes_cpuset_makes_a_unit_systemds_again(tmp_path, systemd):
    """A container the runtime gave a cpuset after the hand-over (an update's reply, whose
    ``runc update`` sets AllowedCPUs): its next change goes through systemd again."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, _ = running_shared(plugin, fake)
    assert len(calls_for(fake_systemd, nginx)) == 2  # handed over at its start
    nginx.linux.resources.cpu.cpus = "0-47"
    plugin.post_update_container(pod("web", "burstable"), nginx)  # (set right: the kernel's
    calls = calls_for(fake_systemd, nginx)  # effective set is not the spec's in this tree)
    assert len(calls) == 4 and cpus_of(calls[2]) == set(range(48)) and calls[3] == RELEASE
    plugin.close()


def test_a_unit_created_without_a_cpuset_is_never_asked(tmp_path, systemd):
    """A container whose spec had no cpuset (created before the daemon ran, say): systemd
    holds none for its unit, so the cgroup file is all there is to write."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket)
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    path = scope(fake, nginx, "kubepods-burstable-podweb.slice", effective=POOL, held=False)
    plugin.create_container(web, nginx)
    plugin.start_container(web, nginx)
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))
    assert list(updates) == [] and fake.read(path, "cpuset.cpus") == POOL
    assert calls_for(fake_systemd, nginx) == []
    plugin.close()


def test_pinning_at_start_serves_the_systemd_driver(tmp_path, systemd):
    """``[nri] pin_at = "start"`` writes the container's own cgroup: its unit, created with no
    cpuset in its spec, holds none, so the write is one systemd keeps; served, not refused."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket, nri_pin_at="start")
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)
    path = scope(fake, pg, "kubepods-poddb.slice", effective="1,25", held=False, mems_effective="0")
    plugin.run_pod_sandbox(db)
    plugin.start_container(db, pg)
    assert fake.read(path, "cpuset.cpus") == "1,25" and fake.read(path, "cpuset.mems") == "0"
    assert calls_for(fake_systemd, pg) == []
    assert plugin.state.assignments[pg.id].cpus == {1, 25}
    plugin.close()


def test_a_slow_systemds_units_stay_with_systemd_not_the_reply(tmp_path, systemd):
    """systemd busier than the daemon's wait (100 scopes under emulation): the calls are sent,
    systemd applies them later, the cgroup files hold the cpusets meanwhile, and the runtime
    is not asked for a ``runc update`` through the same busy systemd."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, path = running_shared(plugin, fake)
    plugin.daemon.node.writer.units.forget(nginx.id)  # systemd's again (a runc update, say)
    seen = len(fake_systemd.calls())
    fake_systemd.stall()
    try:
        db = pod("db")
        adjust, updates = plugin.create_container(db, container("pg", db, 2000))
    finally:
        fake_systemd.resume()
    assert adjust.linux.resources.cpu.cpus == "1,25"
    assert list(updates) == []
    assert fake.read(path, "cpuset.cpus") == POOL
    late = fake_systemd.wait_calls(seen + 2)[seen:]
    assert [c["unit"] for c in late] == [f"cri-containerd-{nginx.id}.scope"] * 2
    assert late[1]["properties"] == RELEASE
    assert plugin.records.of("systemd") == []  # pending is no failure
    plugin.close()


def test_the_cgroup_files_hold_a_change_before_systemd_is_asked(tmp_path, systemd):
    """The files first, then the calls: the cpusets hold however long systemd takes."""
    bus, _ = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, path = running_shared(plugin, fake)
    units = plugin.daemon.node.writer.units
    asked, set_cpus = [], units.set_cpus

    def watched(targets):
        asked.append((fake.read(path, "cpuset.cpus"), [t.container_id for t in targets]))
        return set_cpus(targets)

    units.set_cpus = watched
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))
    assert asked == [(POOL, [nginx.id])]
    plugin.close()


def test_a_refusal_systemd_sends_late_is_owed_to_the_runtimes_next_reply(tmp_path, systemd):
    """What systemd refuses after the batch's wait (``take_refused``) goes to the runtime in
    the next reply that can carry updates, like any other owed target."""
    bus, _ = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, _ = running_shared(plugin, fake)
    units = plugin.daemon.node.writer.units
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))  # nginx moved: written, asked
    refused = [nginx.id]
    units.take_refused = lambda: [refused.pop()] if refused else []
    web = pod("web2", "burstable")
    _, updates = plugin.create_container(web, container("php", web, 500))  # moves nobody
    assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [(nginx.id, POOL)]
    other = pod("other")
    _, updates = plugin.create_container(other, container("app", other, 500))
    assert nginx.id not in [u.container_id for u in updates]  # owed once
    plugin.close()


def test_a_refusal_read_by_a_change_that_carries_its_container_is_still_owed(tmp_path, systemd):
    """Finding 3 of issue 40: systemd's late refusal read while a change moves the container
    again (the reply "carries" it, by writing its files) is not dropped from the owed ledger:
    the runtime gets the container's target with its next reply that can carry updates."""
    bus, _ = systemd
    plugin, fake = node(tmp_path, bus.socket)
    nginx, _ = running_shared(plugin, fake)
    units = plugin.daemon.node.writer.units
    refused = [nginx.id]
    units.take_refused = lambda: [refused.pop()] if refused else []
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))  # moves nginx
    assert nginx.id not in [u.container_id for u in updates]  # written: not this reply's
    web = pod("web2", "burstable")
    _, updates = plugin.create_container(web, container("php", web, 500))  # moves nobody
    assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [(nginx.id, POOL)]
    plugin.close()


@pytest.fixture
def private(tmp_path) -> Iterator[tuple[str, FakeSystemd]]:
    """The FAKE systemd on a peer-to-peer socket of its own, as systemd's /run/systemd/private
    (what the daemon uses as root with systemd as PID 1): it can re-execute."""
    with PrivateBus() as bus:
        path = str(tmp_path / "systemd-private")
        with FakeSystemd(bus, private=path) as fake:
            yield path, fake


def private_node(tmp_path, path: str) -> tuple[Driver, FakeV2]:
    plugin, fake = node(tmp_path, path)
    plugin.daemon.node.writer.units.client = SystemdClient(path, hello=False)  # (no bus: no Hello)
    return plugin, fake


def systemds_again(plugin: Driver, fake: FakeV2):
    """A running shared container whose unit systemd holds the cpuset of (as after a runc
    update): its next change is handed over."""
    nginx, path = running_shared(plugin, fake)
    plugin.daemon.node.writer.units.forget(nginx.id)
    return nginx, path


def test_a_reexec_that_breaks_the_connection_is_got_over_at_once(tmp_path, private):
    """Finding 5 of issue 40: systemd re-executes (its connections closed): the next change's
    send finds a broken pipe, and the daemon connects again and hands the unit over within
    the same change, instead of leaving it to the runtime's next event."""
    path, fake_systemd = private
    plugin, fake = private_node(tmp_path, path)
    nginx, _ = systemds_again(plugin, fake)
    fake_systemd.reexec()
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))
    assert list(updates) == []  # not the runtime's
    calls = calls_for(fake_systemd, nginx)
    assert cpus_of(calls[-2]) == set(range(48)) - {1, 25} and calls[-1] == RELEASE
    seen = len(fake_systemd.calls()) - 2
    assert fake_systemd.holds(f"cri-containerd-{nginx.id}.scope", set(range(48)), seen) is None
    assert plugin.records.of("systemd") == []
    plugin.close()


def released_calls(plugin, fake_systemd, unit: str, since: int) -> list[dict]:
    """``unit``'s calls from call ``since`` on, once the last one is a release.  The answer
    leaves after the daemon's short wait for systemd; on a loaded machine systemd answers
    later and the release follows that answer, on the daemon's loop: run it meanwhile.  The
    30 s are a failure bound, not a delay."""
    deadline = time.monotonic() + 30
    while True:
        plugin.settle()
        calls = [c for c in fake_systemd.calls()[since:] if c["unit"] == unit]
        if (calls and calls[-1]["properties"] == RELEASE) or time.monotonic() > deadline:
            return calls
        plugin.run(asyncio.sleep(0.05))


def test_calls_lost_in_a_reexec_are_sent_again_with_the_cpuset_of_now(tmp_path, private):
    """Findings 1 and 5 of issue 40: a unit's set and release wait unread when systemd
    re-executes, and the pool changes again before anyone knows: the unit is sent its cpuset
    of now, then released - never the lost one - and systemd holds none for it after."""
    path, fake_systemd = private
    plugin, fake = private_node(tmp_path, path)
    nginx, path = systemds_again(plugin, fake)
    unit = f"cri-containerd-{nginx.id}.scope"
    seen = len(fake_systemd.calls())
    fake_systemd.hold()
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))  # pending: unread
    assert list(updates) == []
    fake_systemd.reexec()  # those calls are lost
    now = "0,3-24,27-47"  # once CPUs 2 and 26 are exclusive too
    (fake.root / path / "cpuset.cpus.effective").write_text(now)  # (the kernel's answer)
    db2 = pod("db2")
    _, updates = plugin.create_container(db2, container("pg2", db2, 2000))
    assert list(updates) == []
    applied = released_calls(plugin, fake_systemd, unit, seen)
    assert [cpus_of(c["properties"]) if c["properties"] != RELEASE else None for c in applied] == [
        set(CPUSet.parse(now)),
        None,
    ]
    assert fake_systemd.holds(unit, set(range(48)), seen) is None  # a reload: nothing back
    plugin.close()


def test_a_lost_release_is_finished_by_the_follow_up_without_any_change(tmp_path, private):
    """Finding 2 of issue 40: the last change a unit gets is lost with its connection, and no
    change comes after: the follow-up the daemon schedules (its timer, on its loop) finds the
    loss and hands the unit over."""
    path, fake_systemd = private
    plugin, fake = private_node(tmp_path, path)
    nginx, _ = systemds_again(plugin, fake)  # (as after a runc update: systemd holds 0-47)
    unit = f"cri-containerd-{nginx.id}.scope"
    seen = len(fake_systemd.calls())
    fake_systemd.hold()
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))
    fake_systemd.reexec()
    # a daemon-reload now would put the scope back on 0-47, the new exclusive CPUs with them
    assert fake_systemd.holds(unit, set(range(48)), seen) == set(range(48))
    plugin.run(asyncio.sleep(units_mod.FOLLOW_UP[0] * 3))  # the loop runs: its timer fires
    plugin.settle()
    assert fake_systemd.holds(unit, set(range(48)), seen) is None
    assert cpus_of(calls_for(fake_systemd, nginx)[-2]) == set(range(48)) - {1, 25}
    plugin.close()


def test_unit_files_not_seen_fail_safe(tmp_path, systemd):
    """Finding 4 of issue 40: systemd's unit files are not where the daemon looks (derived
    from ``sysfs``, whose machine root has no /run): every scope is asked of systemd (set,
    then released), never taken as bare, and that is said once."""
    bus, fake_systemd = systemd
    plugin, fake = node(tmp_path, bus.socket)
    web = pod("web", "burstable")
    php = container("php", web, 500)
    scope(fake, php, "kubepods-burstable-podweb.slice", effective=POOL, held=False)
    shutil.rmtree(fake.root.parent.parent.parent / "run")  # the machine's /run not seen
    plugin.create_container(web, php)
    plugin.start_container(web, php)
    assert calls_for(fake_systemd, php)[-1] == RELEASE  # asked, not taken as bare
    [warning] = plugin.records.of("systemd")
    assert warning["REASON"] == "unit-files" and "systemd.unit_root" in warning["MESSAGE"]
    plugin.close()


def test_the_unit_root_is_where_systemds_files_are_read(tmp_path, systemd):
    """``[systemd] unit_root``: the host's root as the daemon sees it (a DaemonSet's /host)."""
    bus, fake_systemd = systemd
    host = tmp_path / "host"
    plugin, fake = node(tmp_path, bus.socket, systemd_unit_root=str(host))
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    scope(fake, nginx, "kubepods-burstable-podweb.slice", effective=POOL, held=True)
    transient = host / "run" / "systemd" / "transient"
    transient.mkdir(parents=True)
    (transient / f"cri-containerd-{nginx.id}.scope").write_text("[Scope]\nDelegate=yes\n")
    plugin.create_container(web, nginx)
    plugin.start_container(web, nginx)
    db = pod("db")
    plugin.create_container(db, container("pg", db, 2000))
    assert calls_for(fake_systemd, nginx) == []  # the host's files say: none held
    assert plugin.records.of("systemd") == []
    plugin.close()


def test_what_systemd_does_not_take_the_runtime_applies(tmp_path, systemd):
    """A unit systemd refuses (here: the FAKE's ``-denied`` name) goes into the reply, for the
    runtime's own ``runc update``; said once."""
    bus, _ = systemd
    plugin, fake = node(tmp_path, bus.socket)
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    nginx.id = "nginx-denied"
    scope(fake, nginx, "kubepods-burstable-podweb.slice", effective=POOL)
    plugin.create_container(web, nginx)
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))
    assert [(u.container_id, u.linux.resources.cpu.cpus) for u in updates] == [
        ("nginx-denied", POOL)
    ]
    [warning] = plugin.records.of("systemd")
    assert warning["REASON"] == "denied"
    plugin.close()


def test_without_systemd_the_runtime_applies_as_before(tmp_path):
    """No bus (``[systemd] bus = "off"``, or none found): systemd-driver containers are moved
    by the runtime, through the replies."""
    plugin, fake = node(tmp_path, "off")
    assert plugin.daemon.node.writer.units is None
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    scope(fake, nginx, "kubepods-burstable-podweb.slice", effective=POOL)
    plugin.create_container(web, nginx)
    db = pod("db")
    _, updates = plugin.create_container(db, container("pg", db, 2000))
    assert [u.container_id for u in updates] == [nginx.id]
    plugin.close()


# --- the OCI hook (CRI-O with cgroup_manager = "systemd") -----------------------------------------


class HookNode:
    """The hook in process on a FAKE cgroup v2 tree whose containers are systemd scopes, a fake
    /proc and a generated 48-CPU sysfs (as tests/unit/test_hook_v2_fake.py, with CRI-O's
    systemd-driver names)."""

    def __init__(self, tmp_path, bus: str) -> None:
        self.sysfs, _ = build("xeon-e5-2680v3-2s", tmp_path)
        self.fake = FakeV2(tmp_path / "fake-cgroup2")
        self.proc = tmp_path / "fake-proc"
        self.bundles = tmp_path / "bundles"
        self.state_dir = tmp_path / "state"
        self.bus = bus
        self.records: list[dict[str, str]] = []
        self.pid = 1000

    def container(self, cid: str, slice_: str, milli: int, pod: str, **effective: str) -> str:
        parts = slice_.removesuffix(".slice").split("-")
        slices = ["-".join(parts[: i + 1]) + ".slice" for i in range(len(parts))]
        cgroup = "/" + "/".join([*slices, f"crio-{cid}.scope"])
        self.fake.mk(cgroup, cpu_max=f"{milli * 100} 100000", **effective)
        self.pid += 1
        (self.proc / str(self.pid)).mkdir(parents=True)
        (self.proc / str(self.pid) / "cgroup").write_text(f"0::{cgroup}\n")
        bundle = self.bundles / cid
        bundle.mkdir(parents=True)
        annotations = {
            "io.kubernetes.pod.uid": pod,
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.pod.namespace": "ns",
            "io.kubernetes.container.name": cid,
        }
        cpu = {"shares": max(2, milli * 1024 // 1000), "quota": milli * 100, "period": 100000}
        (bundle / "config.json").write_text(
            json.dumps({"annotations": annotations, "linux": {"resources": {"cpu": cpu}}})
        )
        return cgroup

    def hook(self, cid: str) -> int:
        state = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": self.pid}
        state["bundle"] = str(self.bundles / cid)
        settings = Settings(
            sysfs=str(self.sysfs),
            state_dir=str(self.state_dir),
            reserved_cpu_count=2,
            systemd_bus=self.bus,
        )
        options = hook.Options(cgroup_root=str(self.fake.root), proc=str(self.proc))
        stdin = io.BytesIO(json.dumps(state).encode())
        self.err = io.StringIO()
        return hook.run(settings, options, stdin, self.err, Audit(self.records.append))


def test_the_hook_keeps_its_cpusets_in_the_scopes_properties(tmp_path, systemd):
    bus, fake_systemd = systemd
    node = HookNode(tmp_path, bus.socket)
    web = node.container("nginx", "kubepods-burstable-podweb.slice", 500, "web", effective="0-47")
    assert node.hook("nginx") == 0, node.err.getvalue()
    # What the kernel will report once the shared container shrinks.
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text(POOL)
    db = node.container(
        "pg", "kubepods-poddb.slice", 2000, "db", effective="1,25", mems_effective="0"
    )
    assert node.hook("pg") == 0, node.err.getvalue()
    assert node.fake.read(db, "cpuset.cpus") == "1,25"
    units: dict[str, list] = {}
    for call in fake_systemd.calls():
        units.setdefault(call["unit"], []).append(call["properties"])
    # No unit files to be seen here: each shared scope is taken as holding a cpuset, so it is
    # set to what its files were given, then released (hardware/systemd/handover.py); the new
    # exclusive container's scope is set and kept, as the runtime keeps one created with a
    # cpuset: systemd's view of a pinned container is the kernel's.
    assert units["crio-pg.scope"] == [
        [["AllowedCPUs", "ay", "02000002"], ["AllowedMemoryNodes", "ay", "01"]],
    ]
    assert cpus_of(units["crio-nginx.scope"][-2]) == set(range(48)) - {1, 25}
    assert units["crio-nginx.scope"][-1] == RELEASE
    assert not [r for r in node.records if r["ACTION"] == "systemd"]


def systemd_keeps(fake_systemd: FakeSystemd, root, seen: int) -> int:
    """What systemd keeps of the calls from ``seen`` on: a runtime drop-in per unit and
    property (``<unit>.d/50-AllowedCPUs.conf``), as it writes them for a transient unit; the
    number of calls now."""
    calls = fake_systemd.calls()
    for call in calls[seen:]:
        dropins = root / "run" / "systemd" / "transient" / f"{call['unit']}.d"
        dropins.mkdir(parents=True, exist_ok=True)
        for name, _, mask in call["properties"]:
            bits = int.from_bytes(bytes.fromhex(mask), "little")
            cpus = ",".join(str(c) for c in range(bits.bit_length()) if bits >> c & 1)
            (dropins / f"50-{name}.conf").write_text(f"[Scope]\n{name}=\n{name}={cpus}\n")
    return len(calls)


@pytest.mark.parametrize("shared", [0, 8, 32])
def test_the_hook_asks_systemd_nothing_for_scopes_handed_over(tmp_path, systemd, shared):
    """Scopes created holding a cpuset (runc's unit file with AllowedCPUs): each is handed over
    the first time the hook writes it; from then on an exclusive start makes the new
    container's one call only (its scope set and kept), none per shared scope and none for
    the exclusive ones placed before, and every shared scope is still kept off the exclusive
    CPUs (written to its cgroup files)."""
    bus, fake_systemd = systemd
    node = HookNode(tmp_path, bus.socket)
    root = node.sysfs.parent  # the unit files' root: the directory above sysfs
    transient = root / "run" / "systemd" / "transient"
    transient.mkdir(parents=True)
    seen, webs = 0, []
    for i in range(shared):
        webs.append(node.container(f"web{i}", f"kubepods-burstable-podw{i}.slice", 500,
                                   f"w{i}", effective="0-47"))  # fmt: skip
        (transient / f"crio-web{i}.scope").write_text("[Scope]\nAllowedCPUs=0-47\n")
        assert node.hook(f"web{i}") == 0, node.err.getvalue()
        seen = systemd_keeps(fake_systemd, root, seen)
    calls_per_start = []
    for n, (exclusive, pool) in enumerate([("1,25", POOL), ("2,26", "0,3-24,27-47")]):
        for web in webs:  # what the kernel will report once the shared scopes shrink
            (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text(pool)
        db = node.container(f"pg{n}", f"kubepods-poddb{n}.slice", 2000, f"db{n}",
                            effective=exclusive, mems_effective="0")  # fmt: skip
        (transient / f"crio-pg{n}.scope").write_text("[Scope]\nAllowedCPUs=0-47\n")
        assert node.hook(f"pg{n}") == 0, node.err.getvalue()
        assert node.fake.read(db, "cpuset.cpus") == exclusive
        assert {node.fake.read(web, "cpuset.cpus") for web in webs} <= {pool}
        calls = fake_systemd.calls()[seen:]
        calls_per_start.append([(c["unit"], c["properties"] == RELEASE) for c in calls])
        seen = systemd_keeps(fake_systemd, root, seen)
    # The new container's own scope, set and kept; no shared scope is asked, nor pg0 again.
    assert calls_per_start == [[(f"crio-pg{n}.scope", False)] for n in range(2)]


def test_the_hook_asks_systemd_nothing_for_scopes_that_hold_no_cpuset(tmp_path, systemd):
    """A scope created with no cpuset in its spec (CRI-O's usual) is bare from the start: a
    shared one is never asked; the new exclusive container's is set once and kept."""
    bus, fake_systemd = systemd
    node = HookNode(tmp_path, bus.socket)
    transient = node.sysfs.parent / "run" / "systemd" / "transient"
    transient.mkdir(parents=True)
    for unit in ("crio-nginx.scope", "crio-pg.scope"):
        (transient / unit).write_text("[Scope]\nDelegate=yes\n")
    web = node.container("nginx", "kubepods-burstable-podweb.slice", 500, "web", effective="0-47")
    assert node.hook("nginx") == 0, node.err.getvalue()
    (node.fake.root / web.strip("/") / "cpuset.cpus.effective").write_text(POOL)
    node.container("pg", "kubepods-poddb.slice", 2000, "db", effective="1,25", mems_effective="0")
    assert node.hook("pg") == 0, node.err.getvalue()
    assert node.fake.read(web, "cpuset.cpus") == POOL
    assert [(c["unit"], c["properties"] == RELEASE) for c in fake_systemd.calls()] == [
        ("crio-pg.scope", False)
    ]


def test_the_hook_says_when_systemd_did_not_take_a_cpuset(tmp_path, systemd):
    bus, _ = systemd
    node = HookNode(tmp_path, bus.socket)
    node.container("pg-denied", "kubepods-poddb.slice", 2000, "db", effective="1,25",
                   mems_effective="0")  # fmt: skip
    assert node.hook("pg-denied") == 0  # the cgroup is written: the container runs pinned
    [record] = [r for r in node.records if r["ACTION"] == "systemd"]
    assert "crio-pg-denied.scope" in record["MESSAGE"]
