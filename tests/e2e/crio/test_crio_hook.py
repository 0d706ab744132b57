"""The OCI hook through real CRI-O 1.36.3: CRI-O reads the project's hooks.d files from its
``hooks_dir``, matches them against each container's annotations and hands them to runc,
which runs the hook at createRuntime and poststop (the ``CRIO_BOTH`` tests: runc, then crun
1.8.1 as CRI-O's default runtime handler).  The same scenarios as with the daemon
(test_crio_nri.py) wherever a hook can do them, on this 2-CPU machine: CPU 0 reserved (and
shared), CPU 1 exclusive.

The committed files name the installed program (/usr/local/bin/nri-cpuplugin-hook); the tests
use a copy of each whose ``hook.path`` is this checkout's hook launcher and whose args add a
private state directory - ``when`` and ``stages`` are the committed ones, unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import host
from harness.cri import CRIError
from harness.crio import Crio
from harness.k8s import ContainerSpec, PodSpec
from harness.runc import hook_program

from e2e.crio.hooksd import hook_files
from e2e.daemon import REPO, check_agreement
from e2e.runtimes import CRIO_BOTH

HOOKS = REPO / "hooks"
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
ALL = "0-1"


def guaranteed(name: str, cpus: float = 1, **kw: object) -> ContainerSpec:
    return ContainerSpec.guaranteed(name, cpus, **kw)


def burstable(name: str, **kw: object) -> ContainerSpec:
    return ContainerSpec(name, cpu_request_milli=250, memory="32Mi", **kw)


class HookState:
    """The hook's state directory, read the way check_agreement reads the daemon's."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "state.json").read_text())

    def records(self) -> set[str]:
        return {p.stem for p in (self.state_dir / "hook-containers").glob("*.json")}


def with_hooks(instance: Crio, tmp_path: Path) -> HookState:
    state_dir = tmp_path / "state"
    program = hook_program(tmp_path / "bin")
    for name, doc in hook_files(program, state_dir).items():
        instance.install_hook(name, doc)
    return HookState(state_dir)


@pytest.fixture
def hooked(make_crio: Callable[..., Crio], tmp_path: Path) -> tuple[Crio, HookState]:
    """CRI-O with NRI off (a hook-mode node) and the hooks in its hooks_dir before start."""
    instance = make_crio(start=False, nri=False)
    state = with_hooks(instance, tmp_path)
    instance.start()
    return instance, state


@CRIO_BOTH
def test_born_pinned_with_memory_node_and_no_quota(hooked: tuple[Crio, HookState]) -> None:
    instance, state = hooked
    cri = instance.cri()
    pod = cri.run("latency", [guaranteed("victim", command=FIRST_LINE)])
    assert cri.wait_logs(pod["victim"], 1) == ["Cpus_allowed_list:\t1"]
    path = cri.cgroup_path(pod["victim"])
    assert host.read_cgroup(path, "cpuset.mems") == "0"
    assert host.read_cgroup(path, "cpu.cfs_quota_us", "cpu") == "-1"
    assert state.state()["assignments"][pod["victim"]]["cpus"] == "1"
    assert state.records() == {pod["victim"]}
    check_agreement(state, cri)


@CRIO_BOTH
def test_siblings_move_before_create_returns_and_get_cpus_back_at_remove(
    hooked: tuple[Crio, HookState],
) -> None:
    instance, state = hooked
    cri = instance.cri()
    noisy = cri.run("noisy", [burstable("burner")])
    pid = cri.inspect(noisy["burner"]).pid
    assert host.cpus_allowed_list(pid) == ALL
    pod_id = cri.run_pod(PodSpec("exclusive", qos="guaranteed"))
    cid = cri.create_container(pod_id, guaranteed("pinned"))
    # CreateContainer has returned (runc create ran the createRuntime hook inside it); the
    # exclusive container has not started, and the shared one is off CPU 1 already.
    assert host.read_cgroup(cri.cgroup_path(noisy["burner"]), "cpuset.cpus") == "0"
    assert host.cpus_allowed_list(pid) == "0"
    cri.start(cid)
    check_agreement(state, cri)
    cri.stop(cid)
    # No hook runs at StopContainer: CRI-O deletes the container (poststop) at RemoveContainer.
    assert host.cpus_allowed_list(pid) == "0"
    cri.remove(cid)
    assert host.cpus_allowed_list(pid) == ALL
    assert state.state()["assignments"] == {} and state.records() == {noisy["burner"]}
    check_agreement(state, cri)


def test_a_stopped_container_frees_its_cpu_for_the_next_before_removal(
    hooked: tuple[Crio, HookState],
) -> None:
    """kubelet may remove a dead container much later; the next hook run sees its cgroup empty
    and gives its CPU to the new container."""
    instance, state = hooked
    cri = instance.cri()
    first = cri.run("first", [guaranteed("a")])
    cri.stop(first["a"])
    second = cri.run("second", [guaranteed("b", command=FIRST_LINE)])
    assert cri.wait_logs(second["b"], 1) == ["Cpus_allowed_list:\t1"]
    assert list(state.state()["assignments"]) == [second["b"]]


