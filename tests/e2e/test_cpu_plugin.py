"""The CPU plugin daemon end to end, through real containerd 1.7.24, 2.1.9 and 2.3.4 and runc, on
this 2-CPU machine: CPU 0 reserved (and shared), CPU 1 exclusive.  The tests marked ``crun`` run
once more on containerd 2.3.4 with crun 1.8.1, which applies the daemon's updates of running
containers with ``crun update``."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import pytest
from harness import host
from harness.cri import CRIError
from harness.k8s import ContainerSpec, PodSpec

from e2e.daemon import REPO, check_agreement, settled_state, wait_for
from e2e.runtimes import ALSO_CRUN

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
ALL = "0-1"


def guaranteed(name: str, cpus: float = 1, **kw) -> ContainerSpec:
    return ContainerSpec.guaranteed(name, cpus, **kw)


def burstable(name: str, **kw) -> ContainerSpec:
    return ContainerSpec(name, cpu_request_milli=250, memory="32Mi", **kw)


@ALSO_CRUN
def test_born_pinned_with_memory_node_and_no_quota(containerd, cri, daemon, oci_runtime):
    pod = cri.run("latency", [guaranteed("victim", command=FIRST_LINE)])
    [line] = cri.wait_logs(pod["victim"], 1)
    assert line == "Cpus_allowed_list:\t1"  # its very first instruction already ran on CPU 1
    path = cri.cgroup_path(pod["victim"])
    assert host.read_cgroup(path, "cpuset.mems") == "0"
    # No quota, crun 1.8.1 too: it cannot write -1 on cgroup v1, and a new container is told
    # 0, which every runtime reads as "write none" (daemon/adapter.py).
    assert host.read_cgroup(path, "cpu.cfs_quota_us", "cpu") == "-1"
    assert cri.inspect(pod["victim"]).spec["linux"]["resources"]["cpu"]["quota"] == 0
    [allocate] = daemon.records("allocate")
    assert allocate["CPUS"] == "1" and allocate["POD_NAME"] == "latency"
    check_agreement(daemon, cri)


@ALSO_CRUN
def test_no_window_siblings_move_before_create_returns(containerd, cri, daemon):
    noisy = cri.run("noisy", [burstable("burner")])
    pid = cri.inspect(noisy["burner"]).pid
    assert host.cpus_allowed_list(pid) == ALL
    pod_id = cri.run_pod(PodSpec("exclusive", qos="guaranteed"))
    cid = cri.create_container(pod_id, guaranteed("pinned"))
    # CreateContainer has returned; the exclusive container has not even started yet.
    assert host.read_cgroup(cri.cgroup_path(noisy["burner"]), "cpuset.cpus") == "0"
    assert host.cpus_allowed_list(pid) == "0"
    cri.start(cid)
    check_agreement(daemon, cri)
    cri.stop(cid)
    assert host.cpus_allowed_list(pid) == ALL  # back as soon as StopContainer returns
    check_agreement(daemon, cri)


def test_who_shares_and_the_pool_is_never_emptied(containerd, cri, daemon):
    pod = cri.run(
        "mixed",
        [
            guaranteed("half", 0.5, command=FIRST_LINE),
        ],
    )
    assert cri.wait_logs(pod["half"], 1) == [f"Cpus_allowed_list:\t{ALL}"]
    burst = cri.run("burst", [burstable("b", command=FIRST_LINE)])
    assert cri.wait_logs(burst["b"], 1) == [f"Cpus_allowed_list:\t{ALL}"]
    best = cri.run("best", [ContainerSpec("e", command=FIRST_LINE)])
    assert cri.wait_logs(best["e"], 1) == [f"Cpus_allowed_list:\t{ALL}"]
    pinned = cri.run("one", [guaranteed("only", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["only"], 1) == ["Cpus_allowed_list:\t1"]
    # Nothing is left for a second exclusive CPU: refused, through CRI, with our reason.
    pod_id = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, guaranteed("two", 1))
    assert "asks for 1 exclusive CPUs" in str(err.value) and "none" in str(err.value)
    assert daemon.records("refuse")
    shares = check_agreement(daemon, cri)
    assert shares == {"half": "0", "b": "0", "e": "0", "only": "1"}


def test_update_container_resources_does_not_undo_pinning(containerd, cri, daemon):
    pod = cri.run("keep", [guaranteed("pinned")])
    cri.update_resources(pod["pinned"], cpuset_cpus=ALL, cpu_limit_milli=1000)
    assert host.read_cgroup(cri.cgroup_path(pod["pinned"]), "cpuset.cpus") == "1"
    check_agreement(daemon, cri)


@ALSO_CRUN
def test_survives_kill_9_and_restarts(containerd, cri, daemon, tmp_path):
    shared = cri.run("shared", [burstable("s")])
    first = cri.run("first", [guaranteed("a")])
    check_agreement(daemon, cri)

    daemon.kill9()  # 1. the daemon dies; a container exits while it is away
    cri.stop(first["a"])
    daemon.start()
    assert check_agreement(daemon, cri) == {"s": ALL}

    second = cri.run("second", [guaranteed("b")])  # 2. the freed CPU is usable again
    assert check_agreement(daemon, cri)["b"] == "1"

    containerd.restart()  # 3. containerd restarts under the running daemon
    daemon.wait_synchronized()
    cri.reconnect()
    check_agreement(daemon, cri)

    daemon.stop()  # 4. the state file is deleted while the daemon is down
    (tmp_path / "state" / "state.json").unlink()
    daemon.start()
    assert check_agreement(daemon, cri) == {"s": "0", "b": "1"}  # adopted, not moved

    daemon.stop()  # 5. ... or corrupted
    (tmp_path / "state" / "state.json").write_text('{"version": 1, "assignments": {"x": ')
    daemon.start()
    assert daemon.new_records("state-rebuild")
    assert list((tmp_path / "state").glob("state.json.bad-*"))
    assert check_agreement(daemon, cri) == {"s": "0", "b": "1"}
    cri.stop(second["b"])
    assert check_agreement(daemon, cri) == {"s": ALL}
    assert shared  # keeps the fixture's pod referenced for readability


def launched_plugin(make_containerd, tmp_path):
    """A containerd (not started) with our plugin pre-registered in its plugin directory."""
    containerd = make_containerd(start=False)
    state_dir = tmp_path / "state"
    launcher = containerd.plugin_path / "10-cpuplugin"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    # Quoted: the checkout (and with it the interpreter) may have spaces in its path.
    launcher.write_text(
        f"#!/bin/sh\ncd {shlex.quote(str(REPO))}\n"
        f"exec {shlex.quote(sys.executable)} -m nri_cpuplugin.cli run "
        f"2>>{shlex.quote(str(tmp_path / 'launched.log'))}\n"
    )
    launcher.chmod(0o755)
    containerd.plugin_config_path.mkdir(parents=True, exist_ok=True)
    (containerd.plugin_config_path / "10-cpuplugin.conf").write_text(
        f'reserved_cpus = "0"\nstate_dir = "{state_dir}"\n'
    )
    return containerd, state_dir


def test_runtime_launched_plugin_without_synchronize_keeps_its_state(make_containerd, tmp_path):
    """containerd 1.7 sends a launched plugin no Synchronize: the state file carries the
    assignments and the shared containers across the plugin's restart."""
    containerd, state_dir = launched_plugin(make_containerd, tmp_path)
    containerd.start()
    cri = containerd.cri()
    shared = cri.run("shared", [burstable("s")])
    pinned = cri.run("pinned", [guaranteed("p", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["p"], 1) == ["Cpus_allowed_list:\t1"]
    containerd.restart()  # the launched plugin dies with containerd and is launched again
    cri.reconnect()
    pod_id = cri.run_pod(PodSpec("late", qos="guaranteed"))
    with pytest.raises(CRIError, match="exclusive"):  # CPU 1 is still known to be taken
        cri.create_container(pod_id, guaranteed("x"))
    # containerd 1.7 never tells the relaunched plugin that this container stopped ...
    cri.stop(pinned["p"])
    # ... so the next event checks the containers it only knows from its state file.
    again = cri.run("again", [guaranteed("q", command=FIRST_LINE)])
    assert cri.wait_logs(again["q"], 1) == ["Cpus_allowed_list:\t1"]
    pid = cri.inspect(shared["s"]).pid
    assert host.cpus_allowed_list(pid) == "0"
    cri.stop(again["q"])  # created in this session: its stop is reported, the pool grows
    wait_for("the shared container to get CPU 1 back", lambda: host.cpus_allowed_list(pid) == ALL)
    state = settled_state(state_dir)
    assert state["assignments"] == {} and shared["s"] in state["sharing"]


@pytest.fixture(autouse=True)
def _no_leftover_state(tmp_path):
    yield
    shutil.rmtree(tmp_path / "state", ignore_errors=True)


def test_agreement_helper_catches_a_disagreement(containerd, cri, daemon):
    """The checker above must be able to fail: break a cgroup behind the plugin's back."""
    pod = cri.run("victim", [guaranteed("v")])
    path = cri.cgroup_path(pod["v"])
    Path(host.cgroup_dir(path), "cpuset.cpus").write_text("0")
    with pytest.raises(AssertionError, match="cgroup has 0, state says 1"):
        check_agreement(daemon, cri)


def test_a_lost_state_never_gives_a_cpu_twice(make_containerd, tmp_path):
    """The state file is replaced by one of a foreign version while the runtime restarts: the
    relaunched plugin sets it aside, and until the runtime lists its containers (containerd
    1.7 never does for a launched plugin) the CPU a running Guaranteed container is pinned
    to is not handed out again."""
    containerd, state_dir = launched_plugin(make_containerd, tmp_path)
    containerd.start()
    cri = containerd.cri()
    pinned = cri.run("pinned", [guaranteed("p", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["p"], 1) == ["Cpus_allowed_list:\t1"]
    containerd.stop()
    (state_dir / "state.json").write_text('{"version": 99, "assignments": {}}')
    containerd.start()
    cri.reconnect()
    pod_id = cri.run_pod(PodSpec("late", qos="guaranteed"))
    with pytest.raises(CRIError, match="exclusive"):  # CPU 1 is in use: refused, not given
        cri.create_container(pod_id, guaranteed("x"))
    assert list(state_dir.glob("state.json.bad-*")), "the foreign file is kept"
    assert host.cpus_allowed_list(cri.inspect(pinned["p"]).pid) == "1"
    # Once the pinned container is gone, its CPU can be given again.
    cri.stop(pinned["p"])
    again = cri.run("again", [guaranteed("q", command=FIRST_LINE)])
    assert cri.wait_logs(again["q"], 1) == ["Cpus_allowed_list:\t1"]


def test_in_place_resize_through_cri(containerd, cri, daemon):
    """kubelet's in-place resize reaches us as UpdateContainerResources: exclusive -> shared ->
    exclusive on this 2-CPU machine, and growth beyond what is free refused with our message."""
    web = cri.run("web", [burstable("w")])
    db = cri.run("db", [guaranteed("d")])
    web_pid, db_pid = cri.inspect(web["w"]).pid, cri.inspect(db["d"]).pid
    assert (host.cpus_allowed_list(db_pid), host.cpus_allowed_list(web_pid)) == ("1", "0")

    cri.update_resources(db["d"], cpu_request_milli=1500, cpu_limit_milli=1500)
    assert host.cpus_allowed_list(db_pid) == ALL  # no longer whole CPUs: shared
    assert host.cpus_allowed_list(web_pid) == ALL  # and the pool got CPU 1 back
    assert daemon.records("resize")[-1]["CPUS"] == ALL

    cri.update_resources(db["d"], cpu_request_milli=1000, cpu_limit_milli=1000)
    assert host.cpus_allowed_list(db_pid) == "1"  # exclusive again
    assert host.cpus_allowed_list(web_pid) == "0"

    with pytest.raises(CRIError, match="asks to grow from 1 to 2"):
        cri.update_resources(db["d"], cpu_request_milli=2000, cpu_limit_milli=2000)
    assert host.cpus_allowed_list(db_pid) == "1" and host.cpus_allowed_list(web_pid) == "0"
    state = daemon.state()
    assert state["assignments"][db["d"]]["cpus"] == "1"
    check_agreement(daemon, cri)


@ALSO_CRUN
def test_dense_node_siblings_are_written_directly_and_reasserted(containerd, cri, daemon):
    """Eight shared containers: all of them are off the new exclusive CPU when CreateContainer
    returns, yet the runtime ran no update for them (its stored spec still says what they were
    created with: the write was ours, one per container, not one `runc update` each).  A later
    UpdateContainerResources of one of them - which re-applies that stored spec - cannot put it
    back on the exclusive CPU: our reply to it carries its cpuset."""
    shared = [cri.run(f"s{i}", [burstable(f"w{i}")])[f"w{i}"] for i in range(8)]
    pids = [cri.inspect(cid).pid for cid in shared]
    pod_id = cri.run_pod(PodSpec("exclusive", qos="guaranteed"))
    cid = cri.create_container(pod_id, guaranteed("pinned"))
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 8  # the window is closed
    specs = [cri.inspect(c).spec["linux"]["resources"]["cpu"]["cpus"] for c in shared]
    assert specs == [ALL] * 8  # ... without the runtime touching them
    cri.start(cid)
    cri.update_resources(shared[3], memory="64Mi")  # re-applies its stored resources
    assert host.cpus_allowed_list(pids[3]) == "0"
    assert cri.inspect(shared[3]).spec["linux"]["resources"]["cpu"]["cpus"] == "0"
    check_agreement(daemon, cri)


def _start_at_once(cri, specs: list[tuple[str, list[ContainerSpec]]]) -> dict:
    """Each pod (RunPodSandbox, CreateContainer, StartContainer) in its own thread, released
    together, as kubelet's pod workers do; raises the first failure once all are done."""
    import threading

    started: dict[str, object] = {}
    errors: list[BaseException] = []
    gate = threading.Barrier(len(specs))

    def one(name: str, containers: list[ContainerSpec]) -> None:
        gate.wait()
        try:
            started[name] = cri.run(name, containers)
        except BaseException as err:  # reported after every thread is done
            errors.append(err)

    threads = [threading.Thread(target=one, args=spec) for spec in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return started


def test_pods_started_at_once_never_leave_a_shared_container_on_the_exclusive_cpu(
    containerd, cri, daemon
):
    """kubelet starts pods in parallel: a shared container answered with the pool of one moment
    may be created (no cgroup yet, so no write reaches it) while an exclusive allocation
    shrinks the pool.  It is moved at its StartContainer, before its first instruction: once
    every start has returned, no shared container may run on the exclusive CPU."""
    for burst in range(3):
        specs = [(f"x{burst}", [guaranteed("x")])]
        specs += [(f"s{burst}-{k}", [burstable("s")]) for k in range(7)]
        started = _start_at_once(cri, specs)
        placed = {
            name: host.cpus_allowed_list(cri.inspect(pod[name[0]]).pid)
            for name, pod in started.items()
        }
        assert placed == {name: "1" if name.startswith("x") else "0" for name in placed}
        check_agreement(daemon, cri)
        cri.remove_all()


@ALSO_CRUN
def test_lagging_specs_converge_at_the_next_synchronize(containerd, cri, daemon):
    """The runtime's stored specs of shared containers moved by direct writes lag behind until
    the next Synchronize (a daemon restart here), whose reply carries them: after it, what the
    runtime would re-apply for every sibling is what runs."""
    before = [cri.run(f"b{i}", [burstable(f"w{i}")])[f"w{i}"] for i in range(4)]
    pod_id = cri.run_pod(PodSpec("exclusive", qos="guaranteed"))
    cri.start(cri.create_container(pod_id, guaranteed("pinned")))
    after = cri.run("late", [burstable("late")])["late"]

    def spec_cpus(cid: str) -> str:
        return cri.inspect(cid).spec["linux"]["resources"]["cpu"]["cpus"]

    assert [spec_cpus(c) for c in before] == [ALL] * 4 and spec_cpus(after) == "0"
    daemon.stop()
    daemon.start()  # waits for the Synchronize; the runtime applies the reply after it
    wait_for(
        "the runtime to apply the Synchronize reply",
        lambda: [spec_cpus(c) for c in [*before, after]] == ["0"] * 5,
        10,
    )
    pids = [cri.inspect(cid).pid for cid in [*before, after]]
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 5
    check_agreement(daemon, cri)


def test_an_earmarked_pod_moves_the_shared_containers_when_it_starts(containerd, cri, daemon):
    """A Guaranteed pod whose sandbox carries its CPU limit (kubelet sends it) has CPU 1
    earmarked when it starts: the shared containers are off it once RunPodSandbox returns,
    and the creation of its exclusive container moves nobody.  A pod whose containers cannot
    use a whole CPU (1.5 CPUs in one container) gives its earmark back at the creation."""
    shared = [cri.run(f"s{i}", [burstable(f"w{i}")])[f"w{i}"] for i in range(8)]
    pids = [cri.inspect(cid).pid for cid in shared]
    spec = guaranteed("pinned", command=FIRST_LINE)
    pod_id = cri.run_pod(PodSpec.for_containers("exclusive", [spec]))
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 8  # moved at pod start
    [earmark] = daemon.records("earmark")
    assert earmark["CPUS"] == "1" and earmark["POD_NAME"] == "exclusive"
    cid = cri.create_container(pod_id, spec)
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 8
    cri.start(cid)
    assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
    [allocate] = daemon.records("allocate")
    assert allocate["CPUS"] == "1" and "earmarked for its pod" in allocate["REASON"]
    check_agreement(daemon, cri)
    cri.stop(cid)
    cri.remove(cid)
    cri.stop_pod(pod_id)
    cri.remove_pod(pod_id)
    # The growth may be written after the answer when a request outlived the daemon's budget.
    wait_for(
        "the shared containers back on every CPU",
        lambda: [host.cpus_allowed_list(pid) for pid in pids] == [ALL] * 8,
        timeout=30,
    )

    fractional = ContainerSpec.guaranteed("half", 1.5)
    pod_id = cri.run_pod(PodSpec.for_containers("fractional", [fractional]))
    assert [host.cpus_allowed_list(pid) for pid in pids] == ["0"] * 8
    cid = cri.create_container(pod_id, fractional)
    cri.start(cid)
    assert [host.cpus_allowed_list(pid) for pid in pids] == [ALL] * 8  # given back
    assert host.cpus_allowed_list(cri.inspect(cid).pid) == ALL
    assert "earmarks" not in settled_state(daemon.state_dir)
    check_agreement(daemon, cri)


def test_a_pod_removed_after_a_runtime_restart_gives_its_earmark_back(containerd, cri, daemon):
    """containerd keeps no NRI state for the sandboxes it finds when it starts, and relays no
    StopPodSandbox/RemovePodSandbox for them (its ``needsStopping``/``needsRemoval``): a
    Guaranteed pod earmarked before the restart and removed after it, before any of its
    containers was created, must still give its CPU back to the shared containers."""
    shared = cri.run("s", [burstable("w")])["w"]
    pid = cri.inspect(shared).pid
    spec = guaranteed("pinned", command=FIRST_LINE)
    pod_id = cri.run_pod(PodSpec.for_containers("exclusive", [spec]))
    assert host.cpus_allowed_list(pid) == "0"  # CPU 1 earmarked
    containerd.restart()  # the daemon reconnects: Synchronize lists the pod
    wait_for("the daemon to resynchronize", lambda: daemon.records("synchronize"), 20)
    cri.stop_pod(pod_id)
    cri.remove_pod(pod_id)
    wait_for("the earmark to be given back", lambda: host.cpus_allowed_list(pid) == ALL, 20)
    assert "earmarks" not in settled_state(daemon.state_dir)
    check_agreement(daemon, cri)
