"""The verdict ``status`` and the probes read from the daemon's health file (ops/health.py),
at times the test chooses (no clock), and kubelet's static policy refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nri_cpuplugin.ops import health, kubelet

T = 1_000_000.0  # the daemon's "now" when it wrote the report


def report(**changes: object) -> dict:
    said = {
        "pid": 42, "version": "0.1.0", "started": T - 100, "updated": T, "registered": True,
        "since": T - 90, "runtime": "containerd v2.1.9", "connect_error": "", "last_event": T,
        "worker": T, "worker_lag": 0.001, "waiting": None, "interval": 10.0, "stale_after": 30.0,
        "budget": 1.5,
    }  # fmt: skip
    said.update(changes)
    return said


@pytest.mark.parametrize(
    ("running", "said", "now", "verdict", "live", "words"),
    [
        (True, report(), T + 5, "healthy", True, "registered with containerd v2.1.9 and keeps up"),
        (None, None, T, "not-running", False, "no nri-cpuplugin daemon has claimed"),
        (False, report(), T, "not-running", False, "(pid 42) is not running"),
        (True, None, T, "stale", False, "has not reported its health yet"),
        (True, report(pid=7), T, "stale", False, "has not reported its health yet"),
        (True, {"pid": 42}, T, "stale", False, "cannot read"),
        (True, report(), T + 31, "stale", False, "event loop has not answered for 31.0s"),
        (True, report(waiting=T - 30.5), T, "stale", False, "worker has not answered for 30.5s"),
        (True, report(waiting=T - 2), T, "stale", True, "lags behind the runtime's events"),
        (True, report(worker_lag=1.6), T, "stale", True, "waited 1.60s for its worker"),
        (True, report(worker_lag=45.0), T, "stale", True, "waited 45.00s for its worker"),
        (
            True, report(registered=False, connect_error="cannot connect: is NRI enabled?"), T,
            "not-connected", True, "not registered with the runtime: cannot connect",
        ),
    ],
)  # fmt: skip
def test_verdicts(running, said, now, verdict, live, words) -> None:
    got = health.judge(running, 42, said, now)
    assert (got.verdict, got.live, got.ready) == (verdict, live, verdict == "healthy")
    assert words in got.message
    assert (
        got.exit_code == {"healthy": 0, "not-running": 3, "not-connected": 4, "stale": 5}[verdict]
    )


def test_the_file_round_trips_and_a_foreign_one_is_none(tmp_path: Path) -> None:
    (tmp_path / ".health.json.0123456789ab.tmp").write_text("{")  # a writer killed mid-write
    health.write(str(tmp_path), report(), first=True)
    assert health.read(str(tmp_path)) == report()
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]  # no temp file left
    (tmp_path / "health.json").write_text("[1, 2]")
    assert health.read(str(tmp_path)) is None
    (tmp_path / "health.json").write_text("not json")
    assert health.read(str(tmp_path)) is None
    assert health.read(str(tmp_path / "none")) is None
    assert health.stale_after(0.05) == health.MIN_STALE and health.stale_after(10) == 30


# --- kubelet's static CPU manager owns the node ---------------------------------------------


def checkpoint(tmp_path: Path, policy: str) -> str:
    path = tmp_path / "cpu_manager_state"
    doc = {"policyName": policy, "defaultCpuSet": "0-7", "checksum": 1}
    path.write_text(json.dumps(doc))
    return str(path)


def test_kubelet_static_policy_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(kubelet.KubeletOwnsCPUs) as err:
        kubelet.check(checkpoint(tmp_path, "static"))
    message = str(err.value)
    for words in ("static CPU manager policy owns", "Drain the node", "cpuManagerPolicy to none",
                  "remove that file", "operator-guide.md"):  # fmt: skip
        assert words in message, words


@pytest.mark.parametrize("policy", ["none", ""])
def test_kubelet_none_or_no_checkpoint_starts(tmp_path: Path, policy: str) -> None:
    kubelet.check(checkpoint(tmp_path, policy) if policy else str(tmp_path / "missing"))
    kubelet.check("")  # the check turned off


def test_an_unreadable_checkpoint_is_a_warning_not_a_refusal(tmp_path: Path, caplog) -> None:
    (tmp_path / "cpu_manager_state").write_text("{not json")
    kubelet.check(str(tmp_path / "cpu_manager_state"))
    kubelet.check(str(tmp_path))  # a directory
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]


# --- what the daemon's heartbeat writes, judged as status would (daemon/heartbeat.py) --------


class Clock:
    def __init__(self) -> None:
        self.now = T

    def __call__(self) -> float:
        return self.now


class QueuedWorker:
    """Holds the jobs handed to it until the test runs them (a worker that may be stuck)."""

    current = None

    def __init__(self) -> None:
        self.jobs: list = []

    def submit(self, name, fn, *args, awaited=True):
        self.jobs.append((fn, args))

    def run(self) -> None:
        jobs, self.jobs = self.jobs, []
        for fn, args in jobs:
            fn(*args)


def test_the_heartbeat_stays_ready_between_beats_and_stale_when_the_worker_is_stuck(
    tmp_path: Path, monkeypatch
) -> None:
    import os

    from nri_cpuplugin.daemon.heartbeat import Heartbeat

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    clock, worker = Clock(), QueuedWorker()
    beat = Heartbeat(worker, lambda: str(tmp_path), lambda: 1.5, interval=10, clock=clock)

    def verdict(after: float) -> health.Verdict:
        return health.judge(True, os.getpid(), health.read(str(tmp_path)), clock.now + after)

    beat.connection(False, "cannot connect: is NRI enabled?")
    assert verdict(0).verdict == "not-connected" and verdict(0).live
    beat.connection(True, "containerd v2.1.9")
    for _ in range(3):  # an idle daemon: its worker runs each heartbeat at once
        beat.beat()
        clock.now += 0.001
        worker.run()
        assert verdict(9.9).ready, verdict(9.9)  # until the next beat, however late in it
        clock.now += 10
    # The worker stops answering: lagging at the next beat, not live two beats later.
    beat.beat()
    clock.now += 10
    beat.beat()
    assert verdict(0).verdict == "stale" and verdict(0).live
    clock.now += 21
    beat.beat()
    assert beat.stuck and not verdict(0).live
    assert "its worker has not answered for 31.0s" in verdict(0).message
    worker.run()  # it answers again, 31 s late: live, not yet keeping up
    clock.now += 10
    beat.beat()
    assert verdict(0).live and not beat.stuck
    assert "a heartbeat waited 31.00s for its worker" in verdict(0).message
    worker.run()  # the next heartbeat, at once
    clock.now += 10
    beat.beat()
    assert verdict(0).ready


# --- sd_notify -------------------------------------------------------------------------------


def test_notify_sends_one_datagram_and_never_waits_for_a_slow_reader(tmp_path: Path) -> None:
    """The daemon notifies from its event loop: a receiver that does not read (its queue full)
    must cost it a lost message, not a blocked loop (found by test_probes.py)."""
    import socket

    from nri_cpuplugin.ops.notify import notify, watchdog_interval

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path)}
        assert notify("READY=1\nSTATUS=registered", env)
        assert receiver.recv(100) == b"READY=1\nSTATUS=registered"
        sent = [notify("WATCHDOG=1", env) for _ in range(1000)]  # nobody reads them
        assert sent[0] and not sent[-1]
    assert not notify("READY=1", {})  # not under systemd: nothing to do
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 60.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "0"}) is None
