"""``[nri] pin_at = "start"``: never consulted at CreateContainer, each container decided and
its cgroup written at StartContainer, before its first instruction.  Cgroups are a FAKE v2
tree below the generated sysfs (this machine's cgroups are v1, not ours to move); the
e2e test on real containerd is tests/e2e/test_start_pinning.py."""

from __future__ import annotations

import asyncio

import pytest
from fake_cgroup_v2 import FakeV2
from nri_messages import container, pod
from test_deadline import Records, holders, on_disk  # noqa: F401 (holders: a fixture)
from test_earmarks import guaranteed_pod
from topologies import build

from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.daemon.deadline import DeadlinePlugin
from nri_cpuplugin.nri.handlers import EVENT_BITS
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.stub import Stub
from nri_cpuplugin.ops.audit import Audit
from nri_cpuplugin.ops.config import ConfigError, Settings, parse_toml

POOL = "0,2-24,26-47"  # once the pod's earmark (CPUs 1 and 25) left the shared pool


def node(tmp_path, budget: float = 1.5) -> tuple[DeadlinePlugin, FakeV2, Records]:
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    (root / "fs").mkdir()
    fake = FakeV2(root / "fs" / "cgroup")
    (fake.root / "cpuset.cpus.effective").write_text("0-47\n")
    settings = Settings(
        sysfs=str(root),
        state_dir=str(tmp_path / "state"),
        reserved_cpu_count=2,
        nri_pin_at="start",
        nri_request_budget=budget,
    )
    records = Records()
    return DeadlinePlugin(settings, Audit(records)), fake, records


def in_cgroup(fake: FakeV2, ctr: pb.Container, effective: str, **files: str) -> pb.Container:
    """``ctr`` with the cgroup the runtime made for it: no cpuset of its own (its spec names
    none), so the kernel shows its pod's CPUs (the fake: ``effective``)."""
    ctr.linux.cgroups_path = f"/kubepods/pod{ctr.name}/{ctr.name}"
    fake.mk(ctr.linux.cgroups_path, effective=effective, **files)
    return ctr


def test_pinning_at_start_is_not_consulted_at_creation(tmp_path):
    plugin, _, _ = node(tmp_path)
    plugin.stub = Stub(plugin, "cpuplugin", "50")
    events = asyncio.run(plugin.configure("", "containerd", "v2.1.9"))
    assert events == plugin.stub.handled_events & ~EVENT_BITS["create_container"]
    assert events & EVENT_BITS["start_container"] and events & EVENT_BITS["run_pod_sandbox"]
    assert parse_toml('[nri]\npin_at = "start"', "t") == {"nri_pin_at": "start"}
    with pytest.raises(ConfigError, match=r"nri\.pin_at = 'later': expected one of create, start"):
        parse_toml('[nri]\npin_at = "later"', "t")


def test_containers_are_decided_and_written_when_they_start(tmp_path):
    """A shared container starts on the pool; a Guaranteed pod's earmark moves it; the pod's
    exclusive container, created from the pod's cgroup, is written before it starts: cpuset,
    memory node, quota lifted - committed, and nothing owed but its stored spec, which lags as
    a moved shared container's does."""
    plugin, fake, records = node(tmp_path)
    web = pod("web", "burstable")
    nginx = in_cgroup(fake, container("nginx", web, 500), effective="0-47")
    db = guaranteed_pod("db", 2000)
    pg = in_cgroup(
        fake, container("pg", db, 2000), "1,25", mems_effective="0", cpu_max="200000 100000"
    )

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        await plugin.start_container(web, nginx)
        assert nginx.id in plugin.state.sharing
        assert fake.read(nginx.linux.cgroups_path, "cpuset.cpus") == ""  # already on the pool
        (fake.root / nginx.linux.cgroups_path.strip("/") / "cpuset.cpus.effective").write_text(
            POOL
        )  # what the kernel shows once the earmark's write below is made
        await plugin.run_pod_sandbox(db)
        assert fake.read(nginx.linux.cgroups_path, "cpuset.cpus") == POOL
        await plugin.start_container(db, pg)
        assert await plugin.drain()

    asyncio.run(scenario())
    assert fake.read(pg.linux.cgroups_path, "cpuset.cpus") == "1,25"
    assert fake.read(pg.linux.cgroups_path, "cpuset.mems") == "0"
    assert fake.read(pg.linux.cgroups_path, "cpu.max") == "max 100000"
    assert on_disk(plugin).assignments[pg.id].cpus == plugin.state.assignments[pg.id].cpus
    assert "uid-db" not in plugin.state.earmarks and not plugin._owed
    mine = [r["ACTION"] for r in records if r.get("CONTAINER_ID") == pg.id]
    assert mine == ["allocate", "nic-locality"]
    # Its next start (the runtime's retry, say) is no decision: it is placed already.
    assert not plugin._decides_at_start(pg.id)


def test_a_container_of_the_systemd_driver_is_refused_with_what_to_do(tmp_path):
    plugin, _, records = node(tmp_path)
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)
    pg.linux.cgroups_path = "kubepods-poddb.slice:cri-containerd:pg"
    web = pod("web", "burstable")
    running = container("nginx", web, 500)
    running.linux.cgroups_path = "kubepods-burstable-podweb.slice:cri-containerd:nginx"

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([web], [running])  # said at once, before any refusal
        [warning] = [r for r in records.of("config") if r.get("REASON")]
        assert "1 of the runtime's containers" in warning["MESSAGE"]
        with pytest.raises(PolicyError, match=r'systemd.*set pin_at = "create"'):
            await plugin.start_container(db, pg)

    asyncio.run(scenario())
    assert pg.id not in plugin.state.assignments and records.of("refuse")


def test_a_start_that_cannot_write_its_cgroup_is_refused(tmp_path):
    plugin, _, _ = node(tmp_path)
    db = guaranteed_pod("db", 2000)
    pg = container("pg", db, 2000)
    pg.linux.cgroups_path = "/kubepods/poddb/gone"  # no such cgroup

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        with pytest.raises(PolicyError, match="written to its cgroup '/kubepods/poddb/gone'"):
            await plugin.start_container(db, pg)

    asyncio.run(scenario())


def test_an_exclusive_start_not_decided_in_time_is_refused_and_undone(tmp_path, holders):  # noqa: F811
    """The state lock held elsewhere: the StartContainer that decides an exclusive container
    is answered with an error within the budget, and what the late job decided is released
    again (the runtime does not start the container)."""
    plugin, fake, records = node(tmp_path, budget=0.3)
    db = guaranteed_pod("db", 2000)
    pg = in_cgroup(fake, container("pg", db, 2000), effective="1,25")

    async def scenario():
        await plugin.configure("", "containerd", "v2.1.9")
        await plugin.synchronize([], [])
        holder = holders(plugin.settings.state_dir)
        with pytest.raises(PolicyError, match=r"within 0\.3 s.*not started now"):
            await plugin.start_container(db, pg)
        holder.release()
        assert await plugin.drain()

    asyncio.run(scenario())
    assert pg.id not in plugin.state.assignments
    assert records.of("deadline") and records.of("deadline-late")
