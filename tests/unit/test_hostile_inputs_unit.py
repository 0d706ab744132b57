"""Hostile or broken surroundings met by the daemon and the shared code, without root: a link
planted as the state lock, a state directory others may write, a configuration that reserves
every CPU, annotation values of hundreds of kilobytes, pods with thousands of annotations, JSON
numbers of thousands of digits.  Each is refused in one line that names the culprit and what
to do, and nothing outside the state directory is touched.

The OCI hook program against real cgroups, and what needs another user, are in
tests/system/test_hostile_inputs.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from builders import container, pod
from daemon_driver import Driver
from topologies import build, offline, topology

from nri_cpuplugin.base import jsonbytes
from nri_cpuplugin.core import annotation
from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.core.eligibility import eligibility
from nri_cpuplugin.core.policy import PolicyError, StaticPolicy
from nri_cpuplugin.core.workload import BURSTABLE, GUARANTEED, Workload
from nri_cpuplugin.hardware.cgroupfs import ContainerCgroups
from nri_cpuplugin.hook import oci
from nri_cpuplugin.hook.records import Record, Records
from nri_cpuplugin.ops.config import Settings
from nri_cpuplugin.storage.store import StateDirError, StateLockTimeout

CLI = [sys.executable, "-m", "nri_cpuplugin.cli"]
P = CPUSet.parse
HUGE = 300_000  # characters of one annotation value


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    """An 8-CPU sysfs tree (CPUs 0-7)."""
    return build("single-socket-no-smt", tmp_path)[0]


@pytest.fixture
def daemon_on(machine: Path):
    """``daemon_on(state_dir, **settings) -> Driver``: the daemon on ``machine``, closed at
    the end."""
    made: list[Driver] = []

    def make(state_dir: Path, **kw) -> Driver:
        made.append(Driver(Settings(sysfs=str(machine), state_dir=str(state_dir), **kw)))
        return made[-1]

    yield make
    for driver in made:
        driver.close()


def run_daemon(machine: Path, state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``nri-cpuplugin run`` up to where it would wait for the runtime (no one listens on the
    socket); a daemon that starts instead of refusing runs into the timeout."""
    return subprocess.run(
        [*CLI, "run", "--socket", str(state_dir.parent / "no-runtime.sock"),
         "--state-dir", str(state_dir), "--sysfs", str(machine), *args],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip


def one_line(stderr: str) -> str:
    """The refusal: exactly one line, ours, no traceback."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nri-cpuplugin: "), stderr
    return lines[0]


def fingerprint(path: Path) -> tuple[bytes, int, int]:
    info = path.stat()
    return path.read_bytes(), stat.S_IMODE(info.st_mode), info.st_mtime_ns


# --- 1. state.lock replaced by a symbolic link ------------------------------------------------


@pytest.fixture
def planted_lock(tmp_path: Path) -> tuple[Path, Path]:
    """(state dir whose state.lock links to a file outside it, that file)."""
    target = tmp_path / "precious.conf"
    target.write_bytes(b"do not truncate me\n")
    target.chmod(0o644)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "state.lock").symlink_to(target)
    return state_dir, target


def test_daemon_load_state_refuses_a_lock_link_and_leaves_its_target_alone(
    daemon_on, planted_lock: tuple[Path, Path]
) -> None:
    state_dir, target = planted_lock
    before = fingerprint(target)
    plugin = daemon_on(state_dir, reserved_cpus=P("0"))
    with pytest.raises(StateLockTimeout) as err:
        plugin.daemon.load_state()
    message = str(err.value)
    assert f"{state_dir}/state.lock is a symbolic link" in message and "remove it" in message
    assert err.value.code == "lock-unusable"
    assert fingerprint(target) == before
    assert os.readlink(state_dir / "state.lock") == str(target)
    # Nothing else but the daemon's own claim on the directory (storage/owner.py).
    assert sorted(p.name for p in state_dir.iterdir()) == ["daemon.lock", "state.lock"]


def test_run_refuses_a_lock_link_in_one_line(
    machine: Path, planted_lock: tuple[Path, Path]
) -> None:
    state_dir, target = planted_lock
    before = fingerprint(target)
    result = run_daemon(machine, state_dir, "--reserved-cpus", "0")
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert f"{state_dir}/state.lock is a symbolic link" in line and "remove it" in line
    assert fingerprint(target) == before


# --- 4. a state directory others may write ----------------------------------------------------


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777], ids=oct)
def test_daemon_refuses_a_state_dir_others_may_write(
    machine: Path, daemon_on, tmp_path: Path, mode: int
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_dir.chmod(mode)
    with pytest.raises(StateDirError, match="writable by group or others"):
        daemon_on(state_dir, reserved_cpus=P("0")).daemon.load_state()
    result = run_daemon(machine, state_dir, "--reserved-cpus", "0")
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert f"refusing to use state directory {state_dir}" in line
    assert f"chmod 0700 {state_dir}" in line
    assert list(state_dir.iterdir()) == []  # nothing was created in it


# --- 11. reserved CPUs covering every CPU -----------------------------------------------------


def test_reserving_every_cpu_is_refused_at_start_as_list_and_as_count() -> None:
    machine = topology("single-socket-no-smt")  # CPUs 0-7
    with pytest.raises(PolicyError) as by_list:
        StaticPolicy.from_config(machine, reserved_cpus=P("0-7"))
    with pytest.raises(PolicyError) as by_count:
        StaticPolicy.from_config(machine, reserved_count=8)
    for err in (by_list.value, by_count.value):
        assert err.code == "config"
    message = str(by_list.value)
    for words in ("reserved CPUs 0-7", "online 0-7", "isolated none", "reserve fewer CPUs"):
        assert words in message, message
    # One CPU left is a working configuration.
    assert StaticPolicy.from_config(machine, reserved_cpus=P("0-6")).assignable == P("7")


def test_reserving_every_cpu_but_offline_or_isolated_ones_is_not_refused() -> None:
    # CPU 7 offline (hotplug): the policy runs on CPUs 0-6 and takes 7 when it returns; an
    # offline CPU must not turn a good configuration into a refusal to start.
    machine = topology("single-socket-no-smt")
    policy = StaticPolicy(offline(machine, "7"), P("0-6"))
    assert not policy.assignable
    # Isolated CPUs are exclusive on request: reserving all the others is a configuration.
    isolcpus = topology("offline-isolcpus")  # isolated 2-3,10-11; offline 5,13
    policy = StaticPolicy(isolcpus, isolcpus.all_cpus - isolcpus.isolated)
    assert policy.free_exclusive(policy.empty_state(), isolated=True) == P("2-3,10-11")
    with pytest.raises(PolicyError, match="every CPU of this machine"):
        StaticPolicy(isolcpus, isolcpus.all_cpus)


@pytest.mark.parametrize("how", ["list", "count"])
def test_run_refuses_to_reserve_every_cpu_in_one_line(
    machine: Path, tmp_path: Path, how: str
) -> None:
    state_dir = tmp_path / "state"
    if how == "list":
        result = run_daemon(machine, state_dir, "--reserved-cpus", "0-7")
    else:
        config = tmp_path / "config.toml"
        config.write_text("reserved_cpu_count = 8\n")
        result = run_daemon(machine, state_dir, "--config", str(config))
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "reserve" in line and "0-7" in line


# --- 12. an annotation value of 300 KB --------------------------------------------------------


KEYS = [annotation.EXCLUSIVE, annotation.ISOLATED, annotation.NIC_LOCALITY, annotation.NICS]


@pytest.mark.parametrize("specific", [False, True], ids=["pod-wide", "container-specific"])
@pytest.mark.parametrize("key", KEYS)
def test_huge_annotation_value_is_not_echoed_by_the_daemon(
    daemon_on, tmp_path: Path, key: str, specific: bool
) -> None:
    plugin = daemon_on(tmp_path / "state", reserved_cpus=P("0"))
    plugin.configure()
    records = plugin.records
    db = pod("db")
    name = f"{key}/container.pg" if specific else key
    db.annotations[name] = "x" * HUGE
    with pytest.raises(PolicyError) as err:
        plugin.create_container(db, container("pg", db, 2000))
    message = str(err.value)  # what the runtime shows whoever created the pod
    assert err.value.code == "bad-annotation"
    assert name in message and "characters, cut" in message
    assert len(message) < 1024, len(message)
    [refusal] = [r for r in records if r["ACTION"] == "refuse"]
    assert len(json.dumps(refusal)) < 2048
    assert not plugin.state.assignments and not plugin.state.sharing


def test_echo_cuts_and_says_so() -> None:
    assert annotation.echo("true") == "'true'"
    cut = annotation.echo("\x00" * HUGE)
    assert len(cut) < 400 and f"({HUGE} characters, cut)" in cut


# --- 13. thousands of annotation keys ---------------------------------------------------------


def crowded_workload(qos: str = BURSTABLE) -> Workload:
    """A container whose pod carries 4,000 annotations: unrelated ones, our keys for 250 other
    containers, and an oversized value of one of ours."""
    annotations = {f"example.com/key-{i}": "v" * 64 for i in range(3_745)}
    annotations |= {f"{annotation.EXCLUSIVE}/container.other-{i}": "false" for i in range(150)}
    annotations |= {f"{annotation.NICS}/container.other-{i}": "eth0" for i in range(100)}
    annotations[annotation.NICS] = "n" * HUGE  # read for exclusive candidates only
    annotations[f"{annotation.NIC_LOCALITY}/container.web"] = "off"
    annotations[annotation.EXCLUSIVE] = "false"
    assert len(annotations) == 3_998
    return Workload(
        container_id="c" * 64, container_name="web", pod_uid="uid-web", pod_name="web",
        pod_namespace="ns", qos=qos, cpu_request_milli=500, annotations=annotations,
        cgroup_path="/kubepods/burstable/poduid-web/" + "c" * 64,
    )  # fmt: skip


def test_a_record_keeps_only_our_keys_for_this_container_and_bounded_values(
    tmp_path: Path,
) -> None:
    workload = crowded_workload()
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    records = Records(str(state_dir))
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        records.write(dir_fd, Record(workload, ContainerCgroups(workload.cgroup_path, None)))
        size = (state_dir / "hook-containers" / f"{workload.container_id}.json").stat().st_size
        assert size < 4096, size
        loaded, problems = records.load(dir_fd)
    finally:
        os.close(dir_fd)
    assert problems == {}
    kept = loaded[workload.container_id].workload.annotations
    assert set(kept) == {
        annotation.NICS, f"{annotation.NIC_LOCALITY}/container.web", annotation.EXCLUSIVE
    }  # fmt: skip
    assert len(kept[annotation.NICS]) == annotation.MAX_VALUE + 1
    # What is kept decides as the whole did: the cut value is still refused as too long.
    whole = crowded_workload(GUARANTEED).evolve(cpu_request_milli=2000)
    cut = loaded[workload.container_id].workload.evolve(qos=GUARANTEED, cpu_request_milli=2000)
    assert eligibility(whole) == eligibility(cut)
    assert annotation.lookup(whole.annotations, annotation.EXCLUSIVE, "web") == "false"
    for w in (whole, cut):
        with pytest.raises(PolicyError, match="longer than the 256 characters"):
            annotation.lookup(w.annotations, annotation.NICS, "web")


# --- 14. a JSON number of thousands of digits -------------------------------------------------


@pytest.mark.parametrize("stdlib", [False, True], ids=["orjson", "stdlib"])
@pytest.mark.parametrize("number", ["9" * 5000, "-" + "1" * 5000, "1" * 4301])
def test_a_number_of_thousands_of_digits_is_a_decode_error(
    monkeypatch: pytest.MonkeyPatch, stdlib: bool, number: str
) -> None:
    monkeypatch.setattr(jsonbytes, "_stdlib", stdlib)
    with pytest.raises(jsonbytes.DecodeError):
        jsonbytes.loads(f'{{"pid": {number}}}'.encode())
    with pytest.raises(jsonbytes.DecodeError):
        jsonbytes.loads(f"[[{number}]]")
    state = f'{{"id": "c1", "status": "creating", "pid": {number}, "bundle": "/b"}}'
    with pytest.raises(oci.InputError, match="is not JSON"):
        oci.parse_state(state.encode())
    # Below the limit the two paths still agree on what they accept.
    assert jsonbytes.loads(b'{"pid": 4194304}') == {"pid": 4194304}
