"""The CPU plugin daemon on NRI, through real CRI-O 1.36.3 (NRI 0.11), conmon and runc, on this
2-CPU machine: CPU 0 reserved (and shared), CPU 1 exclusive.  The same scenarios as on
containerd (tests/e2e/test_cpu_plugin.py) wherever they apply, plus the runtime-launched
install from CRI-O's ``nri_plugin_dir`` and ``nri-cpuplugin status``.  The ``CRIO_BOTH``
tests run again with crun 1.8.1 as CRI-O's default runtime handler."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import host
from harness.cri import CRIClient, CRIError
from harness.crio import Crio
from harness.k8s import ContainerSpec, PodSpec

from e2e.daemon import REPO, Daemon, check_agreement, settled_state, wait_for
from e2e.runtimes import CRIO_BOTH

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
ALL = "0-1"


def guaranteed(name: str, cpus: float = 1, **kw: object) -> ContainerSpec:
    return ContainerSpec.guaranteed(name, cpus, **kw)


def burstable(name: str, **kw: object) -> ContainerSpec:
    return ContainerSpec(name, cpu_request_milli=250, memory="32Mi", **kw)


@pytest.fixture
def daemon(crio: Crio, tmp_path: Path) -> Iterator[Daemon]:
    process = Daemon(crio.nri_socket, tmp_path / "state")
    process.start()
    yield process
    process.stop()


@CRIO_BOTH
def test_born_pinned_with_memory_node_and_no_quota(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon, oci_runtime: str
) -> None:
    cri = crio_cri
    pod = cri.run("latency", [guaranteed("victim", command=FIRST_LINE)])
    [line] = cri.wait_logs(pod["victim"], 1)
    assert line == "Cpus_allowed_list:\t1"  # its very first instruction already ran on CPU 1
    path = cri.cgroup_path(pod["victim"])
    assert path.rsplit("/", 1)[1] == f"crio-{pod['victim']}"
    assert host.read_cgroup(path, "cpuset.mems") == "0"
    # No quota, crun 1.8.1 too (it cannot write -1: a new container is told 0, adapter.py).
    assert host.read_cgroup(path, "cpu.cfs_quota_us", "cpu") == "-1"
    [allocate] = daemon.records("allocate")
    assert allocate["CPUS"] == "1" and allocate["POD_NAME"] == "latency"
    check_agreement(daemon, cri)


@CRIO_BOTH
def test_siblings_move_before_create_returns_and_get_cpus_back_at_stop(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon
) -> None:
    cri = crio_cri
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
    cri.remove(cid)
    assert daemon.state()["assignments"] == {}


def test_impossible_request_is_refused_with_our_message(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon
) -> None:
    cri = crio_cri
    pinned = cri.run("one", [guaranteed("only", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["only"], 1) == ["Cpus_allowed_list:\t1"]
    pod_id = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, guaranteed("two", 1))
    # CRI-O passes the plugin's error text through to the CRI client (kubelet's event).
    assert "asks for 1 exclusive CPUs" in str(err.value) and "none" in str(err.value)
    assert daemon.records("refuse")
    assert cri.containers(pod_id) == []  # nothing half-created is left
    assert check_agreement(daemon, cri) == {"only": "1"}


def test_update_container_resources_does_not_undo_pinning(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon
) -> None:
    cri = crio_cri
    pod = cri.run("keep", [guaranteed("pinned")])
    cri.update_resources(pod["pinned"], cpuset_cpus=ALL, cpu_limit_milli=1000)
    assert host.read_cgroup(cri.cgroup_path(pod["pinned"]), "cpuset.cpus") == "1"
    check_agreement(daemon, cri)


def test_a_restarted_container_gets_its_cpus_back(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon
) -> None:
    """kubelet restarts a container as a new one with the same pod and name."""
    cri = crio_cri
    pod_id = cri.run_pod(PodSpec("restarts", qos="guaranteed"))
    first = cri.create_container(pod_id, guaranteed("app", command=FIRST_LINE))
    cri.start(first)
    assert cri.wait_logs(first, 1) == ["Cpus_allowed_list:\t1"]
    cri.stop(first)
    cri.remove(first)
    second = cri.create_container(pod_id, guaranteed("app", command=FIRST_LINE))
    cri.start(second)
    # Same name and attempt, so the same log file: the second line is the new container's.
    assert cri.wait_logs(second, 2)[1] == "Cpus_allowed_list:\t1"
    assert [r["CPUS"] for r in daemon.records("allocate")] == ["1", "1"]


@CRIO_BOTH
def test_survives_kill_9_and_a_crio_restart_under_it(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon, tmp_path: Path
) -> None:
    cri = crio_cri
    cri.run("shared", [burstable("s")])
    first = cri.run("first", [guaranteed("a")])
    check_agreement(daemon, cri)

    daemon.kill9()  # 1. the daemon dies; a container exits while it is away
    cri.stop(first["a"])
    daemon.start()  # its Synchronize finds the container gone and frees CPU 1
    assert check_agreement(daemon, cri) == {"s": ALL}

    second = cri.run("second", [guaranteed("b")])  # 2. the freed CPU is usable again
    assert check_agreement(daemon, cri)["b"] == "1"

    syncs = len(daemon.new_records("synchronize"))
    crio.restart()  # 3. CRI-O restarts under the running daemon: it reconnects, resyncs
    cri.reconnect()
    wait_for(
        "a Synchronize after the restart", lambda: len(daemon.new_records("synchronize")) > syncs
    )
    assert check_agreement(daemon, cri) == {"s": "0", "b": "1"}
    third = cri.run_pod(PodSpec("third", qos="guaranteed"))
    with pytest.raises(CRIError, match="exclusive"):  # CPU 1 is still known to be taken
        cri.create_container(third, guaranteed("c"))

    crio.kill()  # 4. ... and after a crash of CRI-O
    crio.start()
    cri.reconnect()
    wait_for(
        "a Synchronize after the crash", lambda: len(daemon.new_records("synchronize")) > syncs + 1
    )
    assert check_agreement(daemon, cri) == {"s": "0", "b": "1"}

    daemon.stop()  # 5. the state file is lost while the daemon is down
    (tmp_path / "state" / "state.json").unlink()
    daemon.start()
    assert check_agreement(daemon, cri) == {"s": "0", "b": "1"}  # adopted, not moved
    cri.stop(second["b"])
    assert check_agreement(daemon, cri) == {"s": ALL}


def test_status_shows_what_the_daemon_placed(
    crio: Crio, crio_cri: CRIClient, daemon: Daemon
) -> None:
    pod = crio_cri.run("shown", [guaranteed("pinned")])
    status = daemon.status()
    [shown] = status["assignments"]
    assert (shown["container_id"], shown["pod_name"], shown["cpus"]) == (
        pod["pinned"],
        "shown",
        "1",
    )
    assert (status["shared"], status["exclusive"]) == ("0", "1")


def launched(make_crio: Callable[..., Crio], tmp_path: Path) -> tuple[Crio, Path]:
    """A CRI-O (not started) with our plugin pre-registered in its ``nri_plugin_dir``."""
    instance = make_crio(start=False)
    state_dir = tmp_path / "state"
    instance.plugin_path.mkdir(parents=True, exist_ok=True)
    launcher = instance.plugin_path / "10-cpuplugin"
    # The runtime gives launched plugins no PATH: the interpreter is named absolutely, quoted
    # (the checkout may have spaces in its path).
    launcher.write_text(
        f"#!/bin/sh\ncd {shlex.quote(str(REPO))}\n"
        f"exec {shlex.quote(sys.executable)} -m nri_cpuplugin.cli run "
        f"2>>{shlex.quote(str(tmp_path / 'launched.log'))}\n"
    )
    launcher.chmod(0o755)
    instance.plugin_config_path.mkdir(parents=True, exist_ok=True)
    (instance.plugin_config_path / "10-cpuplugin.conf").write_text(
        f'reserved_cpus = "0"\nstate_dir = "{state_dir}"\n'
    )
    return instance, state_dir


def test_runtime_launched_plugin_pins_and_comes_back_with_crio(
    make_crio: Callable[..., Crio], tmp_path: Path
) -> None:
    instance, state_dir = launched(make_crio, tmp_path)
    instance.start()
    cri = instance.cri()
    shared = cri.run("shared", [burstable("s")])
    pinned = cri.run("pinned", [guaranteed("p", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["p"], 1) == ["Cpus_allowed_list:\t1"]
    pid = cri.inspect(shared["s"]).pid
    assert host.cpus_allowed_list(pid) == "0"
    log = (tmp_path / "launched.log").read_text()
    assert '"ACTION": "allocate"' in log or '"ACTION":"allocate"' in log

    instance.restart()  # the launched plugin dies with CRI-O and is launched again
    cri.reconnect()
    pod_id = cri.run_pod(PodSpec("late", qos="guaranteed"))
    with pytest.raises(CRIError, match="exclusive"):  # CPU 1 is still known to be taken
        cri.create_container(pod_id, guaranteed("x"))
    cri.stop(pinned["p"])  # CRI-O 1.36 resyncs launched plugins: the stop is reported
    wait_for("the shared container to get CPU 1 back", lambda: host.cpus_allowed_list(pid) == ALL)
    state = settled_state(state_dir)
    assert state["assignments"] == {} and shared["s"] in state["sharing"]


def test_pinned_at_start_when_asked_to(crio: Crio, crio_cri: CRIClient, tmp_path: Path) -> None:
    """``[nri] pin_at = "start"``: CRI-O too sends StartContainer before the container's first
    instruction, so the daemon, never consulted at CreateContainer, pins it there."""
    cri = crio_cri
    config = tmp_path / "config.toml"
    config.write_text('[nri]\npin_at = "start"\n')
    daemon = Daemon(crio.nri_socket, tmp_path / "state", config=config).start()
    try:
        noisy = cri.run("noisy", [burstable("burner")])
        spec = guaranteed("victim", command=FIRST_LINE)
        pod_id = cri.run_pod(PodSpec.for_containers("latency", [spec]))
        cid = cri.create_container(pod_id, spec)
        assert cid not in daemon.state()["assignments"]  # not asked at its creation
        cri.start(cid)
        assert cri.wait_logs(cid, 1) == ["Cpus_allowed_list:\t1"]
        assert host.cpus_allowed_list(cri.inspect(noisy["burner"]).pid) == "0"
        assert host.read_cgroup(cri.cgroup_path(cid), "cpu.cfs_quota_us", "cpu") == "-1"
        check_agreement(daemon, cri)
    finally:
        daemon.stop()
