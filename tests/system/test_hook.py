"""The OCI hook program against real cgroup v1 on this machine, with fake containers.

A fake container is what a runtime has made by the time it runs createRuntime hooks: a cgroup
(kubelet-shaped path in a private top cgroup) with the container's process in it, and a bundle
with config.json.  The hook runs as the runtimes run it: its executable, its args, an exact
environment, the OCI state on stdin.  Real runc and podman are in tests/e2e/test_hook_*.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.runc import CgroupSandbox, pod, sandbox

from nri_cpuplugin.core.annotation import EXCLUSIVE as EXCLUSIVE_ANNOTATION
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.state import NodeState
from nri_cpuplugin.hook import entry as hook
from nri_cpuplugin.hook import oci
from nri_cpuplugin.hook.records import RECORDS_DIR
from nri_cpuplugin.ops.config import ConfigError
from nri_cpuplugin.storage import owner
from nri_cpuplugin.storage.store import StateStore

ALL = f"0-{host.online_cpus()[-1]}"
LAST = str(host.online_cpus()[-1])


@pytest.fixture
def box() -> Iterator[CgroupSandbox]:
    with sandbox() as fake_node:
        yield fake_node


def state_of(box: CgroupSandbox) -> NodeState:
    result = StateStore(box.state_dir).peek()
    assert result.state is not None, result.problem
    return result.state


# --- placing and releasing -------------------------------------------------------------------


def test_exclusive_container_pinned_and_shared_moved_in_the_same_run(box: CgroupSandbox) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    assert box.hook(web).returncode == 0
    assert box.affinity(web) == ALL

    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    result = box.hook(db)
    assert result.returncode == 0, result.stderr
    assert box.affinity(db) == LAST
    assert box.affinity(web) == "0"  # moved off the exclusive CPU by the same run
    assert box.quota(db) == "-1"  # CFS quota lifted, as the NRI path does
    allocate = next(r for r in result.records if r["ACTION"] == "allocate")
    assert allocate["CPUS"] == LAST and allocate["CONTAINER_ID"] == db.id
    assert "LOCK_WAIT_MS" in allocate
    state = state_of(box)
    assert str(state.assignments[db.id].cpus) == LAST
    assert state.assignments[db.id].pod_name == "db"
    assert set(state.sharing) == {web.id}
    assert box.problems([web, db]) == []


def test_poststop_gives_the_cpu_back(box: CgroupSandbox) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0
    assert box.hook(db).returncode == 0
    box.stop(db)
    result = box.hook(db, stage="poststop")
    assert result.returncode == 0, result.stderr
    assert "release" in result.actions()
    assert box.affinity(web) == ALL
    state = state_of(box)
    assert not state.assignments and str(state.shared) == ALL
    assert box.problems([web]) == []


def test_a_poststop_for_a_container_that_still_runs_releases_nothing(box: CgroupSandbox) -> None:
    """The id on a poststop's stdin is not trusted: a container whose cgroup still has
    processes keeps its exclusive CPU, and the next exclusive request is refused."""
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0 and box.hook(db).returncode == 0
    result = box.hook(db, stage="poststop")  # db has not stopped
    assert result.returncode == 1
    assert "still has processes" in result.reason_lines[-1], result.stderr
    assert str(state_of(box).assignments[db.id].cpus) == LAST
    assert box.affinity(db) == LAST and box.affinity(web) == "0"
    rival = box.add(pod("rival"), "rival", millicores=1000, limit=1000)
    assert box.hook(rival).returncode == 1
    assert box.problems([web, db]) == []


def test_stage_is_read_from_the_state_status(box: CgroupSandbox) -> None:
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db.state_json("creating"), stage=None).returncode == 0
    assert db.id in state_of(box).assignments
    box.stop(db)
    assert box.hook(db.state_json("stopped"), stage=None).returncode == 0
    assert not state_of(box).assignments
    result = box.hook(db.state_json("running"), stage=None)
    assert result.returncode == 2 and "cannot tell the hook stage" in result.reason_lines[-1]


def test_missed_poststop_is_repaired_by_the_next_run(box: CgroupSandbox) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0
    assert box.hook(db).returncode == 0
    box.stop(db)  # gone without poststop (CRI-O runs it only at RemoveContainer)
    db2 = box.add(pod("db2"), "db", millicores=1000, limit=1000)
    result = box.hook(db2)
    assert result.returncode == 0, result.stderr
    assert box.affinity(db2) == LAST
    assert box.problems([web, db2]) == []


def test_exited_container_with_its_cgroup_still_there_is_stale(box: CgroupSandbox) -> None:
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db).returncode == 0
    box.stop(db, remove_cgroup=False)  # dead, not yet deleted by the runtime
    other = box.add(pod("other"), "x", millicores=1000, limit=1000)
    assert box.hook(other).returncode == 0
    assert box.affinity(other) == LAST


def test_restarted_container_gets_its_cpus_back(box: CgroupSandbox) -> None:
    p = pod("db")
    first = box.add(p, "db", millicores=1000, limit=1000)
    keeper = box.add(p, "sidecar", millicores=100)  # keeps the pod alive meanwhile
    assert box.hook(keeper).returncode == 0
    assert box.hook(first).returncode == 0
    box.stop(first)
    second = box.add(p, "db", millicores=1000, limit=1000)  # kubelet: new id, same name
    result = box.hook(second)
    assert result.returncode == 0, result.stderr
    allocate = next(r for r in result.records if r["ACTION"] == "allocate")
    assert "previous CPUs back" in allocate["REASON"]


def test_second_exclusive_request_is_refused_with_one_line(box: CgroupSandbox) -> None:
    first = box.add(pod("a"), "a", millicores=1000, limit=1000)
    assert box.hook(first).returncode == 0
    before = (box.state_dir / "state.json").read_bytes()
    second = box.add(pod("b"), "b", millicores=1000, limit=1000)
    spec_cpus = box.cpus(second)
    result = box.hook(second)
    assert result.returncode == 1
    assert len(result.reason_lines) == 1
    assert result.reason_lines[0].startswith("nri-cpuplugin: container 'b' of pod default/b")
    assert "exclusive" in result.reason_lines[0]
    refuse = [r for r in result.records if r["ACTION"] == "refuse"]
    assert refuse and refuse[0]["PRIORITY"] == "3" and refuse[0]["CONTAINER_ID"] == second.id
    assert (box.state_dir / "state.json").read_bytes() == before
    assert box.cpus(second) == spec_cpus  # untouched: the runtime destroys it next
    assert not (box.state_dir / RECORDS_DIR / f"{second.id}.json").exists()


@pytest.mark.parametrize(
    ("qos", "millicores", "annotations"),
    [
        ("burstable", 1000, {}),
        ("besteffort", 0, {}),
        ("guaranteed", 1500, {}),
        ("guaranteed", 1000, {EXCLUSIVE_ANNOTATION: "false"}),
    ],
    ids=["burstable", "besteffort", "fractional", "opted-out"],
)
def test_ineligible_containers_share(
    box: CgroupSandbox, qos: str, millicores: int, annotations: dict[str, str]
) -> None:
    c = box.add(pod("p", qos), "c", millicores=millicores, annotations=annotations)
    result = box.hook(c)
    assert result.returncode == 0, result.stderr
    state = state_of(box)
    assert c.id in state.sharing and not state.assignments
    assert box.affinity(c) == ALL


def test_sandbox_and_non_kubernetes_containers_are_left_alone(box: CgroupSandbox) -> None:
    pause = box.add(
        pod("p"),
        "POD",
        millicores=1000,
        annotations={"io.kubernetes.cri-o.ContainerType": "sandbox"},
    )
    plain = box.add(pod("q"), "plain", millicores=1000)
    config = json.loads((plain.bundle / "config.json").read_text())
    config["annotations"] = {"org.example/other": "1"}
    (plain.bundle / "config.json").write_text(json.dumps(config))
    for c in (pause, plain):
        result = box.hook(c)
        assert result.returncode == 0, result.stderr
        assert result.actions() == ["skip"]
        assert box.affinity(c) == ALL
    assert not box.state_dir.exists()  # not even the lock was taken


def test_status_command_shows_hook_assignments(box: CgroupSandbox) -> None:
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db).returncode == 0
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nri_cpuplugin.cli",
            "status",
            "--state-dir",
            str(box.state_dir),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["state"] == "ok"
    assert [a["container_id"] for a in report["assignments"]] == [db.id]


def test_hook_stands_aside_while_an_nri_daemon_owns_the_state_directory(
    box: CgroupSandbox,
) -> None:
    """Both front ends installed on one node: the daemon's claim (storage/owner.py) wins."""
    box.state_dir.mkdir(mode=0o700)
    dir_fd = os.open(box.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        claim = owner.claim(dir_fd, str(box.state_dir), wait=0)  # "the daemon" (this process)
        db = box.add(pod("db"), "db", millicores=1000, limit=1000)
        result = box.hook(db)
        assert result.returncode == 0, result.stderr
        [defer] = result.records
        assert defer["ACTION"] == "defer" and defer["PRIORITY"] == "5"
        assert defer["DAEMON_PID"] == str(os.getpid()) and defer["DAEMON_RUNNING"] == "True"
        assert "both installed" in defer["MESSAGE"]
        assert box.affinity(db) == ALL  # nothing written: the daemon placed it through NRI
        assert not (box.state_dir / "state.json").exists()
        assert not (box.state_dir / RECORDS_DIR).exists()
        assert box.hook(db, stage="poststop").actions() == ["defer"]

        os.close(claim)  # the daemon dies: its containers' CPUs must not be given away
        result = box.hook(db)
        assert result.returncode == 0 and result.actions() == ["defer"]
        assert result.records[0]["PRIORITY"] == "4"
        assert "is not running" in result.records[0]["MESSAGE"]
        assert box.affinity(db) == ALL

        # The operator moves the node to the hook for good: the hook places again.
        (box.state_dir / owner.DAEMON_FILE).unlink()
        result = box.hook(db)
        assert result.returncode == 0 and "allocate" in result.actions(), result.stderr
        assert box.affinity(db) == LAST
    finally:
        os.close(dir_fd)


def test_status_says_who_places_the_containers(box: CgroupSandbox) -> None:
    def status(code: int) -> tuple[dict, str]:
        args = [sys.executable, "-m", "nri_cpuplugin.cli", "status", "--state-dir"]
        run = [*args, str(box.state_dir)]
        text = subprocess.run(run, capture_output=True, text=True)
        report = subprocess.run([*run, "--json"], capture_output=True, text=True)
        assert text.returncode == report.returncode == code, text.stderr
        return json.loads(report.stdout), text.stdout

    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db).returncode == 0
    report, text = status(0)
    assert report["daemon"] is None and "OCI hook mode" in text
    dir_fd = os.open(box.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    claim = owner.claim(dir_fd, str(box.state_dir), wait=0)
    os.close(dir_fd)
    # A "daemon" (this test) that never reports its health: stale (exit 5).
    report, text = status(5)
    assert report["daemon"] == {"pid": os.getpid(), "running": True}
    assert f"pid {os.getpid()}, running" in text
    assert "has not reported its health yet" in report["health"]["message"]
    os.close(claim)
    report, text = status(3)  # not running, as systemctl says of an inactive unit
    assert report["daemon"] == {"pid": os.getpid(), "running": False}
    assert "NOT RUNNING" in text


# --- state file trouble ----------------------------------------------------------------------


def test_corrupt_state_is_set_aside_and_rebuilt_from_live_cgroups(box: CgroupSandbox) -> None:
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0
    assert box.hook(db).returncode == 0
    (box.state_dir / "state.json").write_text('{"version": 1, "torn')
    late = box.add(pod("late", "burstable"), "late", millicores=100)
    result = box.hook(late)
    assert result.returncode == 0, result.stderr
    assert "state-rebuild" in result.actions()
    assert list(box.state_dir.glob("state.json.bad-*"))
    state = state_of(box)
    assert str(state.assignments[db.id].cpus) == LAST  # adopted where it runs
    assert set(state.sharing) == {web.id, late.id}
    assert box.problems([web, db, late]) == []


def test_lock_is_shared_with_the_daemon_and_the_wait_is_bounded(box: CgroupSandbox) -> None:
    c = box.add(pod("db"), "db", millicores=1000, limit=1000)
    store = StateStore(box.state_dir)  # the daemon's store: flock on state.lock
    with store.locked():
        result = box.hook(c, args=["--lock-timeout", "0.3"])
    assert result.returncode == 1
    assert "timed out after 0.3s waiting for the state lock" in result.reason_lines[-1]
    assert box.cpus(c) == ALL
    assert box.hook(c).returncode == 0  # free again


def test_hook_waits_for_the_lock_then_proceeds(box: CgroupSandbox) -> None:
    c = box.add(pod("db"), "db", millicores=1000, limit=1000)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nri_cpuplugin.storage.store import StateStore\n"
            f"with StateStore({str(box.state_dir)!r}).locked():\n"
            "    print('held', flush=True); time.sleep(2.0)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    result = box.hook(c)
    holder.wait()
    assert result.returncode == 0, result.stderr
    allocate = next(r for r in result.records if r["ACTION"] == "allocate")
    assert float(allocate["LOCK_WAIT_MS"]) > 100


# --- hostile and broken input: clean refusal, nothing written ---------------------------------


def _state(**fields: object) -> bytes:
    doc = {
        "ociVersion": "1.0.2",
        "id": "abc",
        "status": "creating",
        "pid": 1,
        "bundle": "/nonexistent",
    }
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


HOSTILE = {
    "empty": b"",
    "not-json": b"{not json",
    "array": b"[1, 2]",
    "huge": b'{"id": "' + b"a" * (oci.MAX_STATE_BYTES + 10) + b'"}',
    "id-dotdot": _state(id="../../etc"),
    "id-slash": _state(id="a/b"),
    "id-nul": _state(id="abc\u0000def"),
    "id-long": _state(id="a" * 129),
    "id-dot": _state(id=".."),
    "id-number": _state(id=123),
    "pid-negative": _state(pid=-5),
    "pid-string": _state(pid="12"),
    "bundle-relative": _state(bundle="relative/dir"),
    "bundle-dotdot": _state(bundle="/run/containers/../../etc"),
    "bundle-nul": _state(bundle="/run/containers/a\u0000b"),
    "bundle-missing": _state(bundle="/nonexistent/bundle"),
}


@pytest.mark.parametrize("stdin", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_state_is_refused_cleanly(box: CgroupSandbox, stdin: bytes) -> None:
    result = box.hook(stdin)
    assert result.returncode == 2, result.stderr
    assert len(result.reason_lines) == 1 and result.reason_lines[0].startswith("nri-cpuplugin: ")
    assert "Traceback" not in result.stderr
    assert not box.state_dir.exists()


def test_pid_outside_the_container_is_refused(box: CgroupSandbox) -> None:
    c = box.add(pod("db"), "db", millicores=1000, limit=1000)
    for pid in (1, os.getpid()):  # root cgroup / a cgroup not named after the container
        result = box.hook(_state(id=c.id, pid=pid, bundle=str(c.bundle)))
        assert result.returncode == 2
        assert "cgroup" in result.reason_lines[-1]
    assert box.cpus(c) == ALL
    assert not box.state_dir.exists()


@pytest.mark.parametrize(
    "breakage", ["symlink", "not-json", "bad-shares", "annotation-not-string", "directory"]
)
def test_broken_config_json_is_refused(box: CgroupSandbox, breakage: str) -> None:
    c = box.add(pod("db"), "db", millicores=1000, limit=1000)
    config = c.bundle / "config.json"
    original = config.read_text()
    config.unlink()
    if breakage == "symlink":
        real = c.bundle / "real.json"
        real.write_text(original)
        config.symlink_to(real)
    elif breakage == "not-json":
        config.write_text("{")
    elif breakage == "bad-shares":
        doc = json.loads(original)
        doc["linux"]["resources"]["cpu"]["shares"] = "1024"
        config.write_text(json.dumps(doc))
    elif breakage == "annotation-not-string":
        doc = json.loads(original)
        doc["annotations"]["io.kubernetes.pod.uid"] = 7
        config.write_text(json.dumps(doc))
    else:
        config.mkdir()
    result = box.hook(c)
    assert result.returncode == 2, result.stderr
    assert len(result.reason_lines) == 1
    assert box.cpus(c) == ALL
    assert not box.state_dir.exists()


def test_hostile_record_files_are_ignored(box: CgroupSandbox, tmp_path: Path) -> None:
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(db).returncode == 0
    records = box.state_dir / RECORDS_DIR
    (records / "evil.json").write_text(
        '{"version": 1, "container_id": "evil", "cpuset_cgroup": "/../../etc"}'
    )
    outside = tmp_path / "target"
    outside.write_text("x")
    (records / "link.json").symlink_to(outside)
    (records / ".hidden.json").write_text("{}")
    (records / "array.json").write_text("[]")
    (records / "typed.json").write_text(
        '{"version": 1, "container_id": "typed", "cpuset_cgroup": "/a", "container_name": 1}'
    )
    other = box.add(pod("o", "burstable"), "o", millicores=100)
    result = box.hook(other)
    assert result.returncode == 0, result.stderr
    assert outside.read_text() == "x"
    assert box.affinity(db) == LAST
    assert sorted(p.name for p in records.iterdir()) == sorted(
        [".hidden.json", f"{db.id}.json", f"{other.id}.json"]
    )
    assert any("unusable" in r["MESSAGE"] for r in result.records)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["createRuntime"], ("createRuntime", {})),
        ([], (None, {})),
        (["--state-dir", "/s", "--lock-timeout=2", "poststop"],
         ("poststop", {"state-dir": "/s", "lock-timeout": "2"})),
        (["--config", "-", "--sysfs=/x"], (None, {"config": "-", "sysfs": "/x"})),
        (["--reserved-cpus", "0", "--help", "--nonsense"], None),  # help wins, nothing runs
        (["--config=--odd", "--", "createRuntime"], ("createRuntime", {"config": "--odd"})),
    ],
)  # fmt: skip
def test_hook_options_parse_as_documented(argv, expected) -> None:
    assert hook.parse_args(argv) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--state_dir", "/s"], "unknown option --state_dir; options: --config, --state-dir"),
        (["createRuntime", "--lock-timeout"], "--lock-timeout needs a value"),
        (["--config", "--help", "createRuntime"], "--config needs a value"),
        (["--", "createRuntime", "poststop"], "unexpected argument 'poststop'"),
        (["createRuntime", "poststop"], "unexpected argument 'poststop': only one STAGE"),
        (["-x"], "unknown option -x"),
    ],
)
def test_bad_hook_options_are_refused_with_the_reason(argv, message) -> None:
    with pytest.raises(hook.UsageError, match=message):
        hook.parse_args(argv)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reserved-cpus": "3-1"}, "--reserved-cpus: invalid cpulist '3-1'"),
        ({"lock-timeout": "-1"}, "expected a number of seconds >= 0"),
        ({"lock-timeout": "inf"}, "expected a number of seconds >= 0"),
        ({"lock-timeout": "nan"}, "expected a number of seconds >= 0"),
    ],
)
def test_bad_hook_option_values_are_refused_with_the_reason(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        hook.settings_and_options(None, values, {})


def test_hook_flags_win_over_the_config_file(tmp_path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('reserved_cpu_count = 2\nstate_dir = "/from-file"\ncfs_quota = "keep"\n')
    values = {"config": str(config), "reserved-cpus": "1", "lock-timeout": "0"}
    settings, options = hook.settings_and_options("poststop", values, {hook.FAULT_ENV: "locked"})
    assert (settings.reserved_cpus, settings.reserved_cpu_count) == (CPUSet.parse("1"), None)
    assert (settings.state_dir, settings.cfs_quota) == ("/from-file", "keep")
    assert (options.stage, options.lock_timeout, options.fault) == ("poststop", 0.0, "locked")


def test_bad_configuration_fails_with_one_line_and_an_audit_record(box: CgroupSandbox) -> None:
    c = box.add(pod("db"), "db", millicores=1000, limit=1000)
    bad = box.dir / "bad.toml"
    bad.write_text('reserved_cpus = "0"\nno_such_key = 1\n')
    for args in (["--config", str(box.dir / "missing.toml")], ["--config", str(bad)]):
        result = box.hook(c, args=args)
        assert result.returncode == 2, result.stderr
        assert len(result.reason_lines) == 1 and result.reason_lines[0].startswith("nri-cpuplugin:")
        assert [r["ACTION"] for r in result.records] == ["hook-config"]
    assert box.cpus(c) == ALL


def test_an_in_place_resize_is_caught_by_the_next_hook_run(box: CgroupSandbox) -> None:
    """``runc update`` (CRI-O's in-place resize) runs no hook: the next run of the hook, for
    any container, finds the new CPU request in the cgroup and resizes as the daemon would."""
    web = box.add(pod("web", "burstable"), "web", millicores=500)
    db = box.add(pod("db"), "db", millicores=1000, limit=1000)
    assert box.hook(web).returncode == 0 and box.hook(db).returncode == 0
    assert box.affinity(db) == "1" and box.affinity(web) == "0"
    shares = box.cpu_dir(db.cgroup) / "cpu.shares"
    shares.write_text("1536\n")  # 1500m: no longer whole CPUs
    late = box.add(pod("late", "burstable"), "late", millicores=100)
    result = box.hook(late)
    assert result.returncode == 0, result.stderr
    assert box.affinity(db) == "0-1" and box.affinity(web) == "0-1"
    assert "resize" in result.actions()
    shares.write_text("1024\n")  # back to 1 CPU: exclusive again
    later = box.add(pod("later", "burstable"), "later", millicores=100)
    assert box.hook(later).returncode == 0
    assert box.affinity(db) == "1" and box.affinity(web) == "0"
    assert box.problems([web, db, late, later]) == []
