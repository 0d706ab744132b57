"""The daemon's health as ``status``, the probes and systemd see it: ``health.json`` in the
state directory, and the verdict read from it.

Why a file the daemon rewrites, rather than asking the daemon over a socket or the metrics
port: a daemon whose event loop or worker is stuck cannot answer a question, but its file
still says when it last could - the reader tells "stuck" from "not running" (the state
directory's claim, storage/owner.py, is the kernel's word on that) without a timeout of its
own.  It needs no listener (metrics are off by default, and a port is one more thing a
DaemonSet and a unit must open), works for the OCI hook's ``status`` and an exec probe in
the daemon's own container alike (both see the state directory), and costs one small write
to the page cache per heartbeat: written atomically (a rename), never synced - after a
crash it is stale, which is what it should say.

The daemon's event loop writes it (``updated``) every ``interval`` seconds and hands the
worker a heartbeat job each time; the worker's last heartbeat (``worker``) and how long it
waited in the queue (``worker_lag``) say whether the worker runs and keeps up.  Wall-clock
times (seconds since the epoch): the reader is another process, maybe in another container.

Verdicts, and ``status``'s exit codes (README.md, "Commands"), as ``systemctl status`` uses 3
for a unit that is not active:

* ``healthy`` (0): running, registered with the runtime, keeping up;
* ``not-running`` (3): no live daemon holds the state directory;
* ``not-connected`` (4): alive, but not registered with the runtime (NRI off, wrong socket);
* ``stale`` (5): alive, but its event loop or worker has not answered within ``stale_after``
  seconds, or its worker lags behind the runtime's events by more than the request budget.

*Live* (the liveness probe; systemd's watchdog) is: neither not running nor stuck.  *Ready*
(the readiness probe; systemd's READY=1) is healthy.
"""

from __future__ import annotations

import os
from typing import Any

from ..base import files, jsonbytes
from ..base.value import Value

HEALTH_FILE = "health.json"
# Heartbeats: the loop writes the file this often; a reader calls a daemon stuck whose file
# or worker is older than STALE_BEATS heartbeats (and not less than MIN_STALE seconds).
DEFAULT_INTERVAL = 10.0
STALE_BEATS = 3
MIN_STALE = 1.0
MAX_SIZE = 4096  # a few hundred bytes; anything larger is not ours

HEALTHY, NOT_RUNNING, NOT_CONNECTED, STALE = "healthy", "not-running", "not-connected", "stale"
EXIT_CODES = {HEALTHY: 0, NOT_RUNNING: 3, NOT_CONNECTED: 4, STALE: 5}


class Verdict(Value):
    """What the daemon's health is (``verdict``: one of the four above), in one line."""

    verdict: str
    message: str
    live: bool

    @property
    def ready(self) -> bool:
        return self.verdict == HEALTHY

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def stale_after(interval: float) -> float:
    return max(MIN_STALE, STALE_BEATS * interval)


def write(state_dir: str, report: dict[str, Any], first: bool = False) -> None:
    """Replace the health file (atomically, not durably); raises OSError.  ``first``: the
    writer's first write, which also removes temp files of a writer killed mid-write (one
    daemon per state directory: no other writer can be in progress)."""
    data = jsonbytes.dumps(report, sort_keys=True, indent=True)
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if first:
            files.remove_temps(dir_fd, f".{HEALTH_FILE}.", ".tmp")
        files.write_atomic(state_dir, HEALTH_FILE, data, durable=False, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read(state_dir: str) -> dict[str, Any] | None:
    """The health file's report; None when there is none or it is not one of ours."""
    try:
        data = files.read_bounded(os.path.join(state_dir, HEALTH_FILE), MAX_SIZE)
        report = jsonbytes.loads(data)
    except (OSError, jsonbytes.DecodeError):
        return None
    return report if isinstance(report, dict) else None


def judge(
    running: bool | None, pid: int | None, report: dict[str, Any] | None, now: float
) -> Verdict:
    """The verdict on a daemon whose claim on the state directory says ``running`` (None: no
    daemon ever claimed it) with pid ``pid``, from its health ``report``, at ``now``."""
    if not running:
        what = "no nri-cpuplugin daemon has claimed this state directory"
        if running is False:
            what = f"the daemon{_pid(pid)} is not running: nothing pins new containers"
        return Verdict(NOT_RUNNING, what, False)
    if report is None or (pid is not None and report.get("pid") != pid):
        # Its file is a previous run's, or there is none: it is starting (loading its state)
        # or a build without health reports.
        why = "runs but has not reported its health yet"
        return Verdict(STALE, f"the daemon{_pid(pid)} {why}", False)
    try:
        return _judge_report(report, now)
    except (KeyError, TypeError, ValueError):
        why = "wrote a health report this build cannot read"
        return Verdict(STALE, f"the daemon{_pid(pid)} {why}", False)


def _judge_report(report: dict[str, Any], now: float) -> Verdict:
    limit = float(report["stale_after"])
    name = f"the daemon{_pid(report['pid'])}"
    loop_age = now - float(report["updated"])
    if loop_age > limit:
        return Verdict(STALE, f"{name}: its event loop has not answered for {loop_age:.1f}s "
                       f"(limit {limit:g}s)", False)  # fmt: skip
    # A heartbeat the worker had not run when the file was written: how long it had waited
    # (one is handed over right after each write, so one still waiting at the next write
    # waited a whole interval).  Only such a one can make the daemon not live: one the
    # worker ran, however late, shows it runs (and its lag whether it keeps up, below).
    waiting, updated = report["waiting"], float(report["updated"])
    lag = float(report["worker_lag"])
    if waiting is not None:
        waited = updated - float(waiting)
        lag = max(lag, waited)
        if waited > limit:
            return Verdict(STALE, f"{name}: its worker has not answered for {waited:.1f}s "
                           f"(limit {limit:g}s)", False)  # fmt: skip
    if not report["registered"]:
        why = report.get("connect_error") or "waiting for the runtime"
        return Verdict(NOT_CONNECTED, f"{name} is not registered with the runtime: {why}", True)
    budget = float(report["budget"])
    if lag > budget:
        return Verdict(STALE, f"{name} lags behind the runtime's events: a heartbeat waited "
                       f"{lag:.2f}s for its worker (budget {budget:g}s)", True)  # fmt: skip
    runtime = report.get("runtime") or "the runtime"
    return Verdict(HEALTHY, f"{name} is registered with {runtime} and keeps up", True)


def _pid(pid: object) -> str:
    return f" (pid {pid})" if pid else ""
