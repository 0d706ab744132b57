"""The OCI hook run by real runc 1.1.5 (bookworm) from config.json, as CRI-O's runc would.

Bundles use the registry-free busybox rootfs, cgroupfs paths shaped like kubelet's in a private
top cgroup, and the hook program with an absolute interpreter and an exact environment (no
PATH).  This machine: cgroup v1 cpusets, CPU 0 reserved, the other CPUs exclusive.  A runtime
that cannot start fails the test with the reason; nothing here skips.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness import runc as runc_harness
from harness.runc import Runc, RuncContainer, pod

from e2e.ready import ready_or_fail
from nri_cpuplugin.core.state import NodeState
from nri_cpuplugin.hook.entry import FAULT_ENV
from nri_cpuplugin.storage.store import StateStore

CPUS = host.online_cpus()
ALL = f"0-{CPUS[-1]}"
LAST = str(CPUS[-1])
RESERVED = "0"


@pytest.fixture(scope="module")
def hook_lab() -> Path:
    ready_or_fail("runc and the busybox rootfs", runc_harness.prepare, runc_harness.reap_stale)
    return runc_harness.debs.LAB


@pytest.fixture
def rc(hook_lab: Path) -> Iterator[Runc]:
    instance = Runc(hook_lab)
    instance.hook_args = ["--state-dir", str(instance.state_dir), "--reserved-cpus", RESERVED]
    try:
        instance.start()
    except Exception as e:
        instance.close()
        pytest.fail(f"runc did not start: {e}", pytrace=False)
    yield instance
    if problems := instance.close():
        pytest.fail("teardown left things behind:\n  " + "\n  ".join(problems), pytrace=False)


def _state(rc: Runc) -> NodeState:
    result = StateStore(rc.state_dir).peek()
    assert result.state is not None, result.problem
    return result.state


def _cgroup_cpus(rc: Runc, c: RuncContainer) -> str:
    return (rc.cpuset_dir(c) / "cpuset.cpus").read_text().strip()


def test_exclusive_container_is_pinned_before_it_runs_and_shared_moves_in_the_same_run(
    rc: Runc,
) -> None:
    web = rc.bundle(pod("web", "burstable"), "web", millicores=500)
    rc.create(web)
    rc.start_container(web)
    assert rc.wait_output(web, 2)[0] == f"Cpus_allowed_list:\t{ALL}"

    db = rc.bundle(pod("db"), "db", millicores=1000, limit=1000)
    rc.create(db)
    # `runc create` has returned: the hook ran, the user program has not started yet.
    init = rc.pid(db)
    assert rc.state(db)["status"] == "created"
    assert host.cpus_allowed_list(init) == LAST
    assert host.cpus_allowed_list(rc.pid(web)) == "0"  # moved by the same hook run
    assert (host.cgroup_dir(db.cgroup, "cpu") / "cpu.cfs_quota_us").read_text().strip() == "-1"
    rc.start_container(db)
    assert rc.wait_output(db, 2) == [f"Cpus_allowed_list:\t{LAST}", LAST]

    state = _state(rc)
    assert str(state.assignments[db.id].cpus) == LAST
    assert set(state.sharing) == {web.id}

    # runc delete runs the poststop hook: the CPU goes back to the shared pool.
    result = rc.delete(db)
    assert result.returncode == 0, result.stderr
    assert host.cpus_allowed_list(rc.pid(web)) == ALL
    assert _cgroup_cpus(rc, web) == ALL
    assert not _state(rc).assignments


def test_dead_container_not_yet_deleted_frees_its_cpu_for_the_next(rc: Runc) -> None:
    first = rc.bundle(pod("a"), "a", millicores=1000, limit=1000)
    rc.create(first)
    rc.start_container(first)
    # It dies; nobody deletes it yet (CRI-O runs `runc delete`, and with it poststop, only at
    # RemoveContainer, possibly much later).  Its cgroup stays, empty.
    os.kill(rc.pid(first), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rc.state(first)["status"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rc.cpuset_dir(first).exists()
    second = rc.bundle(pod("b"), "b", millicores=1000, limit=1000)
    rc.create(second)
    assert host.cpus_allowed_list(rc.pid(second)) == LAST
    assert set(_state(rc).assignments) == {second.id}


def test_32_containers_at_once_each_asking_for_an_exclusive_cpu(rc: Runc) -> None:
    exclusive_cpus = len(CPUS) - 1  # all but the reserved CPU 0
    web = rc.bundle(pod("web", "burstable"), "web", millicores=500)
    rc.create(web)
    rc.start_container(web)

    bundles = [rc.bundle(pod(f"p{i}"), "work", millicores=1000, limit=1000) for i in range(32)]
    procs = []
    for c in bundles:
        out, err = c.stdout_path.open("w"), c.stderr_path.open("w")
        procs.append(
            (
                c,
                subprocess.Popen(
                    rc.create_command(c), stdin=subprocess.DEVNULL, stdout=out, stderr=err
                ),
                out,
                err,
            )
        )
    codes = {}
    for c, proc, out, err in procs:
        codes[c.id] = proc.wait(timeout=300)
        out.close()
        err.close()

    won = [c for c in bundles if codes[c.id] == 0]
    lost = [c for c in bundles if codes[c.id] != 0]
    assert len(won) == exclusive_cpus, {c.id: c.errors()[-300:] for c in lost[:3]}
    for c in lost:
        errors = c.errors()
        assert "nri-cpuplugin: container 'work' of pod default/" in errors, errors[-500:]
        assert "exclusive" in errors
    listed = {entry["id"] for entry in rc.list()}
    assert listed == {web.id} | {c.id for c in won}  # runc destroyed every refused one
    for c in lost:
        assert not rc.cpuset_dir(c).exists()

    state = _state(rc)  # valid: checksum and no CPU twice are checked by decode
    assert set(state.assignments) == {c.id for c in won}
    assert set(state.sharing) == {web.id}
    held = [cpu for a in state.assignments.values() for cpu in a.cpus]
    assert len(held) == len(set(held)) == exclusive_cpus
    assert RESERVED not in {str(cpu) for cpu in held}
    for c in won:
        assert _cgroup_cpus(rc, c) == str(state.assignments[c.id].cpus)
        assert host.cpus_allowed_list(rc.pid(c)) == str(state.assignments[c.id].cpus)
    assert _cgroup_cpus(rc, web) == str(state.shared)
    assert host.cpus_allowed_list(rc.pid(web)) == str(state.shared)


@pytest.mark.parametrize("step", ["committed", "shared-written", "container-written"])
def test_hook_killed_mid_run_fails_the_create_and_the_next_run_repairs(rc: Runc, step: str) -> None:
    web = rc.bundle(pod("web", "burstable"), "web", millicores=500)
    rc.create(web)
    rc.start_container(web)
    victim = rc.bundle(pod("db"), "db", millicores=1000, limit=1000)
    victim_spec = victim.bundle / "config.json"
    spec = json.loads(victim_spec.read_text())
    spec["hooks"]["createRuntime"][0]["env"].append(f"{FAULT_ENV}={step}")
    victim_spec.write_text(json.dumps(spec))
    result = rc.create(victim, check=False)
    assert result.returncode != 0
    assert "signal: killed" in result.stderr or "killed" in result.stderr, result.stderr[-500:]
    assert victim.id not in {entry["id"] for entry in rc.list()}

    again = rc.bundle(pod("db2"), "db", millicores=1000, limit=1000)
    started = time.monotonic()
    rc.create(again)
    assert time.monotonic() - started < 30
    assert host.cpus_allowed_list(rc.pid(again)) == LAST
    assert host.cpus_allowed_list(rc.pid(web)) == "0"
    state = _state(rc)
    assert set(state.assignments) == {again.id} and set(state.sharing) == {web.id}
