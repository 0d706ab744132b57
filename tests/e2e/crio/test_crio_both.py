"""Both front ends on one CRI-O node by mistake: the OCI hook in ``hooks_dir`` and the daemon on
NRI, sharing a state directory.  The daemon wins (nri_cpuplugin/storage/owner.py): it holds a
claim on the state directory while it runs, and the hook, finding the claim, changes nothing
and says so in an audit record (``ACTION=defer``).  While a daemon that owns the directory is
down, the hook stands aside too, so no CPU its containers hold is given away; the daemon puts
things right when it is back.

The hook's audit records go to a datagram socket of the test's own (journald's native
protocol), named by ``NRI_CPUPLUGIN_JOURNAL_SOCKET`` in the hook entries' environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import host
from harness.cri import CRIError
from harness.crio import Crio
from harness.k8s import ContainerSpec, PodSpec
from harness.runc import hook_program

from e2e.crio.hooksd import hook_files
from e2e.daemon import REPO, Daemon, check_agreement, wait_for

FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep 3600"
ALL = "0-1"


class JournalCatcher:
    """A journald stand-in: collects native-protocol datagrams (``KEY=value`` lines)."""

    def __init__(self) -> None:
        # Short: a unix socket path has 108 bytes, and pytest's tmp_path can be long.
        self.dir = Path(tempfile.mkdtemp(prefix="nri-journal-"))
        self.path = self.dir / "socket"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.setblocking(False)
        self.seen: list[dict[str, str]] = []

    def records(self, action: str | None = None) -> list[dict[str, str]]:
        with contextlib.suppress(BlockingIOError):
            while True:
                data = self.sock.recv(1 << 16).decode(errors="replace")
                self.seen.append(
                    dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
                )
        return [r for r in self.seen if action is None or r.get("ACTION") == action]

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def journal() -> Iterator[JournalCatcher]:
    catcher = JournalCatcher()
    yield catcher
    catcher.close()


@pytest.fixture
def node(make_crio, tmp_path: Path, journal: JournalCatcher) -> Iterator[tuple[Crio, Daemon, Path]]:
    """CRI-O with NRI on, the committed hooks.d files in its hooks_dir, and the daemon
    connected: both on the same state directory (the packaged default for both)."""
    instance = make_crio(start=False)
    state_dir = tmp_path / "state"
    program = hook_program(tmp_path / "bin")
    for name, doc in hook_files(program, state_dir).items():
        doc["hook"]["env"].append(f"NRI_CPUPLUGIN_JOURNAL_SOCKET={journal.path}")
        instance.install_hook(name, doc)
    instance.start()
    daemon = Daemon(instance.nri_socket, state_dir)
    daemon.start()
    yield instance, daemon, state_dir
    daemon.stop()


def test_the_daemon_places_and_the_hook_stands_aside(
    node: tuple[Crio, Daemon, Path], journal: JournalCatcher
) -> None:
    instance, daemon, state_dir = node
    cri = instance.cri()
    shared = cri.run("shared", [ContainerSpec("s", cpu_request_milli=250, memory="32Mi")])
    pinned = cri.run("pinned", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
    assert cri.wait_logs(pinned["p"], 1) == ["Cpus_allowed_list:\t1"]
    assert host.cpus_allowed_list(cri.inspect(shared["s"]).pid) == "0"
    # The hook ran for both containers (CRI-O matched the files) and deferred each time.
    deferred = journal.records("defer")
    assert {r["CONTAINER_ID"] for r in deferred} == {shared["s"], pinned["p"]}
    assert all(r["DAEMON_RUNNING"] == "True" for r in deferred)
    assert all(r["DAEMON_PID"] == str(daemon.proc.pid) for r in deferred)
    assert not journal.records("allocate") and not journal.records("share")
    assert not (state_dir / "hook-containers").exists()  # the hook wrote nothing at all
    assert [r["CPUS"] for r in daemon.records("allocate")] == ["1"]
    assert check_agreement(daemon, cri) == {"s": "0", "p": "1"}
    report = daemon.status()
    assert report["daemon"] == {"pid": daemon.proc.pid, "running": True}
    assert [a["container_id"] for a in report["assignments"]] == [pinned["p"]]

    # An impossible request: the daemon refuses through NRI; the hook never even runs.
    before = len(journal.records())
    pod_id = cri.run_pod(PodSpec("greedy", qos="guaranteed"))
    with pytest.raises(CRIError, match="asks for 1 exclusive CPUs"):
        cri.create_container(pod_id, ContainerSpec.guaranteed("two", 1))
    assert len(journal.records()) == before

    cri.stop(pinned["p"])  # the daemon releases at StopContainer ...
    assert host.cpus_allowed_list(cri.inspect(shared["s"]).pid) == ALL
    cri.remove(pinned["p"])  # ... and the hook's poststop at removal stands aside
    assert wait_for(
        "the poststop deferral",
        lambda: any(r.get("CONTAINER_ID") == pinned["p"] for r in journal.records("defer")[2:]),
    )
    assert check_agreement(daemon, cri) == {"s": ALL}


def _agreed(daemon: Daemon, cri) -> bool:
    try:
        check_agreement(daemon, cri)
    except AssertionError:
        return False
    return True


def test_while_the_daemon_is_down_the_hook_gives_nothing_away(
    node: tuple[Crio, Daemon, Path], journal: JournalCatcher
) -> None:
    instance, daemon, _ = node
    cri = instance.cri()
    first = cri.run("first", [ContainerSpec.guaranteed("a", 1, command=FIRST_LINE)])
    assert cri.wait_logs(first["a"], 1) == ["Cpus_allowed_list:\t1"]

    daemon.kill9()
    # CRI-O runs the next container without NRI (the plugin is gone); the hook could place
    # it, but its view of the state has no record of `a` and would take CPU 1 from it.
    late = cri.run("late", [ContainerSpec.guaranteed("b", 1, command=FIRST_LINE)])
    assert cri.wait_logs(late["b"], 1) == [f"Cpus_allowed_list:\t{ALL}"]
    [warning] = [r for r in journal.records("defer") if r["CONTAINER_ID"] == late["b"]]
    assert warning["DAEMON_RUNNING"] == "False" and warning["PRIORITY"] == "4"
    assert "is not running" in warning["MESSAGE"]
    assert host.cpus_allowed_list(cri.inspect(first["a"]).pid) == "1"  # still alone there
    assert daemon.status()["daemon"]["running"] is False

    daemon.start()  # back: its Synchronize moves the unpinned container off CPU 1 ...
    # ... through an update in its reply, which the runtime applies after the daemon's record.
    wait_for("CRI-O to apply the Synchronize reply", lambda: _agreed(daemon, cri), 10)
    assert check_agreement(daemon, cri) == {"a": "1", "b": "0"}
    assert daemon.status()["daemon"] == {"pid": daemon.proc.pid, "running": True}


def test_two_daemons_on_one_state_directory_the_second_refuses(
    node: tuple[Crio, Daemon, Path], tmp_path: Path
) -> None:
    """The same mistake with two daemons (a service and a runtime-launched copy): the second
    exits with the reason instead of answering for every container beside the first."""
    instance, daemon, state_dir = node
    second = subprocess.run(
        [sys.executable, "-m", "nri_cpuplugin.cli", "run", "--socket", str(instance.nri_socket),
         "--state-dir", str(state_dir), "--reserved-cpus", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "NRI_CPUPLUGIN_JOURNAL_SOCKET": "/nonexistent"},
    )  # fmt: skip
    assert second.returncode != 0
    last = second.stderr.strip().splitlines()[-1]
    assert f"in use by another nri-cpuplugin daemon (pid {daemon.proc.pid})" in last, last
    assert os.path.exists(instance.nri_socket)
    pod = instance.cri().run("still", [ContainerSpec.guaranteed("p", 1, command=FIRST_LINE)])
    assert instance.cri().wait_logs(pod["p"], 1) == ["Cpus_allowed_list:\t1"]
