"""Placement under races and refusals (issue: no shared container may run on exclusive CPUs, no
refusal may keep CPUs, no earmark may split a core): each finding reproduced as the runtime
orders things, in process, on the production composition (tests/daemon_driver.py) or the
policy itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from builders import container, pod, workload
from model_runtime import MACHINE, Ctr, ModelNode, cpu_event, cpuset_request, resize_request
from topologies import topology

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.policy import StaticPolicy
from nri_cpuplugin.core.state import Earmark
from nri_cpuplugin.storage.store import StateStore

P = CPUSet.parse


def earmarked(policy: StaticPolicy, limit: int):
    wanted = Earmark(CPUSet(), "sb-a", limit, pod_name="a", pod_namespace="ns")
    return policy.earmark(policy.empty_state(), "pod-a", wanted)


def whole_cores(policy: StaticPolicy, cpus: CPUSet) -> bool:
    """Every core these CPUs touch is theirs whole."""
    siblings = policy.topology.siblings
    return all(siblings(cpu) <= cpus for cpu in cpus)


# --- an earmark trimmed by a claim keeps whole cores ---------------------------------------------


@pytest.mark.parametrize("options", [(), ("full-pcpus-only",)])
def test_a_trimmed_earmark_keeps_whole_cores_for_the_container_that_takes_it(options):
    """A pod of sidecar 500m + main 2 CPUs + 500m (limit 3 CPUs): its earmark has a whole core
    and a thread of another.  The first sidecar claims 500m, and two whole CPUs stay earmarked:
    they must be one core (threads N and N+24 here), not the lowest two ids (1 and 2, halves of
    two cores whose siblings then run shared containers)."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    policy = StaticPolicy(policy.topology, policy.reserved, options)
    state = earmarked(policy, 3000)
    _, state = policy.admit(state, workload(500, pod="pod-a", name="sidecar", qos="guaranteed"))
    kept = state.earmarks["pod-a"].cpus
    assert len(kept) == 2 and whole_cores(policy, kept)
    decision, state = policy.admit(state, workload(2000, pod="pod-a", name="main"))
    assert decision.cpus == kept and whole_cores(policy, decision.cpus)


# --- init containers, as kubelet annotates them ---------------------------------------------------


def test_kubelets_container_type_annotation_makes_an_init_container():
    """kubelet annotates every container with its kind in the pod spec; the runtime's view has
    nothing else to tell an init container by (NRI and OCI alike)."""
    from nri_cpuplugin.core.workload import CONTAINER_TYPE, from_nri
    from nri_cpuplugin.hook.oci import OCIConfig, OCIState, from_oci

    db = pod("db")
    init = container("migrate", db, 1000)
    init.annotations[CONTAINER_TYPE] = "init"
    app = container("pg", db, 1000)
    app.annotations[CONTAINER_TYPE] = "container"
    assert from_nri(db, init).kind == "init"
    assert from_nri(db, app).kind == "app"
    assert from_nri(db, container("old", db, 1000)).kind == "app"  # an older kubelet: none
    state = OCIState("c1", "created", 1, "/b", {})
    config = OCIConfig({CONTAINER_TYPE: "init"}, 1024, None, None)
    assert from_oci(state, config, "/kubepods/poddb/c1", ("uid", "db", "ns", "c")).kind == "init"