@CRIO_BOTH
def test_impossible_request_is_refused_with_our_message(
    hooked: tuple[Crio, HookState], oci_runtime: str
) -> None:
    instance, state = hooked
    cri = instance.cri()
    pinned = cri.run("one", [guaranteed("only", command=FIRST_LINE)])
    assert cri.wait_logs(pinned["only"], 1) == ["Cpus_allowed_list:\t1"]
    pod_id = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
    with pytest.raises(CRIError) as err:
        cri.create_container(pod_id, guaranteed("two", 1))
    message = str(err.value)
    if oci_runtime == "runc":
        # runc puts the hook's last stderr line in its error; CRI-O passes it to the client.
        assert "nri-cpuplugin:" in message and "asks for 1 exclusive CPUs" in message, message
    else:
        # crun names the hook and its exit code only: the reason is in the journal's record.
        assert "error executing hook" in message and "nri-cpuplugin-hook" in message, message
        assert "(exit code: 1)" in message and "exclusive" not in message, message
    assert cri.containers(pod_id) == []  # CRI-O removed the failed container
    assert check_agreement(state, cri) == {"only": "1"}
    assert state.records() == {pinned["only"]}


def test_restarts_keep_cpus(hooked: tuple[Crio, HookState]) -> None:
    instance, state = hooked
    cri = instance.cri()
    shared = cri.run("shared", [burstable("s")])
    pod_id = cri.run_pod(PodSpec("restarts", qos="guaranteed"))
    first = cri.create_container(pod_id, guaranteed("app", command=FIRST_LINE))
    cri.start(first)
    assert cri.wait_logs(first, 1) == ["Cpus_allowed_list:\t1"]

    instance.restart()  # CRI-O restarts: nothing is re-run, the cgroups stay as written
    cri.reconnect()
    assert check_agreement(state, cri) == {"s": "0", "app": "1"}
    instance.kill()  # ... or crashes
    instance.start()
    cri.reconnect()
    assert check_agreement(state, cri) == {"s": "0", "app": "1"}

    cri.stop(first)  # kubelet restarts the container: same pod, same name, new id
    cri.remove(first)
    second = cri.create_container(pod_id, guaranteed("app", command=FIRST_LINE))
    cri.start(second)
    assert cri.wait_logs(second, 2)[1] == "Cpus_allowed_list:\t1"
    assert check_agreement(state, cri) == {"s": "0", "app": "1"}
    assert shared


def test_hooks_d_files_matched_and_unmatched(
    make_crio: Callable[..., Crio], tmp_path: Path
) -> None:
    instance = make_crio(nri=False)  # started with an empty hooks_dir
    cri = instance.cri()
    before = cri.run("before", [guaranteed("early", command=FIRST_LINE)])
    assert cri.wait_logs(before["early"], 1) == [f"Cpus_allowed_list:\t{ALL}"]

    since = instance.log_size()
    state = with_hooks(instance, tmp_path)  # CRI-O picks the files up while it runs
    for name in sorted(p.name for p in HOOKS.glob("*.json")):
        instance.wait_log(f"{name}", since=since)
    matched = cri.run("matched", [guaranteed("m", command=FIRST_LINE)])
    assert cri.wait_logs(matched["m"], 1) == ["Cpus_allowed_list:\t1"]

    # Not a kubelet container hash: the committed `when` does not match, CRI-O does not even
    # hand the hook to runc, and the state file is untouched.
    before_state = (state.state_dir / "state.json").read_bytes()
    odd = guaranteed("u", command=FIRST_LINE, annotations={"io.kubernetes.container.hash": "x!"})
    unmatched = cri.run("unmatched", [odd])
    assert cri.wait_logs(unmatched["u"], 1) == [f"Cpus_allowed_list:\t{ALL}"]
    assert (state.state_dir / "state.json").read_bytes() == before_state
    spec_hooks = cri.inspect(unmatched["u"]).spec.get("hooks", {})
    assert not spec_hooks.get("createRuntime")
    assert (
        cri.inspect(matched["m"])
        .spec["hooks"]["createRuntime"][0]["path"]
        .endswith("nri-cpuplugin-hook")
    )


def test_status_shows_what_the_hook_placed(hooked: tuple[Crio, HookState]) -> None:
    instance, state = hooked
    pod = instance.cri().run("shown", [guaranteed("pinned")])
    out = subprocess.run(
        [sys.executable, "-m", "nri_cpuplugin.cli", "status", "--state-dir",
         str(state.state_dir), "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    status = json.loads(out)
    [shown] = status["assignments"]
    assert (shown["container_id"], shown["pod_name"], shown["cpus"]) == (
        pod["pinned"],
        "shown",
        "1",
    )
    assert (status["shared"], status["exclusive"]) == ("0", "1")
