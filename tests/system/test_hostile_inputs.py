"""Hostile or broken surroundings met by the OCI hook program, run as runtimes run it against
fake containers in real cgroup v1 (harness/runc.py): links planted in the state directory, a
FIFO as its topology cache, a state directory of another user, annotation values of hundreds of
kilobytes, pods with thousands of annotations, JSON numbers of thousands of digits.

Each is refused with one line on stderr that names the culprit and what to do (or, for the
cache, simply survived), no container's cgroup is written on a refusal, and nothing outside the
state directory is touched.  The daemon's side, where it needs no root, is in
tests/unit/test_hostile_inputs_unit.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, HookResult, pod, sandbox
from topologies import build

from nri_cpuplugin.core import annotation
from nri_cpuplugin.storage.store import StateStore

ALL = f"0-{host.online_cpus()[-1]}"
LAST = str(host.online_cpus()[-1])
CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]
NOBODY = 65534


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        fake_node.state_dir.mkdir(mode=0o700, parents=True)
        yield fake_node


def reason(result: HookResult) -> str:
    """The one line the runtime shows for a failed hook (audit records aside)."""
    lines = result.reason_lines
    assert len(lines) == 1 and lines[0].startswith("nri-cpuplugin: "), result.stderr
    return lines[0]


def fingerprint(path: Path) -> tuple[bytes, int, int, int]:
    info = path.lstat()
    return path.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_mtime_ns


def tree(path: Path) -> dict[str, tuple[bytes, int, int, int]]:
    return {str(p.relative_to(path)): fingerprint(p) for p in sorted(path.rglob("*"))}


# --- 1. state.lock replaced by a symbolic link ------------------------------------------------


def test_hook_refuses_a_lock_link_and_leaves_its_target_alone(box: CgroupSandbox) -> None:
    target = box.dir / "root-owned.conf"  # any root-owned file the link may point at
    target.write_bytes(b"setting = 1\n")
    target.chmod(0o644)
    assert target.stat().st_uid == 0
    before = fingerprint(target)
    lock = box.state_dir / "state.lock"
    lock.symlink_to(target)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)

    result = box.hook(db)
    assert result.returncode == 1
    line = reason(result)
    assert f"the state lock {lock} is a symbolic link" in line and "remove it" in line
    assert fingerprint(target) == before
    assert os.readlink(lock) == str(target)
    assert box.cpus(db) == ALL  # nothing was written
    assert not (box.state_dir / "state.json").exists()


# --- 2. the records directory replaced by a symbolic link -------------------------------------


def test_hook_refuses_a_records_directory_link_and_touches_nothing_outside(
    box: CgroupSandbox,
) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    assert box.hook(web).returncode == 0  # a real record exists
    records = box.state_dir / "hook-containers"
    [record] = records.iterdir()

    elsewhere = box.dir / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "foo.json").write_text('{"mine": true}\n')
    (elsewhere / record.name).write_bytes(record.read_bytes())  # even one that looks like ours
    (elsewhere / "notes.txt").write_text("keep\n")
    before = tree(elsewhere)
    for p in records.iterdir():
        p.unlink()
    records.rmdir()
    records.symlink_to(elsewhere)
    state_before = (box.state_dir / "state.json").read_bytes()

    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    for run in (box.hook(db), box.hook(web, stage="poststop")):
        assert run.returncode == 1
        line = reason(run)
        assert f"records directory {records} is a symbolic link" in line
        assert "remove the link" in line
        assert tree(elsewhere) == before
        assert os.readlink(records) == str(elsewhere)
    assert box.cpus(db) == ALL and box.cpus(web) == ALL
    assert (box.state_dir / "state.json").read_bytes() == state_before


# --- 3. the topology cache replaced by a FIFO -------------------------------------------------


def test_a_fifo_as_topology_cache_never_blocks_the_hook(box: CgroupSandbox) -> None:
    cache = box.state_dir / "hook-topology.json"
    os.mkfifo(cache)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    started = time.monotonic()
    result = box.hook(db, timeout=20)  # a hook that blocks is killed here, and fails the test
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert elapsed < 3, f"the hook took {elapsed:.2f}s"
    assert box.cpus(db) == LAST
    assert stat.S_ISREG(cache.lstat().st_mode)  # rediscovered, cached as a file again
    assert json.loads(cache.read_bytes())["topology"]["cpus"]


# --- 4. a state directory of another user, or that others may write ---------------------------


@pytest.mark.parametrize(
    ("uid", "mode", "problem"),
    [
        (NOBODY, 0o700, f"is owned by uid {NOBODY}, not by uid 0 (us)"),
        (0, 0o770, "is writable by group or others"),
        (0, 0o777, "is writable by group or others"),
    ],
    ids=["other-owner", "group-writable", "world-writable"],
)
def test_hook_refuses_a_state_dir_not_ours_alone(
    box: CgroupSandbox, uid: int, mode: int, problem: str
) -> None:
    os.chown(box.state_dir, uid, uid)
    box.state_dir.chmod(mode)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    result = box.hook(db)
    assert result.returncode == 1
    line = reason(result)
    assert f"refusing to use state directory {box.state_dir}: it {problem}" in line
    assert f"chown root: {box.state_dir} && chmod 0700 {box.state_dir}" in line
    assert list(box.state_dir.iterdir()) == []
    assert box.cpus(db) == ALL


def test_daemon_refuses_a_state_dir_of_another_user(tmp_path: Path) -> None:
    machine, _ = build("single-socket-no-smt", tmp_path)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, NOBODY, NOBODY)
    result = subprocess.run(
        [*CLI, "run", "--socket", str(tmp_path / "no-runtime.sock"), "--state-dir",
         str(state_dir), "--sysfs", str(machine), "--reserved-cpus", "0"],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"nri-cpuplugin: refusing to use state directory {state_dir}: ")
    assert f"owned by uid {NOBODY}" in line and f"chown root: {state_dir}" in line
    assert list(state_dir.iterdir()) == []


# --- 12. an annotation value of 300 KB --------------------------------------------------------


@pytest.mark.parametrize("key", [annotation.EXCLUSIVE, annotation.NICS, annotation.NIC_LOCALITY])
def test_hook_does_not_echo_a_huge_annotation_value(box: CgroupSandbox, key: str) -> None:
    huge = "y" * 300_000
    db = box.add(pod("db"), "db", millicores=1000, limit=1000, annotations={key: huge})
    result = box.hook(db)
    assert result.returncode == 1
    line = reason(result)
    assert key in line and "(300000 characters, cut)" in line
    assert len(line) < 1024, len(line)
    assert len(result.stderr) < 4096, len(result.stderr)  # the audit record(s) too
    [refusal] = [r for r in result.records if r["ACTION"] == "refuse"]
    assert len(json.dumps(refusal)) < 2048
    assert box.cpus(db) == ALL


# --- 13. thousands of annotation keys ---------------------------------------------------------


def crowd(name: str) -> dict[str, str]:
    """4,000 annotations: unrelated ones, ours for 299 other containers of the pod, and one
    oversized value of ours that only exclusive candidates read."""
    out = {f"example.com/{name}-key-{i}": "v" * 64 for i in range(3_700)}
    out |= {f"{annotation.EXCLUSIVE}/container.other-{i}": "false" for i in range(150)}
    out |= {f"{annotation.NICS}/container.other-{i}": "eth0" for i in range(149)}
    out[annotation.NICS] = "n" * 100_000
    assert len(out) == 4_000
    return out


def test_records_of_crowded_pods_stay_small(box: CgroupSandbox) -> None:
    shared = [
        box.add(pod(f"web{i}", "burstable"), "web", millicores=500, annotations=crowd(f"w{i}"))
        for i in range(3)
    ]
    for c in shared:
        result = box.hook(c)
        assert result.returncode == 0, result.stderr
    records = box.state_dir / "hook-containers"
    sizes = {p.name: p.stat().st_size for p in records.iterdir()}
    assert len(sizes) == 3 and max(sizes.values()) < 4096, sizes
    # Later runs read them whole (none is set aside as unusable) and keep every pod placed.
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    result = box.hook(db)
    assert result.returncode == 0, result.stderr
    assert not [r for r in result.records if "unusable" in r.get("MESSAGE", "")], result.stderr
    assert box.cpus(db) == LAST
    assert box.problems([*shared, db]) == []  # the shared ones moved off CPU LAST too
    state = StateStore(box.state_dir).peek().state
    assert state is not None and set(state.sharing) == {c.id for c in shared}


# --- 14. a JSON number of thousands of digits -------------------------------------------------


def test_a_number_of_thousands_of_digits_is_an_input_error(box: CgroupSandbox) -> None:
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    stdin = json.loads(db.state_json())
    text = json.dumps(stdin).replace(f'"pid": {db.pid}', '"pid": ' + "9" * 5000)
    assert "9" * 5000 in text
    result = box.hook(text.encode())
    assert result.returncode == 2
    assert "the container state on stdin is not JSON" in reason(result)
    assert [r["ACTION"] for r in result.records] == ["hook-input"]

    # The same in the bundle's config.json (cpu shares).
    config = db.bundle / "config.json"
    doc = json.loads(config.read_text())
    doc["linux"]["resources"]["cpu"]["shares"] = 1234567
    config.write_text(json.dumps(doc).replace("1234567", "1" * 5000))
    result = box.hook(db)
    assert result.returncode == 2
    assert f"{config} is not JSON" in reason(result)
    assert box.cpus(db) == ALL