def test_an_init_container_claims_nothing_and_its_cpus_serve_the_app_container():
    """Pod: an init container of 2 CPUs, then an app container of 2 CPUs (kubelet's pod limit:
    the larger, 2 CPUs).  The init container takes the earmark; once it has finished, the app
    container gets its CPUs again."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 2000)
    init = workload(2000, pod="pod-a", name="migrate", kind="init")
    first, state = policy.admit(state, init)
    _, state = policy.release(state, init.container_id)
    decision, state = policy.admit(state, workload(2000, pod="pod-a", name="main"))
    assert decision.cpus == first.cpus and "init containers' CPUs" in decision.reason


def test_a_sidecar_claims_its_share_when_the_app_container_comes():
    """kubelet annotates a sidecar (a restartable init container) "init" too: still running
    when the app container is created, it claims its limit then, and the earmark keeps no CPU
    that no container of the pod can ask for."""
    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 3500)  # sidecar 1.5 CPUs (shared) + main 2 CPUs
    sidecar = workload(1500, pod="pod-a", name="proxy", kind="init")
    _, state = policy.admit(state, sidecar)
    assert len(state.earmarks["pod-a"].cpus) == 3  # not decided yet: it may be a plain init
    _, state = policy.admit(state, workload(2000, pod="pod-a", name="main"))
    assert "pod-a" not in state.earmarks  # claimed whole: 1.5 + 2 CPUs
    assert state.shared == policy.shareable - state.exclusive


def test_deferred_init_containers_are_kept_in_the_state_file_and_checked():
    from nri_cpuplugin.base import jsonbytes
    from nri_cpuplugin.core import state as state_mod

    policy = StaticPolicy.from_config(topology("xeon-e5-2680v3-2s"), reserved_count=2)
    state = earmarked(policy, 3500)
    _, state = policy.admit(state, workload(1500, pod="pod-a", name="proxy", kind="init"))
    again = state_mod.decode(state_mod.encode(state))
    assert again.earmarks["pod-a"].deferred == state.earmarks["pod-a"].deferred != ()
    doc = state_mod.to_document(state)
    doc["earmarks"]["pod-a"]["deferred"] = [["c", "proxy", -5]]
    doc["checksum"] = state_mod.checksum(doc)
    with pytest.raises(state_mod.StateFormatError, match=r"\[id, name, millicores\]"):
        state_mod.decode(jsonbytes.dumps(doc))


# --- the runtime's ordering, modelled (tests/model_runtime.py) ------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> Iterator[Callable[..., ModelNode]]:
    """``model(driver, units, pin_at) -> ModelNode``: the production daemon on the FAKE node of
    the model-based test (tests/unit/test_model_races.py), 12 CPUs (a core's threads N and
    N+6; 0 and 6 reserved), closed at the end."""
    made: list[ModelNode] = []

    def make(
        driver: str = "cgroupfs", units: bool = False, pin_at: str = "create", lists: bool = True
    ) -> ModelNode:
        base = tmp_path / f"node{len(made)}"
        made.append(ModelNode(base, driver, units, pin_at, lists=lists))
        return made[-1]

    yield make
    for node in made:
        node.close()


def on_exclusive(node: ModelNode, ctr: Ctr) -> CPUSet:
    """The CPUs of others' exclusive sets (assignments, earmarks) the container's cgroup is on."""
    state = node.state
    held = state.assignments.get(ctr.id)
    return (node.on(ctr) or CPUSet()) & (state.exclusive - (held.cpus if held else CPUSet()))


def held_anywhere(node: ModelNode, cid: str) -> bool:
    """Whether CPUs are assigned to the container, in memory or in the state file."""
    disk = StateStore(node.settings.state_dir).peek().state
    return cid in node.state.assignments or (disk is not None and cid in disk.assignments)


def test_an_update_applied_after_an_earmark_is_set_right_at_post_update(model):
    """Finding 1: UpdateContainer of a shared container is answered with the pool; another
    pod's RunPodSandbox earmarks CPUs of it (the container is written off them at once); then
    the runtime applies the update's own entry - the older pool - outside its NRI lock.  Its
    PostUpdateContainer puts the container back off the earmark."""
    node = model()
    runtime = node.runtime
    web = node.pod("web", "burstable").add("nginx", 500)
    node.up(web)
    [nginx] = web.containers
    runtime.update(nginx, cpuset_request(MACHINE.online))
    db = node.pod("db").add("pg", 2000, 2000)
    runtime.run_pod(db)
    node.host.quiesce()
    assert not on_exclusive(node, nginx)
    runtime.apply_own(nginx)
    node.host.quiesce()
    assert not on_exclusive(node, nginx), f"nginx runs on {node.on(nginx)}"
    [moved] = [r for r in node.records.of("share") if r["REASON"] == "older answer applied"]
    assert moved["MOVED"] == "yes" and CPUSet.parse(moved["CPUS"]) == node.on(nginx)


def create_then_earmark(node: ModelNode) -> Ctr:
    """A shared container is created (answered with the pool of then); another pod's
    RunPodSandbox earmarks CPUs of that pool before the container has a cgroup to write."""
    web = node.pod("web", "burstable").add("nginx", 500)
    [nginx] = web.containers
    node.runtime.run_pod(web)
    node.runtime.create(nginx)
    db = node.pod("db").add("pg", 2000, 2000)
    node.runtime.run_pod(db)
    node.host.quiesce()
    assert CPUSet.parse(nginx.cpu().cpus) & node.state.earmarks[db.uid].cpus
    return nginx


def test_a_shared_container_created_from_a_moved_pool_is_moved_before_it_starts(model):
    """Finding 2, where the daemon can write the cgroup: moved at its StartContainer, said so."""
    node = model()
    nginx = create_then_earmark(node)
    assert "refused" not in node.runtime.start(nginx)
    node.host.quiesce()
    assert not on_exclusive(node, nginx)
    [moved] = [r for r in node.records.of("share") if r.get("MOVED")]
    assert (moved["MOVED"], moved["REASON"]) == ("yes", "pool moved during creation")
    assert CPUSet.parse(moved["CPUS"]) == node.on(nginx)


@pytest.mark.parametrize(
    "driver, why",
    [
        ("systemd", "no connection to systemd"),  # the systemd driver, systemd out of reach
        ("cgroupfs", "whose write failed"),  # a cgroup the kernel refuses to change
    ],
)
def test_a_shared_container_created_from_a_moved_pool_that_cannot_be_moved_is_refused(
    model, driver, why
):
    """Finding 2, where the container cannot be moved: its StartContainer is refused (kubelet
    retries it) rather than started on CPUs earmarked for another pod; the refusal is audited
    and says why it could not be moved."""
    node = model(driver)
    nginx = create_then_earmark(node)
    broken = driver == "cgroupfs"
    made = (lambda ctr: node.cgroups.break_writes(ctr.path)) if broken else None
    assert "refused" in node.runtime.start(nginx, made)
    node.host.quiesce()
    assert nginx.phase == "exited" and not held_anywhere(node, nginx.id)
    [refusal] = [r for r in node.records.of("refuse") if r["CONTAINER_ID"] == nginx.id]
    assert why in refusal["MESSAGE"] and refusal["CODE"] == "cgroup-write"
    assert not [r for r in node.records.of("share") if r.get("MOVED")]


def test_pinning_at_start_a_start_refused_for_a_slow_disk_keeps_nothing(model):
    """Finding 3a: pinning at start, the state file's disk stalls while the StartContainer of
    an exclusive container is decided: the runtime is answered with an error within the
    budget, and once the disk is back the CPUs are not assigned (in memory, on disk)."""
    node = model(pin_at="start")
    db = node.pod("db").add("pg", 2000, 2000)
    [pg] = db.containers
    node.runtime.run_pod(db)
    node.runtime.create(pg)
    node.stall.begin("disk", node.settings.state_dir)
    line = node.runtime.start(pg)
    node.stall.end()
    node.host.quiesce()
    assert "refused" in line and "not started now" in line
    assert not held_anywhere(node, pg.id)
    assert node.state.shared == MACHINE.online - node.state.exclusive


def test_pinning_at_start_a_start_whose_cgroup_write_fails_keeps_nothing(model):
    """Finding 3b: pinning at start, the container's own cgroup write fails after its decision
    was committed: the start is refused and the CPUs released again, in memory and on disk,
    the audit showing the release."""
    node = model(pin_at="start")
    db = node.pod("db").add("pg", 2000, 2000)
    [pg] = db.containers
    node.runtime.run_pod(db)
    node.runtime.create(pg)
    line = node.runtime.start(pg, lambda ctr: node.cgroups.break_writes(ctr.path))
    node.host.quiesce()
    assert "refused" in line and "could not be written" in line
    assert not held_anywhere(node, pg.id)
    mine = [r["ACTION"] for r in node.records if r.get("CONTAINER_ID") == pg.id]
    assert mine[mine.index("allocate") :].count("release") == 1


# --- found by the model-based test ----------------------------------------------------------------


def test_a_container_owed_stays_owed_across_its_own_update(model):
    """The systemd driver, systemd out of reach: another pod's earmark leaves a shared
    container on the earmarked CPUs, owed to the runtime's next reply.  An UpdateContainer of
    that container carries its own entry, which the runtime applies only after the call (late):
    it stays owed, and the earmarked pod's CreateContainer moves it before that pod's container
    is created on those CPUs."""
    node = model("systemd")
    runtime = node.runtime
    web = node.pod("web", "burstable").add("nginx", 500)
    node.up(web)
    [nginx] = web.containers
    db = node.pod("db").add("pg", 2000, 2000)
    [pg] = db.containers
    runtime.run_pod(db)
    node.host.quiesce()
    assert on_exclusive(node, nginx) and nginx.id in node.host.daemon.node.owed
    runtime.update(nginx, cpuset_request(MACHINE.online))
    assert nginx.pending is not None  # its own entry: applied later
    runtime.create(pg)
    runtime.start(pg)
    node.host.quiesce()
    assert not node.on(nginx) & node.on(pg), f"nginx on {node.on(nginx)}, pg on {node.on(pg)}"


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_a_resize_moves_the_container_before_its_answer(model, driver):
    """A fractional Guaranteed container resized to one whole CPU: the update's own entry is
    applied by the runtime only after the call has returned (docs/nri-wire.md §11.3).  Meanwhile
    another pod is earmarked and its container created on CPUs of the pool the resized one
    still ran on: the resize wrote it before its answer (cgroupfs), or - where it cannot be
    written (the systemd driver, systemd out of reach) - owed it to the next reply, which the
    runtime applies before it creates that container."""
    node = model(driver)
    runtime = node.runtime
    web = node.pod("web").add("main", 1500, 1500)
    node.up(web)
    [main] = web.containers
    assert "refused" not in runtime.update(main, resize_request(1000, 1000))
    assert main.pending is not None
    db = node.pod("db").add("pg", 2000, 2000)
    node.up(db)
    [pg] = db.containers
    assert main.id in node.state.assignments and pg.phase == "running"
    assert not on_exclusive(node, main), f"main on {node.on(main)}, pg on {node.on(pg)}"


def test_a_resize_answered_with_an_error_after_its_writes_is_written_back(model):
    """The state file's disk stalls while an exclusive container is resized down: the runtime
    is answered with an error (its CPUs unchanged, kubelet retries), and the resize, done once
    the disk is back, is taken back - the shared containers it had written onto the CPU it
    gave up are written off it again."""
    node = model()
    runtime = node.runtime
    web = node.pod("web", "burstable").add("nginx", 500)
    db = node.pod("db").add("pg", 2000, 2000)
    node.up(web)
    node.up(db)
    [nginx], [pg] = web.containers, db.containers
    held = node.state.assignments[pg.id].cpus
    node.stall.begin("disk", node.settings.state_dir)
    line = runtime.update(pg, resize_request(1000, 1000))
    node.stall.end()
    node.host.quiesce()
    assert "refused" in line
    assert node.state.assignments[pg.id].cpus == held
    assert not on_exclusive(node, nginx), f"nginx on {node.on(nginx)}, pg holds {held}"


def offline_its_cpu(node: ModelNode, ctr: Ctr) -> None:
    """CPU hotplug takes the container's exclusive CPU away (the daemon gives it another)."""
    node.host.quiesce()
    [cpu] = node.state.assignments[ctr.id].cpus
    node.host.submit(cpu_event(node.machine, cpu, online=False))
    node.host.quiesce()
    assert cpu not in node.state.assignments[ctr.id].cpus


