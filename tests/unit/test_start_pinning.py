"""``[nri] pin_at = "start"``: never consulted at CreateContainer, each container decided and
its cgroup written at StartContainer, before its first instruction.  Cgroups are a FAKE v2
tree below the generated sysfs (this machine's cgroups are v1, not ours to move); the
e2e test on real containerd is tests/e2e/test_start_pinning.py."""

from __future__ import annotations

import asyncio

import pytest
from builders import container, guaranteed_pod, pod
from daemon_driver import Records, on_disk
from fake_cgroup_v2 import FakeV2, on_generated_node

from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.daemon.service import Daemon
from nri_cpuplugin.nri.handlers import EVENT_BITS
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub
from nri_cpuplugin.ops.config import ConfigError, Settings, parse_toml

POOL = "0,2-24,26-47"  # once the pod's earmark (CPUs 1 and 25) left the shared pool


def node(daemons, tmp_path, budget: float = 1.5) -> tuple[Daemon, FakeV2, Records]:
    """The daemon on the generated 48-CPU node, its cgroups a FAKE v2 tree (no systemd to
    reach: only the cgroupfs driver's cgroups are the daemon's to write)."""
    root, fake = on_generated_node(tmp_path)
    settings = Settings(
        sysfs=str(root),
        state_dir=str(tmp_path / "state"),
        reserved_cpu_count=2,
        nri_pin_at="start",
        nri_request_budget=budget,
        systemd_bus="off",
    )
    daemon, records = daemons(settings)
    return daemon, fake, records


def in_cgroup(fake: FakeV2, ctr: pb.Container, effective: str, **files: str) -> pb.Container:
    """``ctr`` with the cgroup the runtime made for it: no cpuset of its own (its spec names
    none), so the kernel shows its pod's CPUs (the fake: ``effective``)."""
    ctr.linux.cgroups_path = f"/kubepods/pod{ctr.name}/{ctr.name}"
    fake.mk(ctr.linux.cgroups_path, effective=effective, **files)
    return ctr


def test_pinning_at_start_is_not_consulted_at_creation(tmp_path, daemons):
    daemon, _, _ = node(daemons, tmp_path)
    daemon.stub = Stub(daemon.adapter, "cpuplugin", "50")
    events = asyncio.run(daemon.adapter.configure("", "containerd", "v2.1.9"))
    assert events == daemon.stub.handled_events & ~EVENT_BITS["create_container"]
    assert events & EVENT_BITS["start_container"] and events & EVENT_BITS["run_pod_sandbox"]
    assert parse_toml('[nri]\npin_at = "start"', "t") == {"nri_pin_at": "start"}
    with pytest.raises(ConfigError, match=r"nri\.pin_at = 'later': expected one of create, start"):
        parse_toml('[nri]\npin_at = "later"', "t")


def test_containers_are_decided_and_written_when_they_start(tmp_path, daemons):
    """A shared container starts on the pool; a Guaranteed pod's earmark moves it; the pod's
    exclusive container, created from the pod's cgroup, is written before it starts: cpuset,
    memory node, quota lifted - committed, and nothing owed but its stored spec, which lags as
    a moved shared container's does."""
    daemon, fake, records = node(daemons, tmp_path)
    nri = daemon.adapter
    web = pod("web", "burstable")
    nginx = in_cgroup(fake, container("nginx", web, 500), effective="0-47")
    db = guaranteed_pod("db", 2000)
    pg = in_cgroup(
        fake, container("pg", db, 2000), "1,25", mems_effective="0", cpu_max="200000 100000"
    )

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        await nri.start_container(web, nginx)
        assert nginx.id in daemon.node.state.sharing
        assert fake.read(nginx.linux.cgroups_path, "cpuset.cpus") == ""  # already on the pool
        (fake.root / nginx.linux.cgroups_path.strip("/") / "cpuset.cpus.effective").write_text(
            POOL
        )  # what the kernel shows once the earmark's write below is made
        await nri.run_pod_sandbox(db)
        assert fake.read(nginx.linux.cgroups_path, "cpuset.cpus") == POOL
        await nri.start_container(db, pg)
        assert await daemon.drain()

    asyncio.run(scenario())
    assert fake.read(pg.linux.cgroups_path, "cpuset.cpus") == "1,25"
    assert fake.read(pg.linux.cgroups_path, "cpuset.mems") == "0"
    assert fake.read(pg.linux.cgroups_path, "cpu.max") == "max 100000"
    state = daemon.node.state
    assert on_disk(daemon).assignments[pg.id].cpus == state.assignments[pg.id].cpus
    assert "uid-db" not in state.earmarks and not daemon.node.owed
    mine = [r["ACTION"] for r in records if r.get("CONTAINER_ID") == pg.id]
    assert mine == ["allocate", "nic-locality"]
    # Its next start (the runtime's retry, say) is no decision: it is placed already.
    assert not daemon.node.query_decides_at_start(pg.id)


def test_a_container_of_the_systemd_driver_is_refused_with_what_to_do(tmp_path, daemons):
    daemon, _, records = node(daemons, tmp_path)
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)
    pg.linux.cgroups_path = "kubepods-poddb.slice:cri-containerd:pg"
    web = pod("web", "burstable")
    running = container("nginx", web, 500)
    running.linux.cgroups_path = "kubepods-burstable-podweb.slice:cri-containerd:nginx"

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([web], [running])  # said at once, before any refusal
        [warning] = [r for r in records.of("config") if r.get("REASON")]
        assert "1 of the runtime's containers" in warning["MESSAGE"]
        with pytest.raises(PolicyError, match=r'systemd.*set pin_at = "create"'):
            await nri.start_container(db, pg)

    asyncio.run(scenario())
    assert pg.id not in daemon.node.state.assignments and records.of("refuse")


def test_a_start_that_cannot_write_its_cgroup_is_refused(tmp_path, daemons):
    daemon, _, _ = node(daemons, tmp_path)
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)
    pg.linux.cgroups_path = "/kubepods/poddb/gone"  # no such cgroup

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        with pytest.raises(PolicyError, match="written to its cgroup '/kubepods/poddb/gone'"):
            await nri.start_container(db, pg)

    asyncio.run(scenario())


def test_an_exclusive_start_not_decided_in_time_is_refused_and_undone(tmp_path, daemons, holders):
    """The state lock held elsewhere: the StartContainer that decides an exclusive container
    is answered with an error within the budget, and what the late job decided is released
    again (the runtime does not start the container)."""
    daemon, fake, records = node(daemons, tmp_path, budget=0.3)
    nri = daemon.adapter
    db = guaranteed_pod("db", 2000)
    pg = in_cgroup(fake, container("pg", db, 2000), effective="1,25")

    async def scenario():
        await nri.configure("", "containerd", "v2.1.9")
        await nri.synchronize([], [])
        holder = holders(daemon.node.settings.state_dir)
        with pytest.raises(PolicyError, match=r"within 0\.3 s.*not started now"):
            await nri.start_container(db, pg)
        holder.release()
        assert await daemon.drain()

    asyncio.run(scenario())
    assert pg.id not in daemon.node.state.assignments
    assert records.of("deadline") and records.of("deadline-late")
