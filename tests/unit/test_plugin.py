"""The daemon's NRI handlers (the adapter of the composition ``run`` builds), called with real
NRI messages, on a generated 48-CPU topology."""

from __future__ import annotations

import json

import pytest
from builders import container, pod
from daemon_driver import Driver, Records
from fake_cgroup_v2 import FakeV2, on_generated_node
from topologies import build

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import PolicyError
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.hardware.liveness import Liveness
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.config import ConfigError, Settings

P = CPUSet.parse


def actions(records: Records) -> list[str]:
    return [r["ACTION"] for r in records]


def restart(plugin: Driver, records: Records | None = None) -> Driver:
    """A new daemon on the same state directory (kill -9 and restart): the old one's claim
    goes with it."""
    plugin.close()
    return Driver(plugin.node.file_settings, records)


@pytest.fixture
def node(tmp_path):
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    settings = Settings(sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2)
    plugin = Driver(settings)
    plugin.configure()
    yield plugin, plugin.records
    plugin.close()


def cpu_of(message) -> tuple[str, str, int | None]:
    cpu = message.linux.resources.cpu
    return cpu.cpus, cpu.mems, cpu.quota.value if cpu.HasField("quota") else None


def test_exclusive_container_is_born_pinned_and_siblings_shrink_in_the_same_reply(node):
    plugin, records = node
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    db = pod("db")
    adjust, updates = plugin.create_container(db, container("postgres", db, 2000))
    assert cpu_of(adjust) == ("1,25", "0", 0)  # 0,24 reserved; no CFS quota (0 at creation)
    assert [(u.container_id[:5], cpu_of(u), u.ignore_failure) for u in updates] == [
        ("nginx", ("0,2-24,26-47", "", None), True)
    ]
    assert "allocate" in actions(records) and "shared-resize" in actions(records)
    allocate = next(r for r in records if r["ACTION"] == "allocate")
    assert allocate["CPUS"] == "1,25" and allocate["POD_NAME"] == "db"


def test_unsatisfiable_request_fails_closed_and_is_audited(node):
    plugin, records = node
    db = pod("db")
    with pytest.raises(PolicyError, match="asks for 60 exclusive CPUs"):
        plugin.create_container(db, container("huge", db, 60000))
    assert records[-1]["ACTION"] == "refuse" and records[-1]["PRIORITY"] == "3"
    assert not plugin.state.assignments


def test_update_container_never_undoes_pinning(node):
    plugin, _ = node
    db = pod("db")
    ctr = container("postgres", db, 2000)
    plugin.create_container(db, ctr)
    requested = pb.LinuxResources()
    requested.cpu.cpus = "0-47"
    [update] = plugin.update_container(db, ctr, requested)
    assert cpu_of(update) == ("1,25", "0", -1) and not update.ignore_failure