def start_after_its_cpu_went_offline(node: ModelNode) -> tuple[Ctr, str]:
    """An exclusive container created, its CPU offlined, then started: the container and the
    start's line in the runtime's log."""
    db = node.pod("db").add("pg", 1000, 1000)
    [pg] = db.containers
    node.runtime.run_pod(db)
    node.runtime.create(pg)
    offline_its_cpu(node, pg)
    line = node.runtime.start(pg)
    node.host.quiesce()
    return pg, line


def test_an_exclusive_container_created_before_its_cpu_went_offline_starts(model):
    """The systemd driver, systemd out of reach: an exclusive container is created on a CPU
    that goes offline before it starts (the daemon gives it another; the runtime's cgroup for
    it falls back to its pod's CPUs).  Its own new CPU is not another's: it starts, and is
    owed to the runtime's next reply - not refused for running on "exclusive" CPUs."""
    node = model("systemd")
    other = node.pod("other").add("main", 1000, 1000)
    pg, line = start_after_its_cpu_went_offline(node)
    assert "refused" not in line and pg.id in node.host.daemon.node.owed
    assert not on_exclusive(node, pg)
    node.up(other)  # the next reply that can carry updates moves it
    assert node.on(pg) == node.state.assignments[pg.id].cpus


def test_a_refused_start_of_an_exclusive_container_keeps_nothing(model):
    """As above, but the pod's CPUs the runtime's cgroup falls back to hold another pod's
    exclusive CPU: the start is refused (kubelet retries the container), and the CPUs its
    creation was given are released with the refusal, not left until kubelet's retry."""
    node = model("systemd")
    other = node.pod("other").add("main", 1000, 1000)
    node.up(other)
    pg, line = start_after_its_cpu_went_offline(node)
    assert "refused" in line and "exclusive to others" in line
    assert not held_anywhere(node, pg.id)


