"""The hook SIGKILLed at every step boundary; the next invocation repairs state and cgroups.

``NRI_CPUPLUGIN_FAULT=<step>`` (test-only, see nri_cpuplugin/hook.py) makes the hook kill
itself at that boundary.  The runtime then does what runc and crun do when a createRuntime hook
fails: it destroys the container.  Whatever the hook left behind - a committed assignment for
a container that never started, shared containers already shrunk, records without state - the
next invocation must leave the node consistent: state valid, records matching it, and every
live container's cpuset what the state says.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, pod, sandbox

from nri_cpuplugin.hook.records import RECORDS_DIR
from nri_cpuplugin.hook.runner import FAULT_ENV, FAULT_STEPS
from nri_cpuplugin.hook.topology_cache import TOPOLOGY_CACHE

ALL = f"0-{host.online_cpus()[-1]}"
LAST = str(host.online_cpus()[-1])
POSTSTOP_STEPS = ("locked", "loaded", "decided", "committed", "shared-written", "cleaned")


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        yield fake_node


@pytest.mark.parametrize("step", FAULT_STEPS)
def test_create_killed_at_each_step_is_repaired(box: CgroupSandbox, step: str) -> None:
    shared = box.add(pod("web", "burstable"), "web", millicores=500)
    assert box.hook(shared).returncode == 0
    victim = box.add(pod("db"), "db", millicores=1000, limit=1000)
    result = box.hook(victim, env={FAULT_ENV: step})
    assert result.returncode == -signal.SIGKILL, result.stderr
    box.stop(victim)  # the runtime destroys a container whose createRuntime hook failed

    # Next invocation: a shared container.  The pool must be whole again everywhere.
    late = box.add(pod("late", "burstable"), "late", millicores=100)
    result = box.hook(late)
    assert result.returncode == 0, result.stderr
    assert box.problems([shared, late]) == []
    assert box.affinity(shared) == ALL

    # And the CPU the dead container was given is free for the next exclusive one.
    again = box.add(pod("db2"), "db", millicores=1000, limit=1000)
    result = box.hook(again)
    assert result.returncode == 0, result.stderr
    assert box.affinity(again) == LAST
    assert box.problems([shared, late, again]) == []


@pytest.mark.parametrize("step", FAULT_STEPS)
def test_poststop_killed_at_each_step_is_repaired(box: CgroupSandbox, step: str) -> None:
    shared = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(shared).returncode == 0
    assert box.hook(db).returncode == 0
    box.stop(db)
    result = box.hook(db, stage="poststop", env={FAULT_ENV: step})
    if step in POSTSTOP_STEPS:
        assert result.returncode == -signal.SIGKILL, result.stderr
    else:  # a boundary poststop never reaches: it just completes
        assert result.returncode == 0, result.stderr

    late = box.add(pod("late", "burstable"), "late", millicores=100)
    result = box.hook(late)
    assert result.returncode == 0, result.stderr
    assert box.problems([shared, late]) == []
    assert box.affinity(shared) == ALL


def test_repeated_create_for_the_same_container_is_idempotent(box: CgroupSandbox) -> None:
    """prestart and createRuntime both configured, or a runtime retrying: same answer."""
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db, stage="prestart").returncode == 0
    result = box.hook(db, stage="createRuntime")
    assert result.returncode == 0, result.stderr
    allocate = next(r for r in result.records if r["ACTION"] == "allocate")
    assert allocate["REASON"] == "already assigned" and allocate["CGROUP_WRITES"] == "0"
    assert box.problems([db]) == []


@pytest.mark.parametrize("step", ["recorded", "committed"])
def test_an_in_place_resize_found_by_a_killed_run_is_found_again(
    box: CgroupSandbox, step: str
) -> None:
    """A run that finds a resize and dies before its cgroup writes: the next run still sees
    the new request and resizes (the resized record is written only after the commit)."""
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0 and box.hook(db).returncode == 0
    (box.cpu_dir(db.cgroup) / "cpu.shares").write_text("1536\n")  # 1500m: shared now
    victim = box.add(pod("late", "burstable"), "late", millicores=100)
    result = box.hook(victim, env={FAULT_ENV: step})
    assert result.returncode == -signal.SIGKILL, result.stderr
    box.stop(victim)

    later = box.add(pod("later", "burstable"), "later", millicores=100)
    result = box.hook(later)
    assert result.returncode == 0, result.stderr
    assert box.affinity(db) == ALL and box.affinity(web) == ALL
    assert box.problems([web, db, later]) == []


def test_temp_files_of_killed_writes_are_removed_by_the_next_run(box: CgroupSandbox) -> None:
    """A write killed between its temp file and the rename leaves the temp file: a record's is
    removed by the next run, the topology cache's once it is a minute old (cache writes take
    no lock), and nothing else in the state directory is touched."""
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    assert box.hook(web).returncode == 0
    state_dir = Path(box.state_dir)
    records = state_dir / RECORDS_DIR
    record_temp = records / f".{web.id}.json.0123456789ab.tmp"
    old_cache_temp = state_dir / f".{TOPOLOGY_CACHE}.0123456789ab.tmp"
    new_cache_temp = state_dir / f".{TOPOLOGY_CACHE}.ba9876543210.tmp"
    unrelated = state_dir / ".keep-me"
    for path in (record_temp, old_cache_temp, new_cache_temp, unrelated):
        path.write_text("{")
    os.utime(old_cache_temp, (time.time() - 120, time.time() - 120))

    late = box.add(pod("late", "burstable"), "late", millicores=100)
    assert box.hook(late).returncode == 0
    assert not record_temp.exists() and not old_cache_temp.exists()
    assert new_cache_temp.exists() and unrelated.exists()
    assert sorted(p.name for p in records.iterdir()) == sorted(
        [f"{web.id}.json", f"{late.id}.json"]
    )


def test_a_resized_record_that_cannot_be_written_fails_nothing(
    box: CgroupSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run that finds a resize places an exclusive container on the CPU the resize freed,
    and the resized container's record cannot be rewritten after the commit (a full disk):
    the new container is placed all the same, and the next run finds the resize again."""
    import io

    from nri_cpuplugin.hook import entry as hook
    from nri_cpuplugin.hook.records import Records
    from nri_cpuplugin.ops.audit import Audit

    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0 and box.hook(db).returncode == 0
    (box.cpu_dir(db.cgroup) / "cpu.shares").write_text("1536\n")  # 1500m: shared now
    late = box.add(pod("late"), "late", millicores=1000, limit=1000)
    write = Records.write

    def full_for_db(self, dir_fd, record):
        if record.workload.container_id == db.id:
            raise OSError(28, "No space left on device")
        return write(self, dir_fd, record)

    monkeypatch.setattr(Records, "write", full_for_db)
    values = {"state-dir": str(box.state_dir), "reserved-cpus": "0"}
    settings, options = hook.settings_and_options("createRuntime", values, {})
    records: list[dict] = []
    stderr = io.StringIO()
    stdin = io.BytesIO(late.state_json("creating"))
    assert hook.run(settings, options, stdin, stderr, Audit(records.append)) == 0, stderr
    assert box.affinity(late) == LAST and box.affinity(db) == "0"
    assert any("finds the resize again" in r["MESSAGE"] for r in records)
    monkeypatch.setattr(Records, "write", write)
    later = box.add(pod("later", "burstable"), "later", millicores=100)
    assert box.hook(later).returncode == 0
    assert box.problems([web, db, late, later]) == []