def resources(milli: int) -> pb.LinuxResources:
    """What an in-place resize sends: kubelet's shares and quota for a new request/limit."""
    r = pb.LinuxResources()
    r.cpu.shares.value = max(2, milli * 1024 // 1000)
    r.cpu.quota.value = milli * 100
    r.cpu.period.value = 100000
    return r


def test_in_place_resize_grows_shrinks_and_is_refused_when_it_cannot_grow(node):
    plugin, records = node
    web = pod("web", "burstable")
    plugin.create_container(web, container("nginx", web, 500))
    db = pod("db")
    ctr = container("postgres", db, 2000)
    plugin.create_container(db, ctr)
    sibling, mine = plugin.update_container(db, ctr, resources(4000))
    assert cpu_of(mine) == ("1-2,25-26", "0", -1) and not mine.ignore_failure
    assert sibling.ignore_failure and not set(CPUSet.parse(sibling.linux.resources.cpu.cpus)) & {
        1,
        2,
        25,
        26,
    }
    assert actions(records)[-2:] == ["resize", "shared-resize"]
    [sibling, mine] = plugin.update_container(db, ctr, resources(2000))
    assert cpu_of(mine)[0] == "1,25"  # back on the CPUs it started with
    with pytest.raises(PolicyError, match="asks to grow from 2 to 48"):
        plugin.update_container(db, ctr, resources(48000))
    assert actions(records)[-1] == "refuse"
    assert plugin.state.assignments[ctr.id].cpus == P("1,25")  # nothing changed
    restarted = restart(plugin)
    restarted.daemon.load_state()
    assert restarted.state.assignments[ctr.id].cpus == P("1,25")
    restarted.close()


def test_a_container_resized_from_exclusive_to_shared_gets_the_node_memory_nodes_back(
    node, tmp_path
):
    """Exclusive CPUs came with their NUMA node's memory (``cpuset.mems`` 0); in the shared
    pool its memory may come from every node its pod's cgroup may use again (on the fake v2
    tree: node 1 only, to tell it from the root's 0-1), or the root's where its cgroup is not
    known."""
    plugin, _ = node
    fake = FakeV2(tmp_path / "fake-cgroup2")
    fake.mk("kubepods/poddb", mems_effective="1")
    plugin.node.liveness.root = str(fake.root)
    assert plugin.node.liveness.layout() is not None
    db = pod("db")
    ctr = container("postgres", db, 2000)
    ctr.linux.cgroups_path = "/kubepods/poddb/postgres"
    plugin.create_container(db, ctr)
    [mine] = plugin.update_container(db, ctr, resources(1500))
    assert cpu_of(mine) == ("0-47", "1", None) and not mine.ignore_failure
    [again] = plugin.update_container(db, ctr, resources(1200))  # shared to shared
    assert cpu_of(again) == ("0-47", "", None)
    other = container("redis", db, 2000)  # no cgroup path known
    plugin.create_container(db, other)
    updates = plugin.update_container(db, other, resources(500))
    [theirs] = [u for u in updates if u.container_id == other.id]
    assert cpu_of(theirs) == ("0-47", "0-1", None)


def test_removing_an_earlier_sandbox_of_a_pod_leaves_its_newer_sandbox_alone(node):
    """kubelet recreates a pod's sandbox under the same uid and garbage-collects the old one
    later: that RemovePodSandbox must not release the CPUs of the new sandbox's container."""
    plugin, records = node
    old = pod("db")
    first = container("pg", old, 2000)
    plugin.create_container(old, first)
    plugin.stop_container(old, first)
    plugin.remove_container(old, first)
    new = pod("db")
    new.id = "sb-db-2"  # same uid
    second = container("pg2", new, 2000)
    plugin.create_container(new, second)
    held = plugin.state.assignments[second.id].cpus
    plugin.remove_pod_sandbox(old)
    assert plugin.state.assignments[second.id].cpus == held
    assert not held & plugin.state.shared
    assert "earlier sandbox" in records[-1]["MESSAGE"]
    plugin.remove_pod_sandbox(new)  # its own removal does release it
    assert second.id not in plugin.state.assignments


def test_pod_update_keeps_the_pods_cpusets_and_is_audited(node):
    plugin, records = node
    pushed = []  # unsolicited UpdateContainers: never sent, they can deadlock the runtime
    plugin.daemon.stub = type(
        "Stub", (), {"schedule_update_containers": lambda _, u, done: pushed.extend(u)}
    )()
    db = pod("db")
    postgres, sidecar = container("postgres", db, 2000), container("sidecar", db, 500)
    plugin.create_container(db, postgres)
    plugin.create_container(db, sidecar)
    other = pod("web", "burstable")
    plugin.create_container(other, container("nginx", other, 500))
    resized = pb.LinuxResources()
    resized.cpu.shares.value = 2560  # 2500m requested for the pod ...
    resized.cpu.quota.value, resized.cpu.period.value = 300000, 100000  # ... 3 CPUs limit
    plugin.update_pod_sandbox(db, pb.LinuxResources(), resized)
    record, outside = records[-2:]
    assert record["ACTION"] == "pod-update" and record["POD_NAME"] == "db"
    assert (record["CPU_REQUEST_MILLI"], record["CPU_LIMIT_MILLI"]) == ("2500", "3000")
    assert "(1 exclusive)" in record["MESSAGE"]
    # Its own containers (not the other pod's) get their cpusets again: written directly
    # where there are cgroups (this generated tree has none), else with the runtime's next
    # reply that can carry updates - here an UpdateContainer of the other pod's container.
    assert outside["ACTION"] == "outside-reply" and outside["CAUSE"] == "pod resized"
    assert (outside["WRITTEN"], outside["OWED"]) == ("0", "2") and pushed == []
    nginx = container("nginx", other, 500)
    reply = plugin.update_container(other, nginx, pb.LinuxResources())
    assert [(u.container_id[:8], u.linux.resources.cpu.cpus) for u in reply] == [
        ("postgres", "1,25"),
        ("sidecar0", "0,2-24,26-47"),
        ("nginx000", "0,2-24,26-47"),  # the container being updated comes last
    ]
    assert [u.ignore_failure for u in reply] == [True, True, False]
    assert len(plugin.update_container(other, nginx, pb.LinuxResources())) == 1  # told once
    plugin.update_pod_sandbox(pod("unknown"), pb.LinuxResources(), pb.LinuxResources())
    assert pushed == [] and records[-1]["MESSAGE"].endswith(
        "limit none): cpusets of its 0 containers kept (0 exclusive)"
    )


def test_a_container_created_with_an_old_pool_is_moved_before_it_starts(node, monkeypatch):
    """Two pods start at once: a shared container's CreateContainer is answered with the pool
    of that moment, then an exclusive allocation shrinks the pool before the shared one has a
    cgroup to write.  At its StartContainer (cgroup created, nothing run yet) it is written;
    a container whose spec says what we would write costs nothing."""
    plugin, records = node
    written = []  # what reaches the cgroups (this generated tree has none to write)
    monkeypatch.setattr(plugin.node.writer, "write", lambda targets: written.extend(targets) or [])
    web = pod("web", "burstable")
    nginx = container("nginx", web, 500)
    adjust, _ = plugin.create_container(web, nginx)
    db = pod("db")
    postgres = container("postgres", db, 2000)
    mine, _ = plugin.create_container(db, postgres)
    written.clear()
    nginx.linux.resources.cpu.cpus = adjust.linux.resources.cpu.cpus  # its stored spec
    postgres.linux.resources.cpu.cpus = mine.linux.resources.cpu.cpus
    plugin.start_container(db, postgres)
    assert written == []
    plugin.start_container(web, nginx)
    assert [(t.container_id[:5], str(t.cpus)) for t in written] == [
        ("nginx", str(plugin.state.shared))
    ]
    assert records[-1]["REASON"] == "pool moved during creation"
    written.clear()
    nginx.linux.resources.cpu.cpus = str(plugin.state.shared)
    plugin.start_container(web, nginx)
    assert written == []


def test_stop_gives_cpus_back_to_every_shared_container(node):
    plugin, records = node
    web = pod("web", "besteffort")
    plugin.create_container(web, container("a", web, 0))
    plugin.create_container(web, container("b", web, 0))
    db = pod("db")
    ctr = container("postgres", db, 4000)
    plugin.create_container(db, ctr)
    updates = plugin.stop_container(db, ctr)
    assert sorted(u.container_id[:1] for u in updates) == ["a", "b"]
    assert {u.linux.resources.cpu.cpus for u in updates} == {"0-47"}
    assert records[-2]["ACTION"] == "release" and records[-1]["ACTION"] == "shared-resize"


def test_state_survives_a_restart_and_restarted_container_keeps_its_cpus(node, tmp_path):
    plugin, _ = node
    db = pod("db")
    plugin.create_container(db, container("other", db, 2000))
    first = container("postgres", db, 2000)
    adjust, _ = plugin.create_container(db, first)
    plugin.stop_container(db, first)
    # a new daemon on the same state directory (kill -9 and restart)
    again = restart(plugin)
    again.configure(version="v1.7.24")
    restarted = container("postgres2", db, 2000)
    restarted.name = "postgres"  # same pod and name, new id
    adjust2, _ = again.create_container(db, restarted)
    assert adjust2.linux.resources.cpu.cpus == adjust.linux.resources.cpu.cpus
    again.close()


def test_synchronize_rebuilds_and_returns_updates_for_everyone(node):
    plugin, records = node
    db, web = pod("db"), pod("web", "burstable")
    containers = [
        container("pinned", db, 2000, cpus="7,31"),
        container("unpinned", db, 1000, cpus="0-47"),
        container("shared", web, 250, cpus="0-47"),
        container("exited", web, 250, state=4),
    ]
    updates = plugin.synchronize([db, web], containers)
    got = {u.container_id[:8]: cpu_of(u)[0] for u in updates}
    assert got == {"pinned00": "7,31", "unpinned": "1", "shared00": "0,2-6,8-30,32-47"}
    notes = [r["MESSAGE"] for r in records if r["ACTION"] == "reconcile"]
    assert any("adopted 7,31" in n for n in notes) and "synchronize" in actions(records)


def test_synchronize_leaves_out_what_the_runtime_says_already(node):
    """Each update in a reply costs the runtime one `runc update`: a shared container whose
    stored spec already names the shared pool is not in the reply (a dense node reconnecting
    would otherwise pay for every container); one whose spec lags behind is."""
    plugin, _ = node
    db, web = pod("db"), pod("web", "burstable")
    plugin.create_container(db, container("pinned", db, 1000))
    pool = plugin.state.shared
    containers = [
        container("pinned", db, 1000, cpus=str(plugin.state.exclusive)),
        container("current", web, 250, cpus=str(pool)),
        container("lagging", web, 250, cpus="0-47"),
    ]
    updates = plugin.synchronize([db, web], containers)
    got = {u.container_id[:7] for u in updates}
    assert "lagging" in got and "current" not in got
    assert {cpu_of(u)[0] for u in updates if u.container_id.startswith("lagging")} == {str(pool)}


def test_a_new_container_is_told_quota_0_a_running_one_minus_1(node):
    """No CFS quota is 0 at creation (a new cgroup has none; -1 is what crun before 1.22 on
    systemd turns into 1 % of a CPU) and -1 for a running container, whose quota must be
    lifted; a spec that says 0 agrees with "no quota" at the next synchronize."""
    plugin, _ = node
    db = pod("db")
    adjust, _ = plugin.create_container(db, container("created", db, 1000))
    assert cpu_of(adjust)[2] == 0 and not adjust.linux.resources.cpu.HasField("period")
    held, mems, _ = cpu_of(adjust)
    as_created = container("created", db, 1000, cpus=held)  # the spec our adjustment made
    as_created.linux.resources.cpu.mems, as_created.linux.resources.cpu.quota.value = mems, 0
    kubelets = container("created", db, 1000, cpus=held)  # a spec with kubelet's quota
    kubelets.linux.resources.cpu.mems = mems
    assert plugin.synchronize([db], [as_created]) == []
    [update] = plugin.synchronize([db], [kubelets])
    assert cpu_of(update) == (held, mems, -1)


def test_corrupt_state_file_is_set_aside_and_the_daemon_starts(node, tmp_path):
    plugin, _ = node
    state_file = tmp_path / "state" / "state.json"
    state_file.write_text('{"version": 1, "truncated')
    records = Records()
    again = restart(plugin, records)
    again.configure()
    assert actions(records)[0] == "state-rebuild"
    assert list((tmp_path / "state").glob("state.json.bad-*"))
    assert json.loads(state_file.read_text())["assignments"] == {}
    again.close()


def test_runtime_config_string_is_applied_and_flags_win(tmp_path):
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    settings = Settings(sysfs=str(root), state_dir=str(tmp_path / "a"))
    plugin = Driver(settings, flags={"policy_options": ("full-pcpus-only",)})
    plugin.configure('reserved_cpus = "0-1,24-25"\npolicy_options = []', version="v1.7")
    assert plugin.node.policy.reserved == P("0-1,24-25")
    assert plugin.node.policy.options == {"full-pcpus-only"}
    with pytest.raises(ConfigError, match="unknown key 'reserve_cpus'"):
        plugin.configure("reserve_cpus = 2", version="v1.7")
    plugin.close()


def test_unverified_containers_cost_a_creation_nothing(node, tmp_path, monkeypatch):
    """1,000 containers known only from the state file (a restart without Synchronize): a
    creation does not check their cgroups; the sweep checks them a batch at a time."""
    plugin, _ = node
    pods, containers = [], []
    for i in range(1000):
        p = pod(f"old{i:04d}x", "burstable")  # (ids are names padded with 0s)
        c = container(f"old{i:04d}x", p, 100)
        c.linux.cgroups_path = f"/kubepods/burstable/pod{i}/{c.id}"
        pods.append(p)
        containers.append(c)
    plugin.synchronize(pods, containers)  # the earlier life knew them all (one commit)
    restarted = restart(plugin)
    restarted.daemon.load_state()
    assert len(restarted.node.unverified) == 1000
    asked = []  # every container still runs
    monkeypatch.setattr(Liveness, "alive", lambda self, path: asked.append(path) or True)
    for name, milli in (("web", 500), ("db", 2000)):
        p = pod(name, "burstable" if milli < 1000 else "guaranteed")
        restarted.create_container(p, container(name, p, milli))
    assert asked == []
    restarted.submit(ev.SweepRound())
    restarted.submit(ev.SweepRound())
    assert len(asked) == 64 and len(set(asked)) == 64  # in turn: not the first batch again
    assert len(restarted.node.unverified) == 1000  # alive: still watched
    restarted.close()


def test_an_ended_exclusive_holder_is_found_when_its_cpus_are_needed(node, monkeypatch):
    plugin, records = node
    big = pod("big")
    c = container("big", big, 44000)  # every CPU but the reserved ones and one core
    c.linux.cgroups_path = "/kubepods/podbig/big"
    plugin.create_container(big, c)
    restarted = restart(plugin, records)
    restarted.daemon.load_state()
    monkeypatch.setattr(Liveness, "alive", lambda self, path: path != "/kubepods/podbig/big")
    db = pod("db")
    adjust, _ = restarted.create_container(db, container("postgres", db, 4000))
    assert adjust.linux.resources.cpu.cpus  # placed, on CPUs the ended container held
    assert "big" not in "".join(restarted.state.assignments)
    restarted.close()


def test_followers_are_written_directly_on_a_fake_cgroup_v2_tree(tmp_path):
    """The daemon's direct writes on cgroup v2 (a FAKE tree below the generated sysfs: this
    machine's cgroups are v1, and the fake's effective sets stay as the test sets them).  A
    follower whose effective set comes out as asked is done; a container of the systemd driver
    goes to the runtime in the reply; so does one whose ancestors do not offer the CPUs (v2:
    effective = what it asks for, within its parent's): the writes come before the answer."""
    root, fake = on_generated_node(tmp_path)
    settings = Settings(
        sysfs=str(root), state_dir=str(tmp_path / "state"), reserved_cpu_count=2,
        systemd_bus="off",  # whatever this machine runs: no systemd to set a unit's cpuset
    )  # fmt: skip
    plugin = Driver(settings)
    plugin.configure()
    web = pod("web", "burstable")
    written, refused, unit = (container(n, web, 500) for n in ("written", "refused", "unit"))
    written.linux.cgroups_path = "/kubepods/burstable/podweb/written"
    refused.linux.cgroups_path = "/kubepods/burstable/podweb/refused"
    unit.linux.cgroups_path = "kubepods-burstable-podweb.slice:cri-containerd:unit"
    pool = "0,2-24,26-47"  # once CPUs 1 and 25 are exclusive
    fake.mk(written.linux.cgroups_path, cpus="0-47", effective=pool)
    fake.mk(refused.linux.cgroups_path, cpus="0-47", effective="0-47")
    for c in (written, refused, unit):
        plugin.create_container(web, c)
    db = pod("db")
    adjust, updates = plugin.create_container(db, container("postgres", db, 2000))
    assert cpu_of(adjust)[0] == "1,25"
    assert fake.read(written.linux.cgroups_path, "cpuset.cpus") == pool
    assert sorted(u.container_id for u in updates) == sorted([refused.id, unit.id])
    assert all(u.linux.resources.cpu.cpus == pool for u in updates)
    # What the kernel would not apply as written was put back; the runtime applies it instead.
    assert fake.read(refused.linux.cgroups_path, "cpuset.cpus") == "0-47"
    late = container("late", web, 100)
    _, updates = plugin.create_container(web, late)
    assert list(updates) == []  # nothing owed: the runtime had it with the answer
    plugin.close()