def test_a_start_answered_by_its_fallback_is_owed_not_refused_late(model):
    """The systemd driver, systemd out of reach, and the state file's disk stalls behind
    another pod's earmark: a shared container's CreateContainer and StartContainer are
    answered by their fallbacks (the pool of then, an empty reply: the runtime starts it on
    CPUs the earmark takes).  Its StartContainer, done late, cannot refuse what has started:
    the container is owed, and the earmarked pod's CreateContainer moves it."""
    node = model("systemd")
    runtime = node.runtime
    db = node.pod("db").add("pg", 2000, 2000)
    web = node.pod("web", "burstable").add("nginx", 500)
    [pg], [nginx] = db.containers, web.containers
    node.stall.begin("disk", node.settings.state_dir)
    runtime.run_pod(db)
    runtime.run_pod(web)
    runtime.create(nginx)
    assert "refused" not in runtime.start(nginx)
    node.stall.end()
    node.host.quiesce()
    assert on_exclusive(node, nginx) and nginx.id in node.host.daemon.node.owed
    node.up(db)
    assert not node.on(nginx) & node.on(pg), f"nginx on {node.on(nginx)}, pg on {node.on(pg)}"


def test_a_container_created_before_a_restart_without_synchronize_keeps_its_cpus(model):
    """Found by the model-based test: a runtime that never lists its containers (containerd
    1.7 and a plugin it launched) restarts while a container is created but not started.  It
    has no cgroup yet, so the relaunched daemon's sweep sets its decision aside; its
    StartContainer decides it again, so it never starts on CPUs the next pod is given."""
    node = model(lists=False)
    runtime = node.runtime
    first = node.pod("first").add("main", 1000, 1000)
    runtime.advance(first)  # RunPodSandbox
    runtime.advance(first)  # CreateContainer: exclusive, durable before its answer
    [main] = first.containers
    runtime.restart()  # the plugin launched again: no Synchronize
    node.host.fire_timers()  # the sweep looks at the containers known from the state file
    node.host.quiesce()
    runtime.advance(first)  # StartContainer: on the CPU its creation was given
    node.host.quiesce()
    second = node.pod("second").add("main", 1000, 1000)
    runtime.advance(second)  # RunPodSandbox: its earmark
    node.host.quiesce()
    assert not on_exclusive(node, main), f"main runs on {node.on(main)}: {node.state.earmarks}"
